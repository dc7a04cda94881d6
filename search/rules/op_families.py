"""The op families and their placement rule on one mesh axis (``op_rule``).

``op_rule(node, incoming)`` answers, for the placements an op's inputs arrive in on one mesh
axis, the placements it takes them in and the placements of its outputs: which dimension
each tensor is split on (``Shard(d)``), whether the op leaves partial sums (``Partial``), or
whether it needs whole inputs (``Replicate``: the edge pays a gather). Rules are op
families (views, elementwise, matmuls, reductions, normalisations, attention, convolutions),
read from the op's real dimension arguments (``OpNode.attrs``), never guessed from sizes.

Two users, one set of rules:

* the whole-model layouts walk the graph with it (``search.propagation.propagate``: data
  parallel and Megatron-LM). There it is also a *policy*: of the placements an op could
  take, it picks the one its first split input leads to, and it carries Megatron-LM's
  program conventions that are not plain-op truths (vocabulary-parallel embedding and
  cross entropy, the fused q|k|v split, the row-parallel bias counted once);
* the per-op registry derives its lowest-priority defaults from it
  (``search.rules.defaults``), for the families the brute-force check finds it right on.

Where the registry's own rules correct it (uneven splits, partial sums, losses:
``tests/test_rules.py`` names each), the layouts still follow ``op_rule``; see
``search.propagation`` for why the walk does not read the registry yet.
"""

from __future__ import annotations

import math

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from planner.graph import VIEW_OPS, OpNode, TensorMeta

R = Replicate()

# The op families op_rule dispatches on, by ATen name prefix (public: the registry's
# defaults and pointwise rules read them, so both agree on what a family is).
ELEMENTWISE = (
    "aten.add.", "aten.sub.", "aten.mul.", "aten.div.", "aten.neg.", "aten.pow.", "aten.rsqrt.", "aten.sqrt.",
    "aten.exp.", "aten.log.", "aten.reciprocal.", "aten.tanh.", "aten.sigmoid.", "aten.relu.", "aten.gelu.", "aten.silu.",
    "aten.dropout.", "aten.to.", "aten._to_copy.", "aten.type_as.", "aten.where.", "aten.masked_fill.",
    "aten.clamp.", "aten.abs.", "aten.erf.", "aten.cos.", "aten.sin.", "aten.maximum.", "aten.minimum.",
    "aten.eq.", "aten.ne.", "aten.lt.", "aten.le.", "aten.gt.", "aten.ge.", "aten.__and__.", "aten.__or__.",
    "aten.bitwise_not.", "aten.logical_not.", "aten.native_dropout.", "aten.relu_.", "aten.add_.",
    "aten.mul_.", "aten.hardtanh.", "aten.leaky_relu.", "aten.zeros_like.", "aten.ones_like.",
    "aten.full_like.", "aten.broadcast_tensors.", "aten.cat.",
)
SAME_LAYOUT = ("aten.clone.", "aten.contiguous.", "aten.alias.", "aten.detach.", "aten._assert", "aten.lift")
NORMS = ("aten.layer_norm.", "aten.rms_norm.")
SOFTMAXES = ("aten.softmax.", "aten._softmax.", "aten.log_softmax.", "aten._log_softmax.")
LINEARS = ("aten.linear.", "aten.addmm.", "aten.mm.", "aten.matmul.", "aten.bmm.", "aten.baddbmm.")
LOSSES = ("aten.cross_entropy_loss.", "aten.mse_loss.", "aten.nll_loss", "aten.l1_loss.", "aten.binary_cross_entropy")
REDUCTIONS = ("aten.mean.", "aten.sum.", "aten.amax.", "aten.amin.", "aten.max.", "aten.min.", "aten.cumsum.")
SPLITS = ("aten.split.", "aten.split_with_sizes.", "aten.unbind.", "aten.chunk.")
BATCHWISE = (
    "aten.conv1d.", "aten.conv2d.", "aten.conv3d.", "aten.convolution.", "aten.max_pool", "aten.avg_pool",
    "aten.adaptive_avg_pool", "aten.adaptive_max_pool", "aten.group_norm.", "aten.upsample", "aten.pad.",
    "aten.constant_pad_nd.",
)


def known_family(op: str) -> bool:
    """Whether ``op_rule`` has a family for ``op`` (an op outside them is run on whole inputs)."""
    return (
        op == "getitem" or op in VIEW_OPS
        or op.startswith((*SPLITS, *SAME_LAYOUT, "aten.flatten.", "aten.unflatten.", *LINEARS,
                          "aten.scaled_dot_product_attention", "aten.embedding.", *NORMS, *SOFTMAXES, *LOSSES,
                          *REDUCTIONS, *BATCHWISE, *ELEMENTWISE, "aten.stack."))
    )


def op_rule(node: OpNode, incoming: tuple[Placement, ...]) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """(the placements the op takes its inputs in, the placements of its outputs)."""
    outs = node.output_meta
    if all(isinstance(p, Replicate) for p in incoming):
        return incoming, tuple(R for _ in outs)
    op = node.op
    if op == "getitem":
        return incoming, tuple(incoming[0] for _ in outs)
    if op.startswith(SPLITS):
        return _split_rule(node, incoming)
    if node.is_view or op.startswith(SAME_LAYOUT) or op.startswith(("aten.flatten.", "aten.unflatten.")):
        return _view_rule(node, incoming)
    if op.startswith(LINEARS):
        return _matmul_rule(node, incoming)
    if op.startswith("aten.scaled_dot_product_attention"):
        return _attention_rule(node, incoming)
    if op.startswith("aten.embedding."):
        return _embedding_rule(node, incoming)
    if op.startswith(NORMS) or op.startswith(SOFTMAXES):
        return _normalisation_rule(node, incoming)
    if op.startswith(LOSSES):
        return _loss_rule(node, incoming)
    if op.startswith(REDUCTIONS):
        return _reduction_rule(node, incoming)
    if op.startswith(BATCHWISE):
        return _batchwise_rule(node, incoming)
    if op.startswith(ELEMENTWISE):
        return _elementwise_rule(node, incoming)
    if op.startswith("aten.stack."):
        return _stack_rule(node, incoming)
    return _gather_all(node, incoming)  # unknown op: replicated inputs, replicated work


# ----------------------------------------------------------------------------- helpers


def _gather_all(node: OpNode, incoming):
    return tuple(R for _ in incoming), tuple(R for _ in node.output_meta)


def _each(node: OpNode, placement: Placement) -> tuple[Placement, ...]:
    """``placement`` for every output of ``node`` (``max.dim`` gives values and indices)."""
    return tuple(placement for _ in node.output_meta)


def _first_sharded(node: OpNode, incoming) -> tuple[TensorMeta, Shard] | None:
    for meta, placement in zip(node.input_meta, incoming):
        if isinstance(placement, Shard) and meta.shape:
            return meta, Shard(placement.dim % len(meta.shape))
    return None


def _norm_dim(dim: int, rank: int) -> int:
    return dim % rank if rank else 0


def _map_reshape_dim(src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> int | None:
    """Where ``dim`` of ``src`` lands after a reshape to ``dst``: the dst dim that starts at
    the same flat offset, when the sharded dim is its outermost factor or splits evenly."""
    before = math.prod(src[:dim])
    running = 1
    for index, size in enumerate(dst):
        if running == before and size > 1:
            return index if (size % src[dim] == 0 or src[dim] % size == 0) else None
        running *= size
        if running > before:
            return None
    return None


def _moved_dim(node: OpNode, meta: TensorMeta, dim: int) -> int | None:
    """Where sharded dimension ``dim`` of the input lands in the output of a view-like op,
    or ``None`` when the op cuts across it (the input must then be gathered)."""
    op, attrs, rank = node.op, node.attrs, len(meta.shape)
    out = node.output_meta[0]
    if op.startswith("aten.transpose."):
        first, second = _norm_dim(attrs[1], rank), _norm_dim(attrs[2], rank)
        return second if dim == first else first if dim == second else dim
    if op.startswith("aten.t."):
        return rank - 1 - dim
    if op.startswith("aten.permute."):
        return [_norm_dim(d, rank) for d in attrs[1]].index(dim)
    if op.startswith("aten.unsqueeze."):
        return dim + 1 if dim >= _norm_dim(attrs[1], rank + 1) else dim
    if op.startswith("aten.squeeze."):
        if len(attrs) > 1:
            given = attrs[1] if isinstance(attrs[1], (list, tuple)) else [attrs[1]]
            removed = sorted({_norm_dim(d, rank) for d in given if meta.shape[_norm_dim(d, rank)] == 1})
        else:
            removed = [i for i, size in enumerate(meta.shape) if size == 1]
        return None if dim in removed else dim - sum(d < dim for d in removed)
    if op.startswith(("aten.slice.", "aten.narrow.")):
        along = _norm_dim(attrs[1], rank) if len(attrs) > 1 else 0
        return None if along == dim and out.shape[dim] != meta.shape[dim] else dim
    if op.startswith("aten.select."):
        along = _norm_dim(attrs[1], rank)
        return None if along == dim else dim - (along < dim)
    if op.startswith(("aten.expand.", "aten.expand_as.")):
        return dim + len(out.shape) - rank
    if op.startswith(SAME_LAYOUT):
        return dim
    return _map_reshape_dim(meta.shape, out.shape, dim)


# ------------------------------------------------------------------------------- rules


def _view_rule(node: OpNode, incoming):
    found = _first_sharded(node, incoming)
    if found is None or not node.output_meta:
        partial = next((p for p in incoming if isinstance(p, Partial)), R)
        return incoming, tuple(partial for _ in node.output_meta)  # views keep partial sums
    meta, placement = found
    new_dim = _moved_dim(node, meta, placement.dim)
    if new_dim is None:
        return _gather_all(node, incoming)
    return incoming, tuple(Shard(new_dim) for _ in node.output_meta)


def _split_rule(node: OpNode, incoming):
    found = _first_sharded(node, incoming)
    if found is None:
        return _gather_all(node, incoming)
    meta, placement = found
    rank = len(meta.shape)
    if node.op.startswith("aten.unbind."):
        along = _norm_dim(node.attrs[1] if len(node.attrs) > 1 else 0, rank)
        if along == placement.dim:
            return _gather_all(node, incoming)
        return incoming, tuple(Shard(placement.dim - (along < placement.dim)) for _ in node.output_meta)
    along = _norm_dim(node.attrs[2] if len(node.attrs) > 2 else 0, rank)
    if along == placement.dim and placement.dim != rank - 1:
        return _gather_all(node, incoming)
    # A split of the sharded feature dim is a fused projection (q|k|v, gate|up): Megatron
    # lays the weight out so each shard holds its own part of every piece, so it stays local.
    return incoming, tuple(placement for _ in node.output_meta)


def _elementwise_rule(node: OpNode, incoming):
    if not node.output_meta:
        return incoming, ()
    out = node.output_meta[0]
    out_rank = len(out.shape)
    sharded = None
    for meta, placement in zip(node.input_meta, incoming):
        if isinstance(placement, Shard) and meta.shape:
            aligned = placement.dim % len(meta.shape) + out_rank - len(meta.shape)
            if 0 <= aligned < out_rank and meta.shape[placement.dim % len(meta.shape)] == out.shape[aligned]:
                sharded = Shard(aligned)
                break
    if node.op.startswith("aten.cat.") and sharded is not None:
        along = _norm_dim(node.attrs[1] if len(node.attrs) > 1 else 0, out_rank)
        if along == sharded.dim:
            return _gather_all(node, incoming)
    if sharded is None:
        return _partial_elementwise(node, incoming)
    # Inputs that broadcast along the sharded dim stay whole; the others are sharded alike.
    wanted = []
    for meta, placement in zip(node.input_meta, incoming):
        aligned = sharded.dim - (out_rank - len(meta.shape))
        wanted.append(R if aligned < 0 or meta.shape[aligned] == 1 else Shard(aligned))
    return tuple(wanted), tuple(sharded for _ in node.output_meta)


def _stack_rule(node: OpNode, incoming):
    """Pieces of one shape split alike stack into a tensor split on the same dim (shifted
    past the new one when it comes after it)."""
    shapes = {meta.shape for meta in node.input_meta}
    sharded = next((p for p in incoming if isinstance(p, Shard)), None)
    if sharded is None or len(shapes) != 1:
        return _partial_elementwise(node, incoming)
    rank = len(node.output_meta[0].shape)
    new_dim = _norm_dim(node.attrs[1] if len(node.attrs) > 1 else 0, rank)
    dim = sharded.dim % (rank - 1)
    return tuple(Shard(dim) for _ in incoming), (Shard(dim + (dim >= new_dim)),)


def _partial_elementwise(node: OpNode, incoming):
    """Sums of partial sums stay partial; anything non-linear needs the full value first."""
    partials = [p for p in incoming if isinstance(p, Partial)]
    unary_linear = node.op.startswith(("aten.neg.", "aten.to.", "aten._to_copy.", "aten.clone.", "aten.dropout."))
    additive = node.op.startswith(("aten.add.", "aten.sub.")) and len(partials) == len(incoming)
    if partials and (unary_linear or additive):
        return incoming, tuple(partials[0] for _ in node.output_meta)
    return _gather_all(node, incoming)


def _matmul_rule(node: OpNode, incoming):
    """Linear-like ops. Batch or row sharding of the activation passes through; a weight
    sharded on its output features gives sharded features (column parallel); a weight and
    activation both sharded on the contracted dim give partial sums (row parallel)."""
    op = node.op
    out_rank = len(node.output_meta[0].shape)
    act_index = 1 if op.startswith(("aten.addmm.", "aten.baddbmm.")) else 0
    weight_index = act_index + 1
    if weight_index >= len(incoming):
        return _gather_all(node, incoming)
    activation, weight = node.input_meta[act_index], node.input_meta[weight_index]
    act_p, weight_p = incoming[act_index], incoming[weight_index]
    act_last = len(activation.shape) - 1
    act_dim = act_p.dim % len(activation.shape) if isinstance(act_p, Shard) else None
    wanted = list(incoming)
    has_bias = len(incoming) > 2
    bias_index = 0 if op.startswith("aten.addmm.") else 2 if op.startswith("aten.linear.") else None

    if node.params:  # x @ W with W a parameter: linear (W is (out, in)) or mm/addmm (W is (in, out))
        out_dim_w = 0 if op.startswith("aten.linear.") else len(weight.shape) - 1
        in_dim_w = 1 if op.startswith("aten.linear.") else len(weight.shape) - 2
        if act_dim is not None and act_dim != act_last and isinstance(weight_p, Replicate):
            if bias_index is not None and has_bias:
                wanted[bias_index] = R
            return tuple(wanted), (Shard(act_dim if out_rank == len(activation.shape) else 0),)
        if isinstance(weight_p, Shard) and weight_p.dim == out_dim_w and act_dim != act_last:
            wanted[act_index] = R  # sequence-parallel input: all-gathered first
            if bias_index is not None and has_bias:
                wanted[bias_index] = Shard(0)
            return tuple(wanted), (Shard(out_rank - 1),)
        if act_dim == act_last and isinstance(weight_p, Shard) and weight_p.dim == in_dim_w:
            if bias_index is not None and has_bias:
                wanted[bias_index] = R  # (bias counted once after the reduction: cost-model view)
            return tuple(wanted), (Partial(),)
        return _gather_all(node, incoming)

    # Activation @ activation (attention scores, bmm): batch dims shard both operands.
    weight_rank = len(weight.shape)
    if act_dim is not None and act_dim < act_last - 1 and act_dim < weight_rank - 2:
        wanted[weight_index] = Shard(act_dim)
        return tuple(wanted), (Shard(act_dim),)
    if act_dim is not None and act_dim == act_last - 1 and isinstance(weight_p, Replicate):
        return tuple(wanted), (Shard(out_rank - 2),)  # rows of the left operand
    if act_dim is not None and act_dim < act_last and isinstance(weight_p, Replicate) and weight_rank == 2:
        # (B, T, C) @ (C, D) with the right operand whole (a weight transposed by hand, as
        # Falcon writes its projections): every row of the left operand stands alone.
        return tuple(wanted), (Shard(act_dim + out_rank - len(activation.shape)),)
    if act_dim == act_last:
        wanted[weight_index] = Shard(weight_rank - 2)
        return tuple(wanted), (Partial(),)
    return _gather_all(node, incoming)


def _attention_rule(node: OpNode, incoming):
    """q, k, v are (B, heads, S, head_dim): batch and heads shard freely, the rest does not."""
    query = incoming[0]
    if isinstance(query, Shard) and query.dim % 4 in (0, 1):
        dim = query.dim % 4
        wanted = tuple(Shard(dim) if index < 3 else R for index, _ in enumerate(incoming))
        return wanted, tuple(Shard(dim) for _ in node.output_meta)
    return _gather_all(node, incoming)


def _embedding_rule(node: OpNode, incoming):
    weight_p = incoming[0]
    index_p = incoming[1] if len(incoming) > 1 else R
    out_rank = len(node.output_meta[0].shape)
    if isinstance(index_p, Shard) and isinstance(weight_p, Replicate):
        return incoming, (Shard(index_p.dim % max(1, out_rank - 1)),)
    if isinstance(weight_p, Shard) and weight_p.dim == 0 and index_p == R:
        return incoming, (Partial(),)  # vocabulary parallel: rows outside the shard give zeros
    if isinstance(weight_p, Shard) and weight_p.dim == 1 and index_p == R:
        return incoming, (Shard(out_rank - 1),)
    return _gather_all(node, incoming)


def _normalisation_rule(node: OpNode, incoming):
    """Layer/RMS norm over the trailing dims, softmax over ``dim``: other dims may stay sharded."""
    found = _first_sharded(node, incoming[:1])
    if found is None:
        return _gather_all(node, incoming)
    meta, placement = found
    rank = len(meta.shape)
    if node.op.startswith(NORMS):
        normalized = len(node.attrs[1]) if len(node.attrs) > 1 and isinstance(node.attrs[1], (list, tuple)) else 1
        blocked = set(range(rank - normalized, rank))
    else:
        blocked = {_norm_dim(node.attrs[1], rank) if len(node.attrs) > 1 else rank - 1}
    if placement.dim in blocked:
        return _gather_all(node, incoming)
    wanted = (placement,) + tuple(R for _ in incoming[1:])
    return wanted, tuple(placement if len(o.shape) == rank else R for o in node.output_meta)


def _loss_rule(node: OpNode, incoming):
    """A mean loss over batch-sharded rows is a partial average of the per-rank means."""
    found = _first_sharded(node, incoming)
    if found and found[1].dim == 1 and len(found[0].shape) > 1:
        if not _vocabulary_parallel(node):
            return _gather_all(node, incoming)
        # Logits sharded over classes: Megatron's vocabulary-parallel cross entropy
        # all-reduces each row's max, sum of exponentials and target logit across the
        # shards, never gathering the logits; every rank then holds the whole loss
        # (codegen.runtime.loss_parallel runs it, cost_model.loss_parallel prices it).
        return incoming, tuple(R for _ in node.output_meta)
    if found and found[1].dim == 0:
        rows = found[0].shape[0]
        wanted = tuple(Shard(0) if meta.shape and meta.shape[0] == rows else R for meta in node.input_meta)
        return wanted, tuple(Partial("avg") for _ in node.output_meta)
    return _gather_all(node, incoming)


def _vocabulary_parallel(node: OpNode) -> bool:
    """Whether a loss can run on logits split over the classes: a cross entropy without
    class weights or label smoothing (what PyTorch's ``loss_parallel`` takes)."""
    attrs = node.attrs
    weighted = len(node.inputs) > 2
    smoothing = attrs[5] if len(attrs) > 5 and attrs[5] is not None else 0.0
    return node.op == "aten.cross_entropy_loss.default" and not weighted and smoothing == 0.0


def _reduction_rule(node: OpNode, incoming):
    found = _first_sharded(node, incoming)
    if found is None or not node.output_meta:
        return _gather_all(node, incoming)
    meta, placement = found
    rank, dim = len(meta.shape), placement.dim
    out = node.output_meta[0]
    dims_attr = node.attrs[1] if len(node.attrs) > 1 else None
    if node.op.startswith("aten.cumsum."):
        return _gather_all(node, incoming) if _norm_dim(dims_attr, rank) == dim else (incoming, _each(node, Shard(dim)))
    if dims_attr is None or (isinstance(dims_attr, (list, tuple)) and not dims_attr):
        reduced = list(range(rank))  # a full reduction
    else:
        given = dims_attr if isinstance(dims_attr, (list, tuple)) else [dims_attr]
        reduced = sorted({_norm_dim(d, rank) for d in given})
    if dim not in reduced:
        keepdim = len(out.shape) == rank
        return incoming, _each(node, Shard(dim if keepdim else dim - sum(d < dim for d in reduced)))
    if node.op.startswith(("aten.mean.", "aten.sum.")):
        return incoming, _each(node, Partial("avg" if node.op.startswith("aten.mean.") else "sum"))
    return _gather_all(node, incoming)


def _batchwise_rule(node: OpNode, incoming):
    """Convolutions, pooling, group norm, padding: samples are independent along dim 0."""
    found = _first_sharded(node, incoming[:1])
    if found and found[1].dim == 0:
        return (found[1],) + tuple(R for _ in incoming[1:]), tuple(Shard(0) for _ in node.output_meta)
    return _gather_all(node, incoming)
