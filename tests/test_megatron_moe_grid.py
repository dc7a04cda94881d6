"""The Megatron-Core MoE grid (``search.megatron_moe``) that ``benchmarks/moe_frontier.py``
compares searched plans with: on a tiny MoE (``examples/moe.py``, 8 experts, 2 MoE blocks,
batch 16) over ``cpu:2x4``, the configurations it lists and the plans it builds."""

from __future__ import annotations

import dataclasses

import pytest

from planner.api import prepare_model
from planner.model_spec import ModelSpec
from cost_model.simulator import simulated
from search.megatron_moe import MegatronGrid, MegatronMoEConfig, best_of, grid_configs, grid_plan, grid_results
from test_parity import REPO

SPEC = ModelSpec(str(REPO / "examples" / "moe.py"), {"batch_size": 16, "n_expert": 8, "ffn": 512})


@pytest.fixture(scope="module")
def tiny():
    graph, spec, name, cluster = prepare_model(SPEC, "cpu:2x4")
    return graph, spec, name, cluster


@pytest.fixture(scope="module")
def deep():
    """Eight blocks, so that 2 stages x 2 virtual stages each keep 2 (grid_configs's VPP rule)."""
    return prepare_model(ModelSpec(SPEC.source, {**SPEC.overrides, "n_layer": 8}), "cpu:2x4")


def test_the_grid_lists_megatron_cores_degrees(tiny):
    graph, _, _, cluster = tiny
    configs = grid_configs(graph, cluster)
    for config in configs:
        assert config.tp * config.pp * config.dp == 8
        assert 8 % config.ep == 0 and (config.dp * config.tp) % (config.ep * config.etp) == 0
        assert 16 % (config.dp * config.micro_batch_size) == 0
    # EP folded over dp=8 without TP or PP: EP 1, 2, 4, 8, each with recompute none/full and
    # micro-batches of 1 or 2 samples (16 / 8 = 2 per rank; 4 does not split).
    flat = [c for c in configs if c.tp == c.pp == 1]
    assert sorted({c.ep for c in flat}) == [1, 2, 4, 8]
    assert len(flat) == 4 * 2 * 2
    assert any(c.tp == 2 and c.etp in (1, 2) for c in configs) and any(c.pp == 2 for c in configs)


def test_ep_over_dp_plans_fold_the_experts_as_megatron_core_does(tiny):
    graph, spec, name, cluster = tiny
    config = MegatronMoEConfig(tp=1, ep=4, etp=1, pp=1, vpp=1, dp=8, recompute="full", micro_batch_size=1)
    result = grid_plan(config, graph, cluster, spec, name, precision="fp32")
    plan = result.plan
    assert plan is not None and plan.estimate.step_time_s > 0
    assert plan.dp_flavour == "zero1" and plan.recompute == "full"
    assert plan.accumulation_steps == 2  # 16 samples / (8 ranks x 1 per micro-batch)
    for layout in plan.expert_layouts:
        # EP4 over 8 ranks: 2 experts per rank, each expert on 2 ranks (one per EP group),
        # sharded over those 2 (the distributed optimizer's expert-data-parallel group).
        assert layout.mode == "expert_parallel" and layout.sharded_copies
        assert layout.placement.most_experts_per_device == 2
        assert all(len(copies) == 2 for copies in layout.placement.replicas)
    # EP8 over 8 ranks: one copy of each expert, nothing to shard.
    whole = grid_plan(dataclasses.replace(config, ep=8), graph, cluster, spec, name, precision="fp32").plan
    assert all(not layout.sharded_copies and layout.placement.method == "round-robin"
               for layout in whole.expert_layouts)


def test_a_pipeline_configuration_is_built_with_its_own_mesh_schedule_and_experts(deep):
    graph, spec, name, cluster = deep
    assert any(c.pp == 2 and c.vpp == 2 and c.ep == 2 and c.dp == 4 for c in grid_configs(graph, cluster))
    # PP2 x DP4, interleaved over 2 virtual stages, EP2 over each stage's 4 dp ranks, 1 sample
    # per micro-batch: 16 / (4 x 1) = 4 micro-batches per step.
    config = MegatronMoEConfig(tp=1, ep=2, etp=1, pp=2, vpp=2, dp=4, recompute="full", micro_batch_size=1)
    plan = grid_plan(config, graph, cluster, spec, name, precision="fp32").plan
    assert plan is not None
    assert dict(plan.mesh.axes) == {"pp": 2, "dp": 4}
    assert plan.pipeline.stages == 2 and plan.pipeline.schedule == "interleaved"
    assert plan.pipeline.virtual_stages == 2 and plan.pipeline.micro_batches == 4
    assert plan.dp_flavour == "zero1" and plan.recompute == "full"
    assert {s.stage for s in plan.strategies} == {0, 1, 2, 3}
    assert len(plan.expert_layouts) == len(graph.moe_blocks) > 0
    for layout in plan.expert_layouts:
        # EP2 over 4 ranks: 8 experts / 2 = 4 per rank, each expert on 4 / 2 = 2 ranks.
        assert layout.mode == "expert_parallel" and layout.axis == "dp"
        assert layout.placement.devices == 4 and layout.placement.most_experts_per_device == 4
        assert all(len(copies) == 2 for copies in layout.placement.replicas)
    # The step is the simulator's on that very plan, not the stage slicing's estimate.
    again = simulated(dataclasses.replace(plan, estimate=None), graph)
    assert again.estimate.step_time_s == plan.estimate.step_time_s
    assert again.estimate.memory.total == plan.estimate.memory.total


def test_a_tensor_parallel_configuration_is_folded_with_zero1_and_accumulation(tiny):
    graph, spec, name, cluster = tiny
    # TP2 x DP4, EP2 x ETP2 folded over the 8 dp*tp ranks: 8 / (2 x 2) = 2 copies of each
    # expert group; 16 samples / (4 dp ranks x 2 per micro-batch) = 2 accumulated micro-batches.
    config = MegatronMoEConfig(tp=2, ep=2, etp=2, pp=1, vpp=1, dp=4, recompute="full", micro_batch_size=2)
    plan = grid_plan(config, graph, cluster, spec, name, precision="fp32").plan
    assert dict(plan.mesh.axes) == {"dp": 4, "tp": 2} and plan.pipeline is None
    assert plan.dp_flavour == "zero1" and plan.recompute == "full" and plan.accumulation_steps == 2
    for layout in plan.expert_layouts:
        assert layout.mode == "expert_parallel" and layout.tensor_parallel == 2
        assert layout.placement.devices == 2 and layout.placement.most_experts_per_device == 4
    again = simulated(dataclasses.replace(plan, estimate=None), graph)
    assert again.estimate.step_time_s == plan.estimate.step_time_s


def test_configurations_the_planner_cannot_build_say_what_is_missing(tiny, deep):
    graph, spec, name, cluster = tiny
    deep_graph, deep_spec, _, _ = deep
    interleaved_tp = MegatronMoEConfig(tp=2, ep=2, etp=1, pp=2, vpp=2, dp=2, recompute="none", micro_batch_size=1)
    missing = grid_plan(interleaved_tp, deep_graph, cluster, deep_spec, name).missing
    assert "interleaved pipeline with TP beside experts" in missing and "branch" not in missing
    # A constrained search that gives a plan without MoE layouts does not count.
    dense = grid_plan(MegatronMoEConfig(1, 4, 1, 1, 1, 8, "none", 1), graph, cluster, spec, name, "fp32").plan
    refused = grid_plan(interleaved_tp, deep_graph, cluster, deep_spec, name, constrained=lambda config: dense)
    assert refused.plan is None and "gave no such plan" in refused.missing
    # Eight stages of a model of two blocks: refused in one line, not a traceback.
    too_deep = MegatronMoEConfig(tp=1, ep=1, etp=1, pp=8, vpp=1, dp=1, recompute="none", micro_batch_size=2)
    assert "does not split into 8 stages" in grid_plan(too_deep, graph, cluster, spec, name).missing


def test_the_best_is_the_fastest_of_every_built_configuration(tiny):
    graph, spec, name, cluster = tiny
    configs = grid_configs(graph, cluster)
    pruned = grid_results(graph, cluster, spec, name, "fp32", configs=configs)
    # Exhaustively: every configuration built on its own, none pruned (one grid: its caches shared).
    grid = MegatronGrid(graph, cluster, spec, name, "fp32")
    every = [grid.build(config) for config in configs]
    built = [r for r in every if r.plan is not None and r.plan.estimate.fits]
    assert {(r.config.pp > 1, r.config.tp > 1) for r in built} == {(False, False), (True, False), (False, True),
                                                                  (True, True)}
    fastest = min(r.plan.estimate.step_time_s for r in built)
    assert best_of(every).plan.estimate.step_time_s == fastest
    # Pruning by the lower bounds loses nothing: the pruned grid finds the same best.
    assert best_of(pruned).plan.estimate.step_time_s == fastest
    assert [r.config for r in pruned] == configs
    assert any(r.missing.startswith("pruned") for r in pruned)  # the bounds saved some work
    # The folded memory bound is below every simulated folded plan's fullest device.
    folded = [r for r in every if r.plan is not None and r.config.tp > 1]
    assert folded and all(r.plan.estimate.memory.total >= grid.folded_memory_lower_bound(r.config) for r in folded)
    for result in pruned:
        assert result.plan is not None or result.missing


def test_folded_configurations_reuse_one_dense_layout_per_mesh_and_price_as_built_alone(tiny, monkeypatch):
    # The grid keeps Megatron's dense layout per mesh (it was half a row's time, rebuilt for
    # every EP, ETP, recomputation and micro-batch size): each folded plan's step and memory
    # equal folded_plan's own, built from scratch.
    import search.megatron_moe
    from search.moe_folding import dense_strategies, folded_plan

    layouts = []
    monkeypatch.setattr(search.megatron_moe, "dense_strategies",
                        lambda graph, mesh, **options: layouts.append(mesh) or dense_strategies(graph, mesh, **options))
    graph, spec, name, cluster = tiny
    configs = [c for c in grid_configs(graph, cluster) if c.tp > 1 and c.vpp == 1][:12]
    grid = MegatronGrid(graph, cluster, spec, name, "fp32")
    cached = [grid.folded(config) for config in configs]
    assert len(layouts) == len(set(layouts)) < len(configs)  # one per mesh, not per configuration
    for config, result in zip(configs, cached):
        mesh = result.plan.mesh if result.plan is not None else None
        if mesh is None:
            continue
        steps = graph.batch_size // (config.dp * config.micro_batch_size)
        alone = folded_plan(graph, cluster, spec, name, mesh, config.ep, config.etp, precision="fp32",
                            micro_batches=steps if config.pp > 1 else 1, dp_flavour=result.plan.dp_flavour,
                            recompute=config.recompute, accumulation_steps=1 if config.pp > 1 else steps)
        assert alone.estimate.step_time_s == result.plan.estimate.step_time_s
        assert alone.estimate.memory.total == result.plan.estimate.memory.total
    assert any(result.plan is not None for result in cached)


def test_the_frontier_benchmark_simulates_the_published_layout_beside_the_grid(tiny, capsys):
    # benchmarks/moe_frontier.py's published lines: the layout's degrees without and with full
    # recomputation (a DualPipe layout's 1F1B twin too), taken from the grid where it simulated
    # them, else built (here the grid's results are empty, so all are built), each printed.
    from benchmarks.moe_frontier import published_results, report_published

    graph, spec, name, cluster = tiny
    grid = MegatronGrid(graph, cluster, spec, name, "fp32")
    layout = MegatronMoEConfig(tp=1, ep=4, etp=1, pp=1, vpp=1, dp=8, recompute="none", micro_batch_size=1)
    none, full = published_results(grid, layout, [])
    assert (none.config.recompute, full.config.recompute) == ("none", "full")
    assert none.plan.estimate.step_time_s < full.plan.estimate.step_time_s  # recomputing only adds time
    from_grid = published_results(grid, layout, [none])
    assert from_grid[0] is none and from_grid[1].config == full.config
    report_published([none, full])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(",")[0].strip() for line in lines] == ["TP1 EP4 ETP1 PP1 DP8 mbs1 recompute none",
                                                             "TP1 EP4 ETP1 PP1 DP8 mbs1 recompute full"]
    assert published_results(grid, None, []) == []
    # DualPipe on a model without a pipeline: refused in one line, its 1F1B twins built.
    dualpipe = published_results(grid, dataclasses.replace(layout, dualpipe=True), [none])
    assert [r.config.dualpipe for r in dualpipe] == [True, True, False, False]
    assert all(r.plan is None and "DualPipe" in r.missing for r in dualpipe[:2]) and dualpipe[2] is none


def test_a_dualpipe_configuration_is_the_same_pipeline_under_deepseeks_schedule(deep):
    # DeepSeek-V3's published layout runs DualPipe: PP2 x DP4, EP2, 16 / 4 = 4 micro-batches
    # (even, twice the stages). Same mesh, experts and recomputation as its 1F1B twin, the
    # schedule the plan's own; refused in one line where DualPipe does not apply.
    graph, spec, name, cluster = deep
    grid = MegatronGrid(graph, cluster, spec, name, "fp32")
    one_f_one_b = MegatronMoEConfig(tp=1, ep=2, etp=1, pp=2, vpp=1, dp=4, recompute="full", micro_batch_size=1)
    dualpipe = grid.build(dataclasses.replace(one_f_one_b, dualpipe=True)).plan
    twin = grid.build(one_f_one_b).plan
    assert dualpipe.pipeline.schedule == "dualpipe" and twin.pipeline.schedule == "1f1b"
    assert dict(dualpipe.mesh.axes) == dict(twin.mesh.axes) == {"pp": 2, "dp": 4}
    assert dualpipe.expert_layouts == twin.expert_layouts and dualpipe.recompute == "full"
    assert dualpipe.estimate.step_time_s != twin.estimate.step_time_s
    assert "DualPipe" in dataclasses.replace(one_f_one_b, dualpipe=True).describe()
    two_per_rank = dataclasses.replace(one_f_one_b, micro_batch_size=2, dualpipe=True)  # 2 micro-batches < 2 x 2 stages
    assert "at least twice the stages" in grid.build(two_per_rank).missing
    assert not any(config.dualpipe for config in grid_configs(graph, cluster))
