"""Files are never lost (planner/outputs.py): compile stages its program in a temporary folder
and moves it into place only when every file was written; it refuses a user's non-empty
folder unless forced, replaces its own output, and ``plan -o`` / ``profile -o`` refuse to
overwrite a file soap-planner did not write, before any work starts."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import planner
from planner.cli import main
from planner.errors import OutputError
from planner.outputs import PROGRAM_MARKER
from planner.plans import Plan, load_plan
from user_errors import assert_user_error

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "examples" / "mlp.py")
PROGRAM_FILES = ["launch.py", "model_spmd.py", "plan.json"]


@pytest.fixture(scope="module")
def ddp_plan() -> Plan:
    return planner.plan(MLP, "cpu:1x2", search="dp", dp_flavour="ddp", progress=False)


@pytest.fixture(scope="module")
def fsdp_plan() -> Plan:
    return planner.plan(MLP, "cpu:1x2", search="dp", dp_flavour="fsdp", progress=False)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def leftovers(parent: Path) -> list[str]:
    """Temporary folders or files of ours left in ``parent`` (staging, old programs, atomic writes)."""
    return [p.name for p in parent.iterdir() if p.name.endswith((".soap-tmp", ".soap-old", ".tmp"))]


# --------------------------------------------------------------------------- compile


def test_compile_writes_a_marker_listing_its_files(ddp_plan, tmp_path):
    out = planner.compile(ddp_plan, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == sorted([PROGRAM_MARKER, *PROGRAM_FILES])
    marker = json.loads((out / PROGRAM_MARKER).read_text())
    assert marker["generator"] == "soap-planner" and marker["files"] == PROGRAM_FILES and marker["version"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())  # as mkdir would make it, not mkdtemp's 0o700
    assert leftovers(tmp_path) == []


def test_compile_refuses_a_users_folder_and_leaves_it_intact(capsys, ddp_plan, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "launch.py").write_text("print('my launcher')\n")
    ddp_plan.save(tmp_path / "p.json")
    assert_user_error(
        capsys, ["compile", str(tmp_path / "p.json"), "-o", str(folder)],
        f"output folder {folder} is not empty (launch.py)", "--force", "choose a new or empty folder",
    )
    assert snapshot(folder) == {"launch.py": b"print('my launcher')\n"}
    with pytest.raises(OutputError, match="not empty"):
        planner.compile(ddp_plan, folder)
    assert snapshot(folder) == {"launch.py": b"print('my launcher')\n"}
    assert leftovers(tmp_path) == []


def test_a_compile_that_fails_half_way_changes_nothing(ddp_plan, fsdp_plan, tmp_path, monkeypatch):
    import codegen.emit

    out = planner.compile(ddp_plan, tmp_path / "out")
    before = snapshot(out)
    written = []

    def fail_after_plan_json(plan):
        staging = [p for p in tmp_path.iterdir() if p.name.endswith(".soap-tmp")]
        assert len(staging) == 1 and (staging[0] / "plan.json").is_file()  # half-way indeed
        written.append(staging[0])
        raise RuntimeError("the emitter broke")

    monkeypatch.setattr(codegen.emit, "render_launch", fail_after_plan_json)
    with pytest.raises(RuntimeError, match="the emitter broke"):
        planner.compile(fsdp_plan, out)
    assert written and not written[0].exists()
    assert snapshot(out) == before  # the old program, whole: its plan.json beside its own launch.py
    assert load_plan(out / "plan.json").dp_flavour == "ddp"
    assert leftovers(tmp_path) == []


def test_recompiling_onto_its_own_output_replaces_it(ddp_plan, fsdp_plan, tmp_path):
    out = planner.compile(ddp_plan, tmp_path / "out")
    (out / "__pycache__").mkdir()  # what running the program leaves behind
    (out / "__pycache__" / "model_spmd.cpython-311.pyc").write_bytes(b"old bytecode")
    planner.compile(fsdp_plan, out)
    assert load_plan(out / "plan.json").dp_flavour == "fsdp"
    assert "fully_shard(" in (out / "model_spmd.py").read_text()
    assert sorted(p.name for p in out.iterdir()) == sorted([PROGRAM_MARKER, *PROGRAM_FILES])
    assert leftovers(tmp_path) == []


def test_a_failed_swap_puts_the_old_program_back(ddp_plan, fsdp_plan, tmp_path, monkeypatch):
    import planner.outputs

    out = planner.compile(ddp_plan, tmp_path / "out")
    before = snapshot(out)
    rename = os.rename

    def failing_rename(source, destination):
        if str(source).endswith(".soap-tmp"):  # moving the new program in
            raise OSError("disk full")
        rename(source, destination)

    monkeypatch.setattr(planner.outputs.os, "rename", failing_rename)
    with pytest.raises(OSError, match="disk full"):
        planner.compile(fsdp_plan, out)
    assert snapshot(out) == before
    assert leftovers(tmp_path) == []


def test_force_writes_into_a_users_folder_and_keeps_their_files(ddp_plan, fsdp_plan, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me\n")
    (folder / "launch.py").write_text("print('my launcher')\n")
    planner.compile(ddp_plan, folder, force=True)
    assert (folder / "notes.txt").read_text() == "keep me\n"
    assert "Generated by soap-planner" in (folder / "launch.py").read_text()  # --force: the user asked for it
    assert load_plan(folder / "plan.json").dp_flavour == "ddp"
    # Now the folder holds our program and a user's file: recompiling replaces ours, keeps theirs.
    planner.compile(fsdp_plan, folder)
    assert (folder / "notes.txt").read_text() == "keep me\n"
    assert load_plan(folder / "plan.json").dp_flavour == "fsdp"
    assert sorted(p.name for p in folder.iterdir()) == sorted([PROGRAM_MARKER, "notes.txt", *PROGRAM_FILES])
    assert leftovers(tmp_path) == []


def test_a_program_folder_from_before_the_marker_is_ours(ddp_plan, fsdp_plan, tmp_path):
    out = planner.compile(ddp_plan, tmp_path / "out")
    (out / PROGRAM_MARKER).unlink()  # as soap-planner wrote it before the marker existed
    planner.compile(fsdp_plan, out)
    assert load_plan(out / "plan.json").dp_flavour == "fsdp"


@pytest.mark.parametrize("marker", ["[1]", "{not json", '{"generator": "someone else", "files": ["launch.py"]}'])
def test_a_marker_soap_planner_did_not_write_does_not_make_a_folder_ours(ddp_plan, tmp_path, marker):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / PROGRAM_MARKER).write_text(marker)
    (folder / "launch.py").write_text("print('my launcher')\n")
    with pytest.raises(OutputError, match="not written by `planner compile`"):
        planner.compile(ddp_plan, folder)
    assert (folder / "launch.py").read_text() == "print('my launcher')\n"


def test_compile_into_an_empty_or_nested_new_folder(ddp_plan, tmp_path):
    (tmp_path / "empty").mkdir()
    planner.compile(ddp_plan, tmp_path / "empty")
    planner.compile(ddp_plan, tmp_path / "a" / "b" / "c")
    for folder in (tmp_path / "empty", tmp_path / "a" / "b" / "c"):
        assert sorted(p.name for p in folder.iterdir()) == sorted([PROGRAM_MARKER, *PROGRAM_FILES])
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------------- plan -o, profile -o


def test_plan_refuses_a_users_file_before_searching(capsys, tmp_path, monkeypatch):
    import planner.api

    searched = []
    monkeypatch.setattr(planner.api, "plan", lambda *args, **kwargs: searched.append(args))
    notes = tmp_path / "notes.json"
    notes.write_text('{"my": "data"}\n')
    start = time.perf_counter()
    assert_user_error(capsys, ["plan", MLP, "-o", str(notes)], "refusing to overwrite", "--force")
    assert time.perf_counter() - start < 5  # no tracing, no search
    assert searched == []
    assert notes.read_text() == '{"my": "data"}\n'


def test_plan_replaces_its_own_plan_and_force_replaces_anything(capsys, tmp_path):
    path = tmp_path / "p.json"
    argv = ["plan", MLP, "--cluster", "cpu:1x2", "--search", "dp"]
    assert main([*argv, "--dp", "ddp", "-o", str(path)]) == 0
    assert main([*argv, "--dp", "fsdp", "-o", str(path)]) == 0  # a plan: replaced without asking
    assert load_plan(path).dp_flavour == "fsdp"
    path.write_text("not a plan\n")
    assert main([*argv, "-o", str(path), "--force"]) == 0
    assert load_plan(path).world_size == 2
    assert leftovers(tmp_path) == []


def test_plan_save_is_atomic(ddp_plan, tmp_path, monkeypatch):
    import planner.outputs

    path = tmp_path / "p.json"
    ddp_plan.save(path)
    before = path.read_bytes()

    def failing_replace(source, destination):
        raise OSError("disk full")

    monkeypatch.setattr(planner.outputs.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        ddp_plan.save(path)
    assert path.read_bytes() == before
    assert leftovers(tmp_path) == []


def test_profile_output_ownership(capsys, tmp_path, monkeypatch):
    import cost_model.profile
    from test_profile import _canned_profile

    monkeypatch.setattr(cost_model.profile, "measure_machine", lambda *args: _canned_profile(*args))
    for name in ("lab.toml", "lab.json"):
        path = tmp_path / name
        path.write_text('name = "mine"\n' if name.endswith(".toml") else '{"name": "mine"}\n')
        assert_user_error(capsys, ["profile", "-o", str(path)], "refusing to overwrite", "--force")
        assert "mine" in path.read_text()
        assert main(["profile", "-o", str(path), "--force"]) == 0
        assert main(["profile", "-o", str(path)]) == 0  # written by soap-planner now: replaced without asking
        capsys.readouterr()
        assert planner.Cluster.parse(str(path)).world_size == 2


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
