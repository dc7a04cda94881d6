"""The report's MoE tables for a pipeline plan (``planner.pipeline_moe_report``): per layer and
per stage, the all-to-all time left on the critical path and the busiest device's load.

The plan is ``examples/moe.py`` (8 experts, 2 MoE blocks) on ``cpu:2x4`` with ``--mesh pp=2``,
experts round-robin over each stage's 4 dp ranks (tests/test_pipeline_moe.py's fixture)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from rich.console import Console

from cost_model.moe_layers import laid_out_layers
from cost_model.moe_overlap import block_compute_s, exposed_share, layer_passes
from cost_model.simulator import Simulator, simulated
from planner.api import prepare_model
from planner.pipeline_moe_report import stage_moe_summary, stage_moe_table
from planner.plans import Plan
from test_pipeline_moe import SPEC, moe_pipeline  # noqa: F401  (the fixture)


def rows(table) -> list[list[str]]:
    console = Console(width=250, record=True)
    console.print(table)
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in console.export_text().splitlines()
            if line.startswith("│")]


@pytest.fixture(scope="module")
def graph():
    return prepare_model(SPEC, "cpu:2x4")[0]


def test_each_layer_leaves_its_all_to_alls_exposed_without_overlap(moe_pipeline: Plan, graph) -> None:  # noqa: F811
    plan = moe_pipeline
    steps = plan.pipeline.micro_batches
    layers = laid_out_layers(plan, graph, steps)
    for layout in plan.expert_layouts:
        cost = layers[layout.module].cost
        # Nothing overlapped: dispatch + combine of both directions, every micro-batch.
        assert layout.exposed_all_to_all_s == pytest.approx((cost.forward_comm_s + cost.backward_comm_s) * steps)
    table = rows(stage_moe_summary(plan))
    # Stage 0 holds blocks.0.moe, stage 1 blocks.1.moe; 8 experts round-robin over 4 ranks:
    # the busiest holds 2 of 8 uniform experts, 25% of the choices, 1.00x an even share.
    assert [row[0] for row in table] == ["0", "1"] and [row[1] for row in table] == ["1", "1"]
    assert all(row[4] == "25.0% of expert work (1.00x even)" for row in table)
    per_layer = rows(stage_moe_table(plan))
    assert [row[5] for row in per_layer] == [row[3] for row in table]  # one layer per stage


def test_the_overlap_shrinks_the_stages_it_reaches(moe_pipeline: Plan, graph) -> None:  # noqa: F811
    overlapped = simulated(dataclasses.replace(moe_pipeline, moe_a2a_overlap=True), graph)
    simulator = Simulator(overlapped, graph)
    micro_batches = overlapped.pipeline.micro_batches
    # Megatron-Core's combined 1F1B pairs only the steady state's passes
    # (cost_model.moe_overlap.overlapped_pairs): with 2 stages of one chunk, stage 0 warms up
    # with (2 - 0 - 1) x 2 + 1 = 3 forwards, stage 1 with 1; the rest pair.
    assert micro_batches == 2
    paired = {"blocks.0.moe": max(0, micro_batches - 3), "blocks.1.moe": micro_batches - 1}
    for before, after in zip(moe_pipeline.expert_layouts, overlapped.expert_layouts):
        layer = simulator.context.moe_layers[after.module]
        forward, backward = layer_passes(layer, block_compute_s(simulator.context, layer))
        share = simulator.node_costs.a2a_exposed_share(layer)
        assert share == exposed_share(forward, backward, micro_batches, paired[after.module])
        # The share the simulator charged (tests/test_moe_overlap.py works one by hand).
        assert after.exposed_all_to_all_s == pytest.approx(before.exposed_all_to_all_s * share)
    first, second = overlapped.expert_layouts
    assert first.exposed_all_to_all_s == pytest.approx(moe_pipeline.expert_layouts[0].exposed_all_to_all_s)
    assert second.exposed_all_to_all_s < moe_pipeline.expert_layouts[1].exposed_all_to_all_s
    assert "under another micro-batch's compute" in stage_moe_summary(overlapped).title


def test_a_plan_file_without_the_figure_shows_a_dash(moe_pipeline: Plan) -> None:  # noqa: F811
    data = moe_pipeline.to_dict()
    for layout in data["expert_layouts"]:
        del layout["exposed_all_to_all_s"]
    old = Plan.from_dict(data)
    assert all(layout.exposed_all_to_all_s is None for layout in old.expert_layouts)
    assert [row[3] for row in rows(stage_moe_summary(old))] == ["-", "-"]


def test_the_figure_survives_the_plan_file_and_a_bad_one_is_named(moe_pipeline: Plan) -> None:  # noqa: F811
    from planner.errors import PlanFileError

    data = moe_pipeline.to_dict()
    again = Plan.from_dict(json.loads(json.dumps(data)))
    # Layouts compare without their annotations, so the figure is checked on its own.
    assert [layout.exposed_all_to_all_s for layout in again.expert_layouts] == \
        [layout.exposed_all_to_all_s for layout in moe_pipeline.expert_layouts]
    for bad in (-1.0, "fast", float("nan")):
        broken = json.loads(json.dumps(data))
        broken["expert_layouts"][0]["exposed_all_to_all_s"] = bad
        with pytest.raises(PlanFileError, match=r"expert_layouts\[0\]\.exposed_all_to_all_s' must be a number"):
            Plan.from_dict(broken)


def test_a_folded_plan_reports_its_degrees_and_each_devices_share_of_the_stage_group() -> None:
    """``examples/moe.py`` (8 experts) folded on pp2 x dp2 x tp2 (``cpu:2x4``): each stage's
    layer runs over its 4 dp x tp ranks. EP4 round-robin: 2 experts a rank, 2/8 = 25.0% of
    the expert work, 1.00x even. EP2 x EDP2: an EP rank holds 4 experts (50%), split over its
    2 copies: 25.0% a device, 1.00x even. EP4 with expert 0 hot (loads 0.3 and 0.1 for the
    seven others): rank 0 holds experts 0 and 4, 0.3 + 0.1 = 40.0%, 4 x 0.4 = 1.60x even."""
    from planner.strategy import Mesh
    from search.moe_folding import folded_plan
    from test_pipeline_moe import SPEC as spec

    graph, spec, name, cluster = prepare_model(spec, "cpu:2x4")
    mesh = Mesh((("pp", 2), ("dp", 2), ("tp", 2)))
    ep4 = folded_plan(graph, cluster, spec, name, mesh, 4, micro_batches=2)
    summary = rows(stage_moe_summary(ep4))
    assert [row[0] for row in summary] == ["0", "1"]
    assert all(row[2] == "expert parallel EP4 over dp*tp (round-robin, flat)" for row in summary)
    assert all(row[4] == "25.0% of expert work (1.00x even)" for row in summary)
    assert "each over its stage's 4 dp*tp ranks" in stage_moe_table(ep4).title
    copied = folded_plan(graph, cluster, spec, name, mesh, 2, micro_batches=2)
    assert all(row[2].startswith("expert parallel EP2 x EDP2 over dp*tp") and row[4] == "25.0% of expert work (1.00x even)"
               for row in rows(stage_moe_summary(copied)))
    hot = (0.3,) + (0.1,) * 7
    skewed = dataclasses.replace(ep4, expert_layouts=tuple(dataclasses.replace(layout, expert_loads=hot)
                                                           for layout in ep4.expert_layouts))
    assert all(row[4] == "40.0% of expert work (1.60x even)" for row in rows(stage_moe_summary(skewed)))
    assert all(row[6] == "40.0% of expert work" for row in rows(stage_moe_table(skewed)))
