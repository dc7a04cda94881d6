"""The report as a terminal shows it: sized to the terminal's width (80 columns without a
line wrapping apart, wider terminals used), long commands broken with shell continuations
that paste as they are, and ``--format json`` carrying the text's sections for scripts.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cost_model.simulator import simulated
from planner import baselines
from planner.api import prepare_model
from planner.cli import main
from planner.model_spec import ModelSpec
from planner.terminal_width import NARROWEST, WIDEST, terminal_width, wrap_command
from planner.verdict import verdict
from tests.moe_plans import moe_plan
from tests.summa_plans import summa_plan

REPO = Path(__file__).resolve().parents[1]
GPT = str(REPO / "examples" / "gpt.py")


@pytest.fixture(scope="module")
def saved_plans(tmp_path_factory):
    """Plans whose reports hold every kind of section: a Megatron baseline with runners-up
    free text, a pipeline (stage table), a MoE plan (expert table) and a SUMMA plan (grid)."""
    folder = tmp_path_factory.mktemp("plans")
    big = ModelSpec(GPT, {"n_layer": 24, "n_embd": 2048, "n_head": 16, "vocab_size": 50304, "seq_len": 2048,
                          "batch_size": 32})
    small = ModelSpec(GPT, {"n_layer": 8, "n_embd": 512, "n_head": 8, "vocab_size": 32768, "seq_len": 256, "batch_size": 32})
    plans = {
        "megatron": baselines.megatron(big, "dgx-a100-80g:2", tp=8, precision="bf16"),
        "pipeline": baselines.megatron(small, "dgx-a100-80g:2x2", pp=2, micro_batch=2, schedule="interleaved",
                                       virtual_stages=2, dp_flavour="zero1", layers_per_stage=[3, 2, 2, 1]),
        "moe": moe_plan(4, "expert_parallel", "round-robin"),
    }
    summa = summa_plan(ModelSpec(GPT, {"n_layer": 2, "batch_size": 8}), "2d")
    plans["summa"] = simulated(summa, prepare_model(summa.model, summa.cluster)[0])
    paths = {}
    for name, plan in plans.items():
        paths[name] = folder / f"{name}.json"
        plan.save(paths[name])
    return plans, paths


def _report_lines(path: Path, columns: int, monkeypatch, capsys) -> list[str]:
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["report", str(path)]) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("name", ["megatron", "pipeline", "moe", "summa"])
def test_every_report_line_fits_an_80_column_terminal(saved_plans, name, monkeypatch, capsys):
    lines = _report_lines(saved_plans[1][name], 80, monkeypatch, capsys)
    too_long = [line for line in lines if len(line) > 80]
    assert not too_long, too_long[:3]
    assert any(line.startswith("┏") for line in lines)  # the tables are still tables


def test_a_wider_terminal_is_used(saved_plans, monkeypatch, capsys):
    """At 140 columns the strategy table's cells no longer wrap: fewer, longer lines."""
    narrow = _report_lines(saved_plans[1]["megatron"], 80, monkeypatch, capsys)
    wide = _report_lines(saved_plans[1]["megatron"], 140, monkeypatch, capsys)
    assert max(len(line) for line in wide) > 100
    assert max(len(line) for line in wide) <= 140
    assert len(wide) < len(narrow)


def test_the_width_is_clamped_and_a_pipe_gets_the_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "20")
    assert terminal_width() == NARROWEST
    monkeypatch.setenv("COLUMNS", "400")
    assert terminal_width() == WIDEST
    monkeypatch.setenv("COLUMNS", "97")
    assert terminal_width() == 97


def test_simulate_at_80_columns_fits(saved_plans, tmp_path):
    """The issue's check, as a user runs it: ``COLUMNS=80 python -m planner simulate p.json``."""
    run = subprocess.run([sys.executable, "-m", "planner", "simulate", str(saved_plans[1]["megatron"])],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={**os.environ, "COLUMNS": "80", "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) > 40
    assert max(len(line) for line in lines) <= 80


def test_json_carries_the_same_sections_as_the_text(saved_plans, monkeypatch, capsys):
    plans, paths = saved_plans
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["report", str(paths["pipeline"]), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = plans["pipeline"]
    assert data["step_time_s"] == pytest.approx(plan.estimate.step_time_s)
    by_section = {}
    for section in data["sections"]:
        by_section.setdefault(section["section"], []).append(section)
    assert by_section["verdict"][0]["text"] == verdict(plan)
    memory = by_section["memory"][0]
    assert memory["columns"] == ["kind", "bytes", "share"]
    assert [row[0] for row in memory["rows"]][:2] == ["weights (+buffers)", "gradients"]
    assert "pipeline" in by_section  # the family's own section, by its name
    text = plan.report(width=400)  # wide enough that no cell wraps
    for section in data["sections"]:
        if "rows" in section:
            for row in section["rows"]:
                assert row[0].split()[0] in text  # each table's first cell is in the text too


def test_json_keeps_hostile_strings_as_data(saved_plans, tmp_path, monkeypatch, capsys):
    """A plan is shared data: a name with a terminal escape comes back as the same string in
    JSON (escaped by JSON), never as raw control characters on stdout."""
    plans, _ = saved_plans
    import dataclasses

    hostile = dataclasses.replace(plans["moe"], warnings=("\x1b]0;owned\x07 [bold]markup[/bold] \u202eevil",))
    path = tmp_path / "hostile.json"
    hostile.save(path)
    assert main(["report", str(path), "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    warnings = [s["text"] for s in json.loads(out)["sections"] if s["section"] == "warning"]
    assert warnings == ["warning: \x1b]0;owned\x07 [bold]markup[/bold] \u202eevil"]


def test_a_plan_never_simulated_is_refused_in_one_line(tmp_path, capsys):
    plan = summa_plan(ModelSpec(GPT, {"n_layer": 1, "batch_size": 8}), "2d")
    plan.save(tmp_path / "bare.json")
    assert main(["report", str(tmp_path / "bare.json")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "holds no simulated figures" in error and "planner simulate" in error


@pytest.mark.parametrize("width", [40, 60, 80])
def test_a_long_command_breaks_between_arguments_and_pastes_back_whole(width):
    command = ("torchrun --nnodes 4 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 "
               "'out dir/launch.py' --steps 10   # on each of the 4 nodes, MASTER_ADDR = the first node's address")
    lines = wrap_command(command, width, indent="  ")
    assert lines[0].startswith("  # on each of the 4 nodes")
    body = [line for line in lines if not line.lstrip().startswith("#")]
    assert all(line.endswith(" \\") for line in body[:-1]) and not body[-1].endswith("\\")
    assert all(len(line) <= width for line in body if " " in line.strip())
    # What the shell reads: the continuations joined back give the same words.
    pasted = " ".join(line.removesuffix(" \\").strip() for line in body)
    assert shlex.split(pasted) == shlex.split(command.split("   #")[0])
    comment = " ".join(line.strip().removeprefix("# ") for line in lines if line.lstrip().startswith("#"))
    assert comment == "on each of the 4 nodes, MASTER_ADDR = the first node's address"


def test_an_argument_longer_than_the_line_is_kept_whole():
    long_path = "/very/" + "long/" * 20 + "launch.py"
    lines = wrap_command(f"torchrun --nproc_per_node 8 {long_path} --check", 40)
    assert long_path in "".join(lines)
    assert shlex.split(" ".join(line.removesuffix(" \\") for line in lines)) == [
        "torchrun", "--nproc_per_node", "8", long_path, "--check"]


def test_plan_prints_next_commands_within_80_columns(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", GPT, "--cluster", "dgx-a100-80g:2", "--search", "dp", "--set", "batch_size=32", "-o", "p.json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80
    start = lines.index("next:")
    assert lines[start + 1] == "  python -m planner compile p.json -o out"
    assert any(line.rstrip().endswith("\\") for line in lines[start:])
