"""The lines of a graph program (``codegen.spmd_emit``) for ops in a SUMMA block layout.

A node whose strategy carries a ``SummaLayout`` is a linear run as a 2-D SUMMA, 2.5-D or 3-D
matmul, or a layer norm over a hidden dim split on the layout's ``hidden_axis``. Its operands
arrive as DTensors already in the plan's placements (the emitter's ``_to`` redistributes them
where the producer left them otherwise); the line calls ``codegen.runtime.summa_layouts``,
which runs the algorithm on their local shards and wraps the result back in the output's
placements. The comments above the line say which collectives run, over which mesh axes and
why, and the local shapes each rank multiplies.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch.fx
from torch.distributed.tensor import Shard

from codegen.runtime.summa_layouts import SUMMA_AXES, input_placements, weight_placements
from codegen.source_text import comment
from planner.errors import PlanningError
from planner.graph import OpGraph
from planner.plans import Plan
from planner.strategy import NodeStrategy, SummaLayout, placement_to_str, placements_str

RUNTIME_IMPORT = "from codegen.runtime import summa_layouts"
_LINEAR = "aten.linear."
_LAYER_NORM = "aten.layer_norm."


def uses_summa(plan: Plan) -> bool:
    """Whether any node of ``plan`` runs in a SUMMA block layout."""
    return any(isinstance(s.layout, SummaLayout) for s in plan.strategies)


def runs_summa(strategy: NodeStrategy | None) -> bool:
    """Whether the node of ``strategy`` is written by ``node_call``."""
    return strategy is not None and isinstance(strategy.layout, SummaLayout)


def check_plan(plan: Plan, graph: OpGraph) -> None:
    """Refuse, with one line saying why, a plan whose SUMMA layouts the program cannot run:
    a layout on an op other than a linear with a weight or a layer norm over the last dim,
    a mesh with a ``tp`` axis beside the SUMMA axes, sizes the grid does not divide.

    Raises:
        PlanningError: the first such node, named.
    """
    if not uses_summa(plan):
        return
    if "tp" in plan.mesh.names:
        raise PlanningError(f"a plan with SUMMA layouts runs on axes dp, row, col, dep; this mesh also has tp ({plan.mesh})")
    sizes = dict(plan.mesh.axes)
    for strategy in plan.strategies:
        if not runs_summa(strategy):
            continue
        layout = strategy.layout
        node = graph.node(strategy.node)
        where = f"node '{strategy.node[:80]}' ({node.op[:60]}) has a {layout.describe()} layout"
        if node.op.startswith(_LINEAR):
            if len(node.input_meta) < 2 or len(node.input_meta[1].shape) != 2 or not node.params:
                raise PlanningError(f"{where}, but SUMMA runs linears whose weight is a 2-D parameter")
            n, k = node.input_meta[1].shape
            k_ways = layout.q * layout.q if layout.family == "3d" else layout.q
            if n % layout.q or k % k_ways:
                raise PlanningError(f"{where}, but its weight ({n}, {k}) does not split into {layout.q} x {k_ways} blocks")
            rank = len(node.input_meta[0].shape)
            wanted_x = input_placements(plan.mesh.names, rank, layout.family, layout.swapped)
            _check_placements("x", rank, strategy.inputs[0], wanted_x, plan, where)
            wanted_w = weight_placements(plan.mesh.names, layout.family, layout.swapped)
            _check_placements("W", 2, strategy.inputs[1], wanted_w, plan, where)
        elif node.op.startswith(_LAYER_NORM):
            normalized = node.attrs[1] if len(node.attrs) > 1 else None
            if not isinstance(normalized, (list, tuple)) or len(normalized) != 1 or normalized[0] % layout.q:
                raise PlanningError(f"{where}, but a block-layout norm normalises one last dim that {layout.q} divides")
            rank = len(node.input_meta[0].shape)
            _check_placements("x", rank, strategy.inputs[0], {layout.hidden_axis: Shard(rank - 1)}, plan, where)
        else:
            raise PlanningError(f"{where}, but the program runs SUMMA layouts on linears and layer norms only")
        rows = node.input_meta[0].shape[0] if node.input_meta and node.input_meta[0].shape else 0
        ways = layout.q * layout.d * sizes.get("dp", 1)
        if rows % ways:
            raise PlanningError(f"{where}, but its input's leading dim {rows} does not split {ways} ways (dp x row x dep)")


def refuse_forced(plan: Plan, forced: dict[str, str]) -> None:
    """Refuse a plan whose SUMMA op failed in the compile-time dry run (``forced``: node ->
    error), rather than run it silently on whole inputs.

    Raises:
        PlanningError: the first such node and its error.
    """
    for strategy in plan.strategies:
        if runs_summa(strategy) and strategy.node in forced:
            error = " ".join(str(forced[strategy.node]).split())[:200]
            raise PlanningError(
                f"node '{strategy.node[:80]}' has a {strategy.layout.describe()} layout the program cannot run: "
                f"the compile-time dry run failed on it ({error})"
            )


def _check_placements(what: str, rank: int, held, wanted: dict, plan: Plan, where: str) -> None:
    """The plan reads ``what`` (a tensor of ``rank`` dims) in the placements the runtime's
    algorithm works on."""
    rank_of = {axis: index for index, axis in enumerate(plan.mesh.names)}
    for axis, placement in wanted.items():
        given = held[rank_of[axis]]
        same = given == placement or (isinstance(given, Shard) and isinstance(placement, Shard)
                                       and given.dim % rank == placement.dim % rank)
        if not same:
            raise PlanningError(
                f"{where}, but reads {what} as {placements_str(held)}: the runtime needs {placement_to_str(placement)} "
                f"on '{axis}' (codegen/runtime/summa_layouts.py)"
            )


def node_call(strategy: NodeStrategy, fx_node: torch.fx.Node, rendered: Sequence[str], comments: list[str],
              axes: Sequence[str], sizes: Sequence[int]) -> str:
    """The call that computes ``fx_node`` in its SUMMA layout; appends the comments saying
    what it communicates and the local shapes to ``comments``."""
    layout = strategy.layout
    op = str(fx_node.target)
    size = dict(zip(axes, sizes))
    dp = size.get("dp", 1)
    q, d = layout.q, layout.d
    x_shape = tuple(int(v) for v in fx_node.args[0].meta["val"].shape)
    rows = math.prod(x_shape[:-1]) // (q * d * dp)
    if op.startswith(_LAYER_NORM):
        x, normalized, weight, bias, eps = (list(rendered) + ["None"] * 5)[:5]
        comments.append(comment(
            f"block-layout layer norm ({layout.describe()}): the hidden dim {x_shape[-1]} is split over "
            f"'{layout.hidden_axis}' ({x_shape[-1] // q} per rank), so each row's sum and squared deviations are "
            f"all-reduced over '{layout.hidden_axis}' (one number per local row); the weight and bias chunks are "
            f"shared by the ranks holding other rows: their gradients are summed once, by the gradient hook"
        ))
        eps = eps if eps != "None" else "1e-05"
        return f"summa_layouts.block_layer_norm({x}, {normalized}, {weight}, {bias}, {eps}, {layout.hidden_axis!r})"
    x, weight = rendered[0], rendered[1]
    bias = rendered[2] if len(rendered) > 2 else "None"
    n, k = (int(v) for v in fx_node.args[1].meta["val"].shape)
    if layout.family == "3d":
        b, c = ("col", "row") if layout.swapped else ("row", "col")
        comments.append(comment(
            f"{layout.describe()} matmul, roles b='{b}', c='{c}': all-gather W over 'dep' "
            f"([{k // (q * q)}, {n // q}] -> [{k // q}, {n // q}]) and x over '{b}' ([{rows}, {k // q}] -> "
            f"[{rows * q}, {k // q}]), multiply, reduce-scatter y over '{c}' ([{rows * q}, {n // q}] -> [{rows}, {n // q}]); "
            f"y comes out with rows on '{c}' and 'dep', columns on '{b}' "
            f"({'the layout before the previous matmul' if layout.swapped else 'a following matmul runs swapped'})"
        ))
        kept = ("reuse the forward's gathered x and W (kept: 1/q^2 blocks saved instead of the shards, "
                "two all-gathers fewer)" if layout.keep_gathered else f"all-gather x over '{b}' and W over 'dep' again")
        comments.append(comment(
            f"backward: all-gather dy over '{c}', {kept}; reduce-scatter dx over '{b}' while dW is computed, "
            f"then dW over 'dep'"
        ))
    else:
        comments.append(comment(
            f"{layout.describe()} matmul: {q} rounds; round l broadcasts x's block l along 'col' "
            f"([{rows}, {k // q}]) and W's block l along 'row' ([{k // q}, {n // q}]), the next round's blocks "
            f"travelling while this one multiplies; y [{rows}, {n // q}] stays in x's layout"
        ))
        depth = (
            "W's gradient is summed over 'dep' (the depth slices share W but saw other rows) once, by the gradient hook; "
            if layout.family == "2.5d" else ""
        )
        comments.append(comment(
            f"backward: the same broadcasts; dx and dW partials reduced along 'row' and 'col'; {depth}"
            f"the bias chunk's gradient is summed over the ranks holding other rows"
        ))
    kept = f", keep_gathered={layout.keep_gathered!r}" if layout.keep_gathered else ""
    return (f"summa_layouts.summa_linear({x}, {weight}, {bias}, family={layout.family!r}, "
            f"swapped={layout.swapped!r}{kept})")
