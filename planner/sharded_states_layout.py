"""Which slice of a weight each rank steps under ZeRO-1 (``ShardedStatesOptimizer``).

Shared vocabulary of the runtime (``codegen.runtime.sharded_states``, which slices) and the
simulator (``cost_model.data_parallel_step``, which prices the slices' all-gathers), so the
two can never disagree on which weights are gathered.

A rank's local tensor of a weight (its tensor-parallel shard, or the whole weight) is cut
along its first dimension that the ``dp`` size divides into pieces of at least one row;
rank r steps piece r, and the updated pieces are all-gathered. A tensor with no such
dimension (a bias of 7 over dp=2, a scalar) is stepped whole on every rank, with whole
optimizer states, and never gathered.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["sliced_dim"]


def sliced_dim(shape: Sequence[int], ranks: int) -> int | None:
    """The dimension of a local tensor of ``shape`` that ZeRO-1 over ``ranks`` ranks cuts
    into equal pieces (the first one ``ranks`` divides, at least ``ranks`` long), or None
    when no dimension qualifies and every rank steps the tensor whole.

    >>> sliced_dim((7, 6), 2), sliced_dim((7,), 2), sliced_dim((1, 4), 4)
    (1, None, 1)
    """
    return next((d for d, size in enumerate(shape) if size % ranks == 0 and size >= ranks), None)
