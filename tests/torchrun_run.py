"""Run a script under ``torchrun`` on gloo processes for a test: the shared launcher of
``tests/test_adasum.py``, ``tests/test_layer_separation.py`` and ``tests/test_hsdp_program.py``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 300  # seconds; a launch takes ~10-40 s on 2 cores, the limit only stops a hung collective


def torchrun(world: int, *arguments: str, fails: bool = False, cwd: Path | None = None) -> str:
    """``torchrun --nproc_per_node world ARGUMENTS`` with this checkout on the path; its
    stdout, after asserting it succeeded (with ``fails``: its stdout and stderr, after
    asserting it failed). On timeout its whole process group is killed
    (workers wait for ever in a collective otherwise)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), *arguments]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(port)}
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"timed out after {TIMEOUT} s: {' '.join(command)}\n{stdout[-2000:]}{stderr[-2000:]}")
    if fails:
        assert process.returncode != 0, f"{' '.join(command)} succeeded\n{stdout[-3000:]}"
        return stdout + stderr
    assert process.returncode == 0, f"{' '.join(command)}\n{stdout[-3000:]}{stderr[-3000:]}"
    return stdout
