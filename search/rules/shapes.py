"""Reshapes and splits: ops that regroup dims or cut a tensor into pieces.

Reshape (``view``, ``reshape``, ``_unsafe_view``, ``flatten``, ``unflatten``): the dims of
input and output fall into groups of equal element count (``(2, 32, 64) -> (2, 32, 4, 16)``
groups ``64`` with ``4, 16``). A split dim stays split only as the *outermost* dim of its
group, and, when the group merges or splits dims, only if the axis divides the outermost dim
on both sides: otherwise each rank's contiguous block is not the ``torch.chunk`` piece of the
other side (8 rows of 32 over 3 ranks are 96/96/64 rows of the merged (256, ...) tensor, but
``torch.chunk`` gives 86/86/84; 4 heads of 16 over 3 ranks do not cut 64 features at all).
Reshapes
are linear, so ``Partial`` passes through.

Splits (``split``, ``split_with_sizes``, ``unbind``, ``chunk``): a split on another dim
passes through to every piece; a split on the cut dim needs the whole tensor. Under the
standard layout a fused projection ``q|k|v`` sharded on its feature dim does *not* give
each rank its shard of ``q``, ``k`` and ``v``: rank 0 holds all of ``q`` and part of ``k``.
(Megatron gets that layout by permuting the weight rows, which is a different placement,
DTensor's ``_StridedShard``: a program convention, ``search.rules.conventions``.)
"""

from __future__ import annotations

from torch.distributed.tensor import Shard

from planner.graph import OpNode
from search.rules.common import AVG, SUM, R, norm_dim, shardable_dims, attr
from search.rules.registry import AxisCandidate, register_rule


def reshape_dim_map(src: tuple[int, ...], dst: tuple[int, ...], axis_size: int) -> dict[int, int]:
    """Input dim -> output dim for every split that survives a reshape from ``src`` to
    ``dst`` on an axis of ``axis_size`` ranks, with the standard layout on both sides."""
    left = [(dim, size) for dim, size in enumerate(src) if size != 1]
    right = [(dim, size) for dim, size in enumerate(dst) if size != 1]
    mapping: dict[int, int] = {}
    i = j = 0
    while i < len(left) and j < len(right):
        group_in, group_out = [left[i]], [right[j]]
        count_in, count_out = left[i][1], right[j][1]
        i, j = i + 1, j + 1
        while count_in != count_out:
            if count_in < count_out and i < len(left):
                group_in.append(left[i])
                count_in *= left[i][1]
                i += 1
            elif count_out < count_in and j < len(right):
                group_out.append(right[j])
                count_out *= right[j][1]
                j += 1
            else:
                return mapping  # sizes do not match: not a reshape we understand
        (in_dim, in_size), (out_dim, out_size) = group_in[0], group_out[0]
        if in_size < axis_size:
            continue
        one_to_one = len(group_in) == 1 and len(group_out) == 1
        if one_to_one or (in_size % axis_size == 0 and out_size % axis_size == 0):
            mapping[in_dim] = out_dim
    return mapping


def _reshape_candidates(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    src, dst = node.input_meta[0].shape, node.output_meta[0].shape
    others = tuple(R for _ in node.input_meta[1:])  # view_as's template tensor: shape only
    found = [
        AxisCandidate((Shard(in_dim),) + others, (Shard(out_dim),))
        for in_dim, out_dim in reshape_dim_map(src, dst, axis_size).items()
    ]
    if node.input_meta[0].dtype.is_floating_point:
        found += [AxisCandidate((flavour,) + others, (flavour,)) for flavour in (SUM, AVG)]
    return found


@register_rule(
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.reshape.default",
    "aten.flatten.using_ints",
    "aten.unflatten.int",
    "aten.view_as.default",
)
def reshape_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """Reshapes: splits survive as the outermost dim of their group (see module)."""
    return _reshape_candidates(node, axis_size)


@register_rule("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "aten.unbind.int")
def split_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """Pieces keep a split of any other dim; the cut dim itself must be whole."""
    meta = node.input_meta[0]
    rank = len(meta.shape)
    unbind = node.op == "aten.unbind.int"
    along = norm_dim(attr(node, 1 if unbind else 2, 0), rank)
    found = []
    for dim in shardable_dims(meta.shape, axis_size):
        if dim == along:
            continue
        out_dim = dim - (unbind and along < dim)
        found.append(AxisCandidate((Shard(dim),), tuple(Shard(out_dim) for _ in node.output_meta)))
    if meta.dtype.is_floating_point:
        found += [AxisCandidate((flavour,), tuple(flavour for _ in node.output_meta)) for flavour in (SUM, AVG)]
    return found
