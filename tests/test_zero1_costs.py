"""ZeRO-1's simulated step against figures worked out by hand from what the program runs.

Every ZeRO-1 program steps through ``codegen.runtime.sharded_states.ShardedStatesOptimizer``:
each rank of ``dp`` steps its 1/dp slice of every weight, cut on the weight's first
dimension that dp divides, then all-gathers each sliced weight's updated pieces with one
blocking ``all_gather_single`` per weight, one after another; a weight with no such dimension
is stepped whole on every rank and never gathered. The pieces are plain-tensor views, so
on gloo the single-tensor AdamW loop runs over every weight (a piece each) with no DTensor
dispatch, even in a graph program whose weights are DTensors.

The model: ``examples/gpt.py`` with one block and an odd width (n_embd 63, 3 heads), so on
dp=2 only the weights with an even dimension are gathered. Its 17 weights, by hand:

    gathered (an even dim):  wte 256x63, wpe 32x63, mlp.c_fc 252x63 and its bias 252,
                             mlp.c_proj 63x252 (cut on dim 1), lm_head 256x63
    whole on every rank:     ln_1, ln_2, ln_f (weight and bias, 63 each), attn.c_attn
                             189x63 and bias 189, attn.c_proj 63x63 and bias 63, mlp.c_proj
                             bias 63
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_model.collectives import collective_time
from cost_model.compute import optimizer_step_time
from cost_model.simulator import Simulator
from planner import baselines
from planner.model_spec import ModelSpec
from planner.sharded_states_layout import sliced_dim

ROOT = Path(__file__).resolve().parents[1]
ODD_GPT = {"batch_size": 8, "n_layer": 1, "n_head": 3, "n_embd": 63}
GATHERED = {  # weight -> elements, listed by hand above
    "wte.weight": 256 * 63, "wpe.weight": 32 * 63, "blocks.0.mlp.c_fc.weight": 252 * 63,
    "blocks.0.mlp.c_fc.bias": 252, "blocks.0.mlp.c_proj.weight": 63 * 252, "lm_head.weight": 256 * 63,
}


@pytest.fixture(scope="module")
def zero1_plan():
    return baselines.zero(ModelSpec(str(ROOT / "examples" / "gpt.py"), ODD_GPT), "cpu:1x2", stage=1)


def test_the_slice_rule_is_the_first_dimension_dp_divides():
    assert sliced_dim((63, 252), 2) == 1 and sliced_dim((256, 63), 2) == 0
    assert sliced_dim((189, 63), 2) is None and sliced_dim((63,), 2) is None
    assert sliced_dim((1, 8), 4) == 1  # a dimension shorter than dp is never cut
    assert sliced_dim((), 2) is None


def test_each_sliced_weight_is_all_gathered_once_after_the_step(zero1_plan):
    plan = zero1_plan
    assert len(plan.graph.parameters) == 17
    result = Simulator(plan, plan.graph).run()
    events = {event.name: event for event in result.timeline}
    gathers = events["all-gather updated slices (6 parameters)"]
    # fp32 weights (4 bytes), one all-gather of the whole weight each over dp = {0, 1}, in turn.
    expected = sum(collective_time("all_gather", elements * 4, plan.cluster, [0, 1], 1) for elements in GATHERED.values())
    assert gathers.duration_s == pytest.approx(expected, rel=1e-12)
    assert gathers.start_s >= events["optimizer step"].start_s + events["optimizer step"].duration_s - 1e-12
    assert not any("broadcast" in name for name in events)


def test_dp_bytes_are_the_gradient_all_reduce_and_the_gathers(zero1_plan):
    plan = zero1_plan
    weights = sum(meta.numel for meta in plan.graph.parameters.values())
    # Ring all-reduce of every fp32 gradient: 2 (n - 1) / n of it; all-gather of the sliced
    # weights: (n - 1) / n of them; n = 2.
    expected = 2 * (1 / 2) * weights * 4 + (1 / 2) * sum(GATHERED.values()) * 4
    assert plan.estimate.bytes_per_axis["dp"] == pytest.approx(expected, rel=1e-12)


def test_the_optimizer_steps_a_plain_piece_of_every_weight(zero1_plan):
    plan = zero1_plan
    result = Simulator(plan, plan.graph).run()
    step = next(event for event in result.timeline if event.name == "optimizer step")
    sliced = sum(GATHERED.values())
    whole = sum(meta.numel for meta in plan.graph.parameters.values()) - sliced
    # fp32 AdamW reads and writes 4 + 4 + 8 bytes per element of what it steps: half of each
    # sliced weight, all of each whole one; torch.optim's single-tensor loop (CPU) runs over
    # all 17 tensors (a piece of each), on plain tensors: no DTensor dispatch.
    state_bytes = (sliced / 2 + whole) * (4 + 4 + 8)
    assert step.duration_s == pytest.approx(
        optimizer_step_time(state_bytes, plan.cluster.device_of(0), "single_tensor", tensors=17, dispatch_s=0.0),
        rel=1e-12)


def test_weights_stepped_whole_keep_whole_states(zero1_plan):
    plan = zero1_plan
    sliced = sum(GATHERED.values())
    whole = sum(meta.numel for meta in plan.graph.parameters.values()) - sliced
    # fp32 AdamW's two moments: 8 bytes per element, halved only for the sliced weights.
    assert plan.estimate.memory.optimizer_states == pytest.approx((sliced / 2 + whole) * 8, abs=1)


def test_the_pipeline_grid_sees_the_same_gathers(zero1_plan):
    """The pipeline grid prices ZeRO-1 from segment profiles shared across dp sizes
    (``SegmentProfile.zero1_gathered_tensors``): the same 6 weights at dp=2; at dp=4 also
    the same 6 (256, 32 and 252 are multiples of 4); at dp=3 every weight has a dimension 3
    divides (63 = 3 x 21), so all 17 are gathered."""
    profiles = Simulator(zero1_plan, zero1_plan.graph).segment_profiles()
    every = sum(meta.numel for meta in zero1_plan.graph.parameters.values())
    for dp, expected in ((2, sum(GATHERED.values())), (4, sum(GATHERED.values())), (3, every)):
        assert sum(sum(p.zero1_gathered_tensors(dp)) for p in profiles) == expected, dp
