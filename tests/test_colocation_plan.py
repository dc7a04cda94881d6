"""Planning beside a co-runner (search/beside.py) and the co-location report's memory,
device by device (planner/colocation.py), worked out by hand on small timelines and meshes,
and one real case where the choice beside a co-runner is not the plan fastest alone. The
commands on real saved plans are in tests/test_colocation.py (they share its plans).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cost_model.colocation import CoRunner, co_runner_context, rank_memory, swap_seconds
from planner import baselines, simulate
from planner.cluster import Cluster
from planner.cluster_edits import with_memory
from planner.colocation import DeviceMemory, one_after_the_other
from planner.errors import PlanningError
from planner.model_spec import ModelSpec
from planner.strategy import MemoryBreakdown, Mesh, TimelineEvent
from search.beside import choose_beside, pick_beside, schedule_beside, timeline_beside


def _step(compute_s: float, all_reduce_s: float) -> tuple[TimelineEvent, ...]:
    """One data-parallel step: compute, then its gradient all-reduce (nothing overlapped)."""
    return (TimelineEvent("stage 0", "compute", "fwd+bwd", 0.0, compute_s),
            TimelineEvent("stage 0", "collective", "all-reduce", compute_s, all_reduce_s))


# The co-runner A: compute-bound, 6 s of compute then a 1 s all-reduce; 4 bytes a rank.
CO_RUNNER = CoRunner(name="A", timeline=_step(6.0, 1.0), rank_bytes=(4, 4), step_s=7.0, overlap_slowdown=0.0)
CAPACITY = (10, 10)


def test_the_plan_that_leaves_gaps_beats_the_fastest_alone():
    # X: compute 4 + all-reduce 1 = 5 s alone. Y: compute 3 + all-reduce 3 = 6 s alone (less
    # compute, more communication): slower alone. Beside A (A listed first, one compute stream):
    #   X: A 0-6, X 6-10, A's all-reduce 6-7, X's 10-11; then A 10-16, X 16-20 (X's
    #      all-reduce 20-21); A 20-26, X 26-30 (30-31): steady round 31 - 21 = 10 s = 6 + 4,
    #      the compute stream never idle.
    #   Y: A 0-6, Y 6-9, Y's all-reduce 9-12; A 9-15 (its all-reduce ended at 7), Y 15-18
    #      (after its all-reduce, 12, and the stream, 15), Y's 18-21; A 18-24, Y 24-27,
    #      Y's 27-30: steady round 30 - 21 = 9 s = 6 + 3: Y's 3 s of all-reduce run under
    #      A's next compute, so its extra communication costs nothing, its lesser compute wins.
    x = timeline_beside(CO_RUNNER, "X", "X", 5.0, _step(4.0, 1.0), (5, 5), CAPACITY)
    y = timeline_beside(CO_RUNNER, "Y", "Y", 6.0, _step(3.0, 3.0), (5, 5), CAPACITY)
    assert (x.round_s, y.round_s) == pytest.approx((10.0, 9.0))
    best, line = pick_beside(CO_RUNNER, [x, y])
    assert best is y
    assert line.startswith("planned beside A: co-located round 9.000 s against 10.000 s for the plan fastest alone")


def test_a_plan_that_does_not_fit_beside_the_co_runner_is_passed_over():
    # Y needs 7 bytes a rank: 4 + 7 = 11 > 10, so X is kept though Y's round is shorter.
    x = timeline_beside(CO_RUNNER, "X", "X", 5.0, _step(4.0, 1.0), (5, 5), CAPACITY)
    y = timeline_beside(CO_RUNNER, "Y", "Y", 6.0, _step(3.0, 3.0), (5, 7), CAPACITY)
    assert (y.fits, y.tightest) == (False, (1, 11, 10))
    assert pick_beside(CO_RUNNER, [x, y])[0] is x
    with pytest.raises(PlanningError, match=r"none of the 1 plans kept fits beside A: the closest needs 11 B for "
                                            r"both jobs on rank 1, which has 10 B"):
        pick_beside(CO_RUNNER, [y])


def test_each_rank_holds_its_pipeline_stage():
    stage0, stage1 = MemoryBreakdown(weights=100), MemoryBreakdown(weights=30, activations=5)
    fullest = stage0
    # pp outermost: ranks 0-1 are stage 0, ranks 2-3 stage 1 (rank // 2).
    assert rank_memory(Mesh((("pp", 2), ("dp", 2))), (stage0, stage1), fullest) == (stage0, stage0, stage1, stage1)
    # pp innermost: the stages alternate (rank % 2).
    assert rank_memory(Mesh((("dp", 2), ("pp", 2))), (stage0, stage1), fullest) == (stage0, stage1, stage0, stage1)
    # No pipeline: every rank holds the same bytes.
    assert rank_memory(Mesh((("dp", 3),)), (), fullest) == (fullest,) * 3


def test_jobs_in_turn_swap_what_does_not_fit_over_pcie():
    # A 2-device GPU cluster of 1 GiB devices. Rank 0: A 0.75 GiB (0.25 of it activations) +
    # B 0.5 GiB = 1.25 GiB: 0.25 GiB missing. At each of the two switches a round, 0.25 GiB
    # goes out and 0.25 GiB comes back over PCIe 4.0 x16 (16 GT/s x 16 lanes x 128/130 / 8 =
    # 31.51 GB/s): 4 x 2**28 / 31.51e9 = 34.08 ms added to the 3 + 2 s of the two steps.
    gib = 2**30
    cluster = with_memory(Cluster.preset("dgx-a100-80g", 1, 2), gib)
    a = MemoryBreakdown(weights=gib // 2, activations=gib // 4)
    b = MemoryBreakdown(weights=gib // 2)
    devices = [DeviceMemory(rank, "A100", (a.total, b.total), gib) for rank in range(2)]
    assert swap_seconds(gib // 4) == pytest.approx(4 * 2**28 / 31.5077e9, rel=1e-4)
    turn = one_after_the_other(cluster, (3.0, 2.0), devices, [(a, a), (b, b)])
    assert turn.fits and turn.swap_s == pytest.approx(0.034076, rel=1e-3)
    assert turn.round_s == pytest.approx(5.0 + turn.swap_s)
    assert "swapping 256.00 MiB of states to host memory and back at each switch" in turn.note
    # B's states are 0.5 GiB: missing more than that (B of 0.9 GiB) cannot be swapped out.
    big = MemoryBreakdown(weights=gib // 2, activations=gib * 4 // 10)
    devices = [DeviceMemory(rank, "A100", (big.total, big.total), gib) for rank in range(2)]
    turn = one_after_the_other(cluster, (3.0, 2.0), devices, [(big, big), (big, big)])
    assert not turn.fits and "more than a job's states there (512.00 MiB)" in turn.note


def test_beside_a_compute_bound_job_a_communication_bound_plan_keeps_its_step():
    # Real models on 16 V100s over 25 Gb/s (p3.16xlarge:2). A: a small-weight CNN on a large
    # batch (examples/cnn.py, width 8, 8192 images of 128 x 128): compute-bound, 9.5 ms of
    # compute in 3 tasks and a 0.9 ms all-reduce. B: examples/gpt.py widened (n_embd 512, 4
    # layers, vocabulary 8192): communication-bound. With DDP, 2.0 ms of compute and a 28.4 ms
    # all-reduce stream (29.9 ms a step); with ZeRO-2, 1.5 ms of compute in 19 short tasks
    # chained to a reduce-scatter and an all-gather stream of 14.2 ms each (28.7 ms): faster
    # alone. Beside A either plan's round is its own step: A's 9.5 ms of compute fits in the
    # gaps its communication leaves on the compute stream. (The crossover order alone made
    # each of ZeRO-2's short tasks wait whenever A held the compute stream: a 34.8 ms round,
    # and the search took DDP, the plan slower alone, for it; the order by phase lets them go
    # first.) Figures read from the simulator; asserted: each round within 1% of its step
    # alone, and the search keeps ZeRO-2.
    cluster = Cluster.preset("p3.16xlarge", 2)
    examples = Path(__file__).resolve().parents[1] / "examples"
    cnn = ModelSpec(str(examples / "cnn.py"), {"batch_size": 8192, "image_size": 128, "width": 8})
    gpt = ModelSpec(str(examples / "gpt.py"), {"n_embd": 512, "n_layer": 4, "vocab_size": 8192, "batch_size": 16})
    co_runner_plan = baselines.ddp(cnn, cluster)
    co_runner = co_runner_context("A", co_runner_plan, simulate(co_runner_plan), cluster)
    zero2, ddp = baselines.zero(gpt, cluster, stage=2), baselines.ddp(gpt, cluster)
    assert zero2.estimate.step_time_s < ddp.estimate.step_time_s
    for plan in (zero2, ddp):
        beside = schedule_beside(co_runner, plan, zero2.graph)
        assert beside.round_s == pytest.approx(plan.estimate.step_time_s, rel=0.01)
    chosen, line = choose_beside(co_runner, [ddp, zero2], zero2.graph)
    assert chosen is zero2
    assert re.search(r"planned beside A: co-located round ([\d.]+) ms against \1 ms for the plan fastest alone", line)
