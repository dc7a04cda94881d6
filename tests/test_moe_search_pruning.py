"""The MoE search's pruning by bounds: a candidate whose step lower bound
(``Simulator.step_lower_bound``) cannot beat the best fitting plan found is not scheduled.
The pruned search must return exactly the plan the unpruned one returns."""

from __future__ import annotations

from pathlib import Path

import pytest

import search.moe_search as moe_search
from cost_model.simulator import Simulator
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from planner.routing import RoutingStats, synthetic
from moe_plans import HF_MOE

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Small models the MoE family plans (routing, experts and clusters varied so the searches differ).
CASES = {
    "moe.py, 4 experts, cpu:1x4": (ModelSpec(str(EXAMPLES / "moe.py"), {}), "cpu:1x4", None),
    "moe.py, 8 experts, zipf, cpu:2x4": (
        ModelSpec(str(EXAMPLES / "moe.py"), {"n_expert": 8, "ffn": 256, "batch_size": 16, "n_layer": 3}), "cpu:2x4",
        "zipf:1.2"),
    "hf:mixtral tiny, cpu:1x4": (ModelSpec("hf:mixtral", HF_MOE["mixtral"]), "cpu:1x4", None),
    "hf:qwen2_moe tiny, cpu:1x2": (ModelSpec("hf:qwen2_moe", HF_MOE["qwen2_moe"]), "cpu:1x2", None),
}


def _routing(graph, name: str | None) -> RoutingStats:
    if name is None:
        return RoutingStats()
    return synthetic(name, {block.module: (block.experts, block.top_k) for block in graph.moe_blocks})


def _searched(case: str, prune: bool, monkeypatch) -> tuple:
    """(plan, fixed plans, schedules run) of the MoE search on ``CASES[case]``, pruning or not."""
    spec, cluster_name, routing_name = CASES[case]
    graph, spec, name, cluster = prepare_model(spec, cluster_name)
    scheduled = []
    run = Simulator.run
    monkeypatch.setattr(Simulator, "run", lambda self, trace=True: (scheduled.append(1), run(self, trace))[1])
    monkeypatch.setattr(moe_search, "PRUNE", prune)
    plan, fixed = moe_search.search_moe_plan(graph, cluster, spec, name, _routing(graph, routing_name))
    monkeypatch.setattr(Simulator, "run", run)
    return plan, fixed, len(scheduled)


@pytest.mark.parametrize("case", sorted(CASES))
def test_pruned_search_returns_the_unpruned_plan(case, monkeypatch):
    plan, fixed, unpruned_runs = _searched(case, False, monkeypatch)
    pruned_plan, pruned_fixed, pruned_runs = _searched(case, True, monkeypatch)
    assert pruned_plan.expert_layouts == plan.expert_layouts
    assert (pruned_plan.dp_flavour, pruned_plan.recompute, pruned_plan.accumulation_steps) == (
        plan.dp_flavour, plan.recompute, plan.accumulation_steps)
    assert pruned_plan.estimate == plan.estimate
    assert [p.expert_layouts for p in pruned_fixed] == [p.expert_layouts for p in fixed]
    assert pruned_runs <= unpruned_runs


def test_pruning_skips_schedules_on_a_model_with_many_candidates(monkeypatch):
    """Eight experts over 8 devices of 2 nodes under skewed routing: data parallel, sliced,
    and several expert-parallel placements and all-to-alls per layer class; most cannot beat
    the best plan once it is found, and are not scheduled."""
    case = "moe.py, 8 experts, zipf, cpu:2x4"
    assert _searched(case, True, monkeypatch)[2] < _searched(case, False, monkeypatch)[2]


def test_step_lower_bound_is_below_every_simulated_step():
    """The bound pruning relies on, checked on every candidate of a small search."""
    spec, cluster_name, routing_name = CASES["moe.py, 8 experts, zipf, cpu:2x4"]
    graph, spec, name, cluster = prepare_model(spec, cluster_name)
    scored = moe_search.choose_layouts(graph, cluster, _routing(graph, routing_name), "fp32")
    base = moe_search.moe_base_plan(graph, cluster, spec, name)
    import dataclasses

    for flavour, steps in (("ddp", 1), ("fsdp", 2)):
        dense = dataclasses.replace(base, dp_flavour=flavour, accumulation_steps=steps)
        for index in range(len(scored[graph.moe_blocks[0].module])):
            layouts = tuple(scored[b.module][min(index, len(scored[b.module]) - 1)].layout for b in graph.moe_blocks)
            simulator = Simulator(dataclasses.replace(dense, expert_layouts=layouts), graph)
            bound = simulator.step_lower_bound()
            assert 0 < bound <= simulator.run(trace=False).step_time_s
