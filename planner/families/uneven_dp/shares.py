"""Each rank's share of the global batch, chosen exactly (vocabulary layer: pure arithmetic).

Rank ``r`` takes ``b_r`` samples of a global batch of ``B`` and is busy ``fixed_r + b_r *
per_sample_r`` seconds (its compute; ``costs.py`` fits both terms on its device). The step
waits for the slowest rank, so the shares minimise ``max_r (fixed_r + b_r * per_sample_r)``
over integers with ``1 <= b_r <= cap_r`` (``cap_r``: the samples rank r's memory holds) and
``sum_r b_r = B``.

``balanced_shares`` is greedy: every rank starts with one sample, then each further sample
goes to the rank that would finish it soonest. It is exact. Think of rank r's k-th sample as
a slot costing ``fixed_r + k * per_sample_r``; slot costs rise with k, so any assignment
whose ranks take prefixes of their slots has makespan = its dearest slot, and the cheapest
``B`` slots (the first slot of every rank forced in) minimise that dearest slot. The greedy
takes exactly those, cheapest first (ties to the lowest rank, so the result is
deterministic). ``tests/test_uneven_shares.py`` checks it against enumeration.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["balanced_shares", "makespan"]


def makespan(shares: Sequence[int], fixed: Sequence[float], per_sample: Sequence[float]) -> float:
    """The slowest rank's busy seconds under ``shares``."""
    return max(f + b * p for b, f, p in zip(shares, fixed, per_sample))


def balanced_shares(batch: int, fixed: Sequence[float], per_sample: Sequence[float],
                    caps: Sequence[int]) -> tuple[int, ...] | None:
    """The integer shares of ``batch`` samples (one per rank, each from 1 to its cap) that
    minimise the slowest rank's time (module docstring); None when no such shares exist
    (a cap below 1, or the caps summing to less than ``batch``, or fewer samples than ranks).

    Args:
        fixed, per_sample: rank r's seconds independent of its share, and per sample (> 0).
        caps: the most samples each rank's memory holds.
    """
    ranks = len(per_sample)
    if not (len(fixed) == ranks == len(caps)) or ranks == 0:
        raise ValueError("fixed, per_sample and caps need one entry per rank")
    if batch < ranks or min(caps) < 1 or sum(min(cap, batch) for cap in caps) < batch:
        return None
    shares = [1] * ranks
    # The next slot of every rank that may take one more sample: (its cost, rank).
    slots = [(fixed[r] + 2 * per_sample[r], r) for r in range(ranks) if caps[r] > 1]
    heapq.heapify(slots)
    for _ in range(batch - ranks):
        _, rank = heapq.heappop(slots)
        shares[rank] += 1
        if shares[rank] < caps[rank]:
            heapq.heappush(slots, (fixed[rank] + (shares[rank] + 1) * per_sample[rank], rank))
    return tuple(shares)
