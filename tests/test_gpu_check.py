"""``benchmarks/gpu_check.py`` works the day a GPU is lent: its CPU dry run (gloo, tiny
shapes, the ``cpu`` preset) runs every section end to end here, the figures it compares
against are the cost model's own, and its output is guarded like every other writer's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_check_kernels import (  # noqa: E402
    DRY_TIMING,
    attention_items,
    gemm_items,
    predicted_times,
    sustained_s,
)
from benchmarks.gpu_check_report import SECTIONS, load_cluster, simulated_cluster  # noqa: E402
from cost_model import gpu_kernels  # noqa: E402

SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def run_script(*arguments: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, check=False)


@pytest.mark.distributed
def test_dry_run_measures_every_section_and_reruns_one(tmp_path):
    results = tmp_path / "gpu_check.json"
    done = run_script("--dry-run", "-o", str(results))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(results.read_text())
    assert data["environment"]["dry_run"] is True and data["environment"]["torch"] == torch.__version__
    assert data["complete"] is True
    assert set(data["sections"]) == set(SECTIONS)
    programs = data["sections"]["programs"]
    # Every model in both precisions: planned, compiled, checked against one device, trained.
    assert sorted(row["name"] for row in programs) == sorted(
        f"{model} {precision}" for model in ("gpt", "llama", "moe") for precision in ("fp32", "bf16"))
    for row in programs:
        assert row["exit_status"] == 0 and row["parity_ok"], row
        assert row["parity"].startswith("parity ok: max_abs_err="), row
        assert row["steps"] == 3 and row["measured_s"] > 0 and row["predicted_s"] > 0, row
    for section in ("gemm", "attention", "memory", "launch"):
        rows = data["sections"][section]
        assert rows, section
        for row in rows:
            assert row["measured_s"] > 0 and row["predicted_s"] > 0, row
            assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1), row
    names = [row["name"] for row in data["sections"]["gemm"] + data["sections"]["attention"]]
    assert all(f"{name.rsplit(' ', 1)[0]} bwd" in names for name in names if name.endswith(" fwd"))
    assert {row["name"].split()[1] for row in data["sections"]["memory"] if row["name"].startswith("adamw")} == {
        "foreach", "fused"}
    for row in programs + data["sections"]["gemm"]:  # the table shows every item
        assert row["name"] in done.stdout
    assert "the figures are not meaningful" in done.stdout

    # --only reruns one section into the same file and keeps the others.
    again = run_script("--dry-run", "--only", "launch", "-o", str(results))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rerun = json.loads(results.read_text())
    assert rerun["sections"]["programs"] == programs
    assert len(rerun["sections"]["launch"]) == len(data["sections"]["launch"])
    assert rerun["environment"]["started"] >= data["environment"]["started"]


def test_a_spent_budget_skips_items_and_says_how_to_rerun(tmp_path):
    results = tmp_path / "gpu_check.json"
    done = run_script("--dry-run", "--only", "gemm", "--budget", "1e-9", "-o", str(results))
    assert done.returncode == 0, done.stderr
    data = json.loads(results.read_text())
    rows = data["sections"]["gemm"]
    assert rows and all(row["status"] == "skipped" and "--only gemm" in row["reason"] for row in rows)
    assert data["complete"] is True and not data["sections"]["programs"]


def test_refuses_to_overwrite_a_file_it_did_not_write(tmp_path):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}\n')
    done = run_script("--dry-run", "-o", str(notes))
    assert done.returncode == 2
    assert done.stderr.startswith("error: refusing to overwrite") and done.stderr.count("\n") == 1, done.stderr
    assert notes.read_text() == '{"mine": true}\n'


def test_refuses_a_work_folder_holding_a_users_files(tmp_path):
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "cluster.json").write_text("mine\n")
    done = run_script("--dry-run", "--work", str(mine), "-o", str(tmp_path / "gpu_check.json"))
    assert done.returncode == 2
    assert done.stderr.startswith("error: --work:") and done.stderr.count("\n") == 1, done.stderr
    assert (mine / "cluster.json").read_text() == "mine\n" and not (tmp_path / "gpu_check.json").exists()


def test_without_or_tools_plain_models_plan_and_moe_says_why(tmp_path, monkeypatch):
    """The GPU machines' image has no OR-tools: one-device plans of plain models need none
    (data parallelism is all one device gets), and the MoE rows name the missing package."""
    from benchmarks import gpu_check_programs as programs

    def without_ortools(name):
        raise ImportError(f"No module named {name!r}")

    # Only the script's own look-up fails: the planner's search never gets to need OR-tools.
    monkeypatch.setattr(programs, "importlib", SimpleNamespace(import_module=without_ortools))
    assert programs.search_here()[0] == "dp"
    cluster = load_cluster(simulated_cluster("cpu", dry_run=True)[0], tmp_path)[0]
    moe = next(case for case in programs.MODELS if case.name == "moe")
    row = programs.program_results(moe, "fp32", cluster, tmp_path / "moe", 2, lambda: 60.0, lambda text: None)
    assert row["status"] == "failed" and "OR-tools does not import here" in row["reason"], row
    assert "mixes the samples" in row["planner_error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script runs for real")
def test_without_a_gpu_it_asks_for_dry_run(tmp_path):
    done = run_script("-o", str(tmp_path / "gpu_check.json"))
    assert done.returncode == 2
    assert done.stderr.startswith("error: no CUDA device") and "--dry-run" in done.stderr and done.stderr.count("\n") == 1
    assert not (tmp_path / "gpu_check.json").exists()


# The 80 GB GPUs: nvidia-smi's total less 988 MiB of CUDA context and one NCCL communicator
# (planner.gpu_presets.usable_memory_bytes): (81,559 - 988) x 2**20 and (81,920 - 988) x 2**20.
@pytest.mark.parametrize(("device_name", "generation", "memory"), [
    ("NVIDIA H200", "H200", 141e9),
    ("NVIDIA H100 80GB HBM3", "H100", 84_484_816_896),
    ("NVIDIA A100-SXM4-80GB", "A100", 84_863_352_832),
    ("Tesla V100-SXM2-16GB", "V100", 16e9),
    ("NVIDIA GeForce RTX 4090", "H100", 84_484_816_896),  # no preset: the closest guess, said so
])
def test_predictions_are_for_the_gpu_it_runs_on(tmp_path, device_name, generation, memory):
    data, reason = simulated_cluster(device_name, dry_run=False)
    cluster, _ = load_cluster(data, tmp_path)
    device = cluster.device_of(0)
    assert cluster.world_size == 1 and cluster.backend == "nccl"
    assert gpu_kernels.generation_of(device).name == generation
    assert device.memory_bytes == memory
    assert ("no preset names" in reason) == (generation == "H100" and "H100" not in device_name)


def test_kernel_predictions_are_the_cost_models_gpu_kernel_model(tmp_path):
    """On a GPU preset the table's predictions reach the shape-aware kernel model (tiles and
    waves for GEMMs, FlashAttention for attention), not the roofline."""
    data, _ = simulated_cluster("NVIDIA H100 80GB HBM3", dry_run=False)
    device = load_cluster(data, tmp_path)[0].device_of(0)
    generation = gpu_kernels.generation_of(device)
    gemm = next(item for item in gemm_items(dry_run=False) if item.name.startswith("70B down"))
    forward, backward, ops = predicted_times(gemm, device)
    tokens, out_features, in_features = 4096, 8192, 28672
    assert ops == 1
    assert forward == pytest.approx(gpu_kernels.matmul_time(1, tokens, out_features, in_features, device, "bfloat16", 2,
                                                            generation))
    assert backward == pytest.approx(
        gpu_kernels.matmul_time(1, tokens, in_features, out_features, device, "bfloat16", 2, generation)
        + gpu_kernels.matmul_time(1, in_features, out_features, tokens, device, "bfloat16", 2, generation))
    attention = next(item for item in attention_items(dry_run=False) if item.name == "sdpa b4 h32 s4096 d128 causal")
    forward, backward, _ = predicted_times(attention, device)
    assert (forward, backward) == pytest.approx(
        gpu_kernels.attention_times(4 * 32, 4096, 4096, 128, True, device, "bfloat16", generation))


def test_sustained_timing_counts_every_call():
    calls = []

    def sleep_a_millisecond():
        calls.append(None)
        import time

        time.sleep(0.001)

    per_call, timed = sustained_s(sleep_a_millisecond, torch.device("cpu"), DRY_TIMING.warm_s, DRY_TIMING.measure_s)
    assert per_call >= 0.001 and timed >= 3 and len(calls) > timed
