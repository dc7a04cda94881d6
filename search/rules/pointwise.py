"""Pointwise ops (``ELEMENTWISE``) and ``cat``.

Any output dim may be split: inputs holding that dim at full size are split alike, inputs
that broadcast along it stay whole; uneven sizes are fine since every tensor chunks the
dim the same way.

``Partial`` passes only through ops that are linear in the partial operand:

* sign, copies, dtype casts between floating types: ``P -> P``;
* ``mul``/``div`` by a replicated tensor or a number (the partial operand being a factor,
  or the dividend): ``P -> P``;
* ``add``/``sub`` of partials of the same kind: ``(P, P) -> P``;
* ``add``/``sub`` of a replicated tensor or a number to an *average*: ``(P(avg), R) ->
  P(avg)`` (the mean of ``x_r + c`` is ``mean(x_r) + c``). Adding a number to a *sum* is
  wrong (it is added on every rank).

Dropout is not among them: each rank would draw its own mask, and the sum of differently
masked partials is not the dropout of the sum. DTensor refuses it too ("random sampling on
partial tensors is undefined": ``torch/distributed/tensor/_ops/_random_ops.py``, PyTorch
2.13), so a compiled program would reduce first anyway; Megatron-LM reduces the row-parallel
output before its bias-dropout-add (``search.layouts.megatron_layout``).
"""

from __future__ import annotations

from torch.distributed.tensor import Shard

from planner.graph import OpNode
from search.rules.common import AVG, SUM, R, aligned_shard, attr, is_float, norm_dim, shardable_dims
from search.rules.registry import AxisCandidate, register_family, register_rule

# The elementwise ops, by ATen name prefix.
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
# Linear in their one tensor input (and float in, float out where casting).
_LINEAR_UNARY = (
    "aten.neg.", "aten.clone.", "aten.contiguous.", "aten.alias.", "aten.detach.",
    "aten.to.", "aten._to_copy.", "aten.type_as.", "aten.positive.", "aten.lift",
)
_ADDITIVE = frozenset(
    f"aten.{name}.{overload}" for name in ("add", "sub", "add_", "sub_") for overload in ("Tensor", "Scalar")
)
# Not div.Tensor_mode: a rounded quotient is not linear.
_SCALING = frozenset(
    f"aten.{name}.{overload}" for name in ("mul", "div", "mul_", "div_") for overload in ("Tensor", "Scalar")
)


def _is_pointwise(op: str) -> bool:
    return op.startswith(ELEMENTWISE) and not op.startswith(("aten.cat.",))


def pointwise_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """Split any output dim (broadcast inputs stay whole); ``Partial`` where linear."""
    if not node.output_meta or any(o.shape != node.output_meta[0].shape for o in node.output_meta):
        return []  # outputs of different shapes are no elementwise op
    out = node.output_meta[0]
    rank = len(out.shape)
    found = []
    for dim in shardable_dims(out.shape, axis_size):
        try:
            inputs = tuple(aligned_shard(meta, rank, dim, out.shape[dim]) for meta in node.input_meta)
        except ValueError:
            continue
        found.append(AxisCandidate(inputs, tuple(Shard(dim) for _ in node.output_meta)))
    return found + _partial_candidates(node)


def _partial_candidates(node: OpNode) -> list[AxisCandidate]:
    op, metas = node.op, node.input_meta
    if not metas or not all(is_float(o) for o in node.output_meta) or not is_float(metas[0]):
        return []
    count = len(metas)
    scalar_operand = count == 1 and len(node.attrs) > 1 and isinstance(node.attrs[1], (int, float))
    found = []
    for flavour in (SUM, AVG):
        outputs = tuple(flavour for _ in node.output_meta)
        if op.startswith("aten.broadcast_tensors.") and all(is_float(m) for m in metas):
            found.append(AxisCandidate(tuple(flavour for _ in metas), outputs))
        elif op.startswith(_LINEAR_UNARY) and (count == 1 or op.startswith("aten.type_as.")):
            found.append(AxisCandidate((flavour,) + tuple(R for _ in metas[1:]), outputs))
        elif op in _ADDITIVE:
            if count == 2 and all(is_float(m) for m in metas):
                found.append(AxisCandidate((flavour, flavour), outputs))
                if flavour == AVG:  # a constant added to an average stays an average
                    found += [AxisCandidate((AVG, R), outputs), AxisCandidate((R, AVG), outputs)]
            elif scalar_operand and flavour == AVG:
                found.append(AxisCandidate((AVG,), outputs))
        elif op in _SCALING:
            if scalar_operand:
                found.append(AxisCandidate((flavour,), outputs))
            elif count == 2:
                found.append(AxisCandidate((flavour, R), outputs))  # partial factor or dividend
                if op.startswith(("aten.mul.", "aten.mul_.")) and is_float(metas[1]):  # either factor
                    found.append(AxisCandidate((R, flavour), outputs))
    return found


register_family(_is_pointwise, pointwise_rule)


@register_rule("aten.cat.default")
def cat_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """Split any dim but the one concatenated along; partial pieces concatenate to partials."""
    out = node.output_meta[0]
    rank = len(out.shape)
    along = norm_dim(attr(node, 1, 0), rank)
    if any(len(meta.shape) != rank for meta in node.input_meta):
        return []  # legacy empty 1-d inputs: leave them to the replicated strategy
    found = [
        AxisCandidate(tuple(Shard(dim) for _ in node.input_meta), (Shard(dim),))
        for dim in shardable_dims(out.shape, axis_size)
        if dim != along
    ]
    if all(is_float(meta) for meta in node.input_meta):
        found += [AxisCandidate(tuple(f for _ in node.input_meta), (f,)) for f in (SUM, AVG)]
    return found


@register_rule("aten.stack.default")
def stack_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """Split any dim of the inputs (it moves past the new dim when it comes after it);
    partial pieces stack to partials."""
    out = node.output_meta[0]
    rank = len(out.shape)
    new_dim = norm_dim(attr(node, 1, 0), rank)
    if any(meta.shape != node.input_meta[0].shape for meta in node.input_meta):
        return []
    found = [
        AxisCandidate(tuple(Shard(dim) for _ in node.input_meta), (Shard(dim + (dim >= new_dim)),))
        for dim in shardable_dims(node.input_meta[0].shape, axis_size)
    ]
    if all(is_float(meta) for meta in node.input_meta):
        found += [AxisCandidate(tuple(f for _ in node.input_meta), (f,)) for f in (SUM, AVG)]
    return found


@register_rule("aten.outer.default")
def outer_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """``a (n) x b (m) -> (n, m)``: split ``a`` to split rows, ``b`` to split columns; a
    partial factor against a whole one gives partial products."""
    found = []
    if node.input_meta[0].shape[0] >= axis_size:
        found.append(AxisCandidate((Shard(0), R), (Shard(0),)))
    if node.input_meta[1].shape[0] >= axis_size:
        found.append(AxisCandidate((R, Shard(0)), (Shard(1),)))
    if all(is_float(meta) for meta in node.input_meta):
        found += [AxisCandidate((f, R), (f,)) for f in (SUM, AVG)] + [AxisCandidate((R, f), (f,)) for f in (SUM, AVG)]
    return found
