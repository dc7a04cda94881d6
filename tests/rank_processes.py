"""Start a test harness script on ``world`` gloo processes directly, as torchrun's workers.

``torchrun`` is what a user types, and the tests of ``launch.py`` keep it. A harness such
as ``dist_check_many.py`` only needs the processes: torchrun's agent is one more Python
process that imports torch (about 1.2 s of CPU, measured with ``/usr/bin/time`` on a
world-2 launch of an all-reduce: 4.7 s under torchrun, 3.5 s without) before any worker
starts, and on a 2-core CI machine that is wall time, once per launch. So ``launch_ranks``
does the agent's part itself: each rank gets the environment torchrun gives a worker on one
node (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` of a free port); as torchrun does, when one rank fails the others are
stopped, and the launch fails with the first failing rank's status.
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

POLL_S = 0.05  # how often the ranks' states are looked at (torchrun's --monitor-interval is 0.1 s)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_environment(world: int, rank: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for worker ``rank`` of ``world`` on one node."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",  # what torchrun picks for more than one process per node
    }


def launch_ranks(world: int, script: Path, arguments: list[str], cwd: Path, timeout: float,
                 environment: dict[str, str] | None = None) -> tuple[int | None, str, str]:
    """Run ``python script *arguments`` as ranks 0..world-1 (with ``environment`` added to
    this process's) and wait for them all. Returns
    (exit status, stdout, stderr): status 0 when every rank exited 0, the first failing
    rank's status otherwise, None when ``timeout`` seconds passed first (every rank is then
    killed, with the processes it started). Each output is the ranks' own, rank 0's first, as
    torchrun passes them on (without its interleaving)."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="ranks") as folder:
        outputs = [(Path(folder) / f"{rank}.out", Path(folder) / f"{rank}.err") for rank in range(world)]
        processes = []
        for rank, (out, err) in enumerate(outputs):
            with open(out, "w") as stdout, open(err, "w") as stderr:
                processes.append(subprocess.Popen(
                    [sys.executable, str(script), *arguments], cwd=cwd, stdout=stdout, stderr=stderr,
                    env={**os.environ, **(environment or {}), **rank_environment(world, rank, port)}, start_new_session=True,
                ))
        status = _wait(processes, timeout)
        stdout = "".join(out.read_text(errors="replace") for out, _ in outputs)
        stderr = "".join(err.read_text(errors="replace") for _, err in outputs)
    return status, stdout, stderr


def _wait(processes: list[subprocess.Popen], timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while True:
        codes = [process.poll() for process in processes]
        failed = [code for code in codes if code not in (None, 0)]
        if failed or all(code == 0 for code in codes):
            _kill(processes)  # the ranks still waiting in a collective for a failed one
            return failed[0] if failed else 0
        if time.monotonic() > deadline:
            _kill(processes)
            return None
        time.sleep(POLL_S)


def _kill(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended in between
                pass
        process.wait()
