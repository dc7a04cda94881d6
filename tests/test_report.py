"""The strategy report as a user reads it: a verdict first, what looks wrong, the warnings,
then the details; every line within a 100-column terminal.

Plans are built directly (``search.plan_builder`` + the simulator) where the report's
statement depends on the plan's shape, so each test controls what the report must say.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from torch.distributed.tensor import Replicate

import planner
from cost_model.simulator import simulated
from planner import baselines
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from planner.report import REPORT_WIDTH
from planner.strategy import Alternative, Mesh
from planner.units import format_bytes, format_seconds
from planner.verdict import CLOSE_CALL_MARGIN, close_calls, findings, plan_label, plan_route
from search.node_candidates import node_strategies
from search.plan_builder import unsimulated_plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GPT = str(EXAMPLES / "gpt.py")


def _replicated_plan(cluster: str, mesh: Mesh, **overrides):
    """A plan of the tiny GPT on ``mesh`` in which every op runs whole on every rank."""
    graph, spec, name, cluster = prepare_model(ModelSpec(GPT, overrides), cluster)
    strategies = tuple(node_strategies(graph, mesh)[node.name][0] for node in graph.nodes)  # all-replicate first
    inputs = {i.name: (None if i.meta is None else tuple(Replicate() for _ in mesh.names)) for i in graph.inputs}
    return simulated(unsimulated_plan(graph, cluster, spec, name, mesh, strategies, inputs, label="soap"), graph)


@pytest.fixture(scope="module")
def megatron_gpt3():
    """A GPT-3 1.3B-class Megatron plan on two DGX A100 nodes (built, not searched)."""
    spec = ModelSpec(GPT, {"n_layer": 24, "n_embd": 2048, "n_head": 16, "vocab_size": 50304, "seq_len": 2048, "batch_size": 32})
    return baselines.megatron(spec, "dgx-a100-80g:2", tp=8, precision="bf16")


def test_the_report_opens_with_a_verdict_paragraph(megatron_gpt3):
    report = megatron_gpt3.report()
    paragraphs = report.split("\n\n")
    assert paragraphs[0].startswith("soap-planner plan for ")
    verdict = paragraphs[1].replace("\n", " ")
    assert verdict.startswith("Chosen: Megatron-LM tensor parallelism on 16 GPUs (dp=2 x tp=8)")
    assert "bf16 mixed precision" in verdict
    estimate = megatron_gpt3.estimate
    assert f"MFU {estimate.mfu:.1%}" in verdict and "per step" in verdict and "to spare" in verdict
    # The details follow the verdict, not the other way round.
    assert report.index("Chosen:") < report.index("  mesh      ") < report.index("Memory per device")


def test_every_line_fits_a_100_column_terminal(megatron_gpt3):
    assert REPORT_WIDTH == 100
    for plan in (megatron_gpt3, _replicated_plan("dgx-a100-80g:2", Mesh((("dp", 2), ("tp", 8))))):
        lines = plan.report().splitlines()
        assert max(len(line) for line in lines) <= 100, max(lines, key=len)


def test_an_axis_on_which_every_op_is_replicated_is_flagged():
    plan = _replicated_plan("dgx-a100-80g:2", Mesh((("dp", 2), ("tp", 8))))
    notes = findings(plan)
    assert any("every op is replicated on mesh axis 'tp'" in note and "7 of every 8 devices" in note for note in notes)
    assert any("every op is replicated on mesh axis 'dp'" in note for note in notes)  # the inputs are whole there too
    assert "note: every op is replicated on mesh axis 'tp'" in plan.report().replace("\n  ", " ")


def test_a_plan_that_splits_every_axis_is_not_flagged(megatron_gpt3):
    assert not any("replicated on mesh axis" in note for note in findings(megatron_gpt3))


def test_a_data_parallel_plan_is_not_flagged_for_its_replicated_weights():
    plan = planner.plan(GPT, "cpu:1x2", search="dp", progress=False)
    assert plan.label == "" and not any("replicated on mesh axis" in note for note in findings(plan))


def test_a_model_far_too_small_for_its_cluster_is_flagged(megatron_gpt3):
    tiny = _replicated_plan("dgx-a100-80g:2", Mesh((("dp", 2), ("tp", 8))))
    assert tiny.estimate.mfu < 0.02
    assert any(note.startswith("the model is far too small for this cluster") for note in findings(tiny))
    # A 1.3B model on the same cluster keeps its 16 GPUs busy.
    assert megatron_gpt3.estimate.mfu > 0.2
    assert not any("far too small" in note for note in findings(megatron_gpt3))


def test_runners_up_within_the_close_call_margin_are_named(megatron_gpt3):
    step = megatron_gpt3.estimate.step_time_s
    runner = lambda name, ratio, fits=True: Alternative(name, step * ratio, 10**9, fits)  # noqa: E731
    plan = dataclasses.replace(megatron_gpt3, runners_up=(
        runner("far", 1.10), runner("near", 1.02), runner("nearest", 1.005), runner("near but too big", 1.01, fits=False),
        runner("just inside", 1 + 0.999 * CLOSE_CALL_MARGIN), runner("just outside", 1 + 1.001 * CLOSE_CALL_MARGIN),
    ))
    assert [alt.name for alt in close_calls(plan)] == ["nearest", "near", "just inside"]
    note = next(note for note in findings(plan) if note.startswith("close call"))
    assert note.startswith("close call: nearest (+0.5%), near (+2.0%), just inside (+3.0%) fit and are predicted "
                           "within 3% of this plan")
    assert "planner compare" in plan.report().replace("\n  ", " ")
    # Nothing close (or nothing that fits): no note.
    alone = dataclasses.replace(megatron_gpt3, runners_up=(runner("far", 1.10), runner("near but too big", 1.01, False)))
    assert not any(note.startswith("close call") for note in findings(alone))


def test_search_runners_up_include_the_best_data_parallel_plan_and_the_megatron_baseline():
    # The tiny Llama on 4 processes: Megatron's layout applies (its heads split over tp=2).
    plan = planner.plan(ModelSpec(str(EXAMPLES / "llama.py"), {"size": "tiny"}), "cpu:1x4", effort=0.25, progress=False)
    names = [alt.name for alt in plan.runners_up]
    assert any(name.startswith("baseline megatron") for name in names), names
    if plan.label:  # a searched plan won: the data-parallel flavours are still compared
        assert any(name.split(" ")[0] in ("ddp", "zero1", "zero2", "fsdp") for name in names), names
    assert "Megatron-LM baseline" in plan.report().replace("\n", " ")


def test_unknown_ops_are_plan_warnings_shown_once_in_the_report(tmp_path):
    # torch.cummax has no sharding rule: the plan says so, as a warning in the report.
    source = tmp_path / "cummax.py"
    source.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.linear = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return torch.cummax(self.linear(x), dim=1).values.mean()\n"
        "def build():\n"
        "    return M(), (torch.randn(4, 8),)\n"
    )
    plan = planner.plan(str(source), "cpu:1x2", search="dp", progress=False)
    warned = [w for w in plan.warnings if "no sharding rule" in w]
    assert len(warned) == 1 and "cummax.default (1 node)" in warned[0]
    assert plan.report().count("no sharding rule") == 1
    assert not any("search" in w and "mesh" in w for w in plan.warnings)  # the search summary is not a warning


def test_the_chosen_row_names_its_recomputation():
    graph, spec, name, cluster = prepare_model(ModelSpec(GPT, {}), "cpu:1x2")
    plan = planner.plan(ModelSpec(GPT, {}), "cpu:1x2", search="dp", progress=False)
    recomputing = simulated(dataclasses.replace(plan, recompute="full"), graph)
    from planner.report import render_report

    rows = render_report(recomputing, width=400).split("Why this plan: the runners-up")[1]  # a row a line
    first_row = next(line for line in rows.splitlines() if line.startswith("│"))  # the chosen plan (header rows: ┃)
    assert f"│ {plan.name}, recompute full (chosen) " in first_row, rows


def test_a_pipeline_plan_shows_its_stages_bubble_and_axes():
    spec = ModelSpec(GPT, {"n_layer": 8, "n_embd": 512, "n_head": 8, "vocab_size": 32768, "seq_len": 256, "batch_size": 32})
    plan = baselines.megatron(spec, "dgx-a100-80g:2x2", pp=2, micro_batch=2, schedule="interleaved", virtual_stages=2,
                              dp_flavour="zero1", layers_per_stage=[3, 2, 2, 1])
    report = plan.report()
    assert max(len(line) for line in report.splitlines()) <= REPORT_WIDTH
    assert "Pipeline: 2 stages, interleaved, 2 virtual stages per rank, 8 micro-batches, bubble" in report
    assert f"bubble {plan.estimate.bubble_fraction:.1%}" in report
    rows = [line for line in report.splitlines() if "blocks." in line and "|" in line]
    # Rank 0 holds virtual stages 0 and 2, rank 1 stages 1 and 3 (with the head).
    assert "blocks.0-2 + " in rows[0] and "| blocks.5-6" in rows[0]
    assert "blocks.3-4 | blocks.7 + " in rows[1] and "lm_head" in rows[1]
    assert "'dp' (2 ranks) runs ZeRO-1" in report.replace("\n  ", " ")


def test_the_verdict_names_a_pipeline_without_tensor_parallelism_and_its_flavour():
    spec = ModelSpec(GPT, {"n_layer": 4, "batch_size": 16})
    plan = baselines.megatron(spec, "dgx-a100-80g:2x2", pp=2, micro_batch=2, dp_flavour="zero1")
    verdict = plan.report().split("\n\n")[1].replace("\n", " ")
    assert verdict.startswith(
        "Chosen: Megatron-LM pipeline parallelism on 4 GPUs (pp=2 x dp=2), ZeRO-1 data parallelism on dp, "
        "2 pipeline stages (1f1b, 4 micro-batches)"
    )


def test_the_verdict_and_the_name_of_a_sequence_parallel_plan_say_so():
    spec = ModelSpec(GPT, {"n_layer": 2, "batch_size": 8})
    plain, sequence = (baselines.megatron(spec, "dgx-a100-80g:1x4", tp=4, sequence_parallel=sp) for sp in (False, True))
    verdict = " ".join(sequence.report().split("\n\n")[1].split())
    assert verdict.startswith("Chosen: Megatron-LM tensor parallelism with sequence parallelism on 4 GPUs (tp=4)")
    assert sequence.name == "megatron (tp=4; sequence parallel)"
    assert "sequence parallel" not in plain.name and "sequence parallel" not in plain.report()


def test_a_composed_plan_says_which_axis_runs_fsdp_and_which_tensor_parallelism():
    spec = ModelSpec(GPT, {"n_layer": 4, "batch_size": 16})
    plan = baselines.megatron(spec, "dgx-a100-80g:2x4", pp=2, tp=2, micro_batch=2, dp_flavour="fsdp", recompute="full")
    report = " ".join(plan.report().split())
    assert "'pp' (2 ranks) runs pipeline stages; 'dp' (2 ranks) runs FSDP (ZeRO-3); 'tp' (2 ranks) runs tensor" in report


# ------------------------------------------------------------------ runners-up by route


def _on_memory(plan, graph, capacity: int):
    """``plan`` simulated again on its cluster with ``capacity`` bytes per device."""
    cluster = plan.cluster
    tight = dataclasses.replace(
        cluster, nodes=tuple(dataclasses.replace(n, device=dataclasses.replace(n.device, memory_bytes=capacity)) for n in cluster.nodes)
    )
    return simulated(dataclasses.replace(plan, cluster=tight), graph)


def test_the_runners_up_keep_the_best_plan_of_every_route_whatever_its_rank():
    from search.data_parallel import data_parallel_plan
    from search.megatron import megatron_plan
    from search.runners_up import route_best, runners_up

    graph, spec, name, cluster = prepare_model(ModelSpec(str(EXAMPLES / "llama.py"), {"size": "tiny"}), "cpu:2x2")
    data_parallel = [data_parallel_plan(graph, cluster, spec, name, flavour) for flavour in ("ddp", "zero1")]
    megatron = [
        megatron_plan(graph, cluster, spec, name, tp=2, precision="fp32", dp_flavour=flavour) for flavour in ("ddp", "zero2")
    ] + [megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=1, precision="fp32")]
    mesh = Mesh((("dp", 2), ("tp", 2)))
    strategies = tuple(node_strategies(graph, mesh)[node.name][0] for node in graph.nodes)  # all-replicate
    inputs = {i.name: (None if i.meta is None else (Replicate(), Replicate())) for i in graph.inputs}
    searched = [simulated(unsimulated_plan(graph, cluster, spec, name, mesh, strategies, inputs, label="soap"), graph)]
    # A device between the lightest data-parallel plan and the lightest Megatron plan: the
    # data-parallel family fits nowhere, so its best is the one nearest to fitting.
    lightest_dp = min(p.estimate.memory.total for p in data_parallel)
    lightest_megatron = min(p.estimate.memory.total for p in megatron)
    assert lightest_megatron < lightest_dp
    capacity = (lightest_megatron + lightest_dp) // 2
    plans = [_on_memory(p, graph, capacity) for p in (*data_parallel, *megatron, *searched)]
    families = {plan_route(p) for p in plans}
    assert families == {"data parallel", "Megatron grid", "searched, no pipeline"}
    best = min((p for p in plans if p.estimate.fits), key=lambda p: p.estimate.step_time_s)
    assert plan_route(best) == "Megatron grid"
    # One row by rank only: the families' best must come in on their own.
    alternatives = runners_up(best, plans, [], count=1)
    fastest_other = min((p for p in plans if p is not best), key=lambda p: p.estimate.step_time_s)
    assert alternatives[0].name == plan_label(fastest_other)
    by_name = {alt.name: alt for alt in alternatives}
    for family in families - {plan_route(best)}:
        members = [p for p in plans if plan_route(p) == family]
        leader = route_best(members)
        alt = by_name[plan_label(leader)]
        assert alt.route == family
        assert (alt.step_time_s, alt.memory_bytes, alt.fits) == (
            leader.estimate.step_time_s, leader.estimate.memory.total, leader.estimate.fits
        )
        assert alt.mfu == leader.estimate.mfu > 0
        if leader.estimate.fits:
            assert alt.note.startswith("+") and "step time" in alt.note, alt.note
        else:
            assert alt.note.startswith("does not fit: needs "), alt.note
    dp_leader = by_name[plan_label(route_best([p for p in plans if plan_route(p) == "data parallel"]))]
    assert not dp_leader.fits and dp_leader.memory_bytes == min(p.estimate.memory.total for p in plans[:2])
    assert len(alternatives) == 1 + len({plan_label(route_best([p for p in plans if plan_route(p) == f]))
                                         for f in families - {plan_route(best)}} - {alternatives[0].name})


def test_a_searched_plan_reports_the_best_of_each_route_with_mfu_and_memory():
    from planner.report import render_report

    # Two nodes: the pipeline grid is searched beside the data-parallel flavours and the
    # per-op search, so the three families are all considered.
    plan = planner.plan(ModelSpec(str(EXAMPLES / "llama.py"), {"size": "tiny"}), "cpu:2x2", effort=0.25, progress=False)
    families = {alt.route for alt in plan.runners_up} | {plan_route(plan)}
    assert {"data parallel", "Megatron grid", "searched, no pipeline"} <= families, families
    assert max(len(line) for line in plan.report().splitlines()) <= REPORT_WIDTH
    # Wide enough that every row is one line: plan | found by | step time | MFU | memory | fits | note.
    table = render_report(plan, width=400).split("Why this plan: the runners-up")[1]
    cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in table.splitlines() if line.startswith("│")]
    assert cells[0][:2] == [f"{plan_label(plan)} (chosen)", f"{plan_route(plan)} *"]
    assert cells[0][3] == f"{plan.estimate.mfu:.1%}"
    rows = cells[1:]
    assert [row[0] for row in rows] == [alt.name for alt in plan.runners_up]
    for row, alt in zip(rows, plan.runners_up):
        assert row[1].removesuffix(" *") == alt.route
        assert row[2:] == [format_seconds(alt.step_time_s), f"{alt.mfu:.1%}", format_bytes(alt.memory_bytes),
                           "yes" if alt.fits else "no", alt.note]
    # One row starred per family other than the chosen plan's: its fastest that fits.
    for family in families - {plan_route(plan)}:
        members = [(row, alt) for row, alt in zip(rows, plan.runners_up) if alt.route == family]
        marked = [alt for row, alt in members if row[1] == f"{family} *"]
        fitting = [alt for _, alt in members if alt.fits]
        assert len(marked) == 1 and (not fitting or marked[0].step_time_s == min(a.step_time_s for a in fitting))
