"""Cost of changing a tensor's placement on one mesh axis (an edge of the graph).

Forward, per axis, from the producer's output placement to the consumer's input placement:

    S(i) -> R     all-gather          P -> R      all-reduce
    P -> S(i)     reduce-scatter      S(i) -> S(j) all-to-all
    R -> S(i)     local slice (free)  anything -> P  free (zeros or the local term)

The backward pass moves the gradient the other way, with the dual collective: all-gather
<-> reduce-scatter, all-reduce <-> nothing (the gradient of a sum is replicated), slice <->
all-gather, all-to-all <-> all-to-all.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement


def forward_collective(src: Placement, dst: Placement) -> str | None:
    """The collective that turns ``src`` into ``dst`` on one axis, or ``None`` if free."""
    if src == dst or isinstance(dst, Partial):
        return None
    if isinstance(src, Shard):
        return "all_gather" if isinstance(dst, Replicate) else "all_to_all"
    if isinstance(src, Partial):
        return "all_reduce" if isinstance(dst, Replicate) else "reduce_scatter"
    return None  # Replicate -> Shard: each rank keeps its slice


def backward_collective(src: Placement, dst: Placement) -> str | None:
    """The collective the gradient of the edge ``src -> dst`` needs in backward."""
    if src == dst or isinstance(dst, Partial):
        return None
    if isinstance(src, Shard):
        return "reduce_scatter" if isinstance(dst, Replicate) else "all_to_all"
    if isinstance(src, Partial):
        return None if isinstance(dst, Replicate) else "all_gather"
    return "all_gather" if isinstance(dst, Shard) else None
