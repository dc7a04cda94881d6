"""Pipeline stages of different widths (vocabulary layer: pure arithmetic), as FlashFlex /
HexiScale (uneven DP/TP/PP per stage) and Metis (device-group shapes) lay them out: each device
group of n ranks is cut into k stages of n/k ranks (k dividing n), every order of the groups is
tried (a group's stages stay together), and a stage of w ranks runs data parallel inside: each
of its ranks takes 1/w of every micro-batch. 4 H100 + 8 A100 may be two stages of 4 and 8
ranks, or an H100 stage and two A100 stages of 4.

A layout's step, as GPipe or 1F1B runs it (``layout_step``): stage s's seconds per micro-batch
are its blocks' seconds on its device at 1/w_s of the micro-batch (``rows[s]``, plus the head
on the first stage and the tail on the last), and

    step = sum_s stage_s + (m - 1) * max_s stage_s + after(layout, counts)

with ``after`` what the caller adds once the pipeline drains (each stage's gradient
all-reduce over its own ranks, the activations' hops between stages). The split of the blocks
(``least_step_split``) minimises the first two terms exactly: for a cap T on the slowest
stage, a dynamic programme gives the least sum of stage times with every stage within T
(and within its memory); the best step is min over T of that sum + (m - 1) T, T ranging over
every stage time a split can have, from the least feasible cap (found by bisection: feasibility
grows with T) upwards until (m - 1) T plus the uncapped least sum passes the best step found.
It is exact because the optimal split's own slowest stage is one of those caps, where the
programme's sum is at most the split's. ``best_layout`` tries every layout and keeps the least
step (``tests/test_hetero_widths.py`` checks both against every layout and every split).
``after`` is added at the chosen split, not minimised over splits.

Compiled: ``candidates.uneven_width_plans`` turns a layout whose widths differ into a plan
(GPipe; the section's ``widths``), ``codegen.uneven_width_emit`` writes it and
``codegen.runtime.uneven_width_pipeline`` runs it: rank j of a stage of w ranks takes the j-th
1/w of every micro-batch's rows, the rows travel point-to-point between the ranks of stages of
different widths, and each stage's gradients are summed over its own ranks. The step formula
above is GPipe's as much as 1F1B's (the same fill and drain); only the memory differs, and the
layouts are priced with GPipe's (every micro-batch in flight on every stage).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.families.hetero_pipeline.balance import stage_seconds

__all__ = ["LayoutStep", "WidthLayout", "best_layout", "layout_step", "least_step_split", "width_layouts"]


@dataclass(frozen=True)
class WidthLayout:
    """Stage s runs on device group ``groups[s]`` over ``widths[s]`` of its ranks."""

    groups: tuple[int, ...]
    widths: tuple[int, ...]

    @property
    def uneven(self) -> bool:
        """Whether the stages have different widths (compiled by ``codegen.uneven_width_emit``)."""
        return len(set(self.widths)) > 1


@dataclass(frozen=True)
class LayoutStep:
    """A layout priced: its step, blocks per stage and each stage's seconds per micro-batch."""

    step_s: float
    layout: WidthLayout
    blocks: tuple[int, ...]
    stage_s: tuple[float, ...]


def width_layouts(sizes: Sequence[int], max_stages: int, micro_batch: int) -> list[WidthLayout]:
    """Every layout of groups of ``sizes`` ranks: each group cut into k equal stages (k divides
    its size), the groups in every order, 2 to ``max_stages`` stages in all, each stage's width
    dividing ``micro_batch`` (its ranks share every micro-batch evenly)."""
    cuts = [[k for k in range(1, size + 1) if size % k == 0 and micro_batch % (size // k) == 0] for size in sizes]
    found = []
    for order in itertools.permutations(range(len(sizes))):
        for chosen in itertools.product(*(cuts[group] for group in order)):
            if not 2 <= sum(chosen) <= max_stages:
                continue
            groups = tuple(group for group, k in zip(order, chosen) for _ in range(k))
            widths = tuple(sizes[group] // k for group, k in zip(order, chosen) for _ in range(k))
            found.append(WidthLayout(groups, widths))
    return found


def layout_step(layout: WidthLayout, rows: Callable[[int, int], tuple[list[float], float, float]],
                micro_batches: int, after: Callable[[WidthLayout, tuple[int, ...]], float] | None = None,
                fits: Callable[[WidthLayout, int, int, int], bool] | None = None) -> LayoutStep | None:
    """``layout`` priced (module docstring), or None when no split of the blocks fits.

    Args:
        rows: ``rows(group, width)`` -> (each block's seconds per micro-batch, the head's, the
            tail's) on that group's device at 1/width of a micro-batch.
        micro_batches: m, micro-batches per step.
        after: seconds added once the pipeline drains, given the blocks per stage (None: 0).
        fits: ``fits(layout, stage, i, j)``: whether blocks i..j-1 fit in that stage's memory.
    """
    stage_rows = [rows(group, width) for group, width in zip(layout.groups, layout.widths)]
    block_s = [row[0] for row in stage_rows]
    head_s, tail_s = stage_rows[0][1], stage_rows[-1][2]
    counts = least_step_split(block_s, head_s, tail_s, micro_batches,
                              None if fits is None else (lambda s, i, j: fits(layout, s, i, j)))
    if counts is None:
        return None
    seconds = stage_seconds(block_s, head_s, tail_s, counts)
    step = sum(seconds) + (micro_batches - 1) * max(seconds) + (after(layout, counts) if after else 0.0)
    return LayoutStep(step, layout, counts, seconds)


def least_step_split(block_s: Sequence[Sequence[float]], head_s: float, tail_s: float, micro_batches: int,
                     fits: Callable[[int, int, int], bool] | None = None) -> tuple[int, ...] | None:
    """Blocks per stage minimising ``sum(stage seconds) + (m - 1) * slowest`` (module
    docstring), every stage one or more consecutive blocks within ``fits(s, i, j)``; None when
    no split fits or there are fewer blocks than stages. ``block_s[s][k]``: block k's seconds
    on stage s; the head on stage 0, the tail on the last."""
    stages = len(block_s)
    blocks = len(block_s[0]) if stages else 0
    if stages == 0 or blocks < stages:
        return None
    prefix = [list(itertools.accumulate(row, initial=0.0)) for row in block_s]
    spans = {}  # (stage, first block, end) -> seconds, for every span a split may give a stage
    for stage in range(stages):
        extra = (head_s if stage == 0 else 0.0) + (tail_s if stage == stages - 1 else 0.0)
        for start in ([0] if stage == 0 else range(stage, blocks)):
            ends = [blocks] if stage == stages - 1 else range(start + 1, blocks - (stages - 1 - stage) + 1)
            for end in ends:
                if fits is None or fits(stage, start, end):
                    spans[stage, start, end] = prefix[stage][end] - prefix[stage][start] + extra

    def least_sum(cap: float) -> tuple[float, tuple[int, ...]] | None:
        best = {0: (0.0, ())}  # blocks placed -> (least sum, counts) over the stages so far
        for stage in range(stages):
            following: dict[int, tuple[float, tuple[int, ...]]] = {}
            for start, (total, counts) in best.items():
                for end in range(start + 1, blocks + 1):
                    seconds = spans.get((stage, start, end))
                    if seconds is None or seconds > cap:
                        continue
                    candidate = (total + seconds, (*counts, end - start))
                    if end not in following or candidate[0] < following[end][0]:
                        following[end] = candidate
            best = following
        return best.get(blocks)

    caps = sorted(set(spans.values()))
    uncapped = least_sum(float("inf"))
    if uncapped is None:
        return None
    low, high = 0, len(caps) - 1  # the least feasible cap: feasibility only grows with the cap
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if least_sum(caps[middle]) is not None else (middle + 1, high)
    chosen, best_step = None, float("inf")
    for cap in caps[low:]:
        if uncapped[0] + (micro_batches - 1) * cap >= best_step:
            break  # every larger cap gives at least this
        found = least_sum(cap)
        if found is None:
            continue
        seconds = stage_seconds(block_s, head_s, tail_s, found[1])
        step = sum(seconds) + (micro_batches - 1) * max(seconds)
        if step < best_step:
            chosen, best_step = found[1], step
    return chosen


def best_layout(layouts: Sequence[WidthLayout], rows, micro_batches: int, after=None, fits=None) -> LayoutStep | None:
    """The least step over ``layouts`` (``layout_step`` for each; ties: the first), or None."""
    best = None
    for layout in layouts:
        priced = layout_step(layout, rows, micro_batches, after, fits)
        if priced is not None and (best is None or priced.step_s < best.step_s):
            best = priced
    return best
