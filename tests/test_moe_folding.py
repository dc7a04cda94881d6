"""MoE parallel folding: the plan section, the folded layer's costs worked by hand, the search.

A folded plan (``planner.families.moe_folding``) runs attention and dense layers tensor
parallel on ``tp`` and every MoE layer's experts over all ``dp x tp`` ranks, EP x ETP, as
Megatron-Core folds them. Costs come from ``cost_model.moe_folding`` (its module docstring
has the model); here they are checked against the alpha-beta figures of one node of 4 devices
with 1e10 B/s links of 1 us latency (a ring all-gather of S bytes over n ranks takes
(n-1)/n * S / 1e10 + (n-1) * 1e-6 s) and 1e12 FLOP/s devices with 1 us per kernel.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cost_model.moe import MoELayer, moe_layer_cost
from cost_model.moe_folding import folded_groups, folded_layer_cost
from cost_model.moe_layers import copies_sharded_over, copy_shard_costs, expert_data_parallel_groups, param_share
from planner.api import prepare_model
from planner.cluster import Cluster, DeviceSpec, LinkSpec, NodeSpec
from codegen.moe_folding_emit import check_foldable
from cost_model.simulator import simulated
from planner.errors import PlanFileError, PlanningError
from planner.families.moe_folding.section import MoeFoldingSection
from planner.model_spec import ModelSpec
from planner.moe_blocks import MoEBlock
from planner.plans import Plan
from planner.strategy import ExpertLayout, ExpertPlacement, Mesh
from search.moe_folding import folded_degrees, folded_plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DEVICE = DeviceSpec(
    name="arith", peak_flops={"float32": 1e12}, memory_bytes=10**12, memory_bandwidth=1e30,
    matmul_efficiency=1.0, memory_efficiency=1.0, kernel_overhead_s=1e-6,
)
LINK = LinkSpec(bandwidth=1e10, latency=1e-6)
ONE_NODE = Cluster(name="arith", nodes=(NodeSpec(DEVICE, 4, LINK),), inter_link=LINK, backend="gloo")
# 256 tokens a micro-batch, width 64, 4 GELU experts of 128 (2 matmuls), top-2, fp32.
LAYER = MoELayer(tokens=256, hidden=64, ffn=128, experts=4, top_k=2, matmuls=2)


def layout(ep: int, etp: int = 1, capacity_factor: float = 1.0) -> ExpertLayout:
    return ExpertLayout(module="blocks.0.moe", mode="expert_parallel", experts=4, top_k=2,
                        capacity_factor=capacity_factor, axis="dp*tp",
                        placement=ExpertPlacement.round_robin(4, ep), tensor_parallel=etp)


def test_groups_follow_megatron_order_etp_innermost_then_ep_then_edp():
    groups = folded_groups(tuple(range(8)), tp=2, ep=2, etp=2)
    assert groups.etp == (0, 1)  # consecutive ranks split each expert
    assert groups.ep == (0, 2)  # ETP apart
    assert groups.edp == (0, 4)  # EP x ETP apart: the copies
    assert groups.tp == (0, 1)
    with pytest.raises(ValueError):
        folded_groups(tuple(range(8)), tp=2, ep=3, etp=1)


def test_expert_tensor_parallelism_priced_by_hand():
    # dp=2 x tp=2 over ranks 0..3, EP=2, ETP=2, EDP=1, capacity factor 1 (buffers padded to it).
    cost = folded_layer_cost(LAYER, layout(ep=2, etp=2), ONE_NODE, (0, 1, 2, 3), tp=2, sequence_parallel=False,
                             precision="fp32")
    # The EP group (ranks 0 and 2) holds 2 x 256 / 4 = 128 tokens: priced as that layer there.
    ep_only = moe_layer_cost(dataclasses.replace(LAYER, tokens=128), "expert_parallel", ONE_NODE, [0, 2],
                             placement=ExpertPlacement.round_robin(4, 2), capacity_factor=1.0, precision="fp32")
    assert cost.dispatch_s == pytest.approx(ep_only.forward_comm_s)
    # Capacity 1.0 x 128 x 2 / 4 = 64 slots per expert, 2 experts per EP rank: 128 rows, gathered
    # over ETP=2: 256 rows of 64 fp32 = 65536 bytes. All-gather and reduce-scatter over 2 ranks:
    # 1/2 x 65536 / 1e10 + 1e-6 = 4.2768e-6 s each.
    assert cost.etp_s == pytest.approx(2 * 4.2768e-6)
    # ETP GEMMs: 256 rows x (2 x 2 x 64 x 128) FLOPs / 2 = 4,194,304 FLOPs = 4.194304e-6 s + 1 us;
    # backward twice the FLOPs.
    assert cost.moe.forward_compute_s == pytest.approx(4.194304e-6 + 1e-6)
    assert cost.moe.backward_compute_s == pytest.approx(2 * 4.194304e-6 + 1e-6)
    # Back to the attention layout: the dp rank's 256 x 2 / 4 = 128 rows of 64 fp32 (32768 bytes)
    # all-gathered over tp=2: 1/2 x 32768 / 1e10 + 1e-6 = 2.6384e-6 s.
    assert cost.redistribution_s == pytest.approx(2.6384e-6)
    assert cost.moe.forward_comm_s == pytest.approx(cost.dispatch_s + 2 * 4.2768e-6 + 2.6384e-6)
    assert cost.moe.backward_comm_s == cost.moe.forward_comm_s  # the same collectives, reversed
    # Weights: 2 experts x 2 x 64 x 128 x 4 bytes, halved by ETP = 65536 bytes.
    assert cost.moe.weight_bytes == 65536
    # Kept for backward: 256 rows x 4 bytes x (64 + 2 x 1 x 128 / 2) = 196608 bytes.
    assert cost.activation_bytes == 196608
    assert cost.edp_sync_s == 0.0  # EP x ETP = 4: one copy of each expert


def test_expert_data_parallel_copies_all_reduce_their_gradients():
    # EP=2, ETP=1 over 4 ranks: EDP=2 copies (ranks 0 and 2 hold the same experts). Each holds
    # 2 experts x 2 x 64 x 128 x 4 bytes = 131072 bytes; a ring all-reduce over 2 ranks:
    # 2 x (1/2 x 131072 / 1e10 + 1e-6) = 1.51072e-5 s (the tree's 2 x 131072 / 1e10 + 2e-6 is slower).
    cost = folded_layer_cost(LAYER, layout(ep=2), ONE_NODE, (0, 1, 2, 3), tp=2, sequence_parallel=False,
                             precision="fp32")
    assert cost.edp_sync_s == pytest.approx(1.51072e-5)
    assert cost.etp_s == 0.0
    # Whole experts: the compute is the EP layer's own.
    ep_only = moe_layer_cost(dataclasses.replace(LAYER, tokens=128), "expert_parallel", ONE_NODE, [0, 1],
                             placement=ExpertPlacement.round_robin(4, 2), capacity_factor=1.0, precision="fp32")
    assert cost.moe.forward_compute_s == pytest.approx(ep_only.forward_compute_s)


BLOCK = MoEBlock(module="blocks.0.moe", experts=4, top_k=2, capacity_factor=1.0, hidden=64, ffn=128, matmuls=2,
                 router="router.weight", expert_weights=("experts.w_in", "experts.w_out"), kind="test")


def test_experts_sharded_over_their_expert_data_parallel_copies_priced_by_hand():
    """Megatron-FSDP's experts (``ExpertLayout.sharded_copies`` on a folded layout): EP=2,
    ETP=1 over dp2 x tp2 = 4 ranks leaves EDP = 4 / 2 = 2 copies of each expert (ranks 0 and
    2 hold experts 0 and 2, ranks 1 and 3 experts 1 and 3), and each copy holds half of it."""
    sharded = dataclasses.replace(layout(ep=2), sharded_copies=True)
    assert expert_data_parallel_groups(sharded, (0, 1, 2, 3)) == ((0, 2), (1, 3))  # EP x ETP = 2 apart
    assert copies_sharded_over(sharded, 4) == 2 and copies_sharded_over(layout(ep=2), 4) == 1
    # A rank holds 2 of the 4 experts, half of each: a quarter of every stacked expert weight.
    assert param_share(sharded, 4) == (0.25, False)
    # Gathered whole per pass: 2 experts x 2 matmuls x 64 x 128 x 4 bytes = 131,072 bytes over
    # the EDP pair (one node): a ring of 2 moves half, 1/2 x 131,072 / 1e10 + 1 us = 7.5536e-6 s.
    # The fp32 plan reduce-scatters fp32 gradients of the same size, as long.
    shards = copy_shard_costs(BLOCK, sharded, ONE_NODE, "fp32", folded=(0, 1, 2, 3))
    assert shards.gathered_bytes == 131_072
    assert shards.gather_s == pytest.approx(7.5536e-6) and shards.reduce_s == pytest.approx(7.5536e-6)
    # Sent per micro-batch: half of 131,072 bytes for each of two gathers and one reduce-scatter.
    assert shards.sent_bytes == 3 * 65_536
    # No all-reduce of whole copies any more (unsharded: 1.51072e-5 s, the test above).
    cost = folded_layer_cost(LAYER, sharded, ONE_NODE, (0, 1, 2, 3), tp=2, sequence_parallel=False, precision="fp32")
    assert cost.edp_sync_s == 0.0


def test_sequence_parallel_tokens_need_no_redistribution():
    cost = folded_layer_cost(LAYER, layout(ep=4), ONE_NODE, (0, 1, 2, 3), tp=2, sequence_parallel=True,
                             precision="fp32")
    assert cost.redistribution_s == 0.0
    replicated = folded_layer_cost(LAYER, layout(ep=4), ONE_NODE, (0, 1, 2, 3), tp=2, sequence_parallel=False,
                                   precision="fp32")
    assert replicated.moe.forward_comm_s == pytest.approx(cost.moe.forward_comm_s + 2.6384e-6)


def test_degrees_searched_divide_experts_width_and_ranks():
    # 4 experts of width 128 over dp2 x tp2: EP in {2, 4}, ETP dividing tp, EP x ETP dividing 4.
    assert folded_degrees(4, 128, 4, tp=2) == [(2, 1), (2, 2), (4, 1)]
    assert folded_degrees(3, 128, 4, tp=2) == []  # 3 experts split over no EP that divides 4 ranks
    # 256 experts over dp32 x tp8: the 4 largest EPs per ETP in {1, 2, 4, 8}, not all 50-odd pairs.
    degrees = folded_degrees(256, 2048, 256, tp=8)
    assert len(degrees) == 16 and (256, 1) in degrees and (32, 8) in degrees and (2, 1) not in degrees


@pytest.fixture(scope="module")
def traced():
    # ffn=128: the expert size these tests' figures were worked at (examples/moe.py's default
    # is now 512, where EP x ETP wins the dp x tp search instead).
    return prepare_model(ModelSpec(str(EXAMPLES / "moe.py"), {"ffn": 128}), "cpu:1x4")


def test_a_folded_plan_round_trips_and_an_old_layout_loads(traced, tmp_path):
    graph, spec, name, cluster = traced
    plan = folded_plan(graph, cluster, spec, name, Mesh((("dp", 2), ("tp", 2))), ep=2, etp=2)
    assert "EP2 x ETP2 folded over dp x tp" in plan.name
    data = plan.to_dict()
    assert data["moe-folding"] == {"sequence_parallel": False}
    assert data["expert_layouts"][0]["tensor_parallel"] == 2
    again = Plan.from_dict(data)
    assert again.expert_layouts[0].tensor_parallel == 2 and again.sections["moe-folding"] == MoeFoldingSection(False)
    # A layout written before expert tensor parallelism (no key) has whole experts.
    old = folded_plan(graph, cluster, spec, name, Mesh((("dp", 2), ("tp", 2))), ep=4).to_dict()
    assert "tensor_parallel" not in old["expert_layouts"][0]
    assert Plan.from_dict(old).expert_layouts[0].tensor_parallel == 1
    data["moe-folding"] = {"sequence_parallel": "yes"}
    with pytest.raises(PlanFileError, match="moe-folding.sequence_parallel"):
        Plan.from_dict(data)


@pytest.mark.parametrize("change, message", [
    (dict(tensor_parallel=3), "EP=2 x ETP=3 = 6 does not divide the 4 ranks of dp x tp"),
    (dict(placement=ExpertPlacement.round_robin(4, 3)), "4 experts do not split evenly over EP=3"),
    (dict(axis="dp"), "expert parallel on 'dp\\*tp'"),
    # One copy per expert (EP 4 over 4 ranks) leaves nothing to shard the experts over.
    (dict(placement=ExpertPlacement.round_robin(4, 4), sharded_copies=True), "leaves one copy of each"),
])
def test_inconsistent_folding_is_one_line(traced, change, message):
    graph, spec, name, cluster = traced
    plan = folded_plan(graph, cluster, spec, name, Mesh((("dp", 2), ("tp", 2))), ep=2)
    layouts = tuple(dataclasses.replace(layout, **change) for layout in plan.expert_layouts)
    with pytest.raises(ValueError, match=message) as error:
        dataclasses.replace(plan, expert_layouts=layouts)
    assert "\n" not in str(error.value)


def test_a_folded_fsdp_plan_shards_its_experts_over_their_copies(traced):
    """Planned with FSDP, a folded plan shards each expert over its EDP copies as Megatron-FSDP
    does (``search.moe_folding.folded_plan``), says so in its layouts, and prices it; compile
    refuses it in one line (its programs keep whole copies). examples/moe.py at ffn 128: 2
    blocks of 4 GELU experts, w_in and w_out of 64 x 128 each (65,536 expert weights a block),
    fp32, 8 samples over dp2 x tp2, EP2: each rank holds 2 experts (32,768 weights a block),
    EDP = 4 / 2 = 2 copies of each."""
    graph, spec, name, cluster = traced
    mesh = Mesh((("dp", 2), ("tp", 2)))
    plan = folded_plan(graph, cluster, spec, name, mesh, ep=2, dp_flavour="fsdp", accumulation_steps=2)
    assert all(layout.sharded_copies for layout in plan.expert_layouts)
    assert "copies sharded" in plan.name
    assert not any(layout.sharded_copies for layout in
                   folded_plan(graph, cluster, spec, name, mesh, ep=2, accumulation_steps=2).expert_layouts)
    whole = simulated(dataclasses.replace(plan, expert_layouts=tuple(
        dataclasses.replace(layout, sharded_copies=False) for layout in plan.expert_layouts)), graph)
    memory, whole_memory = plan.estimate.memory, whole.estimate.memory
    # Half of each rank's 32,768 expert weights a block fewer: 2 blocks x 16,384 = 32,768
    # weights, at 4 bytes of weight, 4 of gradient and 8 of optimizer states (fp32 AdamW).
    assert whole_memory.weights - memory.weights == 32_768 * 4
    assert whole_memory.gradients - memory.gradients == 32_768 * 4
    assert whole_memory.optimizer_states - memory.optimizer_states == 32_768 * 8
    # The gathered experts of the block running and of the one prefetched: 2 x 32,768 x 4 bytes.
    assert memory.communication_buffers - whole_memory.communication_buffers == 2 * 131_072
    # Per block and micro-batch: a gather before forward, one before backward, and a
    # reduce-scatter after backward (every micro-batch, as FSDP2 and Megatron-FSDP reduce:
    # 2 micro-batches here), each sending half of 131,072 bytes over the EDP pair.
    timeline = [event.name for event in plan.estimate.timeline]
    assert sum("all-gather experts" in event for event in timeline) == 2 * 2 * 2
    assert sum(event.endswith("reduce-scatter expert grads") for event in timeline) == 2 * 2
    assert plan.estimate.bytes_per_axis["expert-copies"] == pytest.approx(2 * 2 * 3 * 65_536)
    assert "expert-copies" not in whole.estimate.bytes_per_axis
    # On NCCL (the arithmetic node, backend nccl) they run beside the compute as FSDP2's do:
    # gathers on the all-gather stream, reduce-scatters on the reduce stream as soon as the
    # block's backward is done, each 1/2 x 131,072 / 1e10 + 1 us = 7.5536e-6 s (fp32).
    on_nccl = folded_plan(graph, dataclasses.replace(ONE_NODE, backend="nccl"), spec, name, mesh, ep=2,
                          dp_flavour="fsdp", accumulation_steps=2).estimate.timeline
    events = {event.name: event for event in on_nccl}
    gathers = [event for event in on_nccl if "all-gather experts" in event.name]
    reductions = [event for event in on_nccl if event.name.endswith("reduce-scatter expert grads")]
    assert len(gathers) == 8 and {event.stream for event in gathers} == {"all_gather"}
    assert len(reductions) == 4 and {event.stream for event in reductions} == {"collective"}
    assert all(event.duration_s == pytest.approx(7.5536e-6) for event in gathers + reductions)
    backward = events["B1 blocks.0 tp-comm"]
    assert events["B1 blocks.0 reduce-scatter expert grads"].start_s == pytest.approx(
        backward.start_s + backward.duration_s)
    last = max(event.start_s + event.duration_s for event in reductions)
    assert events["optimizer step"].start_s >= last - 1e-12  # the step waits for the last reduce-scatter

    from planner.moe_report import moe_table
    from rich.console import Console

    console = Console(width=400, record=True)
    console.print(moe_table(plan))
    assert "each expert sharded over its 2 expert-data-parallel copies" in console.export_text()
    with pytest.raises(PlanningError, match="keep every expert copy whole") as error:
        check_foldable(plan)
    assert "\n" not in str(error.value)


def test_folded_layouts_need_the_section(traced):
    graph, spec, name, cluster = traced
    plan = folded_plan(graph, cluster, spec, name, Mesh((("dp", 2), ("tp", 2))), ep=4)
    with pytest.raises(ValueError, match="only a plan with a 'moe_folding' section runs"):
        dataclasses.replace(plan, sections={})


def test_search_with_mesh_dp_tp_weighs_folded_plans_against_the_others(traced):
    from planner.constraints import SearchConstraints
    from search.auto import search_plan

    graph, spec, name, cluster = traced
    best = search_plan(graph, cluster, spec, name, constraints=SearchConstraints(mesh={"dp": 2, "tp": 2}))
    # On examples/moe.py (4 experts, 2 blocks) the simulator's fastest is folded EP2 x EDP2;
    # every plan that competed (the graph programs on dp x tp too) is slower.
    assert "moe-folding" in best.sections, best.name
    assert (best.expert_layouts[0].placement.devices, best.expert_layouts[0].tensor_parallel) == (2, 1)
    others = [alternative for alternative in best.runners_up if alternative.fits]
    assert others and all(best.estimate.step_time_s <= alternative.step_time_s for alternative in others)
    assert any("folded" not in alternative.name for alternative in others)


def test_unconstrained_search_weighs_folded_plans_and_keeps_data_parallel_where_it_is_faster(traced):
    from search.auto import search_plan

    graph, spec, name, cluster = traced
    best = search_plan(graph, cluster, spec, name)
    # On 4 CPU ranks the tensor-parallel all-reduces of a 64-wide model cost more than they
    # save: every expert replicated over dp=4 is faster than any folded plan, which competed.
    assert "moe-folding" not in best.sections and best.mesh.names == ("dp",), best.name
    folded = [alternative for alternative in best.runners_up if "folded over dp x tp" in alternative.name]
    assert folded and all(alternative.step_time_s > best.estimate.step_time_s for alternative in folded)


def test_the_report_says_how_the_ranks_fold(traced):
    graph, spec, name, cluster = traced
    plan = folded_plan(graph, cluster, spec, name, Mesh((("dp", 2), ("tp", 2))), ep=2, etp=2)
    text = " ".join(plan.report().split())
    assert "the 4 ranks of dp x tp hold the experts as ETP=2 x EP=2 x EDP=1" in text
    assert "each of the 2 tp ranks of a dp rank takes 1/2 of its tokens" in text
