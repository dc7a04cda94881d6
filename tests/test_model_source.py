"""Which model file a plan runs: resolved next to the plan file, and named before it is imported.

A plan's ``model.source`` is Python that ``simulate``, ``compile`` and every rank of a
compiled program import. A relative source (a plan written by hand) is relative to the plan
file's folder, never to the current directory, and each of those commands prints the file's
absolute path on stderr before importing it (``launch.py``: rank 0, once; tested with the
hostile plans' launch in ``test_hostile_plans.py``).
"""

from __future__ import annotations

import json
import shutil

import pytest

import planner
from planner.cli import main
from test_parity import REPO

MLP = REPO / "examples" / "mlp.py"


@pytest.fixture()
def relative_plan(tmp_path, monkeypatch):
    """``shared/plan.json`` naming ``model.py`` (relative) beside it, and a decoy
    ``model.py`` in the folder the user runs from, which must never be imported."""
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    shared.mkdir()
    elsewhere.mkdir()
    shutil.copy(MLP, shared / "model.py")
    (elsewhere / "model.py").write_text("raise SystemExit('the decoy model.py in the current folder was imported')\n")
    plan = planner.plan(str(shared / "model.py"), "cpu:1x2", dp_flavour="ddp", progress=False)
    data = plan.to_dict()
    data["model"]["source"] = "model.py:build"
    (shared / "plan.json").write_text(json.dumps(data))
    monkeypatch.chdir(elsewhere)
    return shared / "plan.json"


def test_relative_source_resolves_next_to_the_plan_file(relative_plan):
    plan = planner.load_plan("../shared/plan.json")
    assert plan.model.source == f"{relative_plan.parent.resolve() / 'model.py'}:build"


def test_simulate_names_the_model_file_before_importing_it(relative_plan, capsys):
    planner.simulate(planner.load_plan(relative_plan))
    err = capsys.readouterr().err
    assert f"importing model file {relative_plan.parent.resolve() / 'model.py'} (model.source of the plan being simulated)" in err


def test_compile_cli_names_the_model_file_and_keeps_it_absolute(relative_plan, tmp_path, capsys):
    assert main(["compile", str(relative_plan), "-o", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    model = relative_plan.parent.resolve() / "model.py"
    assert err.splitlines() == [f"importing model file {model} (model.source of the plan being compiled)"]
    assert json.loads((tmp_path / "out" / "plan.json").read_text())["model"]["source"] == f"{model}:build"
