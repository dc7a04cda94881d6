"""``benchmarks/fidelity_dp.py``: a fidelity row's data-parallel communication on its busiest
device (busy, beside compute, exposed) and what the overlap contention adds to its step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from benchmarks.fidelity_dp import busiest_device, busy_s, data_parallel_time, intervals, overlap_s, row
from cost_model import nccl
from cost_model.simulator import simulated
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from planner.strategy import TimelineEvent
from search.megatron import megatron_plan

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")

# A hand-made timeline (seconds): stage 0 computes 0-4 and 5-9; its gathers run 1-2 and its
# gradient collectives 3-6 and 5.5-7 (overlapping each other); stage 1 computes 0-3 only.
TIMELINE = (
    TimelineEvent("stage 0", "compute", "F0", 0.0, 4.0),
    TimelineEvent("stage 0", "compute", "B0", 5.0, 4.0),
    TimelineEvent("stage 0", "param gather", "all-gather", 1.0, 1.0),
    TimelineEvent("stage 0", "collective", "reduce-scatter a", 3.0, 3.0),
    TimelineEvent("stage 0", "collective", "reduce-scatter b", 5.5, 1.5),
    TimelineEvent("stage 1", "compute", "F0", 0.0, 3.0),
)


def test_busy_time_merges_overlapping_tasks_and_overlap_is_counted_once() -> None:
    """Gathers 1-2 and gradients 3-6, 5.5-7 merge into 1-2 and 3-7: busy 1 + 4 = 5 s. Compute
    0-4 and 5-9 lies beside them 1 (1-2) + 1 (3-4) + 2 (5-7) = 4 s. Stage 0 computes 8 s,
    stage 1 3 s, so stage 0 is the busiest."""
    collectives = intervals(TIMELINE, "stage 0", ("param gather", "collective"))
    assert collectives == [(1.0, 2.0), (3.0, 7.0)]
    assert busy_s(TIMELINE, "stage 0", ("collective",)) == pytest.approx(4.0)
    assert busy_s(TIMELINE, "stage 0", ("param gather", "collective")) == pytest.approx(5.0)
    assert overlap_s(collectives, intervals(TIMELINE, "stage 0", ("compute",))) == pytest.approx(4.0)
    assert busiest_device(TIMELINE) == "stage 0"


def test_contention_is_the_steps_seconds_the_overlap_slowdown_adds(monkeypatch) -> None:
    """examples/gpt.py (width 256, 2 layers) on one DGX-H100 as Megatron-Core's distributed
    optimizer at dp 8: the gradient collectives' busy time is the sum of the reduce-scatters
    on the collective stream, the exposed time the step's own, and the contention the step
    less the same plan simulated with the NCCL profile's overlap slowdown at zero (read here
    by replacing the profile, not as the script does it, by zeroing the step's context)."""
    graph, spec, name, cluster = prepare_model(ModelSpec(GPT, {"batch_size": 32, "n_layer": 2, "n_embd": 256,
                                                               "n_head": 4, "seq_len": 128, "vocab_size": 512}),
                                               "dgx-h100:1")
    plan = megatron_plan(graph, cluster, spec, name, precision="bf16", dp_flavour="zero1")
    plan = simulated(dataclasses.replace(plan, megatron_distributed_optimizer=True), graph)
    measured = data_parallel_time(plan)
    reductions = [event.duration_s for event in plan.estimate.timeline
                  if event.device == "stage 0" and event.stream == "collective"]
    assert reductions and measured.gradient_busy == pytest.approx(sum(reductions))
    assert measured.exposed == plan.estimate.communication_s and measured.step == plan.estimate.step_time_s
    for preset, profile in list(nccl.PROFILES.items()):
        monkeypatch.setitem(nccl.PROFILES, preset, dataclasses.replace(profile, overlap_slowdown=0.0))
    monkeypatch.setattr(nccl, "_MATCHED", {})
    without = simulated(dataclasses.replace(plan, estimate=None), graph).estimate.step_time_s
    assert measured.contention == pytest.approx(plan.estimate.step_time_s - without, abs=1e-12)
    assert measured.contention >= 0.0
    assert "contention" in row("tiny", plan.estimate.step_time_s, measured)
