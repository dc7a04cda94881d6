"""Delta re-simulation (``Simulator.replace`` / ``assign``) gives exactly what a fresh
simulation of the changed plan gives: node costs, rebuilt segments, step time and memory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

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
            simulation_cache.RECENTLY_COSTED.entries.clear()  # cost every node afresh
            fresh_plan = dataclasses.replace(plan, strategies=tuple(strategies[s.node] for s in plan.strategies))
            fresh = Simulator(fresh_plan, graph)
            expected = fresh.run(trace=False)
            assert [vars(s) for s in delta.segments()] == [vars(s) for s in fresh.segments()]
            assert result.step_time_s == expected.step_time_s
            assert result.memory == expected.memory
            assert result.communication_s == expected.communication_s
