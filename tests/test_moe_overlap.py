"""All-to-alls under another micro-batch's compute (``cost_model.moe_overlap``,
``Plan.moe_a2a_overlap``): Megatron-Core's combined-1F1B layer timeline worked by hand, the
simulator's use of it on ``examples/moe.py`` (the arithmetic cluster of
tests/test_moe_plan_costs.py), the search turning it on where it pays, and compile
refusing it in one line."""

from __future__ import annotations

import dataclasses

import pytest

from codegen.plan_checks import check_fields
from cost_model.moe_overlap import (
    LayerPasses, block_compute_s, exchange_compute_slowdown, exposed_communication, exposed_share, layer_passes,
    overlapped_layer_time, overlapped_pairs, overlapped_timeline,
)
from cost_model.simulator import Simulator, simulated
from planner.api import compile_blocker
from planner.errors import PlanFileError
from planner.strategy import ExpertPlacement
from search.moe_search import with_overlap_if_faster
from tests.test_moe_plan_costs import model, layouts  # noqa: F401  (the fixture and its layouts)

FORWARD = LayerPasses(attention=2, dispatch=1, experts=3, combine=1)
BACKWARD = LayerPasses(attention=4, dispatch=1, experts=6, combine=1)


def test_a_compute_heavy_layer_hides_every_all_to_all():
    # Issue order, (stream) start-end, each part after its stream's last and its chain's last;
    # the backward experts split in data (3) and weight (3) gradients, the weight gradients
    # outside the chain:
    #   B combine (comm) 0-1; F attention (compute) 0-2; B dgrad (compute) 2-5 (after B combine
    #   at 1 and F attention); F dispatch (comm) 2-3 (after F attention); B wgrad (compute) 5-8;
    #   B dispatch (comm) 5-6 (after B dgrad, not B wgrad); F experts (compute) 8-11; F combine
    #   (comm) 11-12; B attention (compute) 11-15 (after B dispatch at 6).
    assert overlapped_timeline(FORWARD, BACKWARD) == [
        ("backward", "combine", 0, 1), ("forward", "attention", 0, 2), ("backward", "expert_dgrad", 2, 5),
        ("forward", "dispatch", 2, 3), ("backward", "expert_wgrad", 5, 8), ("backward", "dispatch", 5, 6),
        ("forward", "experts", 8, 11), ("forward", "combine", 11, 12), ("backward", "attention", 11, 15),
    ]
    # 15 = the compute alone (2 + 3 + 4 + 6): the four all-to-alls (4 s) are hidden; run one
    # after the other the pair would take 19.
    assert overlapped_layer_time(FORWARD, BACKWARD) == 15
    assert exposed_communication(FORWARD, BACKWARD) == 0


def test_compute_beside_an_all_to_all_runs_slower():
    # Slowdown 0.25: compute beside a running all-to-all progresses at 1 / 1.25 = 0.8.
    #   0-1: B combine and F attention (0.8 of its 2 done, 1.2 left); 1-2.2: F attention alone.
    #   2.2-3.2: F dispatch and B dgrad (0.8 of 3 done); 3.2-5.4: B dgrad's 2.2 alone.
    #   5.4-6.4: B dispatch and B wgrad (0.8 of 3); 6.4-8.6: B wgrad's 2.2; 8.6-11.6: F experts
    #   alone (F dispatch done at 3.2); 11.6-12.6: F combine and B attention (0.8 of 4);
    #   12.6-15.8: B attention's 3.2. Each second of hidden all-to-all costs the compute 0.2 s:
    #   15.8 = 15 + 4 x 0.2.
    timeline = overlapped_timeline(FORWARD, BACKWARD, slowdown=0.25)
    expected = [(0, 1), (0, 2.2), (2.2, 5.4), (2.2, 3.2), (5.4, 8.6), (5.4, 6.4), (8.6, 11.6), (11.6, 12.6),
                (11.6, 15.8)]
    assert [(start, end) for _, _, start, end in timeline] == [pytest.approx(pair) for pair in expected]
    assert exposed_communication(FORWARD, BACKWARD, slowdown=0.25) == pytest.approx(0.8)


def test_deepep_takes_its_sms_from_the_compute_and_nccl_its_measured_share():
    # DeepEP's normal kernels on 20 of an H100's 132 SMs: the compute keeps 112, 132 / 112 - 1.
    assert exchange_compute_slowdown("deduplicated", 132, 0.189) == pytest.approx(20 / 112)
    # NCCL's all-to-all: the measured slowdown beside any collective (cost_model.nccl).
    assert exchange_compute_slowdown("flat", 132, 0.189) == 0.189
    assert exchange_compute_slowdown("hierarchical", None, 0.0) == 0.0
    assert exchange_compute_slowdown("deduplicated", None, 0.189) == 0.0  # no SMs to take (a CPU)


def test_a_communication_heavy_layer_exposes_what_compute_cannot_cover():
    forward = dataclasses.replace(FORWARD, dispatch=5, combine=5)
    backward = dataclasses.replace(BACKWARD, dispatch=5, combine=5)
    # B combine 0-5; F attention 0-2; B dgrad 5-8; F dispatch 5-10; B wgrad 8-11; B dispatch
    # 10-15 (comm free at 10, B dgrad done at 8); F experts 11-14; F combine 15-20; B attention
    # 15-19: the pair ends at 20, compute is 15, so 5 of the 20 s of all-to-alls stay exposed
    # (6 with the experts' backward unsplit: B dispatch would wait for all 6 s of it).
    assert overlapped_layer_time(forward, backward) == 20
    assert exposed_communication(forward, backward) == 5
    # 4 micro-batches, no pipeline: 3 overlapped pairs expose 5 each, the first forward and
    # the last backward run alone and expose their 10 + 10: (3 x 5 + 20) / (4 x 20) = 0.4375.
    assert overlapped_pairs(4) == (4, 3)
    assert exposed_share(forward, backward, 4, 3) == pytest.approx(0.4375)
    # One micro-batch has no other to overlap with.
    assert exposed_share(forward, backward, *overlapped_pairs(1)) == 1.0


def test_a_pipeline_overlaps_only_its_steady_state():
    # Interleaved, 2 stages x 2 chunks, 4 micro-batches: 8 chunk forwards a rank. Warm-up
    # (2 - rank - 1) x 2 + (2 - 1) x 2 + 1 (the overlap's extra forward): 5 on rank 0, 3 on
    # rank 1; their backwards run alone in the cool-down, the rest pair.
    assert overlapped_pairs(4, stages=2, chunks=2, rank=0) == (8, 3)
    assert overlapped_pairs(4, stages=2, chunks=2, rank=1) == (8, 5)
    # The model zoo's TP2 EP32 PP8 VPP4: 128 micro-batches, 512 chunk forwards; the first
    # rank warms up with 7 x 2 + 3 x 8 + 1 = 39, the last with 25.
    assert overlapped_pairs(128, stages=8, chunks=4, rank=0) == (512, 473)
    assert overlapped_pairs(128, stages=8, chunks=4, rank=7) == (512, 487)
    assert overlapped_pairs(2, stages=4, chunks=1, rank=0) == (2, 0)  # all warm-up
    forward = dataclasses.replace(FORWARD, dispatch=5, combine=5)
    backward = dataclasses.replace(BACKWARD, dispatch=5, combine=5)
    # Rank 0 above: (3 x 5 + 5 x 20) / (8 x 20) = 0.71875.
    assert exposed_share(forward, backward, 8, 3) == pytest.approx(0.71875)


def expert_parallel_plan(model, steps: int, overlap: bool):  # noqa: F811
    graph, base = model
    return dataclasses.replace(base, expert_layouts=layouts("expert_parallel", ExpertPlacement.round_robin(4, 4)),
                               accumulation_steps=steps, moe_a2a_overlap=overlap)


def test_the_simulator_hides_the_all_to_alls_under_the_blocks_compute(model):  # noqa: F811
    graph, _ = model
    simulator = Simulator(expert_parallel_plan(model, 2, True), graph)
    layer = simulator.context.moe_layers["blocks.0.moe"]
    # The compute beside the MoE layer in blocks.0, per rank and micro-batch: 256 tokens over
    # 4 ranks x 2 micro-batches = 32 tokens; c_attn 32 x 64 x 192 x 2 = 786,432 FLOPs,
    # c_proj 32 x 64 x 64 x 2 = 262,144, attention 1 sequence x 4 heads x 32 x 32 x 16 x 2 x 2
    # = 262,144: 1,310,720 FLOPs at 1 TFLOP/s (norms and adds are free on this cluster);
    # backward twice that.
    assert block_compute_s(simulator.context, layer) == pytest.approx((1.31072e-6, 2.62144e-6))
    # Per micro-batch each all-to-all moves 64 copies' rows: 3/4 x 16,384 B / 1 GB/s = 12.288 us;
    # experts forward 80 copies x 32,768 FLOPs = 2.62144 us, backward 5.24288 us.
    # Timeline (us): B combine 0-12.288; F attention 0-1.31072; F dispatch 12.288-24.576;
    # B experts 12.288-17.53088; B dispatch 24.576-36.864; F experts 24.576-27.19744;
    # F combine 36.864-49.152; B attention 36.864-39.48544. Exposed 49.152 - 11.79648 =
    # 37.35552 of the pair's 49.152; with the unpaired passes, (37.35552 + 49.152) / (2 x 49.152) = 0.88.
    anchor = simulator.costs[layer.anchor]
    counts = 0.75 * 4 * 2 * 4 * 8 / 1e9  # the routing's all-gather of counts, not overlapped
    assert anchor.forward_comm_s == pytest.approx(24.576e-6 * 0.88 + counts)
    assert anchor.backward_comm_s == pytest.approx(24.576e-6 * 0.88)


def test_the_overlap_holds_one_more_micro_batch_and_shortens_the_step(model):  # noqa: F811
    graph, _ = model
    plain = simulated(expert_parallel_plan(model, 2, False), graph).estimate
    overlapped = simulated(expert_parallel_plan(model, 2, True), graph).estimate
    assert overlapped.step_time_s < plain.step_time_s
    # Two micro-batches' activations instead of one (the transient recomputed part aside).
    assert plain.memory.activations < overlapped.memory.activations <= 2 * plain.memory.activations


def test_the_search_turns_it_on_only_where_it_pays(model):  # noqa: F811
    graph, _ = model
    two = simulated(expert_parallel_plan(model, 2, False), graph)
    assert with_overlap_if_faster(two, graph).moe_a2a_overlap
    one = simulated(expert_parallel_plan(model, 1, False), graph)
    assert with_overlap_if_faster(one, graph) is one  # nothing to overlap with
    # A device just big enough for the plain plan: the extra micro-batch no longer fits.
    device = dataclasses.replace(two.cluster.nodes[0].device, memory_bytes=two.estimate.memory.total)
    small = dataclasses.replace(two.cluster, nodes=(dataclasses.replace(two.cluster.nodes[0], device=device),))
    tight = simulated(dataclasses.replace(two, cluster=small), graph)
    assert tight.estimate.fits
    assert not with_overlap_if_faster(tight, graph).moe_a2a_overlap


def test_compile_refuses_it_in_one_line(model):  # noqa: F811
    graph, _ = model
    plan = simulated(expert_parallel_plan(model, 2, True), graph)
    with pytest.raises(PlanFileError, match="moe_a2a_overlap") as caught:
        check_fields(plan)
    assert "\n" not in str(caught.value) and "--moe-dispatch overlapped" in str(caught.value)
    assert "plan without --moe-dispatch overlapped to compile" in compile_blocker(plan)


def test_the_plan_file_keeps_it_and_refuses_it_without_expert_parallelism(model):  # noqa: F811
    graph, base = model
    plan = simulated(expert_parallel_plan(model, 2, True), graph)
    assert plan.to_dict()["moe_a2a_overlap"] is True and "all-to-alls under another micro-batch" in plan.name
    with pytest.raises(ValueError, match="no MoE layer of the plan is expert parallel"):
        dataclasses.replace(base, moe_a2a_overlap=True)


def test_a_saved_plan_keeps_it_compile_refuses_it_and_old_files_read_it_as_off(tmp_path):
    from planner.api import prepare_model
    from planner.cluster import Cluster
    from planner.model_spec import ModelSpec
    from search.moe_search import moe_base_plan
    from tests.simulation_only_fields import check_simulation_only_field
    from tests.test_moe_plan_costs import EXAMPLES

    cluster = Cluster.preset("cpu", 1, 4)
    graph, spec, name, _ = prepare_model(ModelSpec(str(EXAMPLES / "moe.py"), {}), cluster)
    plan = dataclasses.replace(moe_base_plan(graph, cluster, spec, name), accumulation_steps=2, moe_a2a_overlap=True,
                               expert_layouts=layouts("expert_parallel", ExpertPlacement.round_robin(4, 4)))
    check_simulation_only_field(simulated(plan, graph), "moe_a2a_overlap", tmp_path)


def test_on_h100s_deepeps_exchange_slows_the_compute_it_hides_under():
    # examples/moe.py on 4 H100s, its layers expert parallel with DeepEP's exchange, 2
    # micro-batches: the simulator's share is the pair's with the compute beside the exchange
    # on 112 of 132 SMs (exchange_compute_slowdown), worse than the same pair for free.
    from planner.api import prepare_model
    from planner.cluster import Cluster
    from planner.model_spec import ModelSpec
    from search.moe_search import moe_base_plan
    from tests.test_moe_plan_costs import EXAMPLES

    cluster = Cluster.preset("dgx-h100", 1, 4)
    graph, spec, name, _ = prepare_model(ModelSpec(str(EXAMPLES / "moe.py"), {}), cluster)
    deepep = tuple(dataclasses.replace(layout, all_to_all="deduplicated")
                   for layout in layouts("expert_parallel", ExpertPlacement.round_robin(4, 4)))
    plan = dataclasses.replace(moe_base_plan(graph, cluster, spec, name), accumulation_steps=2,
                               moe_a2a_overlap=True, expert_layouts=deepep)
    simulator = Simulator(plan, graph)
    layer = simulator.context.moe_layers["blocks.0.moe"]
    forward, backward = layer_passes(layer, block_compute_s(simulator.context, layer))
    share = simulator.node_costs.a2a_exposed_share(layer)
    assert share == pytest.approx(exposed_share(forward, backward, 2, 1, slowdown=20 / 112))
    assert share > exposed_share(forward, backward, 2, 1)
    # The layer's anchor op carries the expert GEMMs and the memory-bound kernels around them
    # (not priced before session 13), with the exposed share of the exchange beside them:
    # examples/moe.py's experts run as its compiled program runs them (planner.expert_kernels:
    # one bmm over the local experts' buffers padded to the capacity), whose memory-bound
    # kernel is the GELU over those buffers (cost_model.expert_memory_ops).
    from cost_model.expert_memory_ops import batched_gelu_times
    from cost_model.moe import element_bytes

    # 4 experts on 4 ranks: one each; 8 x 32 tokens a step in 2 micro-batches, capacity 1.25:
    # ceil(1.25 x 128 x 2 / 4) = 80 slots.
    kernels = layer.cost.kernels
    assert (kernels.local_experts, kernels.rows) == (1, 80)
    memory_ops = batched_gelu_times(kernels.local_experts * kernels.rows, kernels.ffn, element_bytes(plan.precision),
                                    cluster.device_of(0))
    assert memory_ops[0] > 0 and (layer.memory_ops_forward_s, layer.memory_ops_backward_s) == pytest.approx(memory_ops)
    anchor = simulator.costs[layer.anchor]
    assert anchor.forward_s == pytest.approx(layer.cost.forward_compute_s + memory_ops[0])
    assert anchor.backward_s == pytest.approx(layer.cost.backward_compute_s + memory_ops[1])
