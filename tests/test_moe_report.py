"""The report's Mixture-of-Experts section (``planner/moe_report.py``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from planner.api import prepare_model
from planner.model_spec import ModelSpec
from planner.routing import zipf_layer
from planner.strategy import ExpertLayout, ExpertPlacement
from planner.moe_report import moe_notes, moe_table
from search.expert_placement import balanced, load_balance
from search.moe_search import moe_plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SPEC = ModelSpec(str(EXAMPLES / "moe.py"), {"n_expert": 8, "capacity_factor": 0})


def test_the_section_names_mode_capacity_all_to_all_placement_and_load_balance():
    graph, spec, name, cluster = prepare_model(SPEC, "cpu:1x4")
    loads = zipf_layer(8, 1.2, 2).token_share
    placement = balanced(loads, 4, 3)  # a slot to spare per device: hot experts get copies
    layouts = {
        "blocks.0.moe": ExpertLayout("blocks.0.moe", "expert_parallel", 8, 2, 0.0, placement=placement,
                                     routing="zipf:1.2 (test)", expert_loads=loads),
        "blocks.1.moe": ExpertLayout("blocks.1.moe", "expert_sliced", 8, 2, 0.0, routing="zipf:1.2 (test)",
                                     expert_loads=loads),
    }
    plan = moe_plan(graph, cluster, spec, name, layouts)
    report = plan.report()
    assert "Mixture-of-Experts layers (2) on 4 devices" in report
    assert "routing statistics: zipf:1.2 (test)" in " ".join(report.split())
    table = moe_table(plan)
    rows = list(zip(*(list(column.cells) for column in table.columns)))
    parallel, sliced = rows
    assert parallel[:4] == ("blocks.0.moe", "expert parallel", "dropless", "flat")
    assert sliced[:4] == ("blocks.1.moe", "experts sliced", "dropless", "-")
    copied = [expert for expert, copies in enumerate(placement.replicas) if len(copies) > 1]
    extra = sum(len(placement.replicas[expert]) - 1 for expert in copied)
    held = [len(placement.experts_on(device)) for device in range(4)]
    per_device = str(max(held)) if min(held) == max(held) else f"{min(held)}-{max(held)}"
    assert copied and parallel[4] == (
        f"balanced: {per_device} experts per device, {extra} extra copies of experts {', '.join(map(str, copied))}"
    )
    assert sliced[4] == "1/4 of every expert's FFN on each device"
    # Load balance of the busiest device, round-robin against the plan's placement.
    _, before = load_balance(ExpertPlacement.round_robin(8, 4), loads)
    _, after = load_balance(placement, loads)
    assert after < before
    assert parallel[5] == f"{before:.2f} -> {after:.2f}"
    assert sliced[5] == f"{before:.2f} -> 1.00"  # sliced experts are even whatever the routing


def test_text_from_a_plan_file_cannot_add_lines_to_the_report():
    graph, spec, name, cluster = prepare_model(SPEC, "cpu:1x4")
    layouts = {block.module: ExpertLayout(block.module, "data_parallel", 8, 2, 0.0) for block in graph.moe_blocks}
    plan = moe_plan(graph, cluster, spec, name, layouts)
    hostile = dataclasses.replace(plan, expert_layouts=tuple(
        dataclasses.replace(layout, module=layout.module + "\nFAKE LINE") for layout in plan.expert_layouts
    ))
    from planner.report import render_report

    report = render_report(dataclasses.replace(hostile, runners_up=()))
    assert not any(line.startswith("FAKE LINE") for line in report.splitlines())
    assert moe_table(hostile).row_count == 1 and moe_notes(hostile)


def test_the_verdict_names_the_dense_flavour_once_and_the_layer_modes():
    graph, spec, name, cluster = prepare_model(SPEC, "cpu:1x4")
    layouts = {block.module: ExpertLayout(block.module, "expert_sliced", 8, 2, 0.0) for block in graph.moe_blocks}
    plan = dataclasses.replace(moe_plan(graph, cluster, spec, name, layouts), dp_flavour="zero2")
    from planner.verdict import strategy_words

    words = strategy_words(plan)
    assert words.count("ZeRO-2") == 1 and "the 2 MoE layer(s) by layout: experts sliced" in words


def test_the_model_line_names_deepseeks_dense_and_moe_block_runs():
    """DeepSeek-V3's stack is two runs of blocks (``first_k_dense_replace`` dense layers, then
    MoE ones): the report's model line says so, and a plan file keeps it."""
    from moe_plans import HF_MOE
    from planner.plans import Plan
    from search.data_parallel import data_parallel_plan

    spec = ModelSpec("hf:deepseek_v3", {**HF_MOE["deepseek_v3"], "num_hidden_layers": 4, "first_k_dense_replace": 2})
    graph, spec, name, cluster = prepare_model(spec, "cpu:1x2")
    plan = data_parallel_plan(graph, cluster, spec, name, "ddp")
    runs = "repeated blocks: model.layers x4: 2 dense (0-1) + 2 MoE (2-3)"
    assert runs in " ".join(plan.report().split())
    assert Plan.from_dict(plan.to_dict()).summary.block_runs == plan.summary.block_runs
    # A plan written before the runs were recorded words its blocks per stack, as it did.
    older = dataclasses.replace(plan, summary=dataclasses.replace(plan.summary, block_runs=""))
    older_text = " ".join(older.report().split())
    assert "repeated blocks: model.layers x4 " in older_text and "model.layers x4:" not in older_text
    # One run, or runs of a model without MoE layers (told apart by structure only).
    assert prepare_model(SPEC, "cpu:1x2")[0].block_runs_text() == "blocks x2"
    dense = dataclasses.replace(graph, moe_blocks=())
    assert dense.block_runs_text() == "model.layers x4: 2 kind 0 (0-1) + 2 kind 1 (2-3)"
