"""A whole-model SUMMA layout (2-D, 2.5-D or 3-D), as ``megatron_layout`` is Megatron-LM's.

Every linear with a weight parameter runs as a SUMMA matmul with the block-layout placements
of ``planner.strategy.SummaLayout`` (3-D: ``swapped`` by data flow, so consecutive matmuls
alternate and an MLP or an attention block returns to its input's layout); a layer norm over
the hidden dim is the block-layout norm of the axis that splits that dim; the word and
position embeddings are split on that axis too, so the residual stream starts in the block
layout. Every other op follows its inputs, one mesh axis at a time, by the rules of
``search.propagation``: attention runs on its (batch, heads) split. ``dp`` splits the batch.

A linear or norm whose sizes the grid does not divide stays an ordinary op (its weight
replicated); the program then redistributes around it.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from planner.errors import PlanningError
from planner.graph import OpGraph, OpNode
from planner.strategy import SUMMA_FAMILIES, Mesh, NodeStrategy, Placements, SummaLayout
from search.rules.choice import follow

__all__ = ["summa_layout"]

R = Replicate()
ROWS_AXES = ("dp", "row", "dep")  # the axes that may split the batch (rows) of a block layout


def summa_layout(
    graph: OpGraph, mesh: Mesh, family: str, keep_gathered: bool = False
) -> tuple[tuple[NodeStrategy, ...], dict[str, Placements | None]]:
    """Strategies and input placements of ``graph`` on ``mesh`` (axes ``row``, ``col`` and,
    for 2.5-D and 3-D, ``dep``; ``dp`` may sit outside) with every linear in the SUMMA
    ``family`` (module docstring); 3-D linears keep their gathered operands for the
    backward when ``keep_gathered``.

    Raises:
        PlanningError: the mesh does not fit the family, or no linear of the model can run
            as a SUMMA matmul on it.
    """
    layout = _family_layout(mesh, family)
    if keep_gathered and family != "3d":
        raise PlanningError(f"only 3-D linears keep their gathered operands, not {family}")
    axes = mesh.names
    sizes = dict(mesh.axes)
    unknown = [a for a in axes if a not in ("dp", "row", "col", "dep")]
    if unknown:
        raise PlanningError(f"a SUMMA layout runs on axes dp, row, col, dep; this mesh also has {unknown}")
    rows_ways = 1
    for axis in ROWS_AXES:
        rows_ways *= sizes.get(axis, 1)
    if graph.batch_size % rows_ways:
        raise PlanningError(
            f"a {layout.describe()} layout splits the batch {rows_ways} ways (dp x row x dep); batch {graph.batch_size} does not divide"
        )
    hidden_axis = layout.hidden_axis
    placement_of: dict[str, tuple[Placement, ...]] = {}
    inputs: dict[str, Placements | None] = {}
    for graph_input in graph.inputs:
        if graph_input.meta is None:
            inputs[graph_input.name] = None
            continue
        batch = graph_input.batch_dim == 0
        held = tuple(Shard(0) if batch and axis in _input_rows_axes(layout, axes) else R for axis in axes)
        inputs[graph_input.name] = held
        placement_of[graph_input.name] = held
    param_of_input: dict[str, str] = {}
    strategies = []
    summa_nodes = 0
    for node in graph.nodes:
        param_of_input.update(zip(node.param_inputs, node.params))
        incoming = [placement_of.get(name, tuple(R for _ in axes)) for name in node.inputs]
        strategy = _summa_linear(graph, node, incoming, layout, axes, sizes, param_of_input, keep_gathered)
        if strategy is None:
            strategy = _block_norm(graph, node, incoming, layout, axes, sizes, param_of_input)
        if strategy is not None:
            summa_nodes += node.op.startswith("aten.linear.")
        else:
            strategy = _propagated(graph, node, incoming, axes, sizes, hidden_axis, param_of_input)
        strategies.append(strategy)
        if strategy.outputs:
            placement_of[node.name] = strategy.outputs[0]
    if not summa_nodes:
        raise PlanningError(f"no linear of this model can run as a {layout.describe()} matmul (sizes the grid does not divide)")
    return tuple(strategies), inputs


def _family_layout(mesh: Mesh, family: str) -> SummaLayout:
    if family not in SUMMA_FAMILIES:
        raise PlanningError(f"SUMMA family must be one of {SUMMA_FAMILIES}, got {str(family)[:40]!r}")
    names = mesh.names
    for axis in ("row", "col", *(("dep",) if family != "2d" else ())):
        if axis not in names:
            raise PlanningError(f"a {family} SUMMA layout needs mesh axis {axis!r}; the mesh is {mesh}")
    q = mesh.axis_size("row")
    d = mesh.axis_size("dep") if "dep" in names else 1
    try:
        return SummaLayout(q, d, family)
    except ValueError as error:
        raise PlanningError(f"mesh {mesh} cannot hold a {family} SUMMA layout: {error}") from None


def _input_rows_axes(layout: SummaLayout, axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes splitting the rows of the residual stream (the first matmul's input)."""
    rows = ("dp", "row", "dep") if layout.family != "2d" else ("dp", "row")
    return tuple(a for a in axes if a in rows)


def _x_placements(layout: SummaLayout, axes, rank: int) -> tuple[Placement, ...]:
    """A SUMMA linear's input (rank ``rank``, rows on dim 0) on every mesh axis."""
    rows, hidden = Shard(0), Shard(rank - 1)
    if layout.family != "3d":
        table = {"dp": rows, "row": rows, "col": hidden, "dep": rows}
    else:
        b, c = ("col", "row") if layout.swapped else ("row", "col")
        table = {"dp": rows, b: rows, "dep": rows, c: hidden}
    return tuple(table.get(axis, R) for axis in axes)


def _y_placements(layout: SummaLayout, axes, rank: int) -> tuple[Placement, ...]:
    if layout.family != "3d":
        return _x_placements(layout, axes, rank)
    flipped = SummaLayout(layout.q, layout.d, "3d", not layout.swapped)
    return _x_placements(flipped, axes, rank)


def _weight_placements(layout: SummaLayout, axes) -> tuple[Placement, ...]:
    """W (N, K): 2-D/2.5-D: row S(1), col S(0); 3-D: c and dep S(1), b S(0)."""
    if layout.family != "3d":
        table = {"row": Shard(1), "col": Shard(0)}
    else:
        b, c = ("col", "row") if layout.swapped else ("row", "col")
        table = {c: Shard(1), "dep": Shard(1), b: Shard(0)}
    return tuple(table.get(axis, R) for axis in axes)


def _vector_placements(axes, hidden_axis: str) -> tuple[Placement, ...]:
    return tuple(Shard(0) if axis == hidden_axis else R for axis in axes)


def _matches(held: tuple[Placement, ...], wanted: tuple[Placement, ...], rank: int) -> bool:
    def norm(p):
        return Shard(p.dim % rank) if isinstance(p, Shard) else p
    return all(norm(a) == norm(b) for a, b in zip(held, wanted) if isinstance(b, Shard))


def _summa_linear(graph, node: OpNode, incoming, layout, axes, sizes, param_of_input,
                  keep_gathered: bool = False) -> NodeStrategy | None:
    """A linear with a 2-D weight parameter whose sizes the grid divides, as a SUMMA matmul."""
    if not node.op.startswith("aten.linear.") or len(node.inputs) < 2 or node.inputs[1] not in param_of_input:
        return None
    x_meta, w_meta = node.input_meta[0], node.input_meta[1]
    if len(w_meta.shape) != 2 or len(x_meta.shape) < 2:
        return None
    n, k = w_meta.shape
    q, d = layout.q, layout.d
    rows = x_meta.shape[0]
    rows_ways = q * d * sizes.get("dp", 1)
    k_ways = q * q if layout.family == "3d" else q
    if n % q or k % k_ways or rows % rows_ways:
        return None
    rank = len(x_meta.shape)
    if layout.family == "3d":
        swapped = SummaLayout(q, d, "3d", True, keep_gathered)
        layout = swapped if _matches(incoming[0], _x_placements(swapped, axes, rank), rank) \
            else SummaLayout(q, d, "3d", False, keep_gathered)
    x = _x_placements(layout, axes, rank)
    weight = _weight_placements(layout, axes)
    hidden_out = SummaLayout(q, d, "3d", not layout.swapped).hidden_axis if layout.family == "3d" else "col"
    node_inputs = [x, weight]
    params = {param_of_input[node.inputs[1]]: weight}
    if len(node.inputs) > 2:
        bias = _vector_placements(axes, hidden_out)
        node_inputs.append(bias)
        if node.inputs[2] in param_of_input:
            params[param_of_input[node.inputs[2]]] = bias
    y = _y_placements(layout, axes, len(node.output_meta[0].shape))
    return NodeStrategy(node=node.name, op=node.op, module=node.module, inputs=tuple(node_inputs), outputs=(y,),
                        params=params, layout=layout)


def _block_norm(graph, node: OpNode, incoming, layout, axes, sizes, param_of_input) -> NodeStrategy | None:
    """A layer norm over the last dim, split on the layout's hidden axis: the block-layout norm
    (3-D: of the swapped layout when its input comes in the swapped layout)."""
    if not node.op.startswith("aten.layer_norm.") or not node.input_meta:
        return None
    x_meta = node.input_meta[0]
    rank = len(x_meta.shape)
    normalized = node.attrs[1] if len(node.attrs) > 1 else None
    if rank < 2 or not isinstance(normalized, (list, tuple)) or len(normalized) != 1:
        return None
    rows_ways = layout.q * layout.d * sizes.get("dp", 1)
    if x_meta.shape[-1] % layout.q or x_meta.shape[0] % rows_ways:
        return None
    if layout.family == "3d":
        swapped = SummaLayout(layout.q, layout.d, "3d", True)
        layout = swapped if _matches(incoming[0], _x_placements(swapped, axes, rank), rank) else SummaLayout(layout.q, layout.d, "3d")
    x = _x_placements(layout, axes, rank)
    vector = _vector_placements(axes, layout.hidden_axis)
    node_inputs, params = [x], {}
    for index in range(1, len(node.inputs)):
        name = node.inputs[index]
        node_inputs.append(vector if name in param_of_input else tuple(R for _ in axes))
        if name in param_of_input:
            params[param_of_input[name]] = vector
    return NodeStrategy(node=node.name, op=node.op, module=node.module, inputs=tuple(node_inputs), outputs=(x,),
                        params=params, layout=layout)


def _propagated(graph, node: OpNode, incoming, axes, sizes, hidden_axis: str, param_of_input) -> NodeStrategy:
    """Any other op: each axis's placements follow its inputs (``search.rules.choice.follow``);
    an embedding table is split on its features over the hidden axis, so the residual stream
    starts with its hidden dim split there."""
    per_axis_in, per_axis_out = [], []
    for index, axis in enumerate(axes):
        held, fixed = [], set()
        for position, (name, placements) in enumerate(zip(node.inputs, incoming)):
            if name in param_of_input:
                held.append(_param_placement(graph, node, param_of_input[name], axis, sizes, hidden_axis))
                if not isinstance(held[-1], Replicate):
                    fixed.add(position)  # a weight the layout split stays so; a whole one may be sliced
            else:
                held.append(placements[index])
        wanted, outputs = follow(node, tuple(held), sizes[axis], fixed, conventions=True)
        per_axis_in.append(wanted)
        per_axis_out.append(outputs)
    node_inputs = tuple(tuple(per_axis_in[a][i] for a in range(len(axes))) for i in range(len(node.inputs)))
    outputs = tuple(tuple(per_axis_out[a][i] for a in range(len(axes))) for i in range(len(node.output_meta)))
    params = {
        param_of_input[name]: node_inputs[i] for i, name in enumerate(node.inputs) if name in param_of_input
    }
    return NodeStrategy(node=node.name, op=node.op, module=node.module, inputs=node_inputs, outputs=outputs, params=params)


def _param_placement(graph, node: OpNode, param: str, axis: str, sizes, hidden_axis: str) -> Placement:
    meta = graph.parameters.get(param)
    if (
        axis == hidden_axis
        and node.op.startswith("aten.embedding.")
        and meta is not None
        and len(meta.shape) == 2
        and meta.shape[1] % sizes[axis] == 0
    ):
        return Shard(1)
    return R

