"""The registry remembers each op's candidates by what its rule reads (``rule_inputs``).

A whole-model walk meets the same op on the same shapes once per repeated block; the
registry answers those from memory. That is only right if every rule is a pure function of
the remembered fields, so the tests ask each rule again, directly, for nodes that agree on
those fields and differ in everything else (name, tensor names, parameters, module), and
check that a rule registered later is not hidden behind a remembered answer.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Shard

from planner.graph import OpNode, TensorMeta
from planner.model_spec import ModelSpec
from planner.trace import trace
from search.rules import AxisCandidate, axis_candidates, register_rule, replicated, rule_for
from search.rules import registry
from search.rules.registry import rule_inputs

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def graphs():
    found = {}
    for name, (source, overrides) in {
        "gpt": (str(EXAMPLES / "gpt.py"), {}),
        "llama": (str(EXAMPLES / "llama.py"), {"size": "tiny"}),
    }.items():
        model, args, kwargs = ModelSpec(source, overrides).build("meta")
        found[name] = trace(model, args, kwargs)
    return found


def _renamed(node: OpNode) -> OpNode:
    """``node`` with everything a rule must not read changed."""
    return dataclasses.replace(
        node,
        name=f"{node.name}_elsewhere",
        inputs=tuple(f"other_{name}" for name in node.inputs),
        params=tuple(f"other.{name}" for name in node.params),
        param_inputs=tuple(f"other_{name}" for name in node.param_inputs),
        module=f"elsewhere.{node.module}",
        block=None,
        flops=node.flops + 1,
    )


def _asked_directly(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """What the rule itself answers for ``node``, bypassing the remembered answers."""
    found = [replicated(node)]
    rule = rule_for(node.op)
    if rule is not None:
        for candidate in rule(node, axis_size):
            if candidate not in found:
                found.append(candidate)
    return found


@pytest.mark.parametrize("axis_size", [2, 3])
def test_remembered_answers_are_what_each_rule_gives_a_node_that_differs_only_in_names(graphs, axis_size):
    for graph in graphs.values():
        for node in graph.nodes:
            remembered = axis_candidates(node, axis_size)
            other = _renamed(node)
            assert rule_inputs(other, axis_size) == rule_inputs(node, axis_size)
            assert axis_candidates(other, axis_size) == remembered
            assert _asked_directly(other, axis_size) == remembered, f"{node.op} ({node.name}) reads a name or parameter"


def test_a_different_shape_or_axis_size_is_asked_anew(graphs):
    linear = next(n for n in graphs["gpt"].nodes if n.op == "aten.linear.default" and len(n.inputs) == 3)
    batch = linear.input_meta[0].shape[0]
    assert any(c.inputs[0] == Shard(0) for c in axis_candidates(linear, batch))
    # A batch of 1 cannot be split: the batch-split candidate must not come from memory.
    single = dataclasses.replace(
        linear,
        input_meta=(TensorMeta((1, *linear.input_meta[0].shape[1:]), linear.input_meta[0].dtype), *linear.input_meta[1:]),
        output_meta=(TensorMeta((1, *linear.output_meta[0].shape[1:]), linear.output_meta[0].dtype),),
    )
    assert not any(c.inputs[0] == Shard(0) for c in axis_candidates(single, batch))
    assert axis_candidates(linear, 1) == [replicated(linear)]


def test_a_rule_registered_after_an_op_was_asked_about_is_used():
    op = f"test.remembered_{uuid.uuid4().hex}.default"
    meta = TensorMeta((4, 4), torch.float32)
    node = OpNode(name="x", op=op, inputs=("a",), input_meta=(meta,), output_meta=(meta,))
    assert axis_candidates(node, 2) == [replicated(node)]  # no rule yet: replicated only
    split = AxisCandidate((Shard(0),), (Shard(0),))
    register_rule(op)(lambda node, axis_size: [split])
    assert axis_candidates(node, 2) == [replicated(node), split]


def test_a_whole_model_is_answered_from_memory_the_second_time(graphs, monkeypatch):
    """Each node of the tiny Llama asked twice: the first pass computes each distinct op once
    (repeated blocks share answers), the second computes nothing it could remember (counted
    calls of the rules, not seconds: the machine's load cannot fail it)."""
    fresh = graphs["llama"].nodes  # no other test asks about an axis of 5 ranks
    computed = []
    compute = registry._computed_candidates
    monkeypatch.setattr(registry, "_computed_candidates", lambda node, size: computed.append(node.name) or compute(node, size))
    keys = [rule_inputs(n, 5) for n in fresh]
    unkeyed = sum(key is None for key in keys)
    first = [axis_candidates(n, 5) for n in fresh]
    first_computed = len(computed)
    second = [axis_candidates(n, 5) for n in fresh]
    assert first == second
    assert first_computed == len({key for key in keys if key is not None}) + unkeyed < len(fresh)
    assert len(computed) - first_computed == unkeyed


def test_arguments_equal_as_python_keys_but_of_other_types_are_asked_apart():
    """``1``, ``1.0`` and ``True`` (and a list and a tuple) are one dict key in Python; an op
    may read them differently (a dim against a flag), so they must not share an answer."""
    meta = TensorMeta((4, 4), torch.float32)
    node = OpNode(name="x", op="aten.sum.dim_IntList", inputs=("a",), input_meta=(meta,), output_meta=(meta,))
    keys = {
        rule_inputs(dataclasses.replace(node, attrs=(None, value)), 2)
        for value in (1, 1.0, True, [1], (1,))
    }
    assert len(keys) == 5
