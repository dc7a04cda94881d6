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
    LayerPasses, block_compute_s, exposed_communication, exposed_share, overlapped_layer_time, overlapped_timeline,
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
    # Issue order, (stream) start-end, each part after its stream's last and its chain's last:
    #   B combine (comm) 0-1; F attention (compute) 0-2; F dispatch (comm) 2-3 (after F attention);
    #   B experts (compute) 2-8; B dispatch (comm) 8-9 (after B experts); F experts (compute)
    #   8-11; F combine (comm) 11-12; B attention (compute) 11-15 (after B dispatch at 9).
    assert overlapped_timeline(FORWARD, BACKWARD) == [
        ("backward", "combine", 0, 1), ("forward", "attention", 0, 2), ("forward", "dispatch", 2, 3),
        ("backward", "experts", 2, 8), ("backward", "dispatch", 8, 9), ("forward", "experts", 8, 11),
        ("forward", "combine", 11, 12), ("backward", "attention", 11, 15),
    ]
    # 15 = the compute alone (2 + 3 + 4 + 6): the four all-to-alls (4 s) are hidden; run one
    # after the other the pair would take 19.
    assert overlapped_layer_time(FORWARD, BACKWARD) == 15
    assert exposed_communication(FORWARD, BACKWARD) == 0


def test_a_communication_heavy_layer_exposes_what_compute_cannot_cover():
    forward = dataclasses.replace(FORWARD, dispatch=5, combine=5)
    backward = dataclasses.replace(BACKWARD, dispatch=5, combine=5)
    # B combine 0-5; F attention 0-2; F dispatch 5-10; B experts 5-11; B dispatch 11-16;
    # F experts 11-14; F combine 16-21; B attention 16-20: the pair ends at 21, compute is 15,
    # so 6 of the 20 s of all-to-alls stay exposed.
    assert overlapped_layer_time(forward, backward) == 21
    assert exposed_communication(forward, backward) == 6
    # 4 micro-batches: 3 overlapped pairs expose 6 each, the first forward and the last
    # backward run alone and expose their 10 + 10: (3 x 6 + 20) / (4 x 20) = 0.475.
    assert exposed_share(forward, backward, 4) == pytest.approx(0.475)
    # One micro-batch has no other to overlap with.
    assert exposed_share(forward, backward, 1) == 1.0


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
