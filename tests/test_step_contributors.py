"""Step contributors (``cost_model.step_contributor``): what a family adds to the simulated
step through the hooks reaches the schedule, the memory and the traffic, as a family author
relies on: a reduction task after each segment's backward that the optimizer step waits for,
a communication buffer, bytes on an axis, extra op time, and the sharding of the parameters
by the first contributor that owns them. The plan is a GPT on a ``rep x dp`` mesh, every
weight replicated over both axes (a second replica axis, as hybrid sharding has).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_model.contributor_registry import step_contributors
from cost_model.simulator import Simulator
from cost_model.step_contributor import ParameterSharding, StepContributor
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from planner.strategy import Mesh
from search.layouts import data_parallel_layout
from search.plan_builder import unsimulated_plan

GPT = str(Path(__file__).resolve().parent.parent / "examples" / "gpt.py")
GRADIENT_BYTES = 4  # fp32


class ReplicaSync(StepContributor):
    """The module docstring's example: all-reduce each segment's gradients over ``rep`` once
    the backward that reduces them has produced them."""

    def gradient_reduction(self, tasks, device, sync):
        if not sync or "rep" not in tasks.context.mesh.names:
            return None
        return _RepReduction(tasks, device)


class _RepReduction:
    def __init__(self, tasks, device):
        self.tasks, self.device = tasks, device

    def segment_done(self, segment, last, final, deferred, sync_after):
        grads = sum(segment.params.values()) * GRADIENT_BYTES
        seconds = self.tasks.context.collective("all_reduce", grads, "rep")
        sync_after.setdefault(self.device, []).append(self.tasks.graph.add(
            f"all-reduce grads over rep ({segment.name})", (self.device, "collective"), seconds, deps=[last],
            kind="comm"))


class Extras(StepContributor):
    """A fixed buffer, fixed bytes on ``rep`` per segment and fixed time on every linear."""

    BUFFER, SENT, LINEAR_S = 1000.0, 123.0, 1e-3

    def node_cost(self, context, node, strategy, cost):
        if node.op == "aten.linear.default":
            cost.forward_s += self.LINEAR_S

    def communication_buffer_bytes(self, context, segments, elements, weight_bytes, gradient_bytes):
        return self.BUFFER

    def add_axis_bytes(self, context, segment, totals):
        totals["rep"] = totals.get("rep", 0.0) + self.SENT


class HalfShards(StepContributor):
    def parameter_sharding(self, context):
        return ParameterSharding(weights=2, gradients=2, states=2)


@pytest.fixture(scope="module")
def plan_and_graph():
    spec = ModelSpec(GPT, {"n_layer": 2, "n_embd": 32, "n_head": 4, "seq_len": 16, "batch_size": 8, "vocab_size": 64})
    graph, spec, name, cluster = prepare_model(spec, "cpu:1x4")
    mesh = Mesh((("rep", 2), ("dp", 2)))
    strategies, inputs = data_parallel_layout(graph, mesh)
    return unsimulated_plan(graph, cluster, spec, name, mesh, strategies, inputs, dp_flavour="ddp"), graph


def _with(plan, *extra):
    return (*extra, *step_contributors(plan))


def test_a_contributors_reductions_follow_each_segments_backward_and_gate_the_optimizer(plan_and_graph):
    plan, graph = plan_and_graph
    default = Simulator(plan, graph).run()
    simulator = Simulator(plan, graph, contributors=_with(plan, ReplicaSync()))
    result = simulator.run()
    events = {event.name: event for event in result.timeline}
    syncs = [event for event in result.timeline if event.name.startswith("all-reduce grads over rep")]
    segments = simulator.segments()
    assert len(syncs) == len(segments) and not any("over rep" in event.name for event in default.timeline)
    for segment in segments:
        sync = events[f"all-reduce grads over rep ({segment.name})"]
        backward = events[f"B0 {segment.name}"]
        assert sync.stream == "collective"
        assert sync.start_s >= backward.start_s + backward.duration_s
        grads = sum(segment.params.values()) * GRADIENT_BYTES
        assert sync.duration_s == pytest.approx(simulator.context.collective("all_reduce", grads, "rep"))
        assert sync.duration_s > 0
    optimizer = events["optimizer step"]
    assert optimizer.start_s >= max(event.start_s + event.duration_s for event in syncs)
    assert result.step_time_s >= default.step_time_s


def test_a_contributors_buffers_bytes_and_op_time_are_counted(plan_and_graph):
    plan, graph = plan_and_graph
    default = Simulator(plan, graph).run()
    simulator = Simulator(plan, graph, contributors=_with(plan, Extras()))
    result = simulator.run()
    assert result.memory.communication_buffers == default.memory.communication_buffers + int(Extras.BUFFER)
    assert result.bytes_per_axis["rep"] == pytest.approx(Extras.SENT * len(simulator.segments()))
    linears = sum(1 for node in graph.nodes if node.op == "aten.linear.default")
    assert result.compute_s == pytest.approx(default.compute_s + linears * Extras.LINEAR_S, rel=1e-9)


def test_the_first_contributor_that_shards_the_parameters_owns_them(plan_and_graph):
    plan, graph = plan_and_graph
    default = Simulator(plan, graph).run().memory
    halved = Simulator(plan, graph, contributors=_with(plan, HalfShards())).run().memory
    assert halved.optimizer_states == pytest.approx(default.optimizer_states / 2, abs=1)
    assert halved.gradients == pytest.approx(default.gradients / 2, abs=1)
