"""DualPipe as a plan setting (``PipelineConfig.schedule == "dualpipe"``): the schedule's
compute against 1F1B's timed by hand, a device's two stages of memory, a DualPipe plan priced
as its simulated 1F1B twin plus the schedule's difference (``cost_model.dualpipe_step``), the
MoE pipeline grid trying it where it applies, and compile refusing it in one line."""

from __future__ import annotations

import dataclasses

import pytest

from cost_model.dualpipe_step import dualpipe_device_memory, schedule_times
from cost_model.simulator import simulate_plan
from planner.api import compile_blocker, prepare_model
from planner.model_spec import ModelSpec
from planner.strategy import MemoryBreakdown, PipelineConfig
from search.pipeline_search import PipelineGrid, PipelineSpace
from search.stage_experts import EXPERT_PARALLEL, stage_expert_variants
from moe_plans import MOE_EXAMPLE, moe_pipeline_plan

SPEC = ModelSpec(str(MOE_EXAMPLE), {"batch_size": 16, "n_expert": 8, "ffn": 512, "capacity_factor": 1.0})


@pytest.mark.parametrize("stages, micro_batches, one_f_one_b, dualpipe, bubble", [
    # F = 1, B = 2 (halves B = W = 1). 1F1B: (m + pp - 1)(F + B). DualPipe: every device runs
    # its m stage-passes (3 s each) plus the report's bubble (pp/2 - 1)(F&B + B_whole - 3W),
    # F&B = F + B + W = 3 with nothing hidden, B_whole = 2, W = 1: (pp/2 - 1) x 2.
    (2, 4, 5 * 3, 4 * 3, 0),       # 15 against 12 + 0
    (4, 8, 11 * 3, 8 * 3 + 2, 2),  # 33 against 24 + 2
    (8, 16, 23 * 3, 16 * 3 + 6, 6),  # 69 against 48 + 6
])
def test_the_schedules_compute_timed_by_hand(stages, micro_batches, one_f_one_b, dualpipe, bubble):
    times = schedule_times(stages, micro_batches, forward=1.0, backward=2.0)
    assert (times.one_f_one_b_s, times.dualpipe_s, times.dualpipe_bubble_s) == (one_f_one_b, dualpipe, bubble)


def test_a_device_holds_two_stages_and_pp_plus_one_micro_batches():
    # 1F1B twin on 4 stages, 8 micro-batches: stage s holds 4 - s micro-batches, 10 bytes each
    # on stages 0-2 and 12 on stage 3. Device 0 holds stages 0 and 3: weights 1 + 4, gradients
    # 10 + 40, states 100 + 400, and pp + 1 = 5 micro-batches of the larger (12): 60.
    twin = [MemoryBreakdown(weights=s + 1, gradients=10 * (s + 1), optimizer_states=100 * (s + 1),
                            activations=(4 - s) * (12 if s == 3 else 10), communication_buffers=7 + s)
            for s in range(4)]
    devices = dualpipe_device_memory(twin, stages=4, micro_batches=8)
    assert devices[0] == MemoryBreakdown(5, 50, 500, 60, 10)
    assert devices[1] == MemoryBreakdown(5, 50, 500, 50, 9)  # stages 1 and 2, 10 bytes each
    assert devices[3] == devices[0]  # the mirror of device 0
    # Fewer micro-batches than pp + 1 in flight cannot be held: 4 of them at most.
    assert dualpipe_device_memory(twin, stages=4, micro_batches=4)[1].activations == 40


@pytest.fixture(scope="module")
def twin_and_dualpipe():
    """The MoE grid's 1F1B plan of examples/moe.py on pp=2 x dp=4 (4 micro-batches), its
    all-to-alls under the other micro-batch's compute, and the same plan under DualPipe."""
    plan = moe_pipeline_plan(SPEC, 8)
    twin = dataclasses.replace(plan, moe_a2a_overlap=True)
    dualpipe = dataclasses.replace(twin, pipeline=dataclasses.replace(twin.pipeline, schedule="dualpipe"))
    return twin, dualpipe


def test_a_dualpipe_plan_is_priced_from_its_simulated_1f1b_twin(twin_and_dualpipe):
    twin_plan, dualpipe_plan = twin_and_dualpipe
    assert twin_plan.pipeline.micro_batches == 4
    twin, dual = simulate_plan(twin_plan, twin_plan.graph), simulate_plan(dualpipe_plan, dualpipe_plan.graph)
    assert dual.method == "simulator (1F1B twin) + DualPipe schedule"
    # Each device holds both stages' weights, gradients and states ("2x" parameters).
    for kind in ("weights", "gradients", "optimizer_states"):
        both = getattr(twin.stage_memory[0], kind) + getattr(twin.stage_memory[1], kind)
        assert getattr(dual.memory, kind) == both
    # At 2 stages DualPipe has no bubble, 1F1B one pass of the slowest stage ((m + 1) against m
    # passes): the step loses that pass and gains the second stage's gradient reduction and
    # optimizer step, which are not 0 (every rank holds its stage's dense weights).
    assert dual.bubble_fraction == 0
    assert dual.step_time_s != twin.step_time_s
    assert dual.communication_s > twin.communication_s
    assert dual.tokens_per_s == pytest.approx(twin.tokens_per_s * twin.step_time_s / dual.step_time_s)


def test_compile_refuses_dualpipe_in_one_line(twin_and_dualpipe):
    message = compile_blocker(twin_and_dualpipe[1])
    assert "DualPipe" in message and "simulated only" in message and "\n" not in message


def test_bad_dualpipe_shapes_are_refused_in_one_line():
    with pytest.raises(ValueError, match="DualPipe pipeline needs an even number of stages"):
        PipelineConfig(stages=3, schedule="dualpipe", micro_batches=6)
    with pytest.raises(ValueError, match="at least twice the stages; got 4 stages, 1 virtual, 6 micro-batches"):
        PipelineConfig(stages=4, schedule="dualpipe", micro_batches=6)


def test_the_moe_grid_tries_dualpipe_on_even_pipelines_with_enough_micro_batches():
    graph, _, _, cluster = prepare_model(SPEC, "dgx-h100:1x4")
    space = PipelineSpace(
        flavours=("ddp",), tensor_parallel=(1,), recompute=("none",), per_stage_recompute=False,
        sequence_parallel=(False,), searched_layout="off", dualpipe=True,
        expert_layouts=lambda mesh, m: stage_expert_variants(graph, cluster, None, "bf16", mesh, m),
    )
    grid = PipelineGrid(graph, cluster, "bf16", space)
    dualpipe = [c for c in grid.configurations() if c.schedule == "dualpipe"]
    assert dualpipe and all(c.pp % 2 == 0 and c.micro_batches % 2 == 0 and c.micro_batches >= 2 * c.pp
                            for c in dualpipe)
    config = next(c for c in dualpipe if c.pp == 2 and c.experts == EXPERT_PARALLEL)
    twin = dataclasses.replace(config, schedule="1f1b")
    priced, serial = grid.estimate(config), grid.estimate(twin)
    # Both stages' weights on every device: more memory than 1F1B's fullest device.
    assert priced.memory_bytes > serial.memory_bytes
    plan = grid.plan(priced, SPEC, "moe")
    assert plan.pipeline.schedule == "dualpipe" and plan.moe_a2a_overlap
    assert plan.estimate.method == "simulator (1F1B twin) + DualPipe schedule"
    # Without --moe-dispatch overlapped (search.pipeline_candidates) the grid does not try it.
    assert not any(c.schedule == "dualpipe" for c in PipelineGrid(
        graph, cluster, "bf16", dataclasses.replace(space, dualpipe=False)).configurations())
