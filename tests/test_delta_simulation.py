"""Delta re-simulation (``Simulator.replace`` / ``assign``) gives exactly what a fresh
simulation of the changed plan gives: node costs, rebuilt segments, step time and memory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from torch.distributed.tensor import Replicate

from cost_model import simulation_cache
from cost_model.simulator import Simulator
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan

GPT = str(Path(__file__).resolve().parent.parent / "examples" / "gpt.py")


def test_delta_matches_a_fresh_simulation_after_each_move():
    spec = ModelSpec(GPT, {"n_layer": 2, "n_embd": 128, "n_head": 4, "seq_len": 64, "vocab_size": 64, "batch_size": 8})
    graph, spec, name, cluster = prepare_model(spec, "dgx-a100-80g:1")
    plan = megatron_plan(graph, cluster, spec, name, tp=4, pp=2, micro_batch=2)
    delta = Simulator(plan, graph)
    delta.run()
    strategies = {s.node: s for s in plan.strategies}
    linears = [s for s in plan.strategies if s.op.startswith("aten.linear")]
    assert len(linears) >= 4
    for original in linears[:3]:
        gathered = dataclasses.replace(original, inputs=tuple(tuple(Replicate() for _ in p) for p in original.inputs))
        for strategy in (gathered, original, gathered):
            strategies[strategy.node] = strategy
            result = delta.replace(strategy.node, strategy)
            simulation_cache.RECENTLY_COSTED.clear()  # cost every node afresh
            fresh_plan = dataclasses.replace(plan, strategies=tuple(strategies[s.node] for s in plan.strategies))
            fresh = Simulator(fresh_plan, graph)
            expected = fresh.run(trace=False)
            assert [vars(s) for s in delta.segments()] == [vars(s) for s in fresh.segments()]
            assert result.step_time_s == expected.step_time_s
            assert result.memory == expected.memory
            assert result.communication_s == expected.communication_s


def _forget_costed_plans() -> None:
    simulation_cache.RECENTLY_COSTED.clear()


def test_a_plan_with_other_moe_layouts_simulates_as_a_fresh_one(monkeypatch):
    """The MoE search simulates one dense plan with many layouts in a row; each after the
    first re-costs only the MoE layers whose layout changed (``Simulator`` adopts the last
    such plan's costs). Every result must equal a simulation from scratch, in any order."""
    from planner.routing import RoutingStats
    from search.moe_search import choose_layouts, moe_base_plan

    spec = ModelSpec(str(Path(__file__).resolve().parent.parent / "examples" / "moe.py"), {"n_layer": 3, "n_expert": 8})
    graph, spec, name, cluster = prepare_model(spec, "cpu:2x4")
    scored = choose_layouts(graph, cluster, RoutingStats(), "fp32")
    base = moe_base_plan(graph, cluster, spec, name)
    modules = [block.module for block in graph.moe_blocks]
    last = len(scored[modules[0]]) - 1
    assert last >= 3  # data parallel, sliced, expert parallel placements

    def plan_of(picks):
        return dataclasses.replace(base, expert_layouts=tuple(scored[m][i].layout for m, i in zip(modules, picks)))

    order = [(0, 0, 0), (1, 0, 0), (1, 2, 0), (last, 1, 2), (0, 0, 0)]
    _forget_costed_plans()
    from cost_model.node_costs import NodeCosts

    whole = []
    cost_all = NodeCosts.cost_all
    monkeypatch.setattr(NodeCosts, "cost_all", lambda self: (whole.append(1), cost_all(self))[1])
    in_a_row = [Simulator(plan_of(picks), graph).run(trace=False) for picks in order]
    assert len(whole) == 1  # the first plan costs every node; the others only their changed layers
    alone = []
    for picks in order:
        _forget_costed_plans()
        alone.append(Simulator(plan_of(picks), graph).run(trace=False))
    assert in_a_row == alone
    assert len({result.step_time_s for result in alone}) >= 3  # the layouts do change the step


def _pipeline_candidates(graph, plan) -> dict[str, list]:
    """Each node's candidates on the plan's pp x tp mesh (``node_strategies``) that split
    nothing over ``pp`` (the pipeline axis holds stages, not shards), on the node's stage."""
    from search.node_candidates import node_strategies

    pp = plan.mesh.names.index("pp")
    stage = {s.node: s.stage for s in plan.strategies}

    def unsplit(strategy) -> bool:
        placements = (*strategy.inputs, *strategy.outputs, *strategy.params.values())
        return all(isinstance(p[pp], Replicate) for p in placements if p is not None)

    return {node: [s.replaced(stage=stage[node]) for s in found if unsplit(s)]
            for node, found in node_strategies(graph, plan.mesh).items()}


@pytest.mark.parametrize("pipeline", [False, True], ids=["dp2-tp2", "pp2-tp2"])
def test_random_single_op_changes_simulate_as_a_fresh_plan(pipeline):
    """MCMC's moves: a random node takes a random one of its candidate strategies (search's
    ``node_strategies``), one after another, on a dp x tp mesh and on a 1F1B pipeline of two
    stages (whose boundaries' bytes a delta re-simulation keeps while no output placement
    changes). After every move the delta re-simulation's whole estimate (step, compute,
    communication, memory per stage, bytes per axis, bubble) equals, to the bit, a
    simulation of the moved plan from an empty node-cost cache; on a GPU preset, so the
    schedule is re-run with the measured overlap contention. Every third move is of a node
    another segment reads (on the pipeline, one another stage reads), moved to another output
    placement where it has one."""
    import random

    from cost_model.segments import segment_members
    from planner.strategy import Mesh
    from search.layouts import data_parallel_layout
    from search.node_candidates import node_strategies
    from search.plan_builder import unsimulated_plan

    spec = ModelSpec(GPT, {"n_layer": 2, "n_embd": 512, "n_head": 4, "seq_len": 256, "vocab_size": 512, "batch_size": 8})
    graph, spec, name, cluster = prepare_model(spec, "dgx-a100-80g:1x4")
    if pipeline:
        plan = megatron_plan(graph, cluster, spec, name, tp=2, pp=2, micro_batch=2)
        candidates = _pipeline_candidates(graph, plan)
    else:
        mesh = Mesh((("dp", 2), ("tp", 2)))
        strategies, inputs = data_parallel_layout(graph, mesh)
        plan = unsimulated_plan(graph, cluster, spec, name, mesh, strategies, inputs)
        candidates = node_strategies(graph, mesh)
    options = {node: found for node, found in candidates.items() if len(found) > 1}
    current = {s.node: s for s in plan.strategies}
    _forget_costed_plans()
    delta = Simulator(plan, graph)
    delta.run(trace=False)
    # Every third move is of a node another segment reads (a block's output): its segment's
    # readers take their input bytes from it and are rebuilt too.
    layout = segment_members(graph)
    boundary = sorted(node for node in options
                      if any(layout.segment_of[reader] != layout.segment_of[node] for reader in delta.context.consumers.get(node, ())))
    assert boundary
    if pipeline:  # there, the nodes whose outputs cross from stage 0 to stage 1
        stage = {s.node: s.stage for s in plan.strategies}
        boundary = [node for node in boundary
                    if any(stage[reader] != stage[node] for reader in delta.context.consumers.get(node, ()))] or boundary
    rng = random.Random(25)
    seen = set()
    for move in range(12):
        node = rng.choice(boundary if move % 3 == 2 else sorted(options))
        # A boundary node's move changes what it hands on (its output placement) where it can.
        moved = [s for s in options[node] if s.outputs != current[node].outputs] if move % 3 == 2 else []
        current[node] = rng.choice(moved or options[node])
        result = delta.replace(node, current[node])
        _forget_costed_plans()
        fresh = Simulator(dataclasses.replace(plan, strategies=tuple(current[s.node] for s in plan.strategies)), graph)
        assert result == fresh.run(trace=False)
        assert [vars(s) for s in delta.segments()] == [vars(s) for s in fresh.segments()]
        seen.add((result.step_time_s, result.communication_s, result.memory.total, result.bytes_per_axis.get("pp")))
    assert len(seen) >= 6  # the moves do change the estimate
    if pipeline:  # and, once at least, what crosses the stage boundary
        assert len({pp_bytes for *_, pp_bytes in seen}) >= 2
