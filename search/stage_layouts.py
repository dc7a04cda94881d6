"""Per-op placements for pipeline stages found by the SOAP search (CP-SAT).

The pipeline grid (``search.pipeline_search``) prices every configuration with Megatron-LM's
tensor-parallel layout; this module gives it a second layout per tensor-parallel degree:
the one CP-SAT (``search.ilp``) finds on the pipeline mesh itself.

How the stage mesh is searched. The mesh is ``pp x dp x tp`` (axes of size 1 left out).
``pp`` shards nothing: it only says which devices run an op, so every op is whole on it
(``Replicate`` in the ``pp`` column). The candidates are therefore the rule registry's
candidates on the stage mesh (``dp x tp``, ``search.auto.node_strategies``), each with a
``Replicate`` column inserted for ``pp``; the costs are taken on the whole ``pp x dp x tp``
mesh (``search.cost_tables``, which knows that ``pp`` carries no gradient all-reduce), so
dp and tp groups have the ranks and links they have in the pipeline. Repeated blocks share
one decision (``search.blocks``): depth adds no variables, and every block gets the same
placements, so a block costs the same on any stage, which stage slicing relies on.

CP-SAT starts from Megatron's layout (the grid's own), so its answer is never worse than
Megatron's under the search's objective; the grid then prices both and keeps the faster.

One solve per tensor-parallel degree (``representative_mesh``): on the pipeline mesh with
the smallest ``pp`` above one (the most data parallelism). Meshes of the grid with fewer
axes take that layout's columns (``search.layouts.restrict_axes``): a candidate is a
per-axis combination, so dropping an axis leaves a valid candidate on the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.tensor import Replicate

from planner.cluster import Cluster
from planner.errors import PlanningError
from planner.graph import OpGraph
from planner.strategy import Mesh, NodeStrategy, PipelineConfig, Placements
from search.blocks import block_representatives
from search.budget import SearchBudget
from search.cost_tables import build_cost_tables
from search.ilp import IlpResult, solve
from search.layouts import restrict_axes
from search.node_candidates import node_strategies
from search.plan_builder import input_placements, unsimulated_plan

PP_AXIS = "pp"
Layout = tuple[tuple[NodeStrategy, ...], dict[str, Placements | None]]  # strategies, input placements


@dataclass(frozen=True)
class StageLayout:
    """A searched layout on ``mesh``: one strategy per node (all on stage 0; the grid
    restages them), the graph inputs' placements, how the solve went, and the search's
    objective (seconds) of the layout it started from."""

    mesh: Mesh
    strategies: tuple[NodeStrategy, ...]
    inputs: dict[str, Placements | None]
    result: IlpResult
    start_objective_s: float

    def describe(self) -> str:
        """One line for notes: the mesh and CP-SAT's optimality."""
        quality = "optimal" if self.result.optimal else f"gap {self.result.gap:.2%}"
        return (
            f"SOAP stage layout on {self.mesh}: CP-SAT {quality} in {self.result.work:.2f} units of work, "
            f"objective {self.result.objective_s * 1e3:.3f} ms against {self.start_objective_s * 1e3:.3f} ms for Megatron's"
        )


class SearchedLayouts:
    """CP-SAT's stage layouts of one model on one cluster, for the pipeline grid: solved
    once per tp on ``representative_mesh`` (started from Megatron's layout there), a mesh
    with fewer axes taking that layout's columns.

    Args:
        megatron: (tp, axis names) -> Megatron's layout on such a mesh, or None.
    """

    def __init__(
        self, graph: OpGraph, cluster: Cluster, precision: str, budget: SearchBudget,
        megatron: Callable[[int, tuple[str, ...]], Layout | None],
    ) -> None:
        self.graph, self.cluster, self.precision, self.budget = graph, cluster, precision, budget
        self.megatron = megatron
        self.blocks = sum(graph.blocks.values())
        self.solved: dict[int, StageLayout | None] = {}  # tp -> the solve of its representative mesh
        self._restricted: dict[tuple[int, tuple[str, ...]], Layout | None] = {}

    def layout(self, tp: int, names: tuple[str, ...]) -> Layout | None:
        """The searched layout on a mesh with these axis names; None when there is none.

        None without pipeline or without tp: a mesh without ``pp`` is the one the per-op
        search of ``search.auto`` solves at its own sizes, and on a stage without ``tp``
        (weights whole on ``dp``) the search can only choose which activation dim ``dp``
        splits, the work data parallelism splits already. None also when the representative
        mesh lacks one of ``names``, or no pipeline fits."""
        if tp == 1 or PP_AXIS not in names:
            return None
        key = (tp, names)
        if key not in self._restricted:
            searched = self.solve(tp)
            built = None
            if searched is not None and set(names) <= set(searched.mesh.names):
                built = restrict_axes(searched.strategies, searched.inputs, [searched.mesh.names.index(n) for n in names])
            self._restricted[key] = built
        return self._restricted[key]

    def differs(self, tp: int, names: tuple[str, ...]) -> bool:
        """Whether a searched layout exists for these axes and differs from Megatron's
        (where it does not, pricing it again would only repeat Megatron's estimate)."""
        searched = self.layout(tp, names)
        megatron = self.megatron(tp, names)
        return searched is not None and (megatron is None or not same_placements(searched[0], megatron[0]))

    def solve(self, tp: int) -> StageLayout | None:
        """The solve of tp's representative mesh (once); None when there is no such mesh,
        Megatron's layout does not build there (it is the solve's start), or CP-SAT found
        nothing within its budget."""
        if tp not in self.solved:
            mesh = representative_mesh(self.cluster.world_size, tp, self.blocks, self.graph.batch_size)
            start = None if mesh is None else self.megatron(tp, mesh.names)
            try:
                self.solved[tp] = None if start is None else search_stage_layout(
                    self.graph, self.cluster, mesh, start, self.precision, self.budget.ilp_work(), self.budget.seconds_left()
                )
            except PlanningError:
                self.solved[tp] = None
            if self.solved[tp] is not None and self.solved[tp].result.cut_by_wall_clock:
                self.budget.note_cut(f"CP-SAT on pipeline mesh {mesh}")
        return self.solved[tp]


def representative_mesh(world: int, tp: int, blocks: int, batch_size: int) -> Mesh | None:
    """The pipeline mesh the layout of tensor-parallel degree ``tp`` is searched on:
    ``pp`` the smallest divisor above one of ``world / tp`` (at most ``blocks``, leaving a
    ``dp`` that divides the batch), ``dp`` the rest. None when no pipeline fits."""
    if world % tp:
        return None
    rest = world // tp
    for pp in range(2, min(rest, blocks) + 1):
        if rest % pp == 0 and batch_size % (rest // pp) == 0:
            axes = tuple((name, size) for name, size in ((PP_AXIS, pp), ("dp", rest // pp), ("tp", tp)) if size > 1)
            return Mesh(axes)
    return None


def with_whole_axis(strategy: NodeStrategy, position: int) -> NodeStrategy:
    """``strategy`` with a ``Replicate`` column inserted at mesh axis ``position`` (an axis
    on which the op runs whole, as ``pp`` does)."""

    def widen(placements: Placements) -> Placements:
        return (*placements[:position], Replicate(), *placements[position:])

    return dataclasses.replace(
        strategy,
        inputs=tuple(widen(p) for p in strategy.inputs),
        outputs=tuple(widen(p) for p in strategy.outputs),
        params={name: widen(p) for name, p in strategy.params.items()},
        produced=None if strategy.produced is None else tuple(widen(p) for p in strategy.produced),
    )


def search_stage_layout(
    graph: OpGraph,
    cluster: Cluster,
    mesh: Mesh,
    start: tuple[tuple[NodeStrategy, ...], dict[str, Placements | None]],
    precision: str,
    work: float,
    wall_clock_cap_s: float | None = None,
) -> StageLayout:
    """CP-SAT's per-op placements on the pipeline mesh ``mesh`` (``pp`` first), every op
    whole on ``pp`` (see the module docstring).

    Args:
        start: a layout on ``mesh`` (Megatron's): CP-SAT's hint and the simulator's seed.
        work: CP-SAT's budget in units of deterministic time (``SearchBudget.ilp_work``).

    No memory constraint: stages hold a share of the model that the solve does not know;
    the grid checks memory per configuration and keeps Megatron's layout where this one
    does not fit.
    """

    names = mesh.names
    pp_position = names.index(PP_AXIS) if PP_AXIS in names else None
    stage_axes = tuple(axis for axis in mesh.axes if axis[0] != PP_AXIS)
    if not stage_axes:
        raise ValueError(f"a stage mesh needs an axis besides '{PP_AXIS}', got {mesh}")
    representative = block_representatives(graph)
    options = node_strategies(graph, Mesh(stage_axes), only=set(representative.values()))
    if pp_position is not None:
        options = {name: [with_whole_axis(s, pp_position) for s in found] for name, found in options.items()}
    # Megatron's layout among the candidates: the rule registry's differ from it on some
    # ops (a row-parallel bias replicated rather than partial), and without it CP-SAT would
    # start from, and be measured against, a worse layout than the one the grid already has.
    for strategy in start[0]:
        found = options.get(strategy.node)
        if found is not None and not any(_same(strategy, option) for option in found):
            found.append(dataclasses.replace(strategy, stage=0))
    _feed_inputs_as(graph, options, start[1])
    # One micro-batch: per-op costs of the local batch (the grid prices micro-batching).
    pipeline = None if pp_position is None else PipelineConfig(stages=mesh.axis_size(PP_AXIS), micro_batches=1)
    skeleton = unsimulated_plan(
        graph, cluster, None, "probe", mesh, start[0], start[1], precision=precision, pipeline=pipeline
    )
    tables = build_cost_tables(skeleton, graph, options, representative)
    hint = _hint(tables, start[0])
    result = solve(tables, memory_bytes=None, work=work, wall_clock_cap_s=wall_clock_cap_s, hint=hint)
    strategies = tuple(
        dataclasses.replace(tables.candidates[node.name][result.choice[node.name]].strategy, stage=0)
        for node in graph.nodes
    )
    return StageLayout(mesh, strategies, input_placements(graph, mesh, strategies), result, tables.objective(hint))


def _feed_inputs_as(graph: OpGraph, options: dict[str, list[NodeStrategy]], fed: dict[str, Placements | None]) -> None:
    """Keep only the candidates of each graph input's first reader that read it as ``fed``
    (the start layout's input placements), since the first reader decides how an input is
    fed (``search.plan_builder.input_placements``). A pipeline's schedule cuts every rank's
    local inputs into micro-batches along dim 0: with labels whole on dp and tokens split
    on dp, micro-batch k of the labels is not the labels of micro-batch k of the tokens
    (GPT on pp=2 x dp=2 x tp=2 trained on the wrong labels). Fed alike, they stay paired."""
    for graph_input in graph.inputs:
        wanted = fed.get(graph_input.name)
        reader = next((node for node in graph.nodes if graph_input.name in node.inputs), None)
        if wanted is None or reader is None or reader.name not in options:
            continue
        position = reader.inputs.index(graph_input.name)
        options[reader.name] = [s for s in options[reader.name] if s.inputs[position] == wanted]


def same_placements(first: tuple[NodeStrategy, ...], second: tuple[NodeStrategy, ...]) -> bool:
    """Whether two layouts place every op's inputs, outputs and parameters alike."""
    return len(first) == len(second) and all(_same(a, b) for a, b in zip(first, second))


def _same(first: NodeStrategy, second: NodeStrategy) -> bool:
    return (first.inputs, first.outputs, dict(first.params), first.produced) == (
        second.inputs, second.outputs, dict(second.params), second.produced
    )


def _hint(tables, layout: tuple[NodeStrategy, ...]) -> dict[str, int]:
    """``layout`` as candidate indices (all-replicate, index 0, where a node has no match)."""
    wanted = {s.node: s for s in layout}
    hint = {}
    for name, options in tables.candidates.items():
        hint[name] = next((i for i, c in enumerate(options) if _same(c.strategy, wanted[name])), 0)
    return hint
