"""The op-by-op search of one mesh: every op's sharding chosen by CP-SAT (``search.ilp``)
and/or MCMC over the simulator (``search.mcmc``), starting from a layout built directly.

``searched_candidates`` is the candidates part of the ``tp`` and ``summa`` families
(``planner.families``): it searches every mesh of ``SearchContext.meshes`` in turn (the
``dp x tp`` meshes, then SUMMA's), each with the same work budgets (``search.budget``). A mesh whose plans cannot beat a fitting plan found already is not searched:
once its candidates are costed, the sum over ops of each op's least compute is a lower bound
on any of its plans' steps (``compute_lower_bound``), and when that is no faster than the
best fitting plan of the families searched before (the MoE layouts, the data-parallel
flavours), CP-SAT, MCMC and the simulations are skipped and the search summary says so.
DeepSeek-V3 (671B) on 256 GPUs, whose searched meshes run every expert on the whole batch
(no sharding rule moves its tokens: 929 s a step against the MoE family's 28 s), spent about
a third of its planning on four such meshes (cProfile, wall clock on a loaded machine).
"""

from __future__ import annotations

import dataclasses

from cost_model.simulator import simulated
from planner.cluster import Cluster
from planner.errors import PlanningError
from planner.graph import OpGraph
from planner.model_spec import ModelSpec
from planner.plans import Plan
from planner.strategy import Mesh
from search.blocks import block_representatives
from search.budget import SearchBudget
from search.context import SearchContext
from search.cost_tables import build_cost_tables
from search.ilp import solve
from search.layouts import batch_input_placements, combine, megatron_layout
from search.mcmc import mcmc
from search.node_candidates import node_strategies
from search.plan_builder import input_placements, unsimulated_plan
from search.plan_variants import composed_flavours, recomputing
from search.propagation import propagate
from search.rules.summa import is_summa_mesh
from search.summa_hint import summa_hint
from search.summa_meshes import TP_LAYOUTS


def searched_candidates(context: SearchContext) -> list[Plan]:
    """The searched plan of every mesh of ``context.meshes`` with its recomputing and
    composed-flavour variants. A mesh of ``dp`` alone is searched only when DDP may compete
    (weights stay whole on ``dp`` in searched plans: on ``dp`` alone that is DDP)."""
    plans: list[Plan] = []
    meshes, constraints = context.meshes, context.constraints
    for position, mesh in enumerate(meshes):
        context.progress(f"searching mesh {mesh} ({position + 1}/{len(meshes)})", position / len(meshes))
        # Every mesh gets the same work budgets; the wall-clock net is the whole call's
        # (search.budget): a share of it would make a loaded machine cut an ordinary search.
        if mesh.names == ("dp",) and not constraints.allows_family("ddp"):
            continue
        plans += searched_plans(
            context.graph, context.cluster, context.spec, context.model_name, mesh, context.search, context.budget,
            context.seed, context.warnings, context.precision, context.notes,
            tp_layouts="summa" if context.summa_only else "auto", beat=_best_fitting_step(context),
        )
    return plans


def _best_fitting_step(context: SearchContext) -> float | None:
    """The step of the fastest fitting plan the families before found that the user's
    constraints allow, or None."""
    allowed = [plan for plan in context.found if plan.estimate is not None and plan.estimate.fits
               and (not context.constraints.any or context.constraints.allows_plan(plan))]
    return min((plan.estimate.step_time_s for plan in allowed), default=None)


def compute_lower_bound(tables) -> float:
    """Seconds every plan on the tables' mesh spends computing at least: each op's least
    compute over its candidates (forward and backward, all micro-batches), summed. Every
    device of a mesh without pipeline stages runs every op, so its compute stream, and the
    step, take at least this; recomputation and collectives only add to it."""
    return sum(min(candidate.compute_s for candidate in options) for options in tables.candidates.values())


def plan_on_mesh(graph: OpGraph, cluster: Cluster, mesh: Mesh, *, tp_layouts: str = "auto", search: str = "ilp",
                 precision: str = "bf16", effort: float = 1.0, model_name: str = "model", spec: ModelSpec | None = None) -> Plan:
    """The searched plan of one given mesh, simulated (for studies and benchmarks that
    compare layouts on meshes the outer search might not pick, e.g. 1-D over 64 devices).

    Args:
        mesh: any mesh over the cluster's devices (SUMMA axes included).
        tp_layouts: as in ``search_plan`` (``"summa"``: linears in SUMMA layouts only).
        search: ``"ilp"``, ``"mcmc"`` or ``"auto"``.
    """
    if tp_layouts not in TP_LAYOUTS:
        raise PlanningError(f"tp_layouts must be one of {', '.join(TP_LAYOUTS)}, got {str(tp_layouts)[:20]!r}")
    plans = searched_plans(graph, cluster, spec, model_name, mesh, search, SearchBudget(effort=effort), 0, (), precision, [],
                           tp_layouts=tp_layouts)
    return plans[0]


def searched_plans(graph, cluster, spec, model_name, mesh, search, budget: SearchBudget, seed, warnings, precision, notes,
                   tp_layouts: str = "auto", beat: float | None = None) -> list[Plan]:
    """The searched plan of one mesh (and its recomputing variant). CP-SAT starts from a
    layout built directly (Megatron's with tp, data parallelism without, SUMMA's on a SUMMA
    mesh) and falls back to it, so every mesh gets a plan; the simulator then says whether
    it fits. ``beat``: the step (seconds) of a fitting plan found already; when the mesh's
    ``compute_lower_bound`` is no faster, nothing is searched and no plan returned."""
    skeleton, tables = mesh_tables(graph, cluster, spec, model_name, mesh, precision, warnings, tp_layouts)
    if beat is not None and (bound := compute_lower_bound(tables)) >= beat:
        notes.append(f"mesh {mesh}: not searched, its ops' compute alone takes {bound:.3g} s, no faster than "
                     f"the {beat:.3g} s of a plan found already")
        return []
    hint = starting_layout(graph, mesh, tables)
    choice, how = dict(hint), []
    if search in ("auto", "ilp"):
        result = _solve_fitting(tables, cluster, hint, budget)
        if result is None:
            how.append("no sharding fits without recomputation")
            result = solve(tables, memory_bytes=None, work=budget.ilp_work(), wall_clock_cap_s=budget.seconds_left(), hint=hint)
        if result.cut_by_wall_clock:
            budget.note_cut(f"CP-SAT on mesh {mesh}")
        choice = result.choice
        if result.from_hint:
            gap = "" if result.bound_s <= 0 else f", gap {result.gap:.1%}"
            how.append(f"CP-SAT found nothing better than the layout it started from{gap}")
        else:
            how.append(f"CP-SAT {'optimal' if result.optimal else f'gap {result.gap:.1%}'}")
    if search in ("auto", "mcmc"):
        refine = mcmc(
            skeleton, tables, start=choice, seed=seed, iterations=budget.mcmc_proposals(len(graph.nodes)),
            wall_clock_cap_s=budget.seconds_left(),
            patience=500 if search == "auto" else None,  # refining a CP-SAT solution: a short walk
        )
        if refine.cut_by_wall_clock:
            budget.note_cut(f"MCMC on mesh {mesh}")
        choice = refine.choice
        how.append(f"MCMC {refine.iterations} proposals")
    def plan_of(chosen: dict[str, int]) -> Plan:
        strategies = tuple(tables.candidates[node.name][chosen[node.name]].strategy for node in graph.nodes)
        laid_out = dataclasses.replace(skeleton, strategies=strategies, inputs=input_placements(graph, mesh, strategies), label="soap")
        return simulated(laid_out, graph)

    plan = plan_of(choice)
    if hint and choice != hint:
        # CP-SAT's objective is a sum of per-op costs; the simulator overlaps and schedules.
        # Where they disagree, the layout the search started from may simulate faster: keep it.
        start = plan_of(hint)
        if (not start.estimate.fits, start.estimate.step_time_s) < (not plan.estimate.fits, plan.estimate.step_time_s):
            plan = start
            how.append("the starting layout simulates faster: kept")
    notes.append(f"mesh {mesh}: {', '.join(how)}")
    return [plan, *recomputing([plan], graph), *composed_flavours(plan, graph)]


def mesh_tables(graph, cluster, spec, model_name, mesh, precision, warnings=(), tp_layouts: str = "auto"):
    """The unsimulated plan the search of ``mesh`` starts from (data parallel on ``dp``,
    everything else replicated) and the costs of every op's candidates on it."""
    representative = block_representatives(graph)
    strategies_of = node_strategies(graph, mesh, only=set(representative.values()), tp_layouts=tp_layouts)
    seed_strategies, inputs = combine(graph, mesh, {"dp": dp_axis_placements(graph, mesh.axis_size("dp"))} if "dp" in mesh.names else {})
    skeleton = unsimulated_plan(graph, cluster, spec, model_name, mesh, seed_strategies, inputs, precision=precision, warnings=warnings)
    return skeleton, build_cost_tables(skeleton, graph, strategies_of, representative)


def _solve_fitting(tables, cluster: Cluster, hint, budget: SearchBudget):
    """CP-SAT with the memory constraint, or None when no sharding fits without recomputation."""
    # Memory is a sum of independent per-node choices: when even the smallest candidate of
    # every node overflows the device, no solve is needed to know nothing fits.
    if sum(min(c.memory_bytes for c in options) for options in tables.candidates.values()) > cluster.min_device_memory:
        return None
    try:
        return solve(
            tables, memory_bytes=cluster.min_device_memory, work=budget.ilp_work(),
            wall_clock_cap_s=budget.seconds_left(), hint=hint,
        )
    except PlanningError:
        return None


def starting_layout(graph: OpGraph, mesh: Mesh, tables) -> dict[str, int]:
    """A starting solution for CP-SAT: the Megatron layout when the mesh has tp, the SUMMA
    block layout on a SUMMA mesh (``search.summa_hint``), else data parallelism, mapped onto
    each node's candidates (all-replicate where it has no match)."""
    if is_summa_mesh(mesh):
        return summa_hint(graph, tables.candidates)

    try:
        if "tp" in mesh.names:
            layout, _ = megatron_layout(graph, mesh)
        else:
            layout, _ = combine(graph, mesh, {"dp": dp_axis_placements(graph, mesh.axis_size("dp"))})
    except PlanningError:
        return {}
    wanted = {s.node: (s.inputs, s.outputs, tuple(s.params.values())) for s in layout}
    hint = {}
    for name, options in tables.candidates.items():
        key = wanted.get(name)
        hint[name] = next(
            (i for i, c in enumerate(options) if (c.strategy.inputs, c.strategy.outputs, tuple(c.strategy.params.values())) == key),
            0,
        )
    return hint


def dp_axis_placements(graph: OpGraph, dp: int):
    """Where each value of a data-parallel step lives when the batch inputs are split on
    ``dp`` (of ``dp`` ranks; the batch dimension propagated through the graph)."""
    return propagate(graph, dp, batch_input_placements(graph), {})
