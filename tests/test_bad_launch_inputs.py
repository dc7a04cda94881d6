"""Every bad input to a compiled program gets one clear line: ``launch.py``'s flags, edited or
broken program folders, the world size torchrun starts, and which rank says it.

The rows follow ``test_bad_inputs.py``'s rules (exit status 2, exactly one ``error: `` line,
no traceback, fragments naming the problem) and run ``codegen.runtime.launcher.main``
in-process: every check fails before a process group starts. One torchrun launch checks that
a launch error is one line from rank 0 only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

import planner
from bad_inputs_context import Context, make_context, set_fields  # this folder is on sys.path under pytest
from codegen.runtime import launcher
from user_errors import assert_one_error_line


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> Context:
    return make_context(tmp_path_factory)


@pytest.fixture
def rank0(monkeypatch):
    """The environment torchrun gives rank 0 of 2 (nothing here starts a process group)."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)


def _without(name: str) -> Callable[[Context], Path]:
    def folder(c: Context) -> Path:
        program = c.program()
        (program / name).unlink()
        return program

    return folder


def _with(name: str, text: str) -> Callable[[Context], Path]:
    def folder(c: Context) -> Path:
        program = c.program()
        (program / name).write_text(text)
        return program

    return folder


def _edited_plan(mutate: Callable[[dict], None]) -> Callable[[Context], Path]:
    def folder(c: Context) -> Path:
        program = c.program()
        data = json.loads((program / "plan.json").read_text())
        mutate(data)
        (program / "plan.json").write_text(json.dumps(data))
        return program

    return folder


def _model_file_gone(c: Context) -> Path:
    model_file = c.model_copy()
    program = planner.compile(planner.plan(str(model_file), "cpu:1x2", search="dp", progress=False), c.out())
    model_file.unlink()
    return program


def _model_file_edited(c: Context) -> Path:
    model_file = c.model_copy()
    program = planner.compile(planner.plan(str(model_file), "cpu:1x2", search="dp", progress=False), c.out())
    model_file.write_text(model_file.read_text().replace("layers: int = 3", "layers: int = 4"))
    return program


LAUNCH_ROWS = [
    ("atol negative", None, ["--check", "--atol", "-1"], ["argument --atol: must be a finite number >= 0, got '-1'"]),
    ("atol nan", None, ["--check", "--atol", "nan"], ["--atol", "'nan'"]),
    ("rtol negative", None, ["--check", "--rtol", "-0.5"], ["--rtol", "'-0.5'"]),
    ("rtol infinite", None, ["--check", "--rtol", "inf"], ["--rtol", "'inf'"]),
    ("steps negative", None, ["--steps", "-1"], ["--steps: must be an integer >= 0, got '-1'"]),
    ("steps float", None, ["--steps", "1.5"], ["--steps", "'1.5'"]),
    ("lr zero", None, ["--check", "--lr", "0"], ["--lr: must be a positive finite number, got '0'"]),
    ("lr negative", None, ["--steps", "1", "--lr", "-0.001"], ["--lr", "'-0.001'"]),
    ("lr nan", None, ["--check", "--lr", "nan"], ["--lr", "'nan'"]),
    ("nothing to run", None, [], ["say what to run: --check, --steps N"]),
    ("unknown optimizer", None, ["--check", "--optimizer", "adam"], ["--optimizer", "invalid choice: 'adam'"]),
    ("fp64 without check", None, ["--steps", "1", "--fp64"], ["--fp64 says how --check runs its step; add --check"]),
    ("fp64 of a bf16 plan", _edited_plan(set_fields(precision="bf16")), ["--check", "--fp64"],
     ["--fp64 checks fp32 plans; this plan computes in bf16"]),
    ("unknown flag", None, ["--chek"], ["unrecognized arguments: --chek", "launch.py --help"]),
    ("plan.json missing", _without("plan.json"), ["--check"], ["has no plan.json", "planner compile"]),
    ("plan.json corrupt", _with("plan.json", "{"), ["--check"], ["plan.json' is not valid JSON"]),
    ("plan.json of another tool", _with("plan.json", '{"format": "x"}'), ["--check"], ["not a soap-planner plan"]),
    ("model_spmd.py missing", _without("model_spmd.py"), ["--check"], ["has no model_spmd.py"]),
    ("model_spmd.py broken", _with("model_spmd.py", "def parallelize(:\n"), ["--check"],
     ["model_spmd.py fails to import (line 1): SyntaxError"]),
    ("model_spmd.py incomplete", _with("model_spmd.py", "x = 1\n"), ["--check"], ["defines no parallelize()"]),
    ("plan.json batch edited", _edited_plan(set_fields(batch_size=8)), ["--check"],
     ["disagree (batch: plan.json 8, model_spmd.py 16)", "compile the plan again"]),
    ("plan.json mesh edited", _edited_plan(set_fields(mesh=[["tp", 2]])), ["--check"],
     ["disagree (mesh: plan.json (('tp', 2),), model_spmd.py (('dp', 2),))"]),
    ("model file gone", _model_file_gone, ["--check"], ["model file", "mlp_copy.py", "does not exist"]),
    ("model file edited", _model_file_edited, ["--check"], ["now builds a different model than the one planned", "re-plan"]),
]


@pytest.mark.parametrize(("name", "folder", "argv", "fragments"), LAUNCH_ROWS, ids=[row[0] for row in LAUNCH_ROWS])
def test_launch_flags_and_folders(capsys, ctx, rank0, name, folder, argv, fragments):
    program = folder(ctx) if folder is not None else ctx.program_folder
    capsys.readouterr()
    status = launcher.main(Path(program), argv)
    out, err = capsys.readouterr()
    assert_one_error_line(status, out, err, fragments)


@pytest.mark.parametrize(
    ("world", "fragments"),
    [("4", ["compiled for 2 ranks", "torchrun started 4", "--nproc_per_node 2"]), (None, ["must be started by torchrun"])],
    ids=["world size mismatch", "not under torchrun"],
)
def test_launch_world_size(capsys, ctx, monkeypatch, world, fragments):
    monkeypatch.setenv("RANK", "0")
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    capsys.readouterr()
    status = launcher.main(ctx.program_folder, ["--check"])
    out, err = capsys.readouterr()
    assert_one_error_line(status, out, err, fragments)


def test_launch_errors_are_said_by_rank_0_only(capsys, ctx, monkeypatch):
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    assert launcher.main(ctx.program_folder, ["--check", "--atol", "-1"]) == 2
    assert capsys.readouterr() == ("", "")


@pytest.mark.distributed
def test_torchrun_launch_error_is_one_line(ctx):
    """Under torchrun, a bad flag is one ``error:`` line (rank 0's) and no traceback from
    any rank. (torchrun itself then reports that its workers exited 2, with a traceback of
    its own process: that part is torchrun's, not the program's.)"""
    from test_parity import _run, _torchrun

    program = ctx.program()
    launch = _run([*_torchrun(2), str(program / "launch.py"), "--check", "--atol", "-1"], cwd=ctx.scratch, timeout=180)
    assert launch.returncode != 0, launch.describe()
    errors = [line for line in launch.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: argument --atol: must be a finite number >= 0, got '-1'; see launch.py --help"], launch.describe()
    assert str(program) not in launch.stderr.replace(f"{program / 'launch.py'} FAILED", ""), launch.describe()
    assert "codegen/runtime" not in launch.stderr, launch.describe()
