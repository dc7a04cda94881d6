"""The self-contained HTML report (``planner report PLAN --html``): its data, its escaping,
and the page as headless Chromium renders it (no console errors, every section drawn,
hostile plan strings held as text, the filter and zoom working, a screenshot)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from cost_model.simulator import simulated
from planner import baselines
from planner.api import prepare_model
from planner.cli import main
from planner.html_report import html_report, report_page_data, timeline_data
from planner.model_spec import ModelSpec
from planner.strategy import TimelineEvent
from tests.html_browser import browser_missing, opened_page
from tests.moe_plans import moe_plan
from tests.summa_plans import summa_plan

REPO = Path(__file__).resolve().parents[1]
GPT = str(REPO / "examples" / "gpt.py")
HOSTILE = '</script><script>window.__owned = 1</script><img src=x onerror="window.__owned = 2">'


@pytest.fixture(scope="module")
def pipeline_plan():
    spec = ModelSpec(GPT, {"n_layer": 4, "batch_size": 16})
    return baselines.megatron(spec, "dgx-a100-80g:2x2", pp=2, micro_batch=2, dp_flavour="zero1")


@pytest.fixture(scope="module")
def hostile_plan(pipeline_plan):
    """The pipeline plan with a hostile module name and warning, as a shared file could hold."""
    strategies = list(pipeline_plan.strategies)
    strategies[3] = dataclasses.replace(strategies[3], module=HOSTILE)
    return dataclasses.replace(pipeline_plan, strategies=tuple(strategies), warnings=(HOSTILE,))


def _page_data(page_text: str) -> dict:
    block = re.search(r'<script type="application/json" id="plan-data">(.*?)</script>', page_text, re.S)
    return json.loads(block[1])


def test_exposed_communication_is_what_no_compute_covers():
    """Compute 0-1 s and 2-3 s; a collective 0.5-2.5 s: exposed 1-2 s, by hand."""
    events = [TimelineEvent("stage 0", "compute", "F0", 0.0, 1.0), TimelineEvent("stage 0", "compute", "B0", 2.0, 1.0),
              TimelineEvent("stage 0", "collective", "all-reduce", 0.5, 2.0)]
    data = timeline_data(events)
    assert data["exposed"] == {"stage 0": [[1.0, 1.0]]}
    assert data["end_s"] == 3.0
    assert [lane["stream"] for lane in data["lanes"]] == ["compute", "collective"]


def test_the_page_carries_the_plan_as_inert_json(hostile_plan):
    page = html_report(hostile_plan, timeline=hostile_plan.estimate.timeline)
    assert page.count("<script") == 2  # the data block and the page's own script, nothing injected
    assert HOSTILE not in page and "<img" not in page
    data = _page_data(page)
    assert data == json.loads(json.dumps(report_page_data(hostile_plan, timeline=hostile_plan.estimate.timeline)))
    assert any(row["module"] == HOSTILE for row in data["modules"])
    assert data["pipeline"]["stages"] == 2 and len(data["timeline"]["lanes"]) >= 2
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page  # offline


def test_report_html_on_the_command_line_refuses_a_users_file(pipeline_plan, tmp_path, capsys):
    plan_path = tmp_path / "p.json"
    pipeline_plan.save(plan_path)
    mine = tmp_path / "mine.html"
    mine.write_text("<html>my page</html>")
    assert main(["report", str(plan_path), "--html", str(mine)]) == 2
    assert "mine.html" in capsys.readouterr().err and mine.read_text() == "<html>my page</html>"
    assert main(["report", str(plan_path), "--html", str(tmp_path / "r.html")]) == 0
    assert "wrote the report page to" in capsys.readouterr().out
    assert main(["report", str(plan_path), "--html", str(tmp_path / "r.html")]) == 0  # ours: replaced
    assert main(["report", str(plan_path), "--measured", "m.json"]) == 2
    assert "add --html" in capsys.readouterr().err


needs_browser = pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))


@needs_browser
def test_every_section_renders_without_console_errors(pipeline_plan, tmp_path):
    path = tmp_path / "pipeline.html"
    path.write_text(html_report(pipeline_plan, timeline=pipeline_plan.estimate.timeline))
    with opened_page(path) as (page, errors):
        assert errors == []
        counts = {selector: page.locator(selector).count() for selector in (
            "section#verdict", "section#details", "#strategy details", "#strategy .op", "#timeline rect.event",
            "#memory rect.memory-part", "#candidates circle.candidate", "#pipeline tr", "#tables table")}
        assert counts["section#verdict"] == 1 and counts["section#details"] == 1
        assert counts["#strategy .op"] == len(pipeline_plan.strategies)
        assert counts["#timeline rect.event"] == len(pipeline_plan.estimate.timeline)
        assert counts["#memory rect.memory-part"] == 5 * 2  # five kinds, two stages
        assert counts["#candidates circle.candidate"] == (1 + len(pipeline_plan.runners_up) if pipeline_plan.runners_up else 0)
        assert counts["#pipeline tr"] == 1 + len({s.stage for s in pipeline_plan.strategies})
        assert counts["#tables table"] >= 2
        # The filter hides ops that do not match; zooming redraws the axis.
        page.fill("#strategy input.filter", "lm_head")
        shown = page.locator("#strategy .op:visible").count()
        assert 0 < shown < counts["#strategy .op"]
        before = page.locator("#timeline svg text").all_text_contents()
        page.click("text=zoom in")
        assert page.locator("#timeline svg text").all_text_contents() != before
        shot = page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
        assert len(shot) > 10_000
        assert errors == []


@needs_browser
def test_hostile_strings_stay_text_in_the_dom(hostile_plan, tmp_path):
    path = tmp_path / "hostile.html"
    path.write_text(html_report(hostile_plan, timeline=hostile_plan.estimate.timeline))
    with opened_page(path) as (page, errors):
        assert errors == []
        assert page.evaluate("window.__owned") is None
        assert page.locator("script").count() == 2 and page.locator("img").count() == 0
        assert HOSTILE in page.locator("div.warning").first.text_content()
        tree = page.locator("#strategy").text_content()
        assert all(part in tree for part in HOSTILE.split("."))  # the tree splits module paths at dots


@needs_browser
def test_moe_and_summa_sections_draw(tmp_path):
    moe = moe_plan(4, "expert_parallel", "skewed")
    summa = summa_plan(ModelSpec(GPT, {"n_layer": 2, "batch_size": 8}), "2.5d")
    summa = simulated(summa, prepare_model(summa.model, summa.cluster)[0])
    for name, plan, selector, expected in (
        ("moe", moe, "#moe rect.moe-load", 2 * 4 * len(moe.expert_layouts)),
        ("summa", summa, "#summa rect.summa-cell", summa.world_size),
    ):
        path = tmp_path / f"{name}.html"
        path.write_text(html_report(plan, timeline=plan.estimate.timeline))
        with opened_page(path) as (page, errors):
            assert errors == [], name
            assert page.locator(selector).count() == expected, name


def test_measured_parts_are_drawn_beside_the_prediction(tmp_path, capsys):
    """``report --measured m.json --html``: every compared part (op classes, collectives,
    the step) in the page's data with its prediction and measurement; drawn when a browser is
    here."""
    from cost_model.calibration import MEASURED_FORMAT, MEASURED_VERSION

    plan_path = tmp_path / "plan.json"
    assert main(["plan", str(REPO / "examples" / "mlp.py"), "--cluster", "cpu:1x2", "--dp", "ddp", "-o",
                 str(plan_path)]) == 0
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({
        "format": MEASURED_FORMAT, "version": MEASURED_VERSION, "plan": json.loads(plan_path.read_text()),
        "world_size": 2, "step_time_s": 0.01, "step_times_s": [0.01],
        "ops": {"aten.mm.default": {"count": 6, "time_s": 0.004, "flops": 1e6}},
        "collectives": [{"kind": "all_reduce", "bytes": 4096, "count": 1, "time_s": 0.001}],
    }))
    page = tmp_path / "r.html"
    capsys.readouterr()
    assert main(["report", str(plan_path), "--measured", str(measured), "--html", str(page)]) == 0
    parts = _page_data(page.read_text())["measured"]
    by_name = {part["name"]: part for part in parts}
    assert parts and all(part["predicted_s"] >= 0 for part in parts)
    assert any(part["measured_s"] == pytest.approx(0.01) for part in parts)  # the step
    assert any(part["measured_s"] == pytest.approx(0.001) for part in parts)  # the all-reduce
    if browser_missing() is None:
        with opened_page(page) as (browser_page, errors):
            assert errors == []
            assert browser_page.locator("#measured tr").count() == 1 + len(by_name)
