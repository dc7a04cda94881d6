"""Indexing, creation and opaque ops.

* ``gather``/``index``: the indexed tensor whole and the index tensors split (each rank
  looks up its own positions), or both split alike on a dim the op does not index.
* ``diff``: other dims than the differenced one may be split; linear.
* ``slice_scatter``/``select_scatter`` (a write into a view, traced functionally by
  ``planner.functionalize``): any other dim than the written one split in the base and
  alike in the written part (DTensor's own rules; it runs no partial sums through them).
* creation ops (``arange``, ``zeros``, ``new_ones``...): the result does not depend on any
  input value, so they run whole on every rank (a split result is a free local slice later).
* higher-order ops that wrap a subgraph (``wrap_with_set_grad_enabled``, e.g. the rotary
  embedding of HF Llama under ``torch.no_grad``): the node does not show the subgraph, so
  they run whole. Registered explicitly so they do not read as unknown ops.
"""

from __future__ import annotations

from torch.distributed.tensor import Shard

from planner.graph import OpNode
from search.rules.common import AVG, SUM, R, attr, is_float, norm_dim, shardable_dims
from search.rules.registry import AxisCandidate, register_rule


@register_rule("aten.gather.default")
def gather_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """``gather(x, dim, index)``: out[i][j] = x[i][index[i][j]] (dim 1)."""
    if len(node.input_meta) != 2:
        return []
    x, index = node.input_meta
    along = norm_dim(attr(node, 1, 0), len(x.shape))
    found = []
    for dim in shardable_dims(index.shape, axis_size):
        if dim == along:  # positions split, looked up in the whole x
            found.append(AxisCandidate((R, Shard(dim)), (Shard(dim),)))
        elif x.shape[dim] == index.shape[dim]:
            found.append(AxisCandidate((Shard(dim), Shard(dim)), (Shard(dim),)))
    if is_float(x):
        found += [AxisCandidate((flavour, R), (flavour,)) for flavour in (SUM, AVG)]
    return found


@register_rule("aten.index.Tensor")
def index_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """``x[i0, i1, ...]`` with index tensors on the leading dims of x: the result is the
    broadcast of the indices followed by x's remaining dims. Split a broadcast dim in the
    indices (x whole), or a remaining dim of x (indices whole)."""
    metas = node.input_meta
    indices = attr(node, 1, [])
    if len(metas) < 2 or len(indices) != len(metas) - 1:
        return []  # some index entries are slices (None): positions cannot be told apart
    x, index_metas = metas[0], metas[1:]
    out = node.output_meta[0]
    broadcast_rank = max(len(m.shape) for m in index_metas)
    found = []
    for dim in shardable_dims(out.shape[:broadcast_rank], axis_size):
        placed = []
        for meta in index_metas:
            own = dim - (broadcast_rank - len(meta.shape))
            placed.append(R if own < 0 or meta.shape[own] == 1 else Shard(own))
        found.append(AxisCandidate((R,) + tuple(placed), (Shard(dim),)))
    for dim in shardable_dims(x.shape, axis_size):
        if dim >= len(index_metas):
            out_dim = broadcast_rank + dim - len(index_metas)
            found.append(AxisCandidate((Shard(dim),) + tuple(R for _ in index_metas), (Shard(out_dim),)))
    if is_float(x):
        found += [AxisCandidate((flavour,) + tuple(R for _ in index_metas), (flavour,)) for flavour in (SUM, AVG)]
    return found


@register_rule("aten.diff.default")
def diff_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """``diff(x, n, dim, prepend, append)``: split other dims in x and the pads alike."""
    x = node.input_meta[0]
    along = norm_dim(attr(node, 2, -1), len(x.shape))
    found = []
    for dim in shardable_dims(x.shape, axis_size):
        if dim == along:
            continue
        placed = tuple(Shard(dim) if m.shape[dim] == x.shape[dim] else R for m in node.input_meta)
        found.append(AxisCandidate(placed, (Shard(dim),)))
    if all(is_float(m) for m in node.input_meta):
        found += [AxisCandidate(tuple(f for _ in node.input_meta), (f,)) for f in (SUM, AVG)]
    return found


@register_rule("aten.slice_scatter.default", "aten.select_scatter.default")
def scatter_into_view_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """``slice_scatter(base, part, dim, ...)``: ``base`` with ``part`` written into a slice
    of ``dim``; ``select_scatter(base, part, dim, index)``: into one index of ``dim`` (``part``
    has no ``dim``). Each rank writes its piece of ``part`` into its piece of ``base`` when
    both are split alike on another dim."""
    if len(node.input_meta) != 2:
        return []
    base, part = node.input_meta
    along = norm_dim(attr(node, 2, 0), len(base.shape))
    removes_dim = node.op.startswith("aten.select_scatter.")
    found = []
    for dim in shardable_dims(base.shape, axis_size):
        if dim != along:
            part_dim = dim - 1 if removes_dim and dim > along else dim
            found.append(AxisCandidate((Shard(dim), Shard(part_dim)), (Shard(dim),)))
    return found


_READS_SHAPE_ONLY = (
    "aten.new_ones.default",
    "aten.new_zeros.default",
    "aten.new_empty.default",
    "aten.new_full.default",
)


@register_rule(*_READS_SHAPE_ONLY)
def new_tensor_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """``x.new_ones(size)``: the result never reads x's values, so x may arrive in any
    placement; the result (of the given global size) is whole on every rank."""
    x = node.input_meta[0]
    incoming = [Shard(dim) for dim in shardable_dims(x.shape, axis_size)] + ([SUM] if is_float(x) else [])
    return [AxisCandidate((p,), tuple(R for _ in node.output_meta)) for p in incoming]


@register_rule(
    "aten.arange.default",
    "aten.arange.start",
    "aten.arange.start_step",
    "aten.zeros.default",
    "aten.ones.default",
    "aten.full.default",
    "aten.empty.memory_format",
    "aten.scalar_tensor.default",
    "aten.rand.default",
    "aten.randn.default",
    "wrap_with_set_grad_enabled",
    "wrap_with_autocast",
)
def whole_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """Creation ops and opaque higher-order ops: whole on every rank (see module)."""
    return []
