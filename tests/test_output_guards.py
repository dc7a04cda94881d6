"""Every file soap-planner writes replaces only a file soap-planner wrote (unless ``--force``),
is checked before any work, and is written atomically: ``launch.py --metrics``, ``--profile``
and ``--record-routing``, ``planner export-checkpoint -o``, and the helpers in
``planner.outputs`` they share with ``plan -o`` and ``simulate --trace``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import planner
from codegen.runtime import launcher
from codegen.runtime.exported_weights import is_exported_state_dict, save_exported
from codegen.runtime.run_outputs import is_metrics_file, open_metrics
from planner.cluster import is_cluster_file_we_wrote
from planner.errors import OutputError
from planner.json_files import peek_json
from planner.outputs import StagedLines, staged_file, write_text_atomically
from planner.plans import is_plan_file
from planner.routing import RoutingStats, is_routing_file, uniform_layer
from planner.strategy import TRACE_GENERATOR, is_chrome_trace
from user_errors import assert_api_error, assert_one_error_line, assert_user_error

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "examples" / "mlp.py")
USER_TEXT = "my notes, not yours\n"


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    """A compiled data-parallel program of examples/mlp.py for 2 ranks."""
    folder = tmp_path_factory.mktemp("guarded") / "out"
    return planner.compile(planner.plan(MLP, "cpu:1x2", search="dp", progress=False), folder)


@pytest.fixture
def rank0(monkeypatch):
    """The environment torchrun gives rank 0 of 2 (nothing here starts a process group)."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)


def _leftovers(folder: Path) -> list[str]:
    return sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".tmp"))


# ------------------------------------------------------------------ planner.outputs


def test_staged_writes_keep_the_old_file_whole_until_they_succeed(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    target.write_text("old")
    os.chmod(target, 0o640)
    with pytest.raises(RuntimeError), staged_file(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("the writer failed")
    assert target.read_text() == "old" and _leftovers(tmp_path) == []
    with staged_file(target) as temporary:
        torch.save({"w": torch.ones(2)}, temporary)
        assert target.read_text() == "old"  # nothing replaced before the block ends
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(2))
    assert target.stat().st_mode & 0o777 == 0o640  # the old file's mode, as open(path, "w") keeps it
    write_text_atomically(target, "new")
    assert target.read_text() == "new" and _leftovers(tmp_path) == []

    lines = StagedLines(target)
    lines.write_line('{"step": 1}')
    assert target.read_text() == "new" and lines.temporary.read_text() == '{"step": 1}\n'  # followable while it runs
    lines.publish()
    assert target.read_text() == '{"step": 1}\n' and _leftovers(tmp_path) == []


def test_a_resumed_run_keeps_the_metrics_of_the_steps_it_continues(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": step, "loss": 1.0 / step, "step_time_s": 0.1}) for step in range(1, 6)]
    path.write_text("\n".join([*lines[:2], "not json", *lines[2:]]) + "\n")
    assert open_metrics(str(path), rank=1, resumed_at=3) is None  # rank 0 writes it
    staged = open_metrics(str(path), rank=0, resumed_at=3)  # steps 4 and 5 are being run again
    staged.write_line(json.dumps({"step": 4, "loss": 0.0, "step_time_s": 0.1}))
    assert path.read_text().count("\n") == 6  # untouched until the run ends
    staged.publish()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    fresh = open_metrics(str(path), rank=0)  # a run that did not resume starts the file again
    fresh.publish()
    assert path.read_text() == ""


def test_each_writer_recognises_its_own_files_only(tmp_path: Path) -> None:
    def file(name: str, text: str) -> Path:
        (tmp_path / name).write_text(text)
        return tmp_path / name

    metrics = file("metrics.jsonl", '{"step": 1, "loss": 0.5, "lr": 0.001, "step_time_s": 0.01}\n')
    assert is_metrics_file(metrics) and is_metrics_file(file("empty.jsonl", ""))
    assert not is_metrics_file(file("notes.jsonl", '{"step": 1}\n')) and not is_metrics_file(file("t.txt", USER_TEXT))
    assert not is_metrics_file(file("deep.jsonl", "[" * 100_000 + "\n"))  # too deep for json: not ours, not a crash

    routing = tmp_path / "routing.json"
    RoutingStats({"moe": uniform_layer(4, 2)}, "by hand").save(routing)
    assert is_routing_file(routing) and not is_routing_file(file("r.json", '{"format": "mine"}'))
    assert peek_json(file("deep.json", "[" * 100_000)) is None and peek_json(tmp_path / "none.json") is None

    weights = tmp_path / "model.pt"
    save_exported({"layer.weight": torch.ones(2, 2)}, weights)
    model = torch.nn.Linear(2, 2, bias=False)
    assert list(torch.load(weights, weights_only=True)) == ["layer.weight"]  # the marker is no tensor
    assert is_exported_state_dict(weights)
    torch.save(model.state_dict(), tmp_path / "mine.pt")  # a user's own weights
    assert not is_exported_state_dict(tmp_path / "mine.pt") and not is_exported_state_dict(file("x.pt", USER_TEXT))


def test_recognising_a_file_never_reads_a_huge_one(tmp_path: Path) -> None:
    """A 300 MiB file (sparse: no disk used) is not parsed: not ours, unless it is a Chrome
    trace, which soap-planner marks at its end."""
    def huge(name: str, tail: str) -> Path:
        with open(tmp_path / name, "wb") as stream:
            stream.seek(300 << 20)
            stream.write(tail.encode())
        return tmp_path / name

    user = huge("user.json", '"format": "soap-planner-plan"}')
    trace = huge("trace.json", json.dumps({"otherData": {"generator": TRACE_GENERATOR}})[1:])
    assert not any(check(user) for check in (is_plan_file, is_chrome_trace, is_cluster_file_we_wrote, is_metrics_file,
                                             is_routing_file))
    assert is_chrome_trace(trace)


def test_an_exported_state_dict_loads_strictly_into_the_model(tmp_path: Path) -> None:
    """The marker lives in ``_metadata``, which ``load_state_dict`` reads by module prefix:
    a strict load of the whole model still sees exactly its own tensors."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    save_exported(model.state_dict(), tmp_path / "model.pt")
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # strict
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_names_the_filesystem_cannot_hold_and_inputs_as_outputs_are_one_line(capsys, tmp_path: Path) -> None:
    """Found before any work: a name too long for the folder (the staged sibling's included),
    and an output that is a file the same command reads, --force or not."""
    plan = tmp_path / "plan.json"
    planner.plan(MLP, "cpu:1x2", search="dp", progress=False).save(plan)
    long = "x" * 300
    assert_user_error(capsys, ["simulate", str(plan), "--trace", str(tmp_path / f"{long}.json")],
                      "its name has 305 bytes", "choose a shorter name")
    assert_user_error(capsys, ["compile", str(plan), "-o", str(tmp_path / ("y" * 250))], "its name has 250 bytes")
    assert_user_error(capsys, ["simulate", str(plan), "--trace", str(plan), "--force"],
                      "--trace", "is a file this command reads")
    assert_user_error(capsys, ["calibrate", str(plan), "--cluster", "cpu:1x2", "-o", str(plan), "--force"],
                      "is a file this command reads")
    assert planner.load_plan(plan).world_size == 2  # still the plan
    loaded = planner.load_plan(plan)
    assert_api_error(lambda: loaded.save(tmp_path / "a\x00b.json"), OutputError, "cannot hold a NUL character")
    assert_api_error(lambda: planner.compile(loaded, tmp_path / "o\x00ut"), OutputError, "cannot hold a NUL character")
    assert _leftovers(tmp_path) == []


# ------------------------------------------------------------- export-checkpoint -o


def test_export_checkpoint_replaces_only_its_own_file(capsys, tmp_path: Path) -> None:
    mine = tmp_path / "pretrained.pt"
    torch.save({"weight": torch.ones(2)}, mine)
    before = mine.read_bytes()
    assert_user_error(capsys, ["export-checkpoint", str(tmp_path), "-o", str(mine)],
                      "refusing to overwrite", "pretrained.pt", "not a state_dict file written by soap-planner", "--force")
    assert mine.read_bytes() == before
    # A file export-checkpoint wrote passes the output check (then the checkpoint is missing).
    ours = tmp_path / "exported.pt"
    save_exported({"weight": torch.ones(2)}, ours)
    assert_user_error(capsys, ["export-checkpoint", str(tmp_path / "none"), "-o", str(ours)], "no folder", "none")
    # --force lets it past the output check too.
    assert_user_error(capsys, ["export-checkpoint", str(tmp_path / "none"), "-o", str(mine), "--force"], "no folder")
    assert_user_error(capsys, ["export-checkpoint", str(tmp_path), "-o", str(tmp_path)], "is a folder")
    assert_user_error(capsys, ["export-checkpoint", str(tmp_path), "-o", str(tmp_path / "in.pt"), "--force"],
                      "is inside the checkpoint folder")


# ------------------------------------------------------------------ launch.py outputs


def _user_file(folder: Path, name: str, text: str = USER_TEXT) -> str:
    (folder / name).write_text(text)
    return str(folder / name)


def _plan_copy(program: Path, folder: Path) -> str:
    (folder / "plan-copy.json").write_text((program / "plan.json").read_text())
    return str(folder / "plan-copy.json")


LAUNCH_OUTPUT_ROWS = [
    ("metrics over a user's file", lambda p, d: ["--steps", "2", "--metrics", _user_file(d, "notes.jsonl")],
     ["--metrics: refusing to overwrite", "notes.jsonl", "not a metrics file", "--force"]),
    ("profile over a user's file", lambda p, d: ["--steps", "6", "--profile", _user_file(d, "m.json", "{}")],
     ["--profile: refusing to overwrite", "not a measured file", "--force"]),
    ("record-routing over a user's file", lambda p, d: ["--steps", "2", "--record-routing", _user_file(d, "r.json", "{}")],
     ["--record-routing: refusing to overwrite", "not a routing statistics file"]),
    ("profile over the program's plan.json, forced", lambda p, d: ["--steps", "6", "--profile", str(p / "plan.json"), "--force"],
     ["--profile:", "is this program's plan.json", "another file"]),
    ("metrics over the program's launch.py, forced", lambda p, d: ["--steps", "2", "--metrics", str(p / "launch.py"), "--force"],
     ["--metrics:", "this program's launch.py"]),
    ("metrics over a plan file, forced", lambda p, d: ["--steps", "2", "--metrics", _plan_copy(p, d), "--force"],
     ["--metrics:", "plan-copy.json is a soap-planner plan", "even --force"]),
    ("metrics over the --data file, forced",
     lambda p, d: ["--data", f"{_user_file(d, 'data.py')}:batches", "--metrics", str(d / "data.py"), "--force"],
     ["--metrics:", "the file --data reads"]),
    ("metrics over the --init-from file, forced",
     lambda p, d: ["--steps", "1", "--init-from", _user_file(d, "w.pt"), "--metrics", str(d / "w.pt"), "--force"],
     ["--metrics:", "the file --init-from reads"]),
    ("metrics and profile into one file", lambda p, d: ["--steps", "6", "--metrics", str(d / "x.json"), "--profile",
                                                         str(d / "x.json")],
     ["--profile and --metrics both write", "x.json", "its own file"]),
    ("profile into a folder", lambda p, d: ["--steps", "6", "--profile", str(d)], ["--profile: output", "is a folder"]),
    ("record-routing into a missing folder", lambda p, d: ["--steps", "2", "--record-routing", str(d / "gone" / "r.json")],
     ["--record-routing: cannot write", "gone does not exist"]),
]


@pytest.mark.parametrize(("name", "argv", "fragments"), LAUNCH_OUTPUT_ROWS, ids=[row[0] for row in LAUNCH_OUTPUT_ROWS])
def test_launch_outputs_are_refused_before_anything_starts(capsys, program, tmp_path, rank0, name, argv, fragments) -> None:
    """Each refusal is one line, before the process group (none starts here), and every file
    named is as it was."""
    args = argv(program, tmp_path)
    before = {path: path.read_bytes() for path in [*tmp_path.iterdir(), *program.iterdir()] if path.is_file()}
    capsys.readouterr()
    status = launcher.main(program, args)
    out, err = capsys.readouterr()
    assert_one_error_line(status, out, err, fragments)
    assert {path: path.read_bytes() for path in before} == before


@pytest.mark.distributed
def test_launch_replaces_its_own_outputs_whole(program, tmp_path) -> None:
    """Under torchrun: a metrics file and a measured file written by an earlier run are
    replaced whole (no temporary file left), the measured file records the plan's
    fingerprint, and ``compare`` takes it with the program's plan.json; a resumed run
    continues the metrics file of the run it resumes."""
    from test_parity import _run, _torchrun

    from cost_model.calibration import load_measured
    from planner.cli import main as cli_main
    from planner.plan_identity import plan_fingerprint

    metrics, measured = tmp_path / "metrics.jsonl", tmp_path / "measured.json"
    metrics.write_text(json.dumps({"step": 1, "loss": 9.0, "lr": 1.0, "step_time_s": 1.0}) + "\n")  # an earlier run's
    measured.write_text(json.dumps({"format": "soap-planner-measured", "version": 1}))
    launch = _run([*_torchrun(2), str(program / "launch.py"), "--steps", "6", "--metrics", str(metrics),
                   "--profile", str(measured), "--checkpoint-dir", "ckpt"], cwd=tmp_path, timeout=240)
    assert launch.returncode == 0, launch.describe()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3, 4, 5, 6]
    resumed = _run([*_torchrun(2), str(program / "launch.py"), "--steps", "8", "--metrics", str(metrics),
                    "--checkpoint-dir", "ckpt", "--resume"], cwd=tmp_path, timeout=240)
    assert resumed.returncode == 0, resumed.describe()
    assert [json.loads(line) for line in metrics.read_text().splitlines()][:6] == records  # one file, the whole run
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, 9))
    recorded = json.loads(measured.read_text())
    assert recorded["plan_fingerprint"] == plan_fingerprint(json.loads((program / "plan.json").read_text()))
    assert load_measured(measured).world_size == 2
    assert _leftovers(tmp_path) == [] and _leftovers(program) == []
    assert cli_main(["compare", str(program / "plan.json"), str(measured)]) == 0


# ------------------------------------------------------------------ input paths


@pytest.mark.parametrize("flag", ["--init-from", "--data", "--checkpoint-dir"])
def test_an_input_path_the_filesystem_refuses_is_one_line_before_work(program, tmp_path, capsys, rank0, flag):
    """A name longer than the filesystem allows (or a NUL) given to a flag the run reads was an
    OSError traceback on every rank; it is one line naming the flag, before any process group."""
    too_long = str(tmp_path / ("a" * 300))
    value = {"--init-from": too_long + ".pt", "--data": too_long + ".py:batches", "--checkpoint-dir": too_long}[flag]
    extra = ["--save-every", "1"] if flag == "--checkpoint-dir" else []
    status = launcher.main(program, ["--steps", "1", flag, value, *extra])
    out, err = capsys.readouterr()
    line = assert_one_error_line(status, "", err, [flag, "the filesystem refuses this path"])
    assert len(line) < 400  # the 300-character name is shortened in the message


def test_path_kind_tells_file_folder_and_missing(tmp_path):
    from planner.outputs import path_kind

    (tmp_path / "f").write_text("x")
    assert path_kind(tmp_path / "f", "--x") == "file"
    assert path_kind(tmp_path, "--x") == "folder"
    assert path_kind(tmp_path / "missing", "--x") == "missing"
    assert path_kind(tmp_path / "f" / "below", "--x") == "missing"  # a file is not a folder
    assert_api_error(lambda: path_kind("a\x00b", "--x"), OutputError, "--x", "refuses this path")
