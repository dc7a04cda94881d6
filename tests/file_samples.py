"""Real files a user shares, for tests that damage them: a plan of examples/mlp.py on
cpu:1x2 (written by ``planner plan -o``), a preset's cluster file and a routing statistics
file, plus ``run_cli``, which runs ``planner`` in-process and returns what it printed
(``user_errors.assert_one_error_line`` checks a refusal)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

from planner.cli import main
from planner.cluster import Cluster

REPO = Path(__file__).resolve().parents[1]
MLP = str(REPO / "examples" / "mlp.py")


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``planner ARGV`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


def write_real_plan(folder: Path) -> dict[str, Any]:
    """Plan examples/mlp.py on cpu:1x2 with the CLI, save it in ``folder``; its JSON data."""
    path = folder / "plan.json"
    status, _, err = run_cli(["plan", MLP, "--cluster", "cpu:1x2", "--effort", "0.25", "-o", str(path)])
    assert status == 0, err
    return json.loads(path.read_text())


def cluster_data() -> dict[str, Any]:
    """A preset cluster in the file layout (two nodes: the inter-node link is used)."""
    return Cluster.preset("dgx-a100-80g", nodes=2).to_dict()


def routing_data() -> dict[str, Any]:
    """A valid routing statistics file of one MoE layer with 4 experts."""
    return {
        "format": "soap-planner-routing", "version": 1, "source": "recorded over 10 steps",
        "layers": {"blocks.0.moe": {
            "experts": 4, "top_k": 2, "token_share": [0.4, 0.3, 0.2, 0.1],
            "coselection": [[0, 3, 2, 1], [3, 0, 1, 1], [2, 1, 0, 1], [1, 1, 1, 0]],
        }},
    }
