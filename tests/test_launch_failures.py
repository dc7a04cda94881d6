"""How ``launch.py`` fails: one line, printed last by rank 0, a shared exit status (2 user
error, 3 internal error, 130 interrupted), no traceback from our code, and the same line in
torchrun's ``ChildFailedError`` summary (through ``TORCHELASTIC_ERROR_FILE``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import planner
from codegen.runtime import launcher
from codegen.runtime.program import load_program
from planner.errors import LaunchError
from planner.model_spec import ModelSpec
from tests.test_parity import _run, _torchrun

REPO = Path(__file__).resolve().parent.parent
GPT = {"n_layer": 1, "n_embd": 32, "n_head": 4, "vocab_size": 64, "seq_len": 16, "batch_size": 4}


def _failing_parser(error: BaseException):
    """A ``build_parser`` standing in for launch.py's first step, raising ``error``."""
    def build_parser():
        raise error

    return build_parser


@pytest.mark.parametrize(
    "error, status, line",
    [
        (LaunchError("--data: no file 'x.py'; give the path"), 2, "error: --data: no file 'x.py'; give the path"),
        (RuntimeError("boom\nin two lines"), 3, "internal error: RuntimeError: boom in two lines (a bug in soap-planner"),
        (KeyboardInterrupt(), 130, "interrupted"),
        (LaunchError("--data: 'a\x1b[2Jb\nc' is missing"), 2, "error: --data: 'a\\x1b[2Jb\\nc' is missing"),  # inert
        (RuntimeError("[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:3808. This is typically caused"), 3,
         "internal error: another rank stopped while this one waited for it in a collective; that rank's own line is in "
         "torchrun's summary below"),
    ],
)
def test_each_outcome_has_its_status_and_one_line(monkeypatch, capsys, error, status, line) -> None:
    monkeypatch.setattr(launcher, "build_parser", _failing_parser(error))
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert launcher.main(Path("."), ["--steps", "1"]) == status
    printed = capsys.readouterr()
    assert printed.err.startswith(line) and printed.err.count("\n") == 1 and "Traceback" not in printed.err, printed.err


def test_debug_prints_the_traceback_of_an_internal_error(monkeypatch, capsys) -> None:
    monkeypatch.setattr(launcher, "build_parser", _failing_parser(RuntimeError("boom")))
    assert launcher.main(Path("."), ["--steps", "1", "--debug"]) == 3
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().splitlines()[-1].startswith("internal error:")


def test_other_ranks_print_nothing_but_tell_torchrun(monkeypatch, capsys, tmp_path: Path) -> None:
    """Rank 1 prints nothing; its line goes to the error file torchrun gave it, which
    torchrun's own ProcessFailure reads back as the rank's message and its summary shows."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setattr(launcher, "build_parser", _failing_parser(LaunchError("the plan is for 4 ranks, got 2")))
    assert launcher.main(Path("."), ["--steps", "1"]) == 2
    assert capsys.readouterr().err == ""
    failure = ProcessFailure(local_rank=1, pid=123, exitcode=2, error_file=str(error_file))
    assert failure.message["message"] == "error: the plan is for 4 ranks, got 2"
    summary = str(ChildFailedError("out/launch.py", {1: failure}))
    assert "traceback : error: the plan is for 4 ranks, got 2\n" in summary


def test_the_process_exits_with_the_status(tmp_path: Path) -> None:
    code = "from codegen.runtime.launcher import exit_now; print('flushed'); exit_now(2)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "RANK": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and done.stdout == "flushed\n", done


FAILING_DATA = """
import os
import torch


def batches(batch_size):
    generator = torch.Generator().manual_seed(0)
    yield torch.randint(0, 64, (batch_size, 16), generator=generator), torch.randint(0, 64, (batch_size, 16), generator=generator)
    if os.environ["RANK"] == "1":
        raise OSError("shard 7 is missing")
    yield torch.randint(0, 64, (batch_size, 16), generator=generator), torch.randint(0, 64, (batch_size, 16), generator=generator)
"""


@pytest.mark.distributed
def test_a_failure_under_torchrun_is_one_line_in_the_output_and_in_the_summary(tmp_path: Path) -> None:
    """A data function that raises on rank 1 only, at step 2: every rank stops (none is left
    in a collective); the only lines launch.py prints about it are rank 0's ``error:`` line,
    after its step-1 line, and the line of each rank in torchrun's summary; no traceback
    from our code, no per-rank ``[rankN]:`` traceback; the ranks exit 2 (torchrun itself 1)."""
    plan = planner.plan(ModelSpec(str(REPO / "examples/gpt.py"), GPT), "cpu:1x2", dp_flavour="ddp")
    planner.compile(plan, tmp_path / "out")
    # The compiled program knows which inputs index what (the --data range check reads it).
    assert load_program(tmp_path / "out").module.INDEX_INPUTS == {
        "idx": (64, (), "embedding 'wte' (64 rows)"),
        "targets": (64, (-100,), "the loss (64 classes, ignore_index -100)"),
    }
    (tmp_path / "data.py").write_text(FAILING_DATA)
    launch = _run([*_torchrun(2), "out/launch.py", "--data", "data.py:batches"], cwd=tmp_path, timeout=180)
    line = ("error: --data: batches(4) raised OSError: shard 7 is missing while yielding the batch of step 2; fix the "
            "data function (on rank(s) 1)")
    assert launch.returncode == 1, launch.describe()  # torchrun's status when a rank failed
    ours = [text for text in launch.stderr.splitlines() if text.startswith(("error:", "internal error:"))]
    assert ours == [line], launch.describe()
    assert launch.stdout.splitlines()[-1].startswith("step 1:"), launch.describe()  # nothing after the step
    assert "[rank" not in launch.stderr and "codegen/" not in launch.stderr and "launch.py\", line" not in launch.stderr
    root_cause = launch.stderr.split("Root Cause (first observed failure):")[1]
    assert "exitcode  : 2" in root_cause and f"traceback : {line}" in root_cause, launch.describe()
    assert launch.stderr.count(f"traceback : {line}") == 2, launch.describe()  # both ranks' entries


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
