"""Stage slicing: consecutive segments cut into pipeline stages by dynamic programming, and
what a pipeline schedule keeps in flight on each stage.

The recurrence (``slice_stages``) over the segments in model order::

    best[s][j] = min over i < j of max(best[s-1][i], time(i..j)),  if memory_s(i..j) <= capacity
    best[0][0] = 0;  answer best[S][n], cuts recovered from the argmins

``search.pipeline_search`` prices every configuration of its grid with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from cost_model.schedules import schedule as pipeline_schedule


@dataclass(frozen=True)
class SegmentCost:
    """A segment's cost for stage slicing: seconds per micro-batch (forward and backward);
    bytes it holds whatever the schedule (weights, gradients, optimizer states); bytes it
    keeps per micro-batch in flight; bytes alive only while it runs (recomputation); and of
    ``time_s``, the forward's seconds (what a schedule's walk needs, ``search.pipeline_step``)."""

    time_s: float
    static_bytes: float = 0.0
    activation_bytes: float = 0.0
    transient_bytes: float = 0.0
    forward_s: float = 0.0


@dataclass(frozen=True)
class Slicing:
    """How many consecutive segments each stage holds, the slowest stage's seconds per
    micro-batch, and, when stages choose their recomputation (``slice_stages`` given costs
    per mode), each stage's mode."""

    segments_per_stage: tuple[int, ...]
    slowest_s: float
    modes: tuple[str, ...] = ()


def stage_memory(costs: Sequence[SegmentCost], in_flight: int) -> float:
    """Bytes a stage holding ``costs`` needs with ``in_flight`` micro-batches in flight."""
    return (
        sum(c.static_bytes for c in costs)
        + in_flight * sum(c.activation_bytes for c in costs)
        + max((c.transient_bytes for c in costs), default=0.0)
    )


class _SpanCosts:
    """Every stage a list of segment costs can form, as (start i, end j) matrices: seconds,
    bytes held whatever the schedule, bytes kept per micro-batch, largest transient."""

    def __init__(self, costs: Sequence[SegmentCost]):
        n = len(costs)
        time_sum = np.concatenate(([0.0], np.cumsum([c.time_s for c in costs])))
        static_sum = np.concatenate(([0.0], np.cumsum([c.static_bytes for c in costs])))
        activation_sum = np.concatenate(([0.0], np.cumsum([c.activation_bytes for c in costs])))
        # (i, j): a stage holding segments i..j-1, for 0 <= i < j <= n.
        starts, ends = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
        self.span = ends > starts
        self.seconds = np.where(self.span, time_sum[None, :] - time_sum[:, None], np.inf)
        self.static = static_sum[None, :] - static_sum[:, None]
        self.activations = activation_sum[None, :] - activation_sum[:, None]
        self.transient = np.zeros((n + 1, n + 1))
        transients = np.array([c.transient_bytes for c in costs])
        for i in range(n):  # the largest transient of segments i..j-1
            self.transient[i, i + 1:] = np.maximum.accumulate(transients[i:])

    def seconds_if_fits(self, in_flight: int, capacity: float) -> np.ndarray:
        """Each span's seconds where it fits with ``in_flight`` micro-batches, else inf."""
        fits = self.span & (self.static + in_flight * self.activations + self.transient <= capacity)
        return np.where(fits, self.seconds, np.inf)

    def seconds_at(self, start: int, end: int, in_flight: int, capacity: float) -> float:
        """``seconds_if_fits`` of the one span ``start..end``."""
        needed = self.static[start, end] + in_flight * self.activations[start, end] + self.transient[start, end]
        return float(self.seconds[start, end]) if needed <= capacity else np.inf


def slice_stages(
    costs: Sequence[SegmentCost] | Mapping[str, Sequence[SegmentCost]],
    stages: int,
    capacity: float,
    in_flight: Sequence[int],
) -> Slicing | None:
    """Split the segments (in model order) into ``stages`` consecutive non-empty stages
    minimising the slowest stage's time, every stage ``s`` fitting in ``capacity`` bytes with
    ``in_flight[s]`` micro-batches in flight; None when no split fits (the recurrence is in
    the module docstring). Ties go to the split whose later stages are shorter.

    ``costs`` is one list of segment costs, or a list per recomputation mode (``{"none":
    [...], "full": [...]}``, in the order ties should prefer): then each stage also chooses
    its mode, the fastest that fits it (``Slicing.modes``). A 1F1B pipeline's first stage
    holds ``pp`` micro-batches in flight and its last one, so the first stages may need to
    recompute where the last need not.

    Each stage of the recurrence is one vectorised step over every (start i, end j) pair, so
    slicing 130 segments into 64 stages takes milliseconds.
    """
    by_mode = dict(costs) if isinstance(costs, Mapping) else {"": costs}
    n = len(next(iter(by_mode.values())))
    if stages < 1 or stages > n or len(in_flight) != stages or any(len(c) != n for c in by_mode.values()):
        return None
    spans = [_SpanCosts(c) for c in by_mode.values()]
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    starts_of = []
    for s in range(stages):
        seconds = spans[0].seconds_if_fits(in_flight[s], capacity)
        for span in spans[1:]:  # each span's fastest mode that fits
            np.minimum(seconds, span.seconds_if_fits(in_flight[s], capacity), out=seconds)
        candidates = np.maximum(best[:, None], seconds)
        # argmin over the reversed starts: on a tie the latest start, the shortest stage.
        latest = n - np.argmin(candidates[::-1, :], axis=0)
        best = candidates[latest, np.arange(n + 1)]
        starts_of.append(latest)
    if not np.isfinite(best[n]):
        return None
    names = list(by_mode)
    counts, modes, end = [], [], n
    for s in range(stages - 1, -1, -1):
        begin = int(starts_of[s][end])
        counts.append(end - begin)
        # The stage's mode: its fastest that fits (the first listed on a tie).
        times = [span.seconds_at(begin, end, in_flight[s], capacity) for span in spans]
        modes.append(names[times.index(min(times))])
        end = begin
    chose = isinstance(costs, Mapping)
    return Slicing(tuple(reversed(counts)), float(best[n]), tuple(reversed(modes)) if chose else ())


def stage_indices(slicing: Slicing) -> list[range]:
    """The segment indices of each stage, in stage order."""
    ranges, start = [], 0
    for count in slicing.segments_per_stage:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def stage_members(costs: Sequence, slicing: Slicing) -> list[list]:
    """The items of ``costs`` (one per segment) each stage holds, in stage order."""
    return [[costs[i] for i in indices] for indices in stage_indices(slicing)]


@lru_cache(maxsize=256)
def held_at_peaks(schedule: str, pp: int, micro_batches: int, chunks: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """For each device, the micro-batches of each chunk in flight at each local peak of its
    schedule (after the last forward before a backward): the device's activation peak is
    the largest of their sums weighted by each chunk's bytes."""
    per_device = []
    for device in range(pp):
        held, peaks = [0] * chunks, set()
        order = pipeline_schedule(schedule, device, pp, micro_batches, chunks)
        for position, (kind, _, chunk) in enumerate(order):
            held[chunk] += 1 if kind == "F" else -1
            if kind == "F" and (position + 1 == len(order) or order[position + 1][0] == "B"):
                peaks.add(tuple(held))
        per_device.append(tuple(sorted(peaks)))
    return tuple(per_device)


@lru_cache(maxsize=256)
def in_flight_per_stage(schedule: str, pp: int, micro_batches: int, chunks: int) -> tuple[int, ...]:
    """Micro-batches each virtual stage holds at most at once (stage ``c * pp + d`` is chunk
    ``c`` of device ``d``): ``pp - d`` under 1F1B, counted from the schedule when
    interleaved (an upper bound on what the device holds at its peak)."""
    if pp == 1:
        return (1,)
    held = [0] * (pp * chunks)
    for device in range(pp):
        current = [0] * chunks
        for kind, _, chunk in pipeline_schedule(schedule, device, pp, micro_batches, chunks):
            current[chunk] += 1 if kind == "F" else -1
            stage = chunk * pp + device
            held[stage] = max(held[stage], current[chunk])
    return tuple(held)
