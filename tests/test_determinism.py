"""The same model, cluster, seed and effort give the same plan on a quiet and on a busy machine.

The README's quick-start command plans Llama-3-8B on two DGX A100 nodes; this test plans the
same example at its ``tiny`` size on the same cluster (the same outer search: several meshes,
CP-SAT then MCMC on each, the Megatron grid; a quarter of the quick start's CPU time), at an
effort low enough that every CP-SAT solve is stopped by its work budget rather than proved
optimal: the path where a solver budget counted in seconds would make the answer depend on
the machine (the quick start's solves all end optimal, so it never took that path). It is
planned twice, as a user types it plus ``-o``: once as it is, once while two other processes
keep both cores of this machine busy, with a different Python hash seed (set iteration order
must not matter either). The two plan files must be identical but for ``timings``, the
wall-clock seconds each run took, and neither may say that the wall-clock cap cut its search.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
QUICK_START = ["python", "-m", "planner", "plan", "examples/llama.py", "--cluster", "dgx-a100-80g:2"]
# The quick start's example and cluster at the example's test size. Effort 0.02 gives each
# mesh's CP-SAT 0.04 units of deterministic time (search/budget.py), less than it needs to
# prove its answer optimal here, so each solve ends on its work budget.
SMALL_QUICK_START = [*QUICK_START, "--set", "size=tiny", "--effort", "0.02"]
TIMEOUT_S = 600  # both runs finish in under a minute on 2 cores; this only stops a hang


def _plan(output: Path, hash_seed: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    command = [sys.executable, *SMALL_QUICK_START[1:], "-o", str(output)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"$ {' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(output.read_text())


def test_the_quick_start_command_is_the_one_in_the_readme():
    assert " ".join(QUICK_START) in README.read_text()


@pytest.mark.distributed  # slow: two plans in subprocesses, one on a loaded machine
def test_the_quick_start_plans_the_same_on_a_loaded_machine(tmp_path):
    quiet = _plan(tmp_path / "quiet.json", hash_seed="1")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded = _plan(tmp_path / "loaded.json", hash_seed="2")
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert set(quiet["timings"]) == set(loaded["timings"]) == {"trace_s", "search_s", "total_s"}
    quiet.pop("timings"), loaded.pop("timings")
    differing = sorted(key for key in quiet if quiet[key] != loaded.get(key))
    assert quiet == loaded, f"fields that differ: {differing}"
    assert not any("wall-clock cap" in warning for warning in quiet["warnings"])
    # What makes the comparison worth it: several meshes searched, every CP-SAT solve ended by
    # its work budget (a gap, not "optimal"), MCMC walked, and runners-up from other routes.
    summary = quiet["search_summary"]
    meshes = summary.count("CP-SAT gap")
    assert meshes >= 3 and "CP-SAT optimal" not in summary and summary.count("MCMC") == meshes, summary
    assert len({runner["route"] for runner in quiet["runners_up"]}) >= 2, quiet["runners_up"]
