"""Neural-network ops: attention, embedding, convolution, pooling, padding.

Each rule lists only what a rank gets right by running the *same* op on its pieces.
Layouts that need a different local computation are left out, with the reason:

* ``embedding`` with the table split by rows (vocabulary parallel) needs the ids shifted
  into the local rows and the rows outside masked to zero (DTensor's ``MaskPartial``): the
  plain op indexes out of range (a program convention: ``search.rules.conventions``).
* attention split on the key/value sequence (ring attention) needs an online softmax
  across ranks.
"""

from __future__ import annotations

import re

from torch.distributed.tensor import Shard

from planner.attention_masks import is_causal_kind
from planner.graph import OpNode
from search.rules.common import AVG, SUM, R, aligned_shard, attr, chunk_sizes, is_float, shardable_dims
from search.rules.registry import AxisCandidate, register_rule


@register_rule("aten.scaled_dot_product_attention.default")
def attention_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """q, k, v (B, H, S, D) [+ mask broadcast to (B, H, Sq, Sk)]:

    * batch or heads split in q, k, v and the mask where it has them (not where it broadcasts);
    * v's features split (or v partial), the rest whole: the output is linear in v;
    * the query sequence split (k, v whole; the mask's query rows split) when the attention
      is not causal: a causal mask would be offset on every rank but the first. ``is_causal``
      cannot be set together with a mask, so a mask proves it off; without one, only an
      explicit positional ``is_causal=False`` does (the trace drops keyword arguments). A
      mask the trace proved causal (``planner.attention_masks``) counts as ``is_causal``:
      it is priced and compiled as the causal kernel, which a sequence split cannot run.
    """
    metas = node.input_meta
    if len(metas) < 3 or any(len(m.shape) != 4 for m in metas[:3]):
        return []
    query, key, value = metas[:3]
    out = node.output_meta[0]
    mask = metas[3] if len(metas) > 3 else None
    found = []
    for dim in (0, 1):
        size = query.shape[dim]
        if size < axis_size or size < 2 or key.shape[dim] != size or value.shape[dim] != size:
            continue
        placed = (Shard(dim), Shard(dim), Shard(dim))
        if mask is not None:
            placed += (aligned_shard(mask, 4, dim, size),)
        found.append(AxisCandidate(placed, (Shard(dim),)))
    # Linear in v, and v's features pass straight through: split them, or sum partial v.
    whole = tuple(R for _ in metas)
    if value.shape[3] >= axis_size and value.shape[3] > 1:
        found.append(AxisCandidate(whole[:2] + (Shard(3),) + whole[3:], (Shard(3),)))
    found += [AxisCandidate(whole[:2] + (flavour,) + whole[3:], (flavour,)) for flavour in (SUM, AVG)]
    causal = attr(node, 5, None)
    not_causal = (mask is not None and not is_causal_kind(node.attention_mask_kind)) or causal is False
    if not_causal and query.shape[2] >= axis_size and query.shape[2] > 1:
        placed = (Shard(2), R, R) + ((aligned_shard(mask, 4, 2, query.shape[2]),) if mask is not None else ())
        found.append(AxisCandidate(placed, (Shard(len(out.shape) - 2),)))
    return found


@register_rule("aten.embedding.default")
def embedding_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """``embedding(weight (V, D), ids)``: ids split anywhere (weight whole), or the weight's
    features split (ids whole). Linear in the weight."""
    if len(node.input_meta) < 2:
        return []
    weight, ids = node.input_meta[:2]
    out_rank = len(node.output_meta[0].shape)
    found = [AxisCandidate((R, Shard(dim)), (Shard(dim),)) for dim in shardable_dims(ids.shape, axis_size)]
    if len(weight.shape) == 2 and weight.shape[1] >= axis_size:
        found.append(AxisCandidate((Shard(1), R), (Shard(out_rank - 1),)))
    found += [AxisCandidate((flavour, R), (flavour,)) for flavour in (SUM, AVG)]
    return found


_CONVS = ("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default", "aten.convolution.default")


@register_rule(*_CONVS)
def convolution_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """``conv(x (N, C, *spatial), W (O, C/groups, *kernel), b (O,))``: samples split, weights
    whole. Nothing else, although more is right by arithmetic: DTensor runs a convolution
    through a handler of its own that computes from the input's placements alone and calls
    the local op on the local pieces as they are. A split weight (output or input channels)
    or partial sums in x or W come out as a slice or a partial value that DTensor labels
    otherwise (the compile-time dry run sees the local shape break its promise), so the
    program would be wrong; and a spatial split needs the halo exchange DTensor does only for
    the width under conditions. (Checked by running DTensor: tests/test_rules.py.)"""
    metas = node.input_meta
    if len(metas) < 2:
        return []
    x, weight = metas[:2]
    has_bias = len(metas) > 2
    batched = len(x.shape) == len(weight.shape)
    if batched and x.shape[0] >= axis_size and x.shape[0] > 1:
        return [AxisCandidate((Shard(0), R) + ((R,) if has_bias else ()), (Shard(0),))]
    return []


_POOL = re.compile(r"^aten\.(_?adaptive_)?(max|avg)_pool(\d)d(_with_indices)?\.default$")


def pooling_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """Pooling works per sample and per channel: split either. A spatial dim may be split
    when the windows tile it (kernel = stride, no padding or dilation) and every rank's
    piece holds whole windows that make its ``torch.chunk`` piece of the output. Average
    pools are linear."""
    match = _POOL.match(node.op)
    x = node.input_meta[0]
    out = node.output_meta[0]
    spatial = int(match[3])
    leading = len(x.shape) - spatial  # batch and channel dims (channel only when unbatched)
    tiles = _tiling_strides(node, spatial) if not match[1] else None
    found = []
    for dim in shardable_dims(x.shape, axis_size):
        if dim >= leading:
            stride = tiles[dim - leading] if tiles else None
            pieces = zip(chunk_sizes(x.shape[dim], axis_size), chunk_sizes(out.shape[dim], axis_size))
            if stride is None or any(size_in != stride * size_out for size_in, size_out in pieces):
                continue
        found.append(AxisCandidate((Shard(dim),), tuple(Shard(dim) for _ in node.output_meta)))
    if match[2] == "avg" and is_float(x):
        found += [AxisCandidate((flavour,), (flavour,)) for flavour in (SUM, AVG)]
    return found


def _tiling_strides(node: OpNode, spatial: int) -> list[int | None] | None:
    """Per spatial dim, the stride when windows tile the input exactly, else None."""
    def per_dim(value, default):
        value = attr(node, value, default)
        value = list(value) if isinstance(value, (list, tuple)) else [value]
        return value * spatial if len(value) == 1 else value

    kernel = per_dim(1, [])
    if len(kernel) != spatial:
        return None
    stride = per_dim(2, []) or kernel
    stride = stride if len(stride) == spatial else kernel
    padding = per_dim(3, [0])
    dilation = per_dim(4, [1]) if node.op.startswith("aten.max_pool") else [1] * spatial
    return [
        s if k == s and p == 0 and d == 1 else None for k, s, p, d in zip(kernel, stride, padding, dilation)
    ]


register_rule(
    *(
        f"aten.{prefix}{kind}_pool{n}d{suffix}.default"
        for prefix in ("", "adaptive_", "_adaptive_")
        for kind in ("max", "avg")
        for n in (1, 2, 3)
        for suffix in ("", "_with_indices")
        if not (kind == "avg" and suffix)
    )
)(pooling_rule)


@register_rule("aten.pad.default", "aten.constant_pad_nd.default")
def pad_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """Padding changes the last ``len(pad) // 2`` dims; the others may be split. Linear when
    it pads with zeros or copies of the input (reflect/replicate/circular)."""
    x = node.input_meta[0]
    pad = attr(node, 1, [])
    padded_from = len(x.shape) - len(pad) // 2
    found = [
        AxisCandidate((Shard(dim),), (Shard(dim),)) for dim in shardable_dims(x.shape, axis_size) if dim < padded_from
    ]
    if node.op == "aten.pad.default":
        mode, fill = attr(node, 2, "constant"), attr(node, 3, 0)
    else:
        mode, fill = "constant", attr(node, 2, 0)
    if is_float(x) and (mode != "constant" or fill == 0):
        found += [AxisCandidate((flavour,), (flavour,)) for flavour in (SUM, AVG)]
    return found
