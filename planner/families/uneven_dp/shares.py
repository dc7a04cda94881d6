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
deterministic). ``tests/test_uneven_shares.py`` checks it against enumeration. With gradient
accumulation every rank starts with ``least`` samples (one per micro-batch), the same proof
with the first ``least`` slots forced in.

``micro_batch_sizes`` cuts one rank's share into the plan's micro-batches: every rank runs
the same number (FSDP2 and ZeRO-2 reduce-scatter each micro-batch's gradients, so the ranks'
collectives must pair up), a rank with fewer samples runs smaller ones, as equal as integers
allow. Each rank's work is still its share, so the step stays as balanced as without
accumulation.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["balanced_shares", "makespan", "micro_batch_sizes"]


def makespan(shares: Sequence[int], fixed: Sequence[float], per_sample: Sequence[float]) -> float:
    """The slowest rank's busy seconds under ``shares``."""
    return max(f + b * p for b, f, p in zip(shares, fixed, per_sample))


def balanced_shares(batch: int, fixed: Sequence[float], per_sample: Sequence[float],
                    caps: Sequence[int], least: int = 1) -> tuple[int, ...] | None:
    """The integer shares of ``batch`` samples (one per rank, each from ``least`` to its cap)
    that minimise the slowest rank's time (module docstring); None when no such shares exist
    (a cap below ``least``, or the caps summing to less than ``batch``, or fewer samples than
    ``least`` per rank).

    Args:
        fixed, per_sample: rank r's seconds independent of its share, and per sample (> 0).
        caps: the most samples each rank's memory holds.
        least: the fewest samples a rank takes (its micro-batches, one sample each).
    """
    ranks = len(per_sample)
    if not (len(fixed) == ranks == len(caps)) or ranks == 0 or least < 1:
        raise ValueError("fixed, per_sample and caps need one entry per rank, and least must be positive")
    if batch < least * ranks or min(caps) < least or sum(min(cap, batch) for cap in caps) < batch:
        return None
    shares = [least] * ranks
    # The next slot of every rank that may take one more sample: (its cost, rank).
    slots = [(fixed[r] + (least + 1) * per_sample[r], r) for r in range(ranks) if caps[r] > least]
    heapq.heapify(slots)
    for _ in range(batch - least * ranks):
        _, rank = heapq.heappop(slots)
        shares[rank] += 1
        if shares[rank] < caps[rank]:
            heapq.heappush(slots, (fixed[rank] + (shares[rank] + 1) * per_sample[rank], rank))
    return tuple(shares)


def micro_batch_sizes(share: int, steps: int) -> tuple[int, ...]:
    """The samples of each of a rank's ``steps`` micro-batches of its ``share``: consecutive,
    as equal as integers allow, the larger first (module docstring); ``share >= steps``."""
    if steps < 1 or share < steps:
        raise ValueError(f"a share of {share} samples does not make {steps} micro-batches of one sample or more")
    size, larger = divmod(share, steps)
    return tuple(size + 1 if index < larger else size for index in range(steps))
