"""Pipeline stages of different widths (``planner.families.hetero_pipeline.widths``): the layouts,
a hand-worked case where a stage of 2 slow ranks beside one of 1 fast rank beats every layout of
one width, the search against every layout and every split, and the layouts priced on a cluster
(``candidates.width_estimates``)."""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys
from pathlib import Path

import pytest

import planner
from codegen.runtime.uneven_width_pipeline import stage_of_rank, unit_owner
from cost_model.simulator import simulated
from planner.api import prepare_model
from planner.constraints import SearchConstraints
from planner.errors import PlanFileError, PlannerError, PlanningError
from planner.families.hetero_pipeline.balance import stage_seconds
from planner.families.hetero_pipeline.candidates import hetero_pipeline_candidates, width_estimates
from planner.families.hetero_pipeline.section import HeteroStagesSection
from planner.families.hetero_pipeline.widths import (
    WidthLayout,
    best_layout,
    layout_step,
    least_step_split,
    width_layouts,
)
from planner.model_spec import ModelSpec
from planner.plans import load_plan
from search.budget import SearchBudget
from search.context import SearchContext

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hetero_pipeline import random_split_case  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_the_layouts_cut_each_group_into_equal_stages_in_every_order() -> None:
    # A group of 1 rank and one of 2: the 2 as one stage of 2 or two stages of 1, either first.
    assert set(width_layouts((1, 2), 8, micro_batch=2)) == {
        WidthLayout((0, 1), (1, 2)), WidthLayout((0, 1, 1), (1, 1, 1)),
        WidthLayout((1, 0), (2, 1)), WidthLayout((1, 1, 0), (1, 1, 1)),
    }
    # A micro-batch of 1 sample cannot be shared by a stage of 2 ranks.
    assert set(width_layouts((1, 2), 8, micro_batch=1)) == {WidthLayout((0, 1, 1), (1, 1, 1)),
                                                            WidthLayout((1, 1, 0), (1, 1, 1))}
    assert width_layouts((1, 2), 2, micro_batch=2) == [WidthLayout((0, 1), (1, 2)), WidthLayout((1, 0), (2, 1))]
    assert WidthLayout((0, 1), (1, 2)).uneven and not WidthLayout((0, 1, 1), (1, 1, 1)).uneven


def test_a_wide_slow_stage_beside_a_narrow_fast_one_beats_every_layout_of_one_width() -> None:
    # One fast rank (group 0, twice as fast) and two slow ranks (group 1); 4 blocks of 1 ms per
    # sample on a slow rank; micro-batches of M = 2 samples, m = 4 of them.
    # Seconds per block per micro-batch: fast, width 1: 2 samples / 2 = 1 ms; slow, width 2:
    # 1 sample each = 1 ms; slow, width 1: 2 ms.
    def rows(group, width):
        samples = 2 / width
        return [samples * 1e-3 / (2 if group == 0 else 1)] * 4, 0.0, 0.0

    # fast | slow x2: 2 blocks each, stages 2 and 2 ms: step = 4 + (4 - 1) * 2 = 10 ms.
    assert layout_step(WidthLayout((0, 1), (1, 2)), rows, 4).step_s == pytest.approx(10e-3)
    # fast | slow | slow, one width: blocks 2/1/1, stages 2, 2, 2 ms: 6 + 3 * 2 = 12 ms.
    even = layout_step(WidthLayout((0, 1, 1), (1, 1, 1)), rows, 4)
    assert even.blocks == (2, 1, 1) and even.step_s == pytest.approx(12e-3)
    best = best_layout(width_layouts((1, 2), 8, 2), rows, 4)
    assert best.layout == WidthLayout((0, 1), (1, 2)) and best.blocks == (2, 2)
    # What runs after the pipeline drains counts too: 3 ms more for the wide stage's layouts.
    def after(layout, counts):
        return 3e-3 if layout.uneven else 0.0

    assert best_layout(width_layouts((1, 2), 8, 2), rows, 4, after).layout == WidthLayout((0, 1, 1), (1, 1, 1))


def test_the_search_is_the_best_of_every_layout_and_every_split() -> None:
    generator = random.Random(27)
    for _ in range(60):
        sizes = tuple(generator.choice((1, 2, 4)) for _ in range(generator.randint(2, 3)))
        blocks = generator.randint(2, 6)
        micro_batches = generator.randint(1, 4)
        table = {}

        def rows(group, width, table=table, blocks=blocks):
            if (group, width) not in table:
                table[group, width] = ([generator.uniform(0.1, 3.0) for _ in range(blocks)],
                                       generator.uniform(0, 1), generator.uniform(0, 1))
            return table[group, width]

        layouts = width_layouts(sizes, 6, micro_batch=4)
        found = best_layout(layouts, rows, micro_batches)
        # Every layout, every split of the blocks: the least sum + (m - 1) * slowest.
        best = None
        for layout in layouts:
            stage_rows = [rows(g, w) for g, w in zip(layout.groups, layout.widths)]
            block_s, head, tail = [r[0] for r in stage_rows], stage_rows[0][1], stage_rows[-1][2]
            for cuts in itertools.combinations(range(1, blocks), len(layout.groups) - 1):
                bounds = (0, *cuts, blocks)
                seconds = stage_seconds(block_s, head, tail, tuple(b - a for a, b in zip(bounds, bounds[1:])))
                step = sum(seconds) + (micro_batches - 1) * max(seconds)
                best = step if best is None else min(best, step)
        if best is None:
            assert found is None
        else:
            assert found.step_s == pytest.approx(best)


def test_the_split_is_the_least_step_of_every_split_within_memory() -> None:
    generator = random.Random(7)
    for _ in range(200):
        block_s, head, tail, fits = random_split_case(generator)
        stages, blocks, m = len(block_s), len(block_s[0]), generator.randint(1, 6)
        best = None
        for cuts in itertools.combinations(range(1, blocks), stages - 1):
            bounds = (0, *cuts, blocks)
            counts = tuple(b - a for a, b in zip(bounds, bounds[1:]))
            if all(fits(s, bounds[s], bounds[s + 1]) for s in range(stages)):
                seconds = stage_seconds(block_s, head, tail, counts)
                step = sum(seconds) + (m - 1) * max(seconds)
                best = step if best is None else min(best, step)
        found = least_step_split(block_s, head, tail, m, fits)
        if best is None:
            assert found is None
            continue
        seconds = stage_seconds(block_s, head, tail, found)
        assert sum(seconds) + (m - 1) * max(seconds) == pytest.approx(best)


def test_layouts_priced_on_the_mixed_cluster() -> None:
    graph, _, _, cluster = prepare_model(ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8, "n_layer": 4}),
                                         str(REPO / "examples/clusters/mixed.toml"))
    found = width_estimates(graph, cluster, "fp32", SearchBudget())
    layouts = {estimate.step.layout for estimate in found}
    # Both kinds are priced: one width (2 + 2, or four stages of 1) and widths that differ
    # (the fast pair cut into two stages of 1 beside the slow pair as one stage of 2).
    assert WidthLayout((0, 1), (2, 2)) in layouts and WidthLayout((0, 0, 1), (1, 1, 2)) in layouts
    assert WidthLayout((0, 0, 1, 1), (1, 1, 1, 1)) in layouts
    for estimate in found:
        step = estimate.step
        assert sum(step.blocks) == 4 and min(step.blocks) >= 1
        assert step.step_s == pytest.approx(sum(step.stage_s) + (estimate.micro_batches - 1) * max(step.stage_s)
                                            + estimate.sync_s + estimate.hops_s)
        # A stage of one rank has no gradient to all-reduce; a layout of stages of one rank none.
        if set(step.layout.widths) == {1}:
            assert estimate.sync_s == 0.0
    assert found == sorted(found, key=lambda e: e.step_s)


def test_each_rank_of_a_stage_runs_its_contiguous_rows_of_every_micro_batch() -> None:
    # Widths 2, 1, 1 on ranks 0-1, 2, 3; lcm 2: a micro-batch is 2 units, 2 micro-batches 4 units.
    assert [stage_of_rank((2, 1, 1), rank) for rank in range(4)] == [(0, 0), (0, 1), (1, 0), (2, 0)]
    # Stage 0: rank 0 the first half of each micro-batch (units 0, 2), rank 1 the second (1, 3).
    assert [unit_owner((2, 1, 1), 0, unit) for unit in range(4)] == [0, 1, 0, 1]
    assert [unit_owner((2, 1, 1), 2, unit) for unit in range(4)] == [3, 3, 3, 3]
    # Widths 1, 3 (lcm 3): rank 0 runs all 3 units of a micro-batch, ranks 1-3 one each.
    assert [unit_owner((1, 3), 1, unit) for unit in range(6)] == [1, 2, 3, 1, 2, 3]
    # Widths 2, 3 (lcm 6): each of stage 0's ranks 3 units of 6, each of stage 1's 2.
    assert [unit_owner((2, 3), 0, unit) for unit in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [unit_owner((2, 3), 1, unit) for unit in range(6)] == [2, 2, 3, 3, 4, 4]


def node_group(name: str, devices: int, flops: float, memory_bandwidth: float) -> str:
    """One node group of a cluster file: ``devices`` CPU-class devices over gloo loopback."""
    return (f'[[nodes]]\ncount = 1\ndevices = {devices}\n[nodes.device]\nname = "{name}"\n'
            f"peak_flops = {{ float32 = {flops}, bfloat16 = {flops} }}\nmemory_bytes = 8589934592\n"
            f"memory_bandwidth = {memory_bandwidth}\n[nodes.intra_node]\nbandwidth = 2e9\nlatency = 50e-6\n")


# One rank 4x as fast as two slow ones (mixed.toml's figures, the fast one's doubled again).
ONE_FAST_TWO_SLOW = ('name = "one-fast-two-slow"\nbackend = "gloo"\n[inter_node]\nbandwidth = 2e9\nlatency = 50e-6\n'
                     + node_group("cpu-fast", 1, 200e9, 40e9) + node_group("cpu-slow", 2, 50e9, 10e9))


def test_the_search_keeps_stages_of_different_widths_when_they_win(tmp_path) -> None:
    """One rank 4x as fast as two slow ones: the slow pair as one stage of 2 beside the fast
    rank beats every layout of one width, so the family keeps it as a compilable plan (GPipe
    over units, the mesh pp over every rank, the widths in its section), its step put on the
    simulator's scale; the simulator itself refuses it in one line."""
    cluster_file = tmp_path / "one-fast-two-slow.toml"
    cluster_file.write_text(ONE_FAST_TWO_SLOW)
    gpt = ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8, "n_layer": 4})
    graph, spec, name, cluster = prepare_model(gpt, str(cluster_file))
    context = SearchContext(graph=graph, cluster=cluster, spec=spec, model_name=name, search="auto",
                            budget=SearchBudget(), seed=0, warnings=(), precision="fp32",
                            constraints=SearchConstraints(), routing=None, tp_layouts="auto", meshes=[])
    plans = [plan for plan in hetero_pipeline_candidates(context) if "hetero-pp" in plan.sections]
    even = [plan for plan in plans if not plan.sections["hetero-pp"].widths]
    uneven = [plan for plan in plans if plan.sections["hetero-pp"].widths]
    priced = width_estimates(graph, cluster, "fp32", SearchBudget())
    best_even = min(e.step_s for e in priced if not e.step.layout.uneven)
    winner = priced[0]
    # The slow pair before or after the fast rank: the two orders price within 0.01% of each
    # other here (the pipeline's fill and drain are the same), so either may lead.
    assert winner.step.layout in (WidthLayout((1, 0), (2, 1)), WidthLayout((0, 1), (1, 2)))
    assert winner.step_s < best_even
    plan = uneven[0]
    section = plan.sections["hetero-pp"]
    widths = winner.step.layout.widths
    assert section.widths == widths
    assert section.stage_devices == tuple(("cpu-fast", "cpu-slow")[group] for group in winner.step.layout.groups)
    first_ranks = list(range(widths[0]))
    assert section.blocks == winner.step.blocks
    assert [list(r) for r in section.stage_ranks(plan)] == [first_ranks, list(range(widths[0], 3))]
    # The step on the simulator's scale: the widths price x (best simulated / best priced of one width).
    scale = min(p.estimate.step_time_s for p in even) / best_even
    assert plan.estimate.step_time_s == pytest.approx(winner.step_s * scale)
    assert plan.estimate.step_time_s < min(p.estimate.step_time_s for p in even)
    assert plan.mesh.axes == (("pp", 3),) and plan.pipeline.schedule == "gpipe"
    assert plan.pipeline.micro_batches == winner.micro_batches * 2  # units: lcm(2, 1) per micro-batch
    assert {s.stage for s in plan.strategies} == {0, 1}
    # The plan file keeps the widths; bad widths are one line naming the field.
    plan.save(tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json").sections["hetero-pp"] == section
    for bad in ([2, 2], [0, 3], ["2", 1]):
        with pytest.raises(PlanFileError) as error:
            HeteroStagesSection.from_json({**section.to_json(), "widths": bad}, "p.json")
        assert "\n" not in str(error.value) and "hetero-pp.widths" in str(error.value)
    with pytest.raises(ValueError, match="give one width per stage"):
        dataclasses.replace(plan, sections={"hetero-pp": dataclasses.replace(section, widths=(3, 1))})
    with pytest.raises(PlanningError, match=f"different widths {widths[0]}/{widths[1]}; the simulator prices stages of one width only"):
        simulated(plan, graph)
    # What the runtime does not run is refused before compiling, in one line naming the fix.
    one_f_one_b = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, schedule="1f1b"))
    with pytest.raises(PlannerError, match="run GPipe with one virtual stage, not 1f1b with 1; plan it again$"):
        planner.compile(one_f_one_b, tmp_path / "out")
