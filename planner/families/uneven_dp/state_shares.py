"""Optimizer-state shares by memory (Cephalo, arXiv 2411.01075: compute split apart from state
placement), vocabulary layer: pure arithmetic.

Under uneven batch shares a fast device takes more samples, so it holds more activations; a
slow device with much memory has room left. ZeRO shards the optimizer states evenly, so the
device with the least room caps everyone. Here each rank holds a part of the flat vector of
all trainable parameters (every weight flattened, in ``module.parameters()`` order) sized by
its room, independent of its batch share:

- ``state_parts(total, weights)``: the parts of ``total`` elements in proportion to the
  plan's integer ``weights`` (one per rank), rounded by largest remainder so they sum to
  ``total`` exactly (ties to the lowest rank).
- ``memory_state_weights(rooms, state_bytes, scale)``: the weights (summing to ``scale``)
  that maximise the least room any rank has left once it holds its part of ``state_bytes``
  (the bytes that shard: its optimizer states and the fp32 piece it steps). Exact: giving
  units one at a time to the rank with the most room left takes the ``scale`` largest
  "room after k units" slots, which is the max-min optimum (each rank's slots fall as k
  grows, the same argument as ``shares.balanced_shares``); ``tests/test_uneven_state_shares.py``
  checks it against enumeration.
- ``exchange_elements(parts)``: the elements the busiest rank moves in the program's
  reduce-scatter-v or all-gather-v (``state_runtime``): NCCL has no native -v collective,
  so both run as ``all_to_all_single`` with split sizes, which NCCL runs as one grouped
  ``ncclSend``/``ncclRecv`` per peer (``all2all_single_unequal_split`` in
  torch/csrc/cuda/nccl.cpp) and gloo as ``alltoallv``. In the reduce-scatter-v rank r sends
  every other rank its part (``total - p_r`` elements) and receives ``(n - 1) p_r`` (its own
  part from each of the others); the all-gather-v is the same exchange reversed. The step
  waits for the rank that moves the most, ``max_r max(total - p_r, (n - 1) p_r)``; for even
  parts that is ``(n - 1) / n * total``, a ring's figure, and it never exceeds a ring-v's
  ``(n - 1) max_r p_r`` (NCCL's ring passes the largest part through every hop).
- ``bucket_ranges(parts)``: the program exchanges the flat vector in as many exchanges as it
  fills buckets of ``EXCHANGE_BUCKET_ELEMENTS`` (so its buffers stay about a bucket, not the
  whole vector), each a slice of every rank's part in proportion to it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["state_parts", "memory_state_weights", "exchange_elements", "bucket_ranges", "STATE_WEIGHT_SCALE",
           "EXCHANGE_BUCKET_ELEMENTS"]

# The weights the search writes sum to this: parts of any unit within 0.1% of their room-optimal
# size (a resolution chosen here, not a measured figure).
STATE_WEIGHT_SCALE = 1000
# The flat vector is exchanged bucket by bucket so that no rank copies it whole: 25 MiB of
# fp32 elements, DDP's default bucket (bucket_cap_mb=25, torch/nn/parallel/distributed.py).
EXCHANGE_BUCKET_ELEMENTS = 25 * 2**20 // 4


def state_parts(total: int, weights: Sequence[int]) -> tuple[int, ...]:
    """Each rank's part of ``total`` elements, in proportion to ``weights`` (non-negative
    integers, some positive), summing exactly to ``total``: the floor of each exact share,
    then one more element to the largest remainders (ties to the lowest rank)."""
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0 or total < 0:
        raise ValueError(f"state weights must be non-negative integers, some positive, got {list(weights)}")
    scale = sum(weights)
    parts = [total * w // scale for w in weights]
    short = total - sum(parts)
    by_remainder = sorted(range(len(weights)), key=lambda r: (-(total * weights[r] % scale), r))
    for rank in by_remainder[:short]:
        parts[rank] += 1
    return tuple(parts)


def memory_state_weights(rooms: Sequence[float], state_bytes: float,
                         scale: int = STATE_WEIGHT_SCALE) -> tuple[int, ...]:
    """Integer weights summing to ``scale``, one per rank, that maximise ``min_r (rooms[r] -
    state_bytes * w_r / scale)``: each rank's room (bytes its device has left besides the
    states) less its part of the sharded ``state_bytes`` (module docstring; greedy, exact)."""
    if not rooms or scale < 1 or state_bytes < 0:
        raise ValueError("memory_state_weights needs one room per rank, a positive scale and non-negative bytes")
    unit = state_bytes / scale
    weights = [0] * len(rooms)
    slots = [(-float(room), rank) for rank, room in enumerate(rooms)]  # most room left first
    heapq.heapify(slots)
    for _ in range(scale):
        _, rank = heapq.heappop(slots)
        weights[rank] += 1
        heapq.heappush(slots, (-(rooms[rank] - unit * weights[rank]), rank))
    return tuple(weights)


def exchange_elements(parts: Sequence[int]) -> int:
    """Elements the busiest rank sends or receives in the all-to-all that runs a
    reduce-scatter-v (or all-gather-v) of ``parts`` (module docstring)."""
    total, ranks = sum(parts), len(parts)
    return max(max(total - part, (ranks - 1) * part) for part in parts)


def bucket_ranges(parts: Sequence[int], size: int = EXCHANGE_BUCKET_ELEMENTS) -> list[tuple[tuple[int, int], ...]]:
    """The exchanges of the flat vector cut into ``parts`` (consecutive, rank 0 first): as
    many as buckets of ``size`` elements it fills, exchange k holding the k-th of that many
    equal slices of every rank's part (``[start, stop)`` of the flat vector per rank), so
    every rank sends and receives in every exchange and no exchange waits on one rank alone."""
    count = max(1, -(-sum(parts) // size))
    exchanges, offset = [[] for _ in range(count)], 0
    for part in parts:
        step = -(-part // count)
        for index in range(count):
            low, high = offset + min(part, index * step), offset + min(part, (index + 1) * step)
            exchanges[index].append((low, high))
        offset += part
    return [tuple(ranges) for ranges in exchanges]
