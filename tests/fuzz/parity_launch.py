"""Parity-check many compiled programs with as few torchrun launches as possible.

Starting gloo processes costs seconds, so the programs of one world size are checked by
``tests/dist_check_many.py`` in one launch, which prints one ``RESULT`` line per program, in
order. A program that hangs (a collective some ranks never reach) or kills a rank stops the launch:
the launch is stopped when no line came for a while, or ends, the first program without a
line is reported as the one that stopped it, and the programs after it are checked in a new
launch. Unlike
``tests/test_parity.check_many`` this does not need pytest, so the benchmark uses it too.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DIST_CHECK_MANY = Path(__file__).resolve().parents[1] / "dist_check_many.py"


def check_programs(world: int, folders: list[Path], cwd: Path, stall_s: float = 180) -> dict[Path, str]:
    """The result of each program in ``folders``, checked at ``world`` ranks: ``"ok ..."`` or
    ``"FAILED ..."`` (dist_check_many.py's line without its prefix), or
    ``"FAILED launch stopped in this program: ..."`` for one that killed a rank (a collective
    whose sizes differ between ranks aborts gloo) or gave no result for ``stall_s`` seconds
    (a collective some ranks never reach). A program that fails after another one failed in
    the same launch is checked again in a launch of its own, so one broken program does not
    take the next ones down with it."""
    results: dict[Path, str] = {}
    pending = list(folders)
    while pending:
        status, stdout, stderr = _launch(world, pending, cwd, stall_s)
        retry, failed_before, stopped = [], False, False
        for folder in pending:
            line = _result_line(stdout, folder)
            ok = line is not None and line.startswith("ok ")
            if line is None and not stopped and not failed_before:
                # The first program without a line stopped the launch (lines come in order).
                why = f"no result for {stall_s:.0f} s (hung)" if status is None else _crash_reason(status, stderr)
                results[folder] = f"FAILED launch stopped in this program: {why}"
                stopped = True
            elif line is None or (failed_before and not ok):
                # Not run, or failed after another program failed: a failed program may leave
                # a collective half-done in the process group, so check it in a fresh launch.
                retry.append(folder)
            else:
                results[folder] = line
                failed_before = failed_before or not ok
        pending = retry
    return results


def _launch(world: int, folders: list[Path], cwd: Path, stall_s: float) -> tuple[int | None, str, str]:
    """Run one launch; returns (exit status or ``None`` if it stalled, stdout, stderr).

    Output goes to files, not pipes: a worker that outlives torchrun would keep a pipe open.
    A launch that prints no new ``RESULT`` line for ``stall_s`` seconds gets SIGTERM, which
    torchrun passes on to its workers (they run in sessions of their own), then SIGKILL."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), str(DIST_CHECK_MANY)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PET_MASTER_PORT=str(_free_port()))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen([*command, *map(str, folders)], cwd=cwd, env=env, stdout=out, stderr=err, text=True)
        seen, last_progress, stalled = 0, time.monotonic(), False
        while process.poll() is None:
            time.sleep(0.5)
            out.seek(0)
            count = out.read().count("RESULT ")
            if count != seen:
                seen, last_progress = count, time.monotonic()
            elif time.monotonic() - last_progress > stall_s:
                _stop(process)
                stalled = True
        out.seek(0)
        err.seek(0)
        return (None if stalled else process.returncode), out.read(), err.read()


def _stop(process: subprocess.Popen) -> None:
    """Stop torchrun and its workers: SIGTERM (torchrun stops its workers), then SIGKILL for
    any worker still alive."""
    workers = _children(process.pid)
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _children(pid: int) -> list[int]:
    """The process ids of ``pid``'s children (Linux ``/proc``; none elsewhere)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(child) for child in task.read_text().split()]
        except OSError:
            continue
    return found


def _crash_reason(status: int | None, stderr: str) -> str:
    """The launch's exit status and the most telling line of its stderr."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    telling = next(
        (line for line in lines if "what():" in line or "Error:" in line or "error:" in line), lines[-1] if lines else ""
    )
    return f"exit status {status}: {telling[:400]}"


def _result_line(stdout: str, folder: Path) -> str | None:
    prefix = f"RESULT {folder} "
    lines = [line[len(prefix):] for line in stdout.splitlines() if line.startswith(prefix)]
    return lines[0] if lines else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
