"""The ``moe`` plan family (``search/moe_search.py``): each MoE layer's mode, placement and
all-to-all, against exhaustive enumeration of the layouts on a small case, and a golden case.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

import planner
from cost_model.simulator import simulated
from planner.api import prepare_model
from planner.cluster import Cluster, DeviceSpec, LinkSpec, NodeSpec
from planner.model_spec import ModelSpec
from planner.plans import load_plan
from planner.routing import LayerRouting, RoutingStats, synthetic, zipf_layer
from planner.strategy import KEEP_A2A, ExpertLayout, ExpertPlacement
from search import moe_search
from search.moe_search import DENSE_FLAVOURS, choose_layouts, layer_score, moe_base_plan, search_moe_plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DEVICE = DeviceSpec(
    name="arith", peak_flops={"float32": 1e12}, memory_bytes=10**12, memory_bandwidth=1e30,
    matmul_efficiency=1.0, memory_efficiency=1.0, kernel_overhead_s=1e-6,
)
FAST, SLOW = LinkSpec(bandwidth=1e10, latency=1e-6), LinkSpec(bandwidth=1e9, latency=1e-5)


def two_nodes(memory_bytes: int = 10**12) -> Cluster:
    device = dataclasses.replace(DEVICE, memory_bytes=memory_bytes)
    return Cluster(name="arith", nodes=(NodeSpec(device, 2, FAST), NodeSpec(device, 2, FAST)), inter_link=SLOW,
                   backend="gloo")


SMALL = ModelSpec(str(EXAMPLES / "moe.py"), {"n_expert": 4, "capacity_factor": 0, "n_embd": 64, "ffn": 256})
# Layer 0 skewed, layer 1 not in the statistics: uniform.
SKEWED = RoutingStats({"blocks.0.moe": LayerRouting((0.55, 0.25, 0.15, 0.05), 2)}, "test statistics")


def enumerate_plans(graph, cluster, spec, name, routing):
    """Every combination of the layers' candidate layouts with every dense flavour, simulated."""
    scored = choose_layouts(graph, cluster, routing, "fp32")
    searched, _ = search_moe_plan(graph, cluster, spec, name, routing)
    assert searched.recompute == "none"
    base = moe_base_plan(graph, cluster, spec, name)
    modules = list(scored)
    plans = []
    for flavour in DENSE_FLAVOURS:
        dense = dataclasses.replace(base, dp_flavour=flavour,
                                    fsdp_units=graph.block_paths() if flavour in ("zero2", "fsdp") else ())
        for combination in itertools.product(*(scored[m] for m in modules)):
            layouts = tuple(option.layout for option in combination)
            plans.append(simulated(dataclasses.replace(dense, expert_layouts=layouts), graph))
    return searched, plans, scored


@pytest.mark.parametrize("limit", [moe_search.ENUMERATION_LIMIT, 1], ids=["enumerating classes", "coordinate descent"])
def test_the_search_matches_enumeration_of_every_layout_combination(monkeypatch, limit):
    monkeypatch.setattr(moe_search, "ENUMERATION_LIMIT", limit)
    graph, spec, name, cluster = prepare_model(SMALL, two_nodes())
    searched, plans, scored = enumerate_plans(graph, cluster, spec, name, SKEWED)
    # Both nodes are used, so every placement comes with both all-to-alls.
    modes = {(o.layout.mode, o.layout.all_to_all) for o in scored["blocks.0.moe"]}
    assert modes == {("data_parallel", "flat"), ("expert_sliced", "flat"), ("expert_parallel", "flat"),
                     ("expert_parallel", "hierarchical")}
    assert len(plans) == 3 * len(scored["blocks.0.moe"]) * len(scored["blocks.1.moe"]) >= 48
    best = min(plan.estimate.step_time_s for plan in plans)
    assert searched.estimate.step_time_s == pytest.approx(best, rel=1e-9)
    # The layers got different statistics, and each layout records what it was planned with.
    first, second = searched.expert_layouts
    assert first.expert_loads == (0.55, 0.25, 0.15, 0.05) and first.routing == "test statistics"
    assert second.expert_loads == (0.25,) * 4 and second.routing.startswith("uniform (not in")


# Many tokens, small experts: replicating the experts is fastest, and holds the most.
TIGHT = ModelSpec(str(EXAMPLES / "moe.py"), {
    "n_expert": 8, "capacity_factor": 0, "n_embd": 64, "ffn": 512, "batch_size": 64, "seq_len": 64,
})


def test_when_the_fastest_layouts_do_not_fit_the_search_matches_the_best_that_fits():
    graph, spec, name, _ = prepare_model(TIGHT, two_nodes())
    routing = RoutingStats({"blocks.0.moe": zipf_layer(8, 1.0, 2)}, "test statistics")
    unbounded, plans, _ = enumerate_plans(graph, two_nodes(), spec, name, routing)
    assert "data_parallel" in [layout.mode for layout in unbounded.expert_layouts]
    # A device just too small for the fastest combination.
    memory = int(unbounded.estimate.memory.total) - 1
    fitting = [plan for plan in plans if plan.estimate.memory.total <= memory]
    assert fitting and len(fitting) < len(plans)
    searched, _ = search_moe_plan(graph, two_nodes(memory), spec, name, routing)
    assert searched.estimate.fits
    assert searched.estimate.step_time_s == pytest.approx(min(p.estimate.step_time_s for p in fitting), rel=1e-9)


GOLDEN = ModelSpec(str(EXAMPLES / "moe.py"), dict(
    n_expert=64, top_k=2, n_embd=1024, ffn=512, capacity_factor=0, seq_len=512, batch_size=32, n_layer=2, n_head=8,
    vocab_size=1024,
))


def test_skewed_routing_across_nodes_picks_expert_parallel_with_our_balanced_placement():
    graph, spec, name, cluster = prepare_model(GOLDEN, "dgx-a100-80g:4")
    routing = synthetic("zipf:1.2", {b.module: (b.experts, b.top_k) for b in graph.moe_blocks})
    searched, fixed = search_moe_plan(graph, cluster, spec, name, routing, precision="bf16")
    block = graph.moe_blocks[0]
    tokens = 32 * 512
    for layout in searched.expert_layouts:
        assert layout.mode == "expert_parallel" and layout.placement.method == "balanced"
        # 4 nodes: the flat exchange, as NCCL runs it every peer's latency overlaps
        # (cost_model.collectives.NCCL_PEERS_IN_FLIGHT), so the two-level exchange's fewer,
        # larger messages save no latency and its two phases run one after the other.
        assert layout.all_to_all == "flat"
        assert layout.expert_loads == zipf_layer(64, 1.2, 2).token_share
    chosen = layer_score(block, dataclasses.replace(searched.expert_layouts[0], cost=planner.strategy.CostParts()),
                         tokens, cluster, "bf16").time_s
    options = choose_layouts(graph, cluster, routing, "bf16")[block.module]
    assert chosen == pytest.approx(min(option.time_s for option in options))
    # Strictly better than round-robin's and EPLB's placements with the same all-to-all.
    for method in ("round-robin", "EPLB (global)"):
        rivals = [o.time_s for o in options if o.layout.placement is not None and o.layout.placement.method == method
                  and o.layout.all_to_all == "flat"]
        assert rivals and chosen < min(rivals)
    # And the whole plan is no slower than any fixed mode.
    assert len(fixed) == 3
    assert all(searched.estimate.step_time_s <= other.estimate.step_time_s for other in fixed)


def test_plan_chooses_moe_layouts_and_the_plan_file_keeps_them(tmp_path):
    plan = planner.plan(str(EXAMPLES / "moe.py"), "cpu:1x4", routing="zipf:1.2", progress=False)
    assert plan.label == "moe" and plan.mesh.axes == (("dp", 4),) and plan.dp_flavour in DENSE_FLAVOURS
    assert [layout.module for layout in plan.expert_layouts] == ["blocks.0.moe", "blocks.1.moe"]
    assert all(layout.routing == "zipf with exponent 1.2 (synthetic)" for layout in plan.expert_layouts)
    assert plan.expert_layouts[0].cost.compute_s > 0
    plan.save(tmp_path / "p.json")
    loaded = load_plan(tmp_path / "p.json")
    assert loaded.expert_layouts == plan.expert_layouts
    assert planner.simulate(loaded).step_time_s == pytest.approx(plan.estimate.step_time_s)


def test_the_family_is_allowed_only_where_the_samples_mix_inside_moe_layers():
    from search.moe_search import moe_family_allowed
    from search.batch_coupling import CoupledOp, batch_coupled_ops

    graph, _, _, cluster = prepare_model(SMALL, "cpu:1x4")
    coupled = batch_coupled_ops(graph)
    assert coupled and moe_family_allowed(graph, cluster, coupled)
    outside = next(node for node in graph.nodes if not node.module.startswith("blocks.0.moe")
                   and not node.module.startswith("blocks.1.moe"))
    assert not moe_family_allowed(graph, cluster, [*coupled, CoupledOp(outside.name, outside.op, outside.module)])
    assert not moe_family_allowed(graph, Cluster.parse("cpu:1x3"), coupled)  # batch 8 does not split 3 ways
    # A block no compiled runtime runs: priced by a layout if given one, never proposed.
    unknown = dataclasses.replace(graph, moe_blocks=tuple(dataclasses.replace(b, runtime="other") for b in graph.moe_blocks))
    assert not moe_family_allowed(unknown, cluster, coupled)
    dense, _, _, _ = prepare_model(ModelSpec(str(EXAMPLES / "gpt.py"), {}), "cpu:1x4")
    assert dense.moe_blocks == () and not moe_family_allowed(dense, cluster, [])


def test_routing_for_a_dense_model_is_a_warning_not_a_plan_change():
    plan = planner.plan(str(EXAMPLES / "mlp.py"), "cpu:1x2", routing="zipf:1.2", progress=False)
    assert not plan.expert_layouts
    assert any("routing statistics were given but the model has no Mixture-of-Experts layer" in w for w in plan.warnings)


def test_simulating_a_plan_file_whose_layouts_do_not_match_the_model_is_one_line(tmp_path, capsys):
    from user_errors import assert_user_error

    plan = planner.plan(str(EXAMPLES / "moe.py"), "cpu:1x4", progress=False)
    for change, fragment in (
        ({"module": "blocks.7.moe"}, "plan field 'expert_layouts[0].module' ('blocks.7.moe') is not an MoE layer"),
        ({"experts": 8, "expert_loads": ()}, "plan field 'expert_layouts[0].experts' is 8 but layer 'blocks.0.moe' of"),
    ):
        layout = dataclasses.replace(plan.expert_layouts[0], placement=None, mode="data_parallel", **change)
        bad = dataclasses.replace(plan, expert_layouts=(layout, *plan.expert_layouts[1:]))
        bad.save(tmp_path / "bad.json", force=True)
        assert_user_error(capsys, ["simulate", str(tmp_path / "bad.json")], fragment)


def test_huggingface_blocks_get_the_modes_their_programs_run():
    # HF blocks keep their router; programs swap only their experts (expert parallel, flat
    # all-to-all) or leave them replicated: the search proposes nothing else for them, even
    # across nodes and when the FFN divides over the devices.
    from planner.moe_blocks import HF_STACKED_EXPERTS
    from search.moe_search import layer_candidates, modes_compiled_for

    graph, _, _, _ = prepare_model(SMALL, "cpu:1x4")
    block = dataclasses.replace(graph.moe_blocks[0], runtime=HF_STACKED_EXPERTS)
    two_nodes = Cluster.parse("dgx-a100-80g:2")
    loads = (1 / block.experts,) * block.experts
    hf = layer_candidates(block, loads, "uniform", two_nodes, 1024, "bf16")
    routed = layer_candidates(graph.moe_blocks[0], loads, "uniform", two_nodes, 1024, "bf16")
    assert {layout.mode for layout in hf} == set(modes_compiled_for(block)) == {"data_parallel", "expert_parallel"}
    assert {layout.all_to_all for layout in hf} == {"flat"}
    assert {layout.mode for layout in routed} == {"data_parallel", "expert_sliced", "expert_parallel"}
    assert "hierarchical" in {layout.all_to_all for layout in routed}


# Two large experts in each of 4 layers, top-1; an FFN the 4 devices do not divide (no
# expert-sliced layout): whole experts on their copies are what holds the most.
BIG_EXPERTS = ModelSpec(str(EXAMPLES / "moe.py"), {
    "n_expert": 2, "top_k": 1, "capacity_factor": 0, "n_embd": 64, "ffn": 4098, "n_layer": 4,
})


def test_experts_too_big_for_whole_copies_are_sharded_over_them(monkeypatch):
    graph, spec, name, cluster = prepare_model(BIG_EXPERTS, two_nodes())
    assert [p.method for p in moe_search.grid_placements(2, 4)] == ["1 per device x 2 copies", "2 per device x 4 copies"]
    # A device exactly as large as a plan that shards each expert over its 2 copies needs.
    grid = ExpertPlacement.copied_grid(2, 4, 1)
    sharded = dataclasses.replace(
        moe_base_plan(graph, cluster, spec, name), dp_flavour="fsdp", fsdp_units=graph.block_paths(), recompute="full",
        expert_layouts=tuple(ExpertLayout(b.module, "expert_parallel", 2, 1, 0.0, placement=grid, sharded_copies=True)
                             for b in graph.moe_blocks),
    )
    memory = simulated(sharded, graph).estimate.memory.total
    searched, _ = search_moe_plan(graph, two_nodes(memory), spec, name)
    assert searched.estimate.fits
    assert all(layout.sharded_copies for layout in searched.expert_layouts)
    # Without those layouts nothing fits on that device.
    monkeypatch.setattr(moe_search, "grid_placements", lambda experts, world: [])
    unsharded, _ = search_moe_plan(graph, two_nodes(memory), spec, name)
    assert not unsharded.estimate.fits
    assert not any(layout.sharded_copies for layout in unsharded.expert_layouts)


def test_sharded_copies_compete_when_memory_chose_some_layouts(monkeypatch):
    # With room for everything, the search runs once, without grid layouts. With a device
    # that holds the replicated experts only when FSDP shards them, DDP's fastest layouts do
    # not fit: memory chose, so the grid layouts with sharded copies compete too, and the
    # plan is no slower than the best without them.
    graph, spec, name, cluster = prepare_model(BIG_EXPERTS, two_nodes())
    asked = []
    choose = moe_search.choose_layouts

    def recording(*args, **kwargs):
        asked.append(args[4] if len(args) > 4 else kwargs.get("sharded_copies", False))
        return choose(*args, **kwargs)

    monkeypatch.setattr(moe_search, "choose_layouts", recording)
    search_moe_plan(graph, cluster, spec, name)
    assert asked == [False]
    base = moe_base_plan(graph, cluster, spec, name)
    replicated = dataclasses.replace(
        base, dp_flavour="fsdp", fsdp_units=graph.block_paths(),
        expert_layouts=tuple(ExpertLayout(b.module, "data_parallel", 2, 1, 0.0) for b in graph.moe_blocks),
    )
    memory = simulated(replicated, graph).estimate.memory.total
    asked.clear()
    searched, _ = search_moe_plan(graph, two_nodes(memory), spec, name)
    assert asked == [False, True] and searched.estimate.fits
    monkeypatch.setattr(moe_search, "grid_placements", lambda experts, world: [])
    without, _ = search_moe_plan(graph, two_nodes(memory), spec, name)
    assert without.estimate.fits and searched.estimate.step_time_s <= without.estimate.step_time_s


def test_accumulation_is_searched_where_the_whole_batch_does_not_fit(monkeypatch):
    # Longer sequences: activations dominate. On a device exactly as large as the roomy
    # plan run in 2 micro-batches, the whole batch does not fit; the search finds 2
    # micro-batches (each routed on its own), which beat every plan that fits without
    # accumulating (recomputed blocks, sharded dense weights).
    spec = ModelSpec(str(EXAMPLES / "moe.py"), {"n_expert": 4, "capacity_factor": 1.25, "n_embd": 64, "ffn": 256,
                                                 "batch_size": 16, "seq_len": 128})
    graph, spec, name, _ = prepare_model(spec, two_nodes())
    roomy, _ = search_moe_plan(graph, two_nodes(), spec, name)
    assert roomy.accumulation_steps == 1 and roomy.recompute == "none"
    assert moe_search.accumulation_counts(graph, two_nodes()) == [1, 2, 4]  # 4 samples per rank
    memory = simulated(dataclasses.replace(roomy, accumulation_steps=2), graph).estimate.memory.total
    searched, _ = search_moe_plan(graph, two_nodes(memory), spec, name)
    assert searched.estimate.fits and searched.accumulation_steps == 2
    assert not simulated(dataclasses.replace(searched, accumulation_steps=1), graph).estimate.fits
    monkeypatch.setattr(moe_search, "accumulation_counts", lambda graph, cluster: [1])
    without, _ = search_moe_plan(graph, two_nodes(memory), spec, name)
    assert without.accumulation_steps == 1 and without.estimate.fits
    assert searched.estimate.step_time_s < without.estimate.step_time_s


def test_accumulation_skips_the_counts_whose_activations_cannot_fit(monkeypatch):
    # 8 samples per rank. On a device as large as the roomy plan in 8 micro-batches, the
    # plans at one micro-batch leave room for less than half their activations: the search
    # goes from 1 straight to 4 (each count tried costs a search per dense flavour), where
    # expert-parallel layouts fit; at 2 they would not.
    spec = ModelSpec(str(EXAMPLES / "moe.py"), {"n_expert": 4, "capacity_factor": 1.25, "n_embd": 64, "ffn": 256,
                                                 "batch_size": 32, "seq_len": 128})
    graph, spec, name, _ = prepare_model(spec, two_nodes())
    roomy, _ = search_moe_plan(graph, two_nodes(), spec, name)
    memory = simulated(dataclasses.replace(roomy, accumulation_steps=8), graph).estimate.memory.total
    tried = []
    search_with = moe_search._search_with

    def recording(*args):
        tried.append((args[-1].recompute, args[-1].accumulation_steps))
        return search_with(*args)

    monkeypatch.setattr(moe_search, "_search_with", recording)
    searched, _ = search_moe_plan(graph, two_nodes(memory), spec, name)
    # At 4 micro-batches the blocks recomputed keeping their exchanges (full_keep_a2a) leave
    # room for one layer's experts data parallel (no all-to-all): 5.24 ms, where without
    # recomputation both layers must be expert parallel to fit (5.47 ms).
    assert searched.estimate.fits and searched.accumulation_steps == 4 and searched.recompute == KEEP_A2A
    assert [layout.mode for layout in searched.expert_layouts] == ["expert_parallel", "data_parallel"]
    assert [steps for recompute, steps in dict.fromkeys(tried) if recompute == "none"] == [1, 4]
    assert [steps for recompute, steps in dict.fromkeys(tried) if recompute == KEEP_A2A] == [1, 4]
    assert not simulated(dataclasses.replace(searched, accumulation_steps=2), graph).estimate.fits
