"""SUMMA candidates: a node's strategies in the 2-D, 2.5-D or 3-D block layout of a mesh with
``row`` / ``col`` (and ``dep``) axes (``planner.strategy.SummaLayout`` gives the placements).

A SUMMA linear is a multi-axis strategy that no per-axis rule expresses (on ``row`` the
activation is split by rows but the weight by K), so its candidates are built here, whole,
and added to the per-axis ones (``search.auto.node_strategies``). The other ops of a block
keep the activations in the block layout:

* linear (``aten.linear``, x ``(..., K)``, W ``(N, K)``, b ``(N)``): the family's placements,
  with, for 3-D, both role assignments (``swapped`` False and True; consecutive matmuls
  alternate so an MLP returns to its input's layout);
* layer norm / RMS norm over the hidden dim: input and output in the block layout, the
  hidden dim split on the layout's ``hidden_axis`` (the runtime all-reduces the statistics
  there), the weight and bias ``S(0)`` on that axis; they carry the family's layout;
* elementwise ops, dropout, residual adds: the per-axis rules already allow the block
  layout on each axis; it is assembled from them here so that the cap on per-axis
  combinations (``search.rules.MAX_CANDIDATES``) cannot drop it.

Attention, embedding, the loss and the views around them keep their per-axis rules; their
boundary with the block layout is a resharding edge that the cost model prices.

Which family a mesh runs follows from its axis order (``summa_family``): ``row x col`` is 2-D,
``dep x row x col`` 2.5-D, ``row x col x dep`` 3-D. The rows (``l``) are always dim 0, the batch.
"""

from __future__ import annotations

import math

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from planner.graph import OpNode
from planner.strategy import Mesh, NodeStrategy, SummaLayout
from search.rules.registry import axis_candidates

R = Replicate()
SUMMA_AXES = ("row", "col", "dep")
LINEAR_OPS = ("aten.linear.default",)
NORM_OPS = ("aten.layer_norm.default", "aten.rms_norm.default")
# Ops whose output has its input's shape element by element: the block layout passes through.
BLOCK_POINTWISE = (
    "aten.add.Tensor", "aten.mul.Tensor", "aten.sub.Tensor", "aten.gelu.default", "aten.relu.default",
    "aten.silu.default", "aten.tanh.default", "aten.dropout.default", "aten.native_dropout.default",
    "aten.sigmoid.default", "aten.clone.default", "aten._to_copy.default",
)


def summa_family(mesh: Mesh) -> str | None:
    """The SUMMA family a mesh's ``row``/``col``/``dep`` axes run, or None (no such axes)."""
    order = [name for name in mesh.names if name in SUMMA_AXES]
    return {("row", "col"): "2d", ("dep", "row", "col"): "2.5d", ("row", "col", "dep"): "3d"}.get(tuple(order))


def mesh_layouts(mesh: Mesh) -> list[SummaLayout]:
    """The SUMMA layouts a mesh can run (3-D: both role assignments, each with and without
    kept gathers), none for other meshes."""
    family = summa_family(mesh)
    if family is None:
        return []
    q = mesh.axis_size("row")
    d = mesh.axis_size("dep") if family != "2d" else 1
    if mesh.axis_size("col") != q:
        return []
    if family == "3d":
        return [SummaLayout(q, d, "3d", swapped, keep) for keep in (False, True) for swapped in (False, True)]
    return [SummaLayout(q, d, family)]


def block_placements(layout: SummaLayout, rank: int, output: bool = False) -> dict[str, Placement]:
    """Per SUMMA axis, the placement of an activation of ``rank`` dims in ``layout``'s block
    layout: rows (dim 0) split on every axis but the one holding the hidden (last) dim. For
    a 3-D linear's output (``output=True``) the roles of row and col are exchanged."""
    hidden = layout.hidden_axis
    if output and layout.family == "3d":
        hidden = "col" if hidden == "row" else "row"
    axes = ("row", "col") + (("dep",) if layout.family != "2d" else ())
    return {axis: Shard(rank - 1) if axis == hidden else Shard(0) for axis in axes}


def _weight_placements(layout: SummaLayout) -> dict[str, Placement]:
    """W ``(N, K)`` per axis: 2-D/2.5-D K on row, N on col; 3-D K on c and dep, N on b."""
    if layout.family != "3d":
        return {"row": Shard(1), "col": Shard(0), **({"dep": R} if layout.family == "2.5d" else {})}
    b, c = ("col", "row") if layout.swapped else ("row", "col")
    return {c: Shard(1), "dep": Shard(1), b: Shard(0)}


def _bias_placements(layout: SummaLayout) -> dict[str, Placement]:
    """b ``(N)``: split like the output's hidden dim, replicated elsewhere."""
    hidden = _out_hidden_axis(layout)
    return {axis: Shard(0) if axis == hidden else R for axis in block_placements(layout, 1)}


def _out_hidden_axis(layout: SummaLayout) -> str:
    """The axis holding the hidden (last) dim of a linear's output."""
    if layout.family != "3d":
        return "col"
    return "col" if layout.swapped else "row"


def _on_mesh(mesh: Mesh, per_axis: dict[str, Placement], rows_on_dp: bool) -> tuple[Placement, ...]:
    """One placement per mesh axis: the SUMMA axes from ``per_axis``; ``dp`` splits the rows of
    activations (``rows_on_dp``) and replicates parameters; other axes replicate."""
    return tuple(per_axis[name] if name in per_axis else (Shard(0) if name == "dp" and rows_on_dp else R)
                 for name in mesh.names)


def _divides(shape: tuple[int, ...], placements: tuple[Placement, ...], mesh: Mesh) -> bool:
    """Whether every split dim divides evenly by the product of the axes splitting it."""
    splits: dict[int, int] = {}
    for (_, size), placement in zip(mesh.axes, placements):
        if isinstance(placement, Shard):
            splits[placement.dim] = splits.get(placement.dim, 1) * size
    return all(dim < len(shape) and shape[dim] % ways == 0 for dim, ways in splits.items())


def summa_candidates(node: OpNode, mesh: Mesh) -> list[NodeStrategy]:
    """The node's strategies in the block layout(s) of ``mesh`` (none when the mesh has no
    SUMMA axes, the op has no block-layout form, or its sizes do not split evenly)."""
    layouts = mesh_layouts(mesh)
    if not layouts or not node.output_meta:
        return []
    if node.op in LINEAR_OPS:
        return [s for layout in layouts if (s := _linear(node, mesh, layout)) is not None]
    if node.op in NORM_OPS:  # kept gathers are a matmul's choice: a norm carries the plain layout
        return [s for layout in layouts if not layout.keep_gathered and (s := _norm(node, mesh, layout)) is not None]
    if node.op in BLOCK_POINTWISE:
        return _pointwise(node, mesh, layouts)
    return []


def _strategy(node: OpNode, mesh: Mesh, layout: SummaLayout | None, inputs, outputs) -> NodeStrategy | None:
    metas = (*node.input_meta, *node.output_meta)
    if not all(_divides(tuple(meta.shape), p, mesh) for meta, p in zip(metas, (*inputs, *outputs))):
        return None
    params = {param: inputs[node.inputs.index(source)] for param, source in zip(node.params, node.param_inputs)}
    return NodeStrategy(node=node.name, op=node.op, module=node.module, inputs=tuple(inputs), outputs=tuple(outputs),
                        params=params, layout=layout)


def _linear(node: OpNode, mesh: Mesh, layout: SummaLayout) -> NodeStrategy | None:
    x, weight = node.input_meta[0], node.input_meta[1]
    if len(weight.shape) != 2 or len(x.shape) < 2 or node.inputs[1] not in node.param_inputs:
        return None
    rank = len(x.shape)
    inputs = [_on_mesh(mesh, block_placements(layout, rank), True), _on_mesh(mesh, _weight_placements(layout), False)]
    if len(node.inputs) > 2:
        inputs.append(_on_mesh(mesh, _bias_placements(layout), False))
    output = _on_mesh(mesh, block_placements(layout, len(node.output_meta[0].shape), output=True), True)
    return _strategy(node, mesh, layout, inputs, [output])


def _norm(node: OpNode, mesh: Mesh, layout: SummaLayout) -> NodeStrategy | None:
    x = node.input_meta[0]
    normalized = next((a for a in node.attrs if isinstance(a, (list, tuple))), None)
    if normalized is not None and len(normalized) != 1:
        return None  # the block layout splits one hidden dim
    activation = _on_mesh(mesh, block_placements(layout, len(x.shape)), True)
    hidden = layout.hidden_axis
    weight = _on_mesh(mesh, {axis: Shard(0) if axis == hidden else R for axis in SUMMA_AXES if axis in mesh.names}, False)
    inputs = [activation] + [weight if source in node.param_inputs else _replicated(mesh) for source in node.inputs[1:]]
    outputs = [activation if len(meta.shape) == len(x.shape) else _replicated(mesh) for meta in node.output_meta]
    if len(node.output_meta) != 1:
        return None  # the traced forward-only norm has one output; others are not block ops here
    return _strategy(node, mesh, layout, inputs, outputs)


def _replicated(mesh: Mesh) -> tuple[Placement, ...]:
    return tuple(R for _ in mesh.names)


def _pointwise(node: OpNode, mesh: Mesh, layouts: list[SummaLayout]) -> list[NodeStrategy]:
    """Block-layout strategies assembled from the per-axis rules (one per hidden axis)."""
    out = node.output_meta[0]
    rank = len(out.shape)
    if rank < 2:
        return []
    strategies, seen = [], set()
    per_axis_options = {name: axis_candidates(node, size) for name, size in mesh.axes}
    for layout in layouts:
        wanted = _on_mesh(mesh, block_placements(layout, rank), True)
        chosen = []
        for index, (name, _) in enumerate(mesh.axes):
            match = next((c for c in per_axis_options[name] if _matches(node, c, wanted[index], rank)), None)
            if match is None:
                break
            chosen.append(match)
        else:
            inputs = tuple(tuple(c.inputs[i] for c in chosen) for i in range(len(node.inputs)))
            outputs = tuple(tuple(c.outputs[i] for c in chosen) for i in range(len(node.output_meta)))
            if outputs in seen:
                continue
            seen.add(outputs)
            strategy = _strategy(node, mesh, None, inputs, outputs)
            if strategy is not None:
                strategies.append(strategy)
    return strategies


def _matches(node: OpNode, candidate, wanted: Placement, rank: int) -> bool:
    """A per-axis candidate whose outputs, and inputs of the output's rank, are ``wanted``."""
    if any(p != wanted for p in candidate.outputs):
        return False
    return all(p == wanted for p, meta in zip(candidate.inputs, node.input_meta)
               if len(meta.shape) == rank and meta.dtype.is_floating_point)


def is_summa_mesh(mesh: Mesh) -> bool:
    """Whether ``mesh`` has the axes of a SUMMA family."""
    return summa_family(mesh) is not None


def grid_devices(mesh: Mesh) -> int:
    """Devices of one SUMMA grid of ``mesh`` (q * q * d), 1 without SUMMA axes."""
    return math.prod(size for name, size in mesh.axes if name in SUMMA_AXES) if is_summa_mesh(mesh) else 1
