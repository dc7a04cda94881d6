"""The pipeline grid (search/pipeline_search.py): stage slicing by dynamic programming, the
cost model it prices configurations with, and the plans it hands to the search.

Models are traced on meta tensors; nothing runs a step.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_model.simulator import Simulator
from planner import baselines
from planner.api import prepare_model
from planner.cluster import Cluster
from planner.errors import ArgumentError, PlanningError
from planner.model_spec import ModelSpec
from search.budget import SearchBudget
from search.megatron import megatron_plan
from search.pipeline_configs import schedule_kind
from search.pipeline_search import PER_STAGE, Configuration, PipelineGrid, PipelineSpace, pipeline_plans
from search.stage_slicing import SegmentCost, slice_stages, stage_memory

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")


# ------------------------------------------------------------------ stage slicing


def exhaustive(costs, stages, capacity, in_flight):
    """The slowest stage of the best split, trying every set of cuts; None if none fits."""
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = (0, *cuts, len(costs))
        members = [costs[bounds[s]:bounds[s + 1]] for s in range(stages)]
        if any(stage_memory(m, in_flight[s]) > capacity for s, m in enumerate(members)):
            continue
        slowest = max(sum(c.time_s for c in m) for m in members)
        best = slowest if best is None else min(best, slowest)
    return best


segment = st.builds(
    SegmentCost,
    time_s=st.sampled_from([0.5, 1.0, 2.0, 3.0, 7.0]),
    static_bytes=st.sampled_from([0.0, 1.0, 4.0]),
    activation_bytes=st.sampled_from([0.0, 1.0, 2.0]),
    transient_bytes=st.sampled_from([0.0, 0.0, 3.0]),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(segment, min_size=1, max_size=8), st.data())
def test_slicing_matches_exhaustive_enumeration(costs, data):
    stages = data.draw(st.integers(1, len(costs)))
    in_flight = data.draw(st.lists(st.integers(1, 4), min_size=stages, max_size=stages))
    capacity = data.draw(st.sampled_from([4.0, 8.0, 16.0, 1e9]))
    slicing = slice_stages(costs, stages, capacity, in_flight)
    expected = exhaustive(costs, stages, capacity, in_flight)
    if expected is None:
        assert slicing is None
        return
    assert slicing.slowest_s == pytest.approx(expected)
    counts = slicing.segments_per_stage
    assert len(counts) == stages and min(counts) >= 1 and sum(counts) == len(costs)
    # The cuts it returns are a split with that slowest stage, and it fits.
    start = 0
    for s, count in enumerate(counts):
        members = costs[start:start + count]
        assert sum(c.time_s for c in members) <= slicing.slowest_s + 1e-9
        assert stage_memory(members, in_flight[s]) <= capacity
        start += count


def test_slicing_balances_a_heavy_end():
    # An embedding, six equal blocks and a head as slow as three blocks, on three stages:
    # the even split (2, 2, 2 blocks) makes the last stage 5 units; the head alone on the
    # last stage and 3 + 3 blocks before it, 3.5.
    costs = [SegmentCost(0.5)] + [SegmentCost(1.0)] * 6 + [SegmentCost(3.0)]
    slicing = slice_stages(costs, 3, capacity=1e9, in_flight=[3, 2, 1])
    assert slicing.slowest_s == pytest.approx(3.5)
    assert slicing.segments_per_stage == (4, 3, 1)


def test_slicing_respects_memory_of_the_stages_holding_more_micro_batches():
    # Stage 0 holds 4 micro-batches in flight, so under a tight capacity it takes fewer
    # blocks than the time balance alone would give it.
    costs = [SegmentCost(1.0, activation_bytes=1.0)] * 8
    free = slice_stages(costs, 2, capacity=1e9, in_flight=[4, 1])
    tight = slice_stages(costs, 2, capacity=12.0, in_flight=[4, 1])
    assert free.segments_per_stage == (4, 4)
    assert tight.segments_per_stage == (3, 5)
    assert slice_stages(costs, 2, capacity=3.0, in_flight=[4, 1]) is None


def exhaustive_with_modes(by_mode, stages, capacity, in_flight):
    """The slowest stage of the best split when each stage also picks its mode, trying
    every set of cuts and the fastest fitting mode of each stage; None if none fits."""
    n = len(next(iter(by_mode.values())))
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        slowest = 0.0
        for s in range(stages):
            fitting = [
                sum(c.time_s for c in costs[bounds[s]:bounds[s + 1]])
                for costs in by_mode.values()
                if stage_memory(costs[bounds[s]:bounds[s + 1]], in_flight[s]) <= capacity
            ]
            if not fitting:
                break
            slowest = max(slowest, min(fitting))
        else:
            best = slowest if best is None else min(best, slowest)
    return best


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(segment, segment), min_size=1, max_size=7), st.data())
def test_slicing_with_modes_matches_exhaustive_enumeration(pairs, data):
    # Two modes per segment: "none" as drawn, "full" the other draw made cheaper to keep.
    by_mode = {"none": [a for a, _ in pairs], "full": [dataclasses.replace(b, static_bytes=a.static_bytes) for a, b in pairs]}
    stages = data.draw(st.integers(1, len(pairs)))
    in_flight = data.draw(st.lists(st.integers(1, 4), min_size=stages, max_size=stages))
    capacity = data.draw(st.sampled_from([4.0, 8.0, 16.0, 1e9]))
    slicing = slice_stages(by_mode, stages, capacity, in_flight)
    expected = exhaustive_with_modes(by_mode, stages, capacity, in_flight)
    if expected is None:
        assert slicing is None
        return
    assert slicing.slowest_s == pytest.approx(expected)
    assert len(slicing.modes) == stages
    start = 0
    for s, (count, mode) in enumerate(zip(slicing.segments_per_stage, slicing.modes)):
        members = by_mode[mode][start:start + count]
        assert sum(c.time_s for c in members) <= slicing.slowest_s + 1e-9
        assert stage_memory(members, in_flight[s]) <= capacity
        start += count


def test_first_stage_recomputes_where_the_last_need_not():
    # Worked by hand. Four equal segments on two 1F1B stages (stage 0 holds 2 micro-batches
    # in flight, stage 1 one), capacity 25 bytes. Without recomputation a segment takes 1 s
    # and keeps 10 bytes; recomputed, 1.5 s, keeps 2 bytes and briefly holds 8.
    #   2 + 2 with none everywhere: stage 0 needs 2 x 20 = 40 > 25, no.
    #   stage 0 full: 2 x 4 + 8 = 16 fits, 3 s; stage 1 none: 20 fits, 2 s -> slowest 3 s.
    #   1 + 3: stage 0 none (20 fits, 1 s); stage 1 needs full (6 + 8 = 14), 4.5 s -> 4.5 s.
    #   3 + 1: stage 0 full (2 x 6 + 8 = 20), 4.5 s -> 4.5 s.
    none = [SegmentCost(1.0, activation_bytes=10.0)] * 4
    full = [SegmentCost(1.5, activation_bytes=2.0, transient_bytes=8.0)] * 4
    slicing = slice_stages({"none": none, "full": full}, 2, capacity=25.0, in_flight=[2, 1])
    assert slicing.segments_per_stage == (2, 2) and slicing.modes == ("full", "none")
    assert slicing.slowest_s == pytest.approx(3.0)
    assert slice_stages(none, 2, capacity=25.0, in_flight=[2, 1]) is None  # no uniform "none" split fits
    assert slice_stages(full, 2, capacity=25.0, in_flight=[2, 1]).slowest_s == pytest.approx(3.0)


# ------------------------------------------------------------ the grid on a model


def gpt_spec(**overrides) -> ModelSpec:
    # Width 1024 with a 64K vocabulary: the head costs about five blocks, and kernels this
    # size outlast the host's time to issue them (at width 512 the A100 would wait for the
    # host: cost_model.host_dispatch).
    settings_ = {"n_layer": 8, "n_embd": 1024, "n_head": 16, "vocab_size": 65536, "seq_len": 256, "batch_size": 32}
    return ModelSpec(GPT, {**settings_, **overrides})


@pytest.fixture(scope="module")
def heavy_head():
    return prepare_model(gpt_spec(), "dgx-a100-80g:2x2")


def with_device_memory(cluster: Cluster, memory_bytes: int) -> Cluster:
    nodes = tuple(
        dataclasses.replace(node, device=dataclasses.replace(node.device, memory_bytes=memory_bytes))
        for node in cluster.nodes
    )
    return dataclasses.replace(cluster, nodes=nodes)


def test_segment_profiles_add_up_to_the_simulated_costs(heavy_head):
    graph, spec, name, cluster = heavy_head
    plan = megatron_plan(graph, cluster, spec, name, tp=2, pp=2, micro_batch=4, precision="bf16")
    profiles = Simulator(plan, graph).segment_profiles()
    assert [p.block for p in profiles] == [False] + [True] * 8 + [False]
    micro_batches = plan.pipeline.micro_batches
    annotated = sum(s.cost.compute_s + s.cost.communication_s for s in plan.strategies)
    # The ops' own costs, plus where a segment's kernels are shorter than the host's time to
    # issue them, the device's wait for the host (cost_model.host_dispatch).
    waits = sum(segment.host_wait_s for segment in Simulator(plan, graph).segments())
    assert sum(p.time_s["none"] for p in profiles) * micro_batches == pytest.approx(annotated + waits * micro_batches, rel=1e-9)
    block = profiles[1]
    # Fused attention keeps no score matrix, so selective recomputation changes nothing here.
    assert block.time_s["none"] == block.time_s["selective"] < block.time_s["full"]
    assert block.kept_bytes["full"] < block.kept_bytes["selective"] == block.kept_bytes["none"]
    assert block.transient_bytes["full"] == block.kept_bytes["none"]


def test_heavy_head_gets_fewer_blocks_and_that_is_faster(heavy_head):
    graph, spec, name, cluster = heavy_head
    grid = PipelineGrid(graph, cluster, "bf16", PipelineSpace())
    config = Configuration(tp=1, pp=2, dp=2, micro_batch=2, micro_batches=8, schedule="1f1b", virtual_stages=1,
                           flavour="ddp", recompute="none")
    estimate = grid.estimate(config)
    first, last = estimate.layers_per_stage
    assert first + last == 8 and last < first
    uneven = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, precision="bf16",
                           layers_per_stage=estimate.layers_per_stage)
    even = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, precision="bf16")
    assert uneven.estimate.step_time_s < even.estimate.step_time_s
    assert grid.plan(estimate, spec, name).estimate == uneven.estimate
    # The cost model prices what the simulator says to within a few percent.
    assert estimate.step_s == pytest.approx(uneven.estimate.step_time_s, rel=0.05)
    assert estimate.memory_bytes == pytest.approx(uneven.estimate.memory.total, rel=0.05)


def test_interleaved_estimates_follow_the_simulator(heavy_head):
    graph, spec, name, cluster = heavy_head
    grid = PipelineGrid(graph, cluster, "bf16", PipelineSpace())
    # Two micro-batches of 8 slice the head alone onto the last virtual stage, (2, 3, 3, 0)
    # blocks: uneven stages, which the closed form m x busiest device + (pp - 1) x slowest
    # virtual stage put 10% above the simulation (zero1: 45.2 against 41.0 ms); the walked
    # schedule (cost_model.schedules.schedule_makespan) is within 3% of it.
    for flavour, recompute, micro_batch in (("zero1", "none", 1), ("ddp", "full", 1), ("zero1", "none", 8)):
        config = Configuration(tp=1, pp=2, dp=2, micro_batch=micro_batch, micro_batches=16 // micro_batch,
                               schedule="interleaved", virtual_stages=2, flavour=flavour, recompute=recompute)
        estimate = grid.estimate(config)
        plan = grid.plan(estimate, spec, name)
        assert plan.pipeline.virtual_stages == 2 and sum(estimate.layers_per_stage) == 8
        assert estimate.step_s == pytest.approx(plan.estimate.step_time_s, rel=0.03)
        assert estimate.memory_bytes == pytest.approx(plan.estimate.memory.total, rel=0.05)


def test_grid_plans_fit_when_the_fastest_configuration_does_not(heavy_head):
    graph, spec, name, roomy = heavy_head
    # The grid's finalists come fastest estimate first; the search keeps the fastest simulated.
    finalists = pipeline_plans(graph, roomy, spec, name, "bf16", SearchBudget())
    fastest = min(finalists, key=lambda plan: plan.estimate.step_time_s)
    need = fastest.estimate.memory.total
    tight = with_device_memory(roomy, int(need * 0.8))
    # The roomy winner does not fit on the tight cluster...
    squeezed = dataclasses.replace(fastest, cluster=tight)
    assert not Simulator(squeezed, graph).run(trace=False).fits
    # ... and every plan the grid gives there fits.
    plans = pipeline_plans(graph, tight, spec, name, "bf16", SearchBudget())
    assert plans and all(plan.estimate.fits for plan in plans)
    # ... and none is faster than the roomy search's best: the roomy grid simulated the
    # fastest plan it has. (It did not while the interleaved estimate was a closed form,
    # m x busiest device + (pp - 1) x slowest virtual stage, which put zero1, pp2 x dp2, 2
    # micro-batches of 8, two chunks at 45.2 ms against 41.0 simulated: the roomy finalists
    # were then 1F1B or no pipeline, best 43.7 ms, while the tight cluster, with fewer
    # configurations fitting, simulated that interleaved plan and returned it.)
    assert min(plan.estimate.step_time_s for plan in plans) >= fastest.estimate.step_time_s


def test_finalists_hold_the_fastest_estimate_of_each_schedule(heavy_head):
    # Every configuration priced (brute force), the fastest estimate that fits of each
    # schedule kind: best(4) holds each of them, and fills the fourth place with the
    # fastest of the rest. On this grid the four fastest estimates overall are three
    # interleaved ones and no pipeline, so without a finalist per schedule 1F1B (43.6 ms,
    # 43.7 simulated) would not be simulated at all.
    graph, _, _, cluster = heavy_head
    grid = PipelineGrid(graph, cluster, "bf16", PipelineSpace())
    fastest: dict[str, float] = {}
    every = []
    for config in grid.configurations():
        estimate = grid.estimate(config)
        if estimate is not None:
            every.append(estimate.step_s)
            kind = schedule_kind(config)
            fastest[kind] = min(fastest.get(kind, estimate.step_s), estimate.step_s)
    assert set(fastest) == {"none", "1f1b", "interleaved"}
    assert fastest["1f1b"] > sorted(every)[3]  # not among the four fastest estimates
    finalists = PipelineGrid(graph, cluster, "bf16", PipelineSpace()).best(4)
    times = [estimate.step_s for estimate in finalists]
    assert all(any(t == pytest.approx(seconds, rel=1e-12) for t in times) for seconds in fastest.values())
    assert times == sorted(times) and len(times) == 4
    # One finalist: the fastest estimate of all; two: the two fastest schedule kinds' leaders.
    assert [e.step_s for e in grid.best(1)] == pytest.approx([min(every)])
    assert [e.step_s for e in grid.best(2)] == pytest.approx(sorted(fastest.values())[:2])


def test_grid_is_deterministic_and_bounded(heavy_head):
    graph, spec, name, cluster = heavy_head
    first = pipeline_plans(graph, cluster, spec, name, "bf16", SearchBudget(effort=1))
    second = pipeline_plans(graph, cluster, spec, name, "bf16", SearchBudget(effort=1))
    assert [(p.name, p.recompute, p.estimate.step_time_s) for p in first] == [
        (p.name, p.recompute, p.estimate.step_time_s) for p in second
    ]
    assert len(first) == SearchBudget(effort=1).pipeline_candidates()
    grid = PipelineGrid(graph, cluster, "bf16", PipelineSpace())
    grid.best(4)
    assert 0 < grid.priced < len(grid.configurations())  # the bounds pruned some


def test_grid_options_follow_the_space(heavy_head):
    graph, _, _, cluster = heavy_head
    configs = PipelineGrid(graph, cluster, "bf16", PipelineSpace()).configurations()
    assert {c.tp for c in configs} == {1, 2}
    assert {c.pp for c in configs} == {1, 2, 4}
    for c in configs:
        assert c.tp * c.pp * c.dp == cluster.world_size
        assert c.micro_batch * c.micro_batches * c.dp == graph.batch_size
        if c.schedule == "interleaved":
            assert c.micro_batches % c.pp == 0 and c.pp * c.virtual_stages <= 8
    assert {c.sequence_parallel for c in configs if c.tp == 1} == {False}
    assert {c.sequence_parallel for c in configs if c.tp == 2} == {False, True}
    even = PipelineGrid(graph, cluster, "bf16", PipelineSpace(uneven=False, flavours=("ddp",))).configurations()
    assert {c.flavour for c in even} == {"ddp"} and {c.pp for c in even} == {1, 2, 4}


def test_sequence_parallel_configurations_build_sequence_parallel_plans(heavy_head):
    graph, spec, name, cluster = heavy_head
    grid = PipelineGrid(graph, cluster, "bf16", PipelineSpace())
    plans = {}
    for split in (False, True):
        config = Configuration(tp=2, pp=2, dp=1, micro_batch=1, micro_batches=32, schedule="1f1b", virtual_stages=1,
                               flavour="ddp", recompute="none", sequence_parallel=split)
        plans[split] = grid.plan(grid.estimate(config), spec, name)
    assert plans[True].name == plans[False].name[:-1] + "; sequence parallel)"
    # The residual stream split over tp: fewer activation bytes kept for backward.
    assert plans[True].estimate.memory.activations < plans[False].estimate.memory.activations


def test_pipeline_plan_names_tell_configurations_apart(heavy_head):
    graph, spec, name, cluster = heavy_head
    plan = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, schedule="interleaved", virtual_stages=2,
                         dp_flavour="zero1", precision="bf16")
    assert plan.name == "megatron (pp=2 x dp=2; interleaved x2, 8 micro-batches; zero1)"
    assert megatron_plan(graph, cluster, spec, name, tp=2, precision="bf16").name == "megatron (dp=2 x tp=2)"


# ------------------------------------------------------- baselines.megatron(layers_per_stage)


def test_megatron_layers_per_stage_places_blocks():
    plan = baselines.megatron(gpt_spec(), "dgx-a100-80g:2x2", pp=4, micro_batch=2, layers_per_stage=[3, 2, 2, 1])
    stages_of_blocks = {}
    for strategy in plan.strategies:
        if strategy.module.startswith("blocks."):
            stages_of_blocks[int(strategy.module.split(".")[1])] = strategy.stage
    assert stages_of_blocks == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 2, 7: 3}


@pytest.mark.parametrize(
    "layers, error, message",
    [
        ([3, 3], PlanningError, r"holds 6 layers but the model has 8"),
        ([4, 4, 0], PlanningError, r"has 3 entries but the pipeline has 2 \(virtual\) stages"),
        ([4, 0, 4], PlanningError, r"leaves stage\(s\) 1 without a layer"),
        ([5, -1, 4], PlanningError, r"integers >= 0"),
        ([4.0, 4], ArgumentError, r"layers_per_stage must be a list of integers"),
        ("44", ArgumentError, r"layers_per_stage must be a list of integers"),
    ],
)
def test_megatron_layers_per_stage_validation(layers, error, message):
    pp = 3 if layers == [4, 0, 4] or layers == [5, -1, 4] else 2
    with pytest.raises(error, match=message):
        baselines.megatron(gpt_spec(), "dgx-a100-80g:2x2" if pp == 2 else "dgx-a100-80g:1x3", pp=pp,
                           micro_batch=1, layers_per_stage=layers)


# --------------------------------------------------------------- in the outer search


def test_search_prices_pipelines_on_one_node_only_when_memory_forces_recomputation(heavy_head):
    from search.auto import search_plan

    graph, spec, name, _ = heavy_head
    roomy = Cluster.parse("dgx-a100-80g:1x4")
    plan = search_plan(graph, roomy, spec, name, search="ilp", budget=SearchBudget(effort=0.25), precision="bf16")
    assert plan.pipeline is None and not any("micro-batches" in alt.name for alt in plan.runners_up)
    # Squeeze memory until the roomy winner needs recomputation: the grid's pipelines compete.
    tight = with_device_memory(roomy, int(plan.estimate.memory.total * 0.6))
    squeezed = search_plan(graph, tight, spec, name, search="ilp", budget=SearchBudget(effort=0.25), precision="bf16")
    assert squeezed.estimate.fits
    names = [squeezed.name, *(alt.name for alt in squeezed.runners_up)]
    assert any("micro-batches" in entry for entry in names)


def test_a_layout_restricted_to_some_axes_is_the_layout_of_the_smaller_mesh(heavy_head):
    from planner.strategy import Mesh
    from search.layouts import megatron_layout, restrict_axes

    graph = heavy_head[0]
    full = megatron_layout(graph, Mesh((("pp", 2), ("dp", 2), ("tp", 2))), sequence_parallel=True,
                           layers_per_stage=(8, 0))
    strategies, inputs = restrict_axes(*full, [1, 2])
    direct, direct_inputs = megatron_layout(graph, Mesh((("dp", 2), ("tp", 2))), sequence_parallel=True)
    assert inputs == direct_inputs
    assert [dataclasses.replace(s, stage=0) for s in strategies] == list(direct)


def test_nearly_even_layers_leave_the_end_stages_short():
    from search.layouts import nearly_even_layers

    assert nearly_even_layers(8, 4) == (2, 2, 2, 2)
    assert nearly_even_layers(126, 16) == (7,) + (8,) * 14 + (7,)
    assert nearly_even_layers(10, 4) == (2, 3, 3, 2)
    assert nearly_even_layers(7, 2) == (4, 3)  # two stages: the first end takes the extra block


def test_slicing_is_never_slower_than_megatrons_split(heavy_head):
    graph, _, _, cluster = heavy_head
    free = PipelineGrid(graph, cluster, "bf16", PipelineSpace())
    megatron = PipelineGrid(graph, cluster, "bf16", PipelineSpace(uneven=False))
    compared = 0
    for config in free.configurations():
        if config.pp == 1 or config.recompute != "none":
            continue
        ours, theirs = free.estimate(config), megatron.estimate(config)
        if theirs is not None:
            assert ours is not None and ours.step_s <= theirs.step_s * (1 + 1e-12)
            compared += 1
            if ours.step_s < theirs.step_s * (1 - 1e-9):
                assert ours.layers_per_stage != theirs.layers_per_stage
    assert compared > 20


def test_per_stage_recomputation_beats_recomputing_every_stage():
    """Between the memory that full recomputation needs and what none needs, the grid gives
    the first 1F1B stage (two micro-batches in flight) full recomputation and the last none;
    the simulator agrees it fits and is faster than recomputing everywhere."""
    graph, spec, name, cluster = prepare_model(gpt_spec(seq_len=1024), "dgx-a100-80g:2x2")
    config = Configuration(tp=1, pp=2, dp=2, micro_batch=4, micro_batches=4, schedule="1f1b", virtual_stages=1,
                           flavour="ddp", recompute="none")
    # What each mode needs with the layers split evenly (Megatron's split): balanced by time,
    # the roomy grid gives the loss's stage fewer layers and the first stage more than any
    # budget below needs, so its memory is no bound on what "none" needs.
    roomy = PipelineGrid(graph, cluster, "bf16", PipelineSpace(uneven=False))
    needs = {mode: roomy.estimate(dataclasses.replace(config, recompute=mode)).memory_bytes for mode in ("none", "full")}
    tight = with_device_memory(cluster, int(needs["full"] + 0.3 * (needs["none"] - needs["full"])))
    grid = PipelineGrid(graph, tight, "bf16", PipelineSpace())
    assert grid.estimate(config) is None
    full = grid.estimate(dataclasses.replace(config, recompute="full"))
    mixed = grid.estimate(dataclasses.replace(config, recompute=PER_STAGE))
    assert mixed.stage_recompute == ("full", "none") and mixed.step_s < full.step_s
    mixed_plan, full_plan = grid.plan(mixed, spec, name), grid.plan(full, spec, name)
    assert mixed_plan.recompute == "full" and mixed_plan.pipeline.stage_recompute == ("full", "none")
    assert mixed_plan.estimate.fits and mixed_plan.estimate.step_time_s < full_plan.estimate.step_time_s
    assert mixed.step_s == pytest.approx(mixed_plan.estimate.step_time_s, rel=0.05)
    # Stage 1 keeps every activation of its micro-batch: more than it would recomputing.
    assert mixed_plan.estimate.stage_memory[1].activations > full_plan.estimate.stage_memory[1].activations
    assert "per stage: full, none" in mixed_plan.report()
    # The Megatron-only space has no per-stage configurations.
    assert all(c.recompute != PER_STAGE for c in PipelineGrid(graph, tight, "bf16", PipelineSpace(per_stage_recompute=False)).configurations())
