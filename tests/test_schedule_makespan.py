"""The interleaved schedule's step walked pass by pass (``cost_model.schedules.schedule_makespan``)
and the pipeline grid's estimate built on it (``search.pipeline_step.StepPricing.step_time``),
against timelines worked out by hand and against the simulator.

Every case is pp = 2 devices x 2 chunks with 2 micro-batches: virtual stages 0 and 2 on
device 0, 1 and 3 on device 1. The orders (``cost_model.schedules.interleaved``; written
F<micro-batch>s<virtual stage>):

    device 0: F0s0 F1s0 F0s2 F1s2 B0s2 B1s2 B0s0 B1s0
    device 1: F0s1 F1s1 F0s3 B0s3 F1s3 B1s3 B0s1 B1s1
"""

from __future__ import annotations

import pytest
from test_simulator import GPT, compute_only_cluster  # this folder is on sys.path under pytest

from cost_model.schedules import schedule_makespan
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan
from search.pipeline_search import Configuration, PipelineGrid, PipelineSpace
from search.stage_slicing import Slicing


def closed_form(forward, backward, pp, micro_batches):
    """The closed form the grid used before the walk: m x busiest device + (pp - 1) x
    slowest virtual stage."""
    stage = [f + b for f, b in zip(forward, backward)]
    return micro_batches * max(sum(stage[d::pp]) for d in range(pp)) + (pp - 1) * max(stage)


def test_even_stages_take_the_closed_form():
    # Forward 1, backward 2 on every virtual stage, no hop. Device 0: F0s0 [0,1] F1s0 [1,2];
    # device 1: F0s1 [1,2] F1s1 [2,3]; device 0: F0s2 [2,3] F1s2 [3,4]; device 1: F0s3
    # [3,4] B0s3 [4,6] F1s3 [6,7] B1s3 [7,9]; device 0: B0s2 [6,8] B1s2 [9,11]; device 1:
    # B0s1 [9,11] B1s1 [11,13]; device 0: B0s0 [11,13] B1s0 [13,15]. Step 15 =
    # 2 micro-batches x 6 (a device's passes) + 1 x 3 (one virtual stage): the closed form.
    forward, backward = [1.0] * 4, [2.0] * 4
    assert schedule_makespan("interleaved", 2, 2, 2, forward, backward) == pytest.approx(15.0)
    assert closed_form(forward, backward, 2, 2) == pytest.approx(15.0)


def test_uneven_stages_finish_before_the_closed_form():
    # Forwards 1, 1, 1, 5 and backwards twice them: a last virtual stage as slow as five of
    # the others (a heavy head alone there, as the grid's slicing makes it). Device 0: F0s0
    # [0,1] F1s0 [1,2]; device 1: F0s1 [1,2] F1s1 [2,3]; device 0: F0s2 [2,3] F1s2 [3,4];
    # device 1: F0s3 [3,8] B0s3 [8,18] F1s3 [18,23] B1s3 [23,33]; device 0: B0s2 [18,20]
    # B1s2 [33,35]; device 1: B0s1 [33,35] B1s1 [35,37]; device 0: B0s0 [35,37] B1s0
    # [37,39]. Step 39; the closed form says 2 x (3 + 15) + 15 = 51.
    forward, backward = [1.0, 1.0, 1.0, 5.0], [2.0, 2.0, 2.0, 10.0]
    assert schedule_makespan("interleaved", 2, 2, 2, forward, backward) == pytest.approx(39.0)
    assert closed_form(forward, backward, 2, 2) == pytest.approx(51.0)


def test_each_boundary_costs_a_hop():
    # The even case with 0.5 per send between virtual stages. Device 0: F0s0 [0,1] F1s0
    # [1,2]; device 1: F0s1 [1.5,2.5] F1s1 [2.5,3.5]; device 0: F0s2 [3,4] F1s2 [4,5];
    # device 1: F0s3 [4.5,5.5] B0s3 [5.5,7.5] F1s3 [7.5,8.5] B1s3 [8.5,10.5]; device 0:
    # B0s2 [8,10] B1s2 [11,13]; device 1: B0s1 [10.5,12.5] B1s1 [13.5,15.5]; device 0:
    # B0s0 [13,15] B1s0 [16,18]. Step 18.
    assert schedule_makespan("interleaved", 2, 2, 2, [1.0] * 4, [2.0] * 4, hop_s=0.5) == pytest.approx(18.0)


def test_one_f_one_b_walk_is_its_closed_form_on_even_stages():
    # 1F1B, 2 stages, 4 micro-batches, forward 1 and backward 2: (m + p - 1) x 3 = 15.
    assert schedule_makespan("1f1b", 2, 4, 1, [1.0, 1.0], [2.0, 2.0]) == pytest.approx(15.0)


def test_grid_estimate_and_simulation_both_take_the_hand_worked_step():
    # The uneven case above on a real model: 8 GPT blocks on a cluster where only FLOPs
    # cost time (tests/test_simulator.compute_only_cluster: a block's backward is twice its
    # forward, links free), virtual stages of 1, 1, 1 and 5 blocks. With T a block's
    # forward + backward per micro-batch (f = T / 3), the walk above gives 39 f = 13 T;
    # the closed form 51 f = 17 T. The embedding and the head (vocabulary 32) add about 1%
    # of a block to the first and last virtual stages, hence rel=0.01 against 13 T.
    spec = ModelSpec(GPT, {"n_layer": 8, "n_embd": 256, "n_head": 4, "seq_len": 128, "vocab_size": 32,
                           "batch_size": 16})
    graph, spec, name, _ = prepare_model(spec, "cpu:1x1")
    cluster = compute_only_cluster(2)
    plan = megatron_plan(graph, cluster, spec, name, tp=1, pp=2, micro_batch=8, schedule="interleaved",
                         virtual_stages=2, layers_per_stage=(1, 1, 1, 5), precision="bf16")
    grid = PipelineGrid(graph, cluster, "bf16", PipelineSpace())
    config = Configuration(tp=1, pp=2, dp=1, micro_batch=8, micro_batches=2, schedule="interleaved",
                           virtual_stages=2, flavour="ddp", recompute="none")
    costs = grid.segment_costs(config, "none")
    block = costs[1]
    assert block.forward_s == pytest.approx(block.time_s / 3)
    # Segments: the embedding, 8 blocks, the head; the first virtual stage holds the
    # embedding and one block, the last five blocks and the head.
    estimate = grid.pricing.step_time(config, costs, Slicing((2, 1, 1, 6), 0.0))
    simulated = plan.estimate.step_time_s
    assert plan.pipeline.micro_batches == 2
    assert simulated == pytest.approx(13 * block.time_s, rel=0.01)
    assert estimate == pytest.approx(13 * block.time_s, rel=0.01)
    assert estimate == pytest.approx(simulated, rel=1e-3)
