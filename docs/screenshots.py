"""Screenshots of the HTML report for the README: ``python docs/screenshots.py PLAN.json``.

Writes the page for PLAN (simulated again for its timeline) and photographs it in headless
Chromium: ``docs/report_overview.png`` (verdict, details, the top of the strategy tree) and
``docs/report_charts.png`` (timeline, memory, the plans the search considered). The README's
pictures are of the quick start's plan (``python -m planner plan examples/llama.py --cluster
dgx-a100-80g:2 -o plan.json``).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.api import simulate  # noqa: E402
from planner.html_report import html_report  # noqa: E402
from planner.plans import load_plan  # noqa: E402
from tests.html_browser import browser_missing, opened_page  # noqa: E402


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python docs/screenshots.py PLAN.json")
    missing = browser_missing()
    if missing:
        raise SystemExit(f"error: {missing}")
    plan = load_plan(sys.argv[1])
    page_path = REPO / "docs" / "report_example.html"
    page_path.write_text(html_report(plan, timeline=simulate(plan).timeline))
    with opened_page(page_path, width=1280, height=1000) as (page, errors):
        if errors:
            raise SystemExit(f"error: the page logged console errors: {errors}")
        page.screenshot(path=str(REPO / "docs" / "report_overview.png"))
        charts = page.locator("#timeline")
        charts.scroll_into_view_if_needed()
        box_top = page.evaluate("document.querySelector('#timeline').getBoundingClientRect().top + window.scrollY")
        page.evaluate(f"window.scrollTo(0, {box_top} - 10)")
        page.screenshot(path=str(REPO / "docs" / "report_charts.png"))
    page_path.unlink()
    print("wrote docs/report_overview.png and docs/report_charts.png")


if __name__ == "__main__":
    main()
