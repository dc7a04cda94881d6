"""DualPipe as a simulated schedule (``cost_model.dualpipe``): 2 devices and 4 micro-batches
timed by hand, and the reference's bubble formula where its assumptions hold."""

from __future__ import annotations

import pytest

from cost_model.dualpipe import (
    PassTimes, dualpipe_bubble_formula, dualpipe_order, simulate,
)

TIMES = PassTimes.serial(forward=1, backward=2, weights=1)  # overlapped = 1 + 2 + 1 = 4: nothing hidden


def test_two_devices_four_micro_batches_follow_the_reference_steps():
    # DualPipe.step at 2 ranks, 4 chunks: both ranks are middle ranks (half_rank 0 of 1).
    # Step 2: F0 then F1 (F1's send held back); step 4 (i = 0, middle): F0 (send held), B1 whole,
    # then F1&B0 overlapped; step 6: B1 whole, then B0 with its weights deferred; step 8: W.
    expected = [("F", 0, False), ("F", 1, True), ("F", 0, True), ("BW", 1), ("FB", 1, 0), ("BW", 1), ("B", 0), ("W",)]
    assert dualpipe_order(0, 2, 4) == expected == dualpipe_order(1, 2, 4)


def test_two_devices_four_micro_batches_timed_by_hand():
    # Device 0 (device 1 is its mirror; phase 0 on device 0 is direction "down", micro-batches
    # d0/m0, d0/m1; phase 1 is "up", whose last stage device 0 holds):
    #   F d0m0 0-1 (first stage, no wait); F d1m0 1-2 (device 1's F d1m0 ends at 1), held;
    #   F d0m1 2-3, held: at 3 F d1m0 counts as sent; B+W d1m0 3-6 (last stage, after its own F);
    #   at 6 F d0m1 is sent; F d1m1 & B d0m0 6-10 (device 1's F d1m1 sent at 6, its B d0m0 done at 6);
    #   B+W d1m1 10-13; B d0m1 13-15 (device 1's B+W d0m1 ends at 13); W 15-16.
    timeline = simulate(2, 4, TIMES)
    starts = [(start, end) for _, start, end in timeline.passes[0]]
    assert starts == [(0, 1), (1, 2), (2, 3), (3, 6), (6, 10), (10, 13), (13, 15), (15, 16)]
    assert [(s, e) for _, s, e in timeline.passes[1]] == starts
    # 16 s, all busy: no bubble at 2 stages, as (2/2 - 1)(F&B + B - 3W) = 0 says.
    assert timeline.step_s == 16 and timeline.bubble(0) == timeline.bubble(1) == 0
    assert dualpipe_bubble_formula(2, TIMES) == 0


def test_an_overlapped_chunk_shortens_the_step_by_what_it_hides():
    # The F&B chunk takes 3 instead of 4 (its all-to-alls hidden): everything after it moves 1 earlier.
    assert simulate(2, 4, PassTimes(1, 2, 1, overlapped=3)).step_s == 15


@pytest.mark.parametrize("stages", [4, 8])
@pytest.mark.parametrize("overlapped", [3, 2])
def test_the_bubble_is_the_reports_where_passes_are_equal(stages, overlapped):
    # The reference's figure and table take F = B = W (one unit each): the busiest device idles
    # (stages/2 - 1)(F&B + B_whole - 3W) = (stages/2 - 1)(F&B + 2 - 3).
    times = PassTimes(1, 1, 1, overlapped)
    timeline = simulate(stages, 20, times)
    assert max(timeline.bubble(rank) for rank in range(stages)) == dualpipe_bubble_formula(stages, times)
    assert dualpipe_bubble_formula(stages, times) == (stages / 2 - 1) * (overlapped + 2 - 3)


def test_every_pass_runs_once_per_micro_batch():
    timeline = simulate(8, 20, TIMES)
    for rank, passes in timeline.passes.items():
        kinds = [work[0] for work, _, _ in passes]
        forwards = kinds.count("F") + kinds.count("FB")
        backwards = kinds.count("B") + kinds.count("BW") + kinds.count("FB")
        assert forwards == backwards == 20, rank  # each device runs both directions' 10 each
        assert kinds.count("W") == kinds.count("B")


def test_bad_shapes_are_refused_in_one_line():
    with pytest.raises(ValueError, match="even number of pipeline stages"):
        dualpipe_order(0, 3, 12)
    with pytest.raises(ValueError, match="at least twice the stages"):
        dualpipe_order(0, 4, 6)
