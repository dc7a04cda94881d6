"""Text from files is inert in a terminal: whatever a plan, cluster or measured file says, what
``planner`` prints holds no character a terminal acts on (ESC sequences that clear the
screen, set the title or hide an OSC 8 link; carriage returns; BEL; bidirectional
overrides) and no rich markup or emoji code is interpreted: ``[link=...]`` and ``[bold]``
are printed as they are written.

Each test puts hostile strings into a real file's text fields and runs the command that
prints them, through ``planner.cli.main``; a control (the same strings printed raw) shows
the check catches them.
"""

from __future__ import annotations

import json

import pytest

from cost_model.calibration import MEASURED_FORMAT, MEASURED_VERSION
from file_samples import MLP, run_cli, write_real_plan
from planner.plans import load_plan
from planner.terminal import inert, inert_line
from user_errors import assert_one_error_line

CLEAR_AND_LIE = "\x1b[2J\x1b[Hall good"
TITLE = "\x1b]0;pwned\x07"
HIDDEN_LINK = "\x1b]8;;file:///etc/passwd\x1b\\click\x1b]8;;\x1b\\"
OVERWRITE = "fails\rworks"
BIDI = "txt.\u202eexe"
MARKUP = "[link=file:///etc/passwd]docs[/link] [bold red]x[/bold red] :warning:"
PAYLOADS = [CLEAR_AND_LIE, TITLE, HIDDEN_LINK, OVERWRITE, BIDI, MARKUP]
LITERAL = ["[link=file:///etc/passwd]docs[/link]", "[bold red]x[/bold red]", ":warning:", r"\x1b[2J", r"\u202e"]


def assert_inert(text: str) -> None:
    """No character a terminal acts on, newlines aside."""
    acting = sorted({character for character in text if not character.isprintable() and character != "\n"})
    assert not acting, f"characters a terminal acts on: {acting!r}"


def test_the_check_catches_raw_text():
    for payload in PAYLOADS[:-1]:
        with pytest.raises(AssertionError):
            assert_inert(f"warning: {payload}")
        assert_inert(inert(f"warning: {payload}\nnext line"))
    assert "\n" not in inert_line("a\nb") and "\n" in inert("a\nb")


@pytest.fixture(scope="module")
def hostile_plan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    data = write_real_plan(folder)
    data["warnings"] = [f"{index}: {payload}" for index, payload in enumerate(PAYLOADS)]
    data["runners_up"][0].update(name=CLEAR_AND_LIE + " " + MARKUP, note=HIDDEN_LINK + TITLE, route=BIDI + OVERWRITE)
    data["search_summary"] = MARKUP + OVERWRITE
    data["summary"]["name"] = MARKUP + TITLE
    data["cluster"]["name"] = "lab " + MARKUP  # cluster names must be printable: markup only
    path = folder / "plan.json"
    path.write_text(json.dumps(data))
    return path


def test_simulate_prints_a_plans_strings_inert_and_literal(hostile_plan):
    status, out, err = run_cli(["simulate", str(hostile_plan)])
    assert status == 0, err
    assert_inert(out)
    assert_inert(err)
    for literal in LITERAL:
        assert literal in out, literal
    # Every warning is still there, each on its own line.
    for index in range(len(PAYLOADS)):
        assert f"warning: {index}: " in out


def test_the_report_of_the_api_is_inert_too(hostile_plan):
    report = load_plan(hostile_plan).report()
    assert_inert(report)
    assert "[link=file:///etc/passwd]docs[/link]" in report


def test_error_lines_quoting_a_file_are_one_inert_line(tmp_path, hostile_plan):
    data = json.loads(hostile_plan.read_text())
    for field in ("dp_flavour", "precision", "format"):
        for payload in PAYLOADS:
            path = tmp_path / "bad.json"
            path.write_text(json.dumps({**data, field: f"x\n{payload}"}))
            status, out, err = run_cli(["simulate", str(path)])
            line = assert_one_error_line(status, out, err, ["bad.json", field])
            assert_inert(line)


def test_compare_prints_a_measured_files_names_inert(tmp_path, hostile_plan):
    plan = tmp_path / "plan.json"
    status, _, err = run_cli(["plan", MLP, "--cluster", "cpu:1x2", "--effort", "0.25", "--dp", "ddp", "-o", str(plan)])
    assert status == 0, err
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({
        "format": MEASURED_FORMAT, "version": MEASURED_VERSION, "plan": json.loads(plan.read_text()),
        "world_size": 2, "step_time_s": 0.01, "step_times_s": [0.01],
        "ops": {CLEAR_AND_LIE + MARKUP: {"count": 1, "time_s": 0.001, "flops": 0}},
        "collectives": [{"kind": "all_reduce", "bytes": 4096, "count": 1, "time_s": 0.001}],
    }))
    status, out, err = run_cli(["compare", str(plan), str(measured)])
    assert status == 0, err
    assert_inert(out)
    # A collective's kind names a row of the table: one that is not a plain word is refused, inert.
    data = json.loads(measured.read_text())
    data["collectives"][0]["kind"] = HIDDEN_LINK + MARKUP
    measured.write_text(json.dumps(data))
    status, out, err = run_cli(["compare", str(plan), str(measured)])
    assert_inert(assert_one_error_line(status, out, err, ["measured.json", "collective kind"]))


def test_routing_files_quoted_in_errors_are_one_inert_line(tmp_path):
    """A routing file's layer names and version reach the error line only escaped."""
    from file_samples import routing_data

    layer = routing_data()["layers"]["blocks.0.moe"]
    for payload in PAYLOADS:
        for data in ({**routing_data(), "layers": {payload: layer}}, {**routing_data(), "version": payload}):
            path = tmp_path / "routing.json"
            path.write_text(json.dumps(data))
            status, out, err = run_cli(["plan", "/no/such/model.py", "--routing", str(path)])
            assert_inert(assert_one_error_line(status, out, err, ["routing.json"]))
