"""The CUDA path of compiled programs at world 1: plan a model for the one-device cluster,
compile it, and run ``launch.py --check --steps N`` under torchrun (NCCL on a GPU, gloo on a
dry run), in fp32 and in bf16; report the parity verdict and the measured step time beside
the plan's prediction.

Models: ``examples/gpt.py`` (GPT-2 small's shape on a GPU), a tiny ``hf:llama`` (built from
its config, nothing downloaded) and ``examples/moe.py`` (top-2 of 8 experts); on a dry run
each at the tiny sizes the tests use.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import planner
from planner.cluster import Cluster
from planner.errors import PlannerError
from planner.model_spec import ModelSpec

REPO = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16")
PARITY_LINE = re.compile(r"^parity (ok|FAILED|failed)[^\n]*$", re.MULTILINE)


@dataclass(frozen=True)
class ModelCase:
    """One model to plan, compile and run: its spec and its overrides on a GPU and on a dry run."""

    name: str
    source: str
    gpu: dict[str, Any]
    dry: dict[str, Any]

    def spec(self, dry_run: bool) -> ModelSpec:
        return ModelSpec(self.source, dict(self.dry if dry_run else self.gpu))


MODELS = (
    ModelCase("gpt", str(REPO / "examples" / "gpt.py"),
              gpu=dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, seq_len=1024, batch_size=8),
              dry=dict(n_layer=2, n_head=4, n_embd=64, seq_len=32, batch_size=4)),
    ModelCase("llama", "hf:llama",
              gpu=dict(num_hidden_layers=4, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                       num_key_value_heads=4, vocab_size=32000, seq_len=1024, batch_size=8),
              dry=dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, seq_len=32, batch_size=4)),
    ModelCase("moe", str(REPO / "examples" / "moe.py"),
              gpu=dict(n_layer=4, n_head=12, n_embd=768, n_expert=8, top_k=2, ffn=2048, vocab_size=32000,
                       seq_len=1024, batch_size=8),
              dry=dict(n_layer=2, n_head=4, n_embd=64, n_expert=4, top_k=2, ffn=128, seq_len=32, batch_size=4)),
)


def search_here() -> tuple[str, str | None]:
    """The search the plans use on this machine: ``("auto", None)`` when OR-tools (the
    CP-SAT search) imports; else ``("dp", why)``: data parallelism, which is what a
    one-device plan of a plain model is anyway, while a model whose samples mix (MoE) cannot
    be planned without it. The GPU machines' image has no OR-tools (a session carries its
    wheel: see ``benchmarks/gpu_check.py``)."""
    try:
        importlib.import_module("ortools.sat.python.cp_model")
    except ImportError as error:
        return "dp", (f"OR-tools does not import here ({error}), so the plans are searched over data parallelism "
                      f"only; carry its wheel (benchmarks/gpu_check.py says how)")
    return "auto", None


def program_results(case: ModelCase, precision: str, cluster: Cluster, folder: Path, steps: int,
                    time_left: Callable[[], float], say: Callable[[str], None]) -> dict[str, Any]:
    """Plan ``case`` for ``cluster`` in ``precision``, compile it into ``folder`` and run its
    ``launch.py --check --steps`` under torchrun, within ``time_left()`` seconds. Returns one
    result row: parity, measured and predicted step time, peak memory; or a failure with the
    output's last lines."""
    name = f"{case.name} {precision}"
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    search, without_ortools = search_here()
    try:
        plan = planner.plan(case.spec(dry_run=cluster.backend == "gloo"), cluster, precision=precision, search=search,
                            progress=False, time_budget_s=max(10.0, min(120.0, time_left() / 2)))
    except PlannerError as error:
        if without_ortools is None:
            raise
        return {"name": name, "status": "failed", "planner_error": str(error),
                "reason": f"{case.name} needs the CP-SAT search to plan (its samples mix): {without_ortools}"}
    plan.save(folder / "plan.json", force=True)
    program = planner.compile(plan, folder / "out", force=True)
    planned_s = time.monotonic() - started
    say(f"  {name}: planned ({plan.dp_flavour}, predicted step {plan.estimate.step_time_s * 1e3:.2f} ms) "
        f"and compiled in {planned_s:.0f} s; running launch.py --check --steps {steps}")
    metrics = folder / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               str(program / "launch.py"), "--check", "--steps", str(steps), "--metrics", str(metrics)]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    row: dict[str, Any] = {"name": name, "search": search, "dp_flavour": plan.dp_flavour, "mesh": str(plan.mesh),
                           "predicted_step_s": plan.estimate.step_time_s,
                           "predicted_peak_memory_bytes": plan.estimate.memory.total,
                           "predicted_mfu": plan.estimate.mfu, "command": " ".join(command)}
    limit = max(5.0, time_left())
    done = run_to_end(command, environment, folder, limit)
    output = done.stdout + done.stderr
    if done.returncode is None:
        return {**row, "status": "failed", "reason": f"launch.py ran past the section's budget ({limit:.0f} s) and was stopped",
                "output_tail": output.splitlines()[-20:]}
    parity = PARITY_LINE.search(done.stdout)
    row.update(exit_status=done.returncode, parity=parity.group(0) if parity else None,
               parity_ok=bool(parity and parity.group(1) == "ok"))
    records = _records(metrics)
    if done.returncode != 0 or not records:
        return {**row, "status": "failed",
                "reason": f"launch.py exited {done.returncode}" + ("" if records else " with no step recorded"),
                "output_tail": output.splitlines()[-20:]}
    steady = [record["step_time_s"] for record in records[1:]] or [records[0]["step_time_s"]]
    measured = statistics.median(steady)
    row.update(measured_s=measured, predicted_s=plan.estimate.step_time_s, steps=len(records),
               first_step_s=records[0]["step_time_s"], measured_mfu=records[-1]["mfu"],
               measured_peak_memory_bytes=max(record["peak_memory_bytes"] for record in records),
               final_loss=records[-1]["loss"],
               note=f"{row['parity'] or 'no parity line'}; median of {len(steady)} steps after the first")
    return row


def run_to_end(command: list[str], environment: dict[str, str], folder: Path, limit_s: float) -> subprocess.CompletedProcess:
    """Run ``command`` in a process group of its own for at most ``limit_s`` seconds. Past the
    limit, or when this process is interrupted, the group is stopped (``stop_group``); the
    returned ``returncode`` is then None."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
                               cwd=folder, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=limit_s)
        return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    except subprocess.TimeoutExpired:
        stop_group(process)
        stdout, stderr = process.communicate()
        return subprocess.CompletedProcess(command, None, stdout, stderr)
    except BaseException:
        stop_group(process)
        raise


def stop_group(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to ``process``'s group (it leads one), then SIGKILL after ``grace_s``. torchrun
    starts its workers in sessions of their own and stops them itself on SIGTERM, so the
    grace period lets it do that: a worker left running would hold the GPU."""
    for number in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, number)
        try:
            process.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _records(path: Path) -> list[dict[str, Any]]:
    """The step records ``--metrics`` wrote (none if the file is missing)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


__all__ = ["MODELS", "PRECISIONS", "ModelCase", "program_results", "search_here"]

