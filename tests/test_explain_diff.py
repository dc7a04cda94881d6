"""``planner explain`` (why an op is placed so: each alternative's cost beside the choice) and
``planner diff`` (what differs between two plans and its predicted effect)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from torch.distributed.tensor import Replicate

from planner import baselines
from planner.api import prepare_model
from planner.cli import main
from planner.errors import ArgumentError
from planner.model_spec import ModelSpec
from planner.plan_diff import expert_differences, module_differences, plan_differences, render_diff
from planner.units import format_seconds
from search.explain import explain_ops, select_ops
from tests.moe_plans import moe_plan

REPO = Path(__file__).resolve().parents[1]
GPT = str(REPO / "examples" / "gpt.py")
SPEC = {"n_layer": 2, "n_embd": 64, "n_head": 4, "batch_size": 8}


@pytest.fixture(scope="module")
def data_parallel():
    return baselines.ddp(ModelSpec(GPT, SPEC), "cpu:1x4")


@pytest.fixture(scope="module")
def megatron():
    return baselines.megatron(ModelSpec(GPT, SPEC), "cpu:1x4", tp=2)


@pytest.fixture(scope="module")
def graph(data_parallel):
    return prepare_model(ModelSpec(GPT, SPEC), "cpu:1x4")[0]


def test_the_choice_is_listed_once_with_every_alternative_and_parts_that_add_up(data_parallel, graph):
    chosen = select_ops(data_parallel, module="blocks.0.mlp.c_fc")
    (explanation,) = explain_ops(data_parallel, graph, chosen)
    assert explanation.op == "aten.linear.default"
    assert sum(option.chosen for option in explanation.options) == 1
    assert len(explanation.options) >= 3  # batch split, replicated, and others the registry offers
    totals = [option.total_s for option in explanation.options]
    assert totals == sorted(totals)
    for option in explanation.options:
        assert option.total_s == pytest.approx(option.compute_s + option.communication_s + option.resharding_s)
    # DDP's choice: the batch split on dp, its neighbours split alike, so nothing to reshard.
    assert explanation.chosen.placement().startswith("(S(0)), (R), (R) -> (S(0))")
    assert explanation.chosen.resharding_s == 0.0


def test_the_replicated_alternative_loses_on_compute_by_the_data_parallel_degree(data_parallel, graph):
    """Run whole on each of the 4 ranks, the linear does 4x the work of its quarter batch: its
    compute is about 4x the choice's (the kernel model's efficiency varies a little with shape)."""
    (explanation,) = explain_ops(data_parallel, graph, select_ops(data_parallel, module="blocks.0.mlp.c_fc"))
    replicated = next(o for o in explanation.options if o.placement().startswith("(R), (R), (R) -> (R)"))
    assert 3.0 < replicated.compute_s / explanation.chosen.compute_s < 5.0
    assert replicated.resharding_s > 0  # its input gathered, its output sliced back
    verdict = explanation.verdict(replicated)
    assert verdict.startswith("slower by ")
    difference = replicated.total_s - explanation.chosen.total_s
    assert format_seconds(difference) in verdict


def test_an_alternative_that_overflows_the_device_says_so(data_parallel, graph):
    (explanation,) = explain_ops(data_parallel, graph, select_ops(data_parallel, module="blocks.0.mlp.c_fc"))
    tight = dataclasses.replace(explanation, spare_bytes=0.0)
    dearer = [o for o in tight.options if o.memory_bytes > tight.chosen.memory_bytes and not o.not_allowed]
    assert dearer
    assert all(tight.verdict(option).startswith("does not fit: needs ") for option in dearer)


def test_layer_and_op_selection_and_their_one_line_errors(megatron):
    layer_one = select_ops(megatron, layer=1)
    assert layer_one and all(".1." in s.module or s.module.endswith(".1") for s in layer_one)
    first = layer_one[0]
    assert select_ops(megatron, op=first.node) == [first]
    with pytest.raises(ArgumentError, match="no op named 'nope'"):
        select_ops(megatron, op="nope")
    with pytest.raises(ArgumentError, match="no module path with a layer index 7"):
        select_ops(megatron, layer=7)


def test_explain_on_the_command_line(megatron, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    path = tmp_path / "m.json"
    megatron.save(path)
    assert main(["explain", str(path), "--module", "blocks.0.attn"]) == 0
    out = capsys.readouterr().out
    assert "ops: the chosen placement against the best alternative" in out
    assert "chosen" in out and max(len(line) for line in out.splitlines()) <= 100
    assert main(["explain", str(path), "--module", "nowhere"]) == 2
    assert "no op under module 'nowhere'" in capsys.readouterr().err


def test_diff_names_the_settings_and_modules_that_differ_and_the_effect(data_parallel, megatron):
    settings = dict((what, (a, b)) for what, a, b in plan_differences(data_parallel, megatron))
    assert settings["mesh"] == ("dp=4", "dp=2 x tp=2")
    modules = {module for module, _, _ in module_differences(data_parallel, megatron)}
    assert "blocks.*.mlp.c_fc" in modules and "blocks.*.attn.c_proj" in modules
    text = render_diff(data_parallel, megatron, ("a.json", "b.json"), 120)
    step = megatron.estimate.step_time_s - data_parallel.estimate.step_time_s
    change = f"{'+' if step >= 0 else '-'}{format_seconds(abs(step))} ({step / data_parallel.estimate.step_time_s:+.1%})"
    assert change in text
    assert "bytes sent per device on 'tp'" in text
    assert max(len(line) for line in text.splitlines()) <= 120


def test_diff_of_a_plan_with_itself_says_the_layout_is_the_same(data_parallel):
    assert plan_differences(data_parallel, data_parallel) == []
    assert module_differences(data_parallel, data_parallel) == []
    assert "The plans run the same layout" in render_diff(data_parallel, data_parallel, ("a", "a"), 100)


def test_diff_shows_expert_layouts_and_warns_about_different_models(data_parallel):
    sliced, spread = moe_plan(4, "expert_sliced"), moe_plan(4, "expert_parallel", "round-robin")
    rows = expert_differences(sliced, spread)
    assert rows and all(a.startswith("expert_sliced") and b.startswith("expert_parallel") for _, a, b in rows)
    assert "warning: the plans are of different models" in render_diff(data_parallel, spread, ("a", "b"), 100)


def test_diff_on_the_command_line(data_parallel, megatron, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    data_parallel.save(tmp_path / "a.json")
    megatron.save(tmp_path / "b.json")
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "Predicted effect (B against A)" in out and "Placements that differ" in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_layouts_a_search_rule_keeps_out_are_shown_as_not_allowed(data_parallel, graph):
    """Weights not whole on dp per op are the ZeRO/FSDP flavours' business: listed, not offered."""
    (explanation,) = explain_ops(data_parallel, graph, select_ops(data_parallel, module="blocks.0.mlp.c_fc"))
    refused = [option for option in explanation.options if option.not_allowed]
    assert refused
    for option in refused:
        # dp is the only axis: a weight not whole (Replicate) there, sharded or partial.
        assert any(not isinstance(placements[0], Replicate) for placements in option.strategy.params.values())
        assert explanation.verdict(option).startswith("not allowed: weights split on dp")
    assert not explanation.chosen.not_allowed
