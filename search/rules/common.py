"""Small helpers the rule families share."""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from planner.graph import OpNode, TensorMeta

R = Replicate()
SUM = Partial("sum")
AVG = Partial("avg")


def shardable_dims(shape: tuple[int, ...], axis_size: int) -> list[int]:
    """Dims long enough to split over ``axis_size`` ranks (evenly or not)."""
    return [dim for dim, size in enumerate(shape) if size > 1 and size >= axis_size]


def norm_dim(dim: int, rank: int) -> int:
    """``dim`` made non-negative for a tensor of rank ``rank`` (0-dim tensors: 0)."""
    return dim % rank if rank else 0


def attr(node: OpNode, position: int, default):
    """Positional argument ``position`` of the op, or ``default`` when the call left it out
    (or passed it by keyword, which the trace does not keep)."""
    return node.attrs[position] if len(node.attrs) > position and node.attrs[position] is not None else default


def aligned_shard(meta: TensorMeta, out_rank: int, out_dim: int, out_size: int) -> Placement:
    """The placement an input broadcast into an output of rank ``out_rank`` needs when the
    output is split on ``out_dim`` (of size ``out_size``): the matching dim split alike, or
    ``Replicate`` where the input broadcasts (size 1 or missing)."""
    dim = out_dim - (out_rank - len(meta.shape))
    if dim < 0 or meta.shape[dim] == 1:
        return R
    if meta.shape[dim] != out_size:
        raise ValueError(f"input {meta} does not broadcast to size {out_size} at output dim {out_dim}")
    return Shard(dim)


def chunk_sizes(size: int, axis_size: int) -> list[int]:
    """What ``torch.chunk`` gives each rank of a dim of ``size`` (DTensor's ``Shard``)."""
    chunk = -(-size // axis_size) if size else 0
    return [max(0, min(chunk, size - rank * chunk)) for rank in range(axis_size)]


def is_float(meta: TensorMeta) -> bool:
    return meta.dtype.is_floating_point or meta.dtype.is_complex


def divides(axis_size: int, size: int) -> bool:
    return size % axis_size == 0
