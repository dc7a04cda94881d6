"""Heterogeneous clusters: uneven data-parallel shares against the even split and against the
fast devices alone, simulated on two mixes and measured on CPU.

    python benchmarks/heterogeneous.py              # (a) and (b), about 3 minutes on 2 cores
    python benchmarks/heterogeneous.py --simulated  # (a) only
    python benchmarks/heterogeneous.py --steps 12   # (b) with more measured steps
    python benchmarks/heterogeneous.py --pipelines  # (d) only, simulated and measured
    python benchmarks/heterogeneous.py --pipelines --simulated  # (d) simulated only, about 2 minutes

(a) Simulated step of each mix: the even data-parallel plan (every rank B/dp samples, the step
    waits for the slowest device), the same flavour on the fastest devices alone (the others
    left out), and ours (``planner.families.uneven_dp``: shares by speed and memory).
    Mixes: ``examples/clusters/mixed.toml`` (2 fast + 2 slow CPU-class devices, GPT example at
    a CPU size, DDP) and ``examples/clusters/a100-h100.toml`` (4 DGX A100 + 4 DGX H100 nodes,
    a GPT-13B as MPT-13B's llm-foundry run: 40 layers, width 5120, 40 heads, sequence 2048,
    2 sequences per GPU, FSDP, bf16).
(b) Measured on CPU gloo at world 4 on ``mixed.toml``: the uneven and the even DDP programs of
    the CPU GPT, each rank slowed to its declared speed (``launch.py
    --slowdown-from-cluster 16``: the fast ranks 16x slower than a core of this host, the slow
    ones 32x, ``codegen/runtime/slowdown.py``),
    median step time over the steps after the first two, beside the prediction. The CPU
    devices' figures are the ``cpu`` preset's placeholders (not a profile of this host), so
    the absolute predictions are not expected to match; the ratio uneven / even is the claim.
(d) Pipelines with one stage per device group (``planner.families.hetero_pipeline``, Metis):
    on each mix, the family's best plan (blocks balanced by speed and memory, the stage order
    chosen), simulated, against the same configuration with Megatron-LM's even split of the
    blocks (``search.layouts.nearly_even_layers``), each stage priced on its own device; on
    ``mixed.toml`` both programs also measured as (b) measures them (the plan's cluster lists
    its nodes in stage order, so the slowdown follows each stage's device).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.api import prepare_model  # noqa: E402
from planner.cluster import Cluster  # noqa: E402
from planner.device_groups import device_groups, sub_cluster  # noqa: E402
from planner.families.uneven_dp.candidates import uneven_plan  # noqa: E402
from planner.model_spec import ModelSpec  # noqa: E402
from search.budget import SearchBudget  # noqa: E402
from search.data_parallel import data_parallel_plan  # noqa: E402
from search.layouts import nearly_even_layers  # noqa: E402

MIXED = REPO / "examples/clusters/mixed.toml"
# The fast ranks compute 16x slower than a core and the slow ones 32x (launch.py
# --slowdown-from-cluster 16): sleeps, not the shared cores the ranks contend for, fill the step.
# At 4, with a load average of 15 on 2 cores, contention alone stretched the ranks nearly as
# much as the sleeps meant to (this GPT measured 1.19x, one 4x its width x sequence 1.08x; at
# 16 this GPT measures 1.28x; predicted 1.43x).
SLOWDOWN_BASE = 16
A100_H100 = REPO / "examples/clusters/a100-h100.toml"
# The CPU GPT: large enough that compute, not dispatch, fills a step on one core.
CPU_GPT = {"n_layer": 4, "n_embd": 128, "n_head": 4, "seq_len": 64, "vocab_size": 256, "batch_size": 24}
# MPT-13B as llm-foundry ran it on 64 H100s (benchmarks/fidelity.py: 40 x 5120, 40 heads,
# seq 2048, 2 per GPU, FSDP); vocabulary as fidelity.py's MPT_VOCAB.
GPT_13B = {"n_layer": 40, "n_embd": 5120, "n_head": 40, "vocab_size": 50368, "seq_len": 2048, "batch_size": 128}
MIXES = (
    ("2 fast + 2 slow CPU, GPT (CPU size)", MIXED, CPU_GPT, "ddp", "fp32"),
    ("4 DGX A100 + 4 DGX H100, GPT-13B", A100_H100, GPT_13B, "fsdp", "bf16"),
)


def three_plans(cluster_file: Path, overrides: dict, flavour: str, precision: str):
    """(even, fast devices alone, uneven) plans of the GPT example on the cluster file."""
    spec = ModelSpec(str(REPO / "examples/gpt.py"), overrides)
    graph, spec, name, cluster = prepare_model(spec, Cluster.load(cluster_file))
    even = data_parallel_plan(graph, cluster, spec, name, flavour, (), precision)
    fastest = max(device_groups(cluster), key=lambda group: group.peak_flops("bfloat16"))
    fast = data_parallel_plan(graph, sub_cluster(cluster, fastest.device), spec, name, flavour, (), precision)
    return even, fast, uneven_plan(even, graph)


def simulated_rows() -> list[tuple]:
    """(a): one row per mix."""
    rows = []
    for title, cluster_file, overrides, flavour, precision in MIXES:
        even, fast, ours = three_plans(cluster_file, overrides, flavour, precision)
        rows.append((title, even, fast, ours))
        shares = ours.sections["uneven"].shares
        print(f"{title}\n  even {even.name}: {even.estimate.step_time_s * 1e3:.1f} ms"
              f"{'' if even.estimate.fits else ' (does not fit)'}\n"
              f"  fast devices alone {fast.name} on {fast.world_size} ranks: {fast.estimate.step_time_s * 1e3:.1f} ms"
              f"{'' if fast.estimate.fits else ' (does not fit)'}\n"
              f"  ours, shares {sorted(set(shares))} (ranks 0 and {len(shares) - 1}: {shares[0]}, {shares[-1]}): "
              f"{ours.estimate.step_time_s * 1e3:.1f} ms: {even.estimate.step_time_s / ours.estimate.step_time_s:.2f}x "
              f"the even plan, {fast.estimate.step_time_s / ours.estimate.step_time_s:.2f}x the fast devices alone",
              flush=True)
    return rows


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measured_step_s(folder: Path, steps: int, cwd: Path) -> float:
    """Median step seconds of ``launch.py --steps`` at world 4 with the cluster's slowdown,
    the first two steps (warm-up) left out."""
    metrics = cwd / f"{folder.name}.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", str(folder / "launch.py"),
               "--steps", str(steps), "--slowdown-from-cluster", str(SLOWDOWN_BASE), "--metrics", str(metrics)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(_free_port())}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return statistics.median(record["step_time_s"] for record in records[2:])


def measured_rows(steps: int) -> None:
    """(b): the uneven and the even DDP programs on mixed.toml, predicted and measured."""
    import planner

    even, _, ours = three_plans(MIXED, CPU_GPT, "ddp", "fp32")
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        measured = {}
        for label, plan in (("even", even), ("uneven", ours)):
            folder = planner.compile(plan, scratch / label)
            measured[label] = measured_step_s(folder, steps, scratch)
    predicted = {"even": even.estimate.step_time_s, "uneven": ours.estimate.step_time_s}
    print(f"measured on CPU gloo, world 4, mixed.toml, slow ranks 2x (median of {steps - 2} steps):")
    for label in ("even", "uneven"):
        print(f"  {label:6}: predicted {predicted[label] * 1e3:7.1f} ms, measured {measured[label] * 1e3:7.1f} ms")
    print(f"  uneven speed-up: predicted {predicted['even'] / predicted['uneven']:.2f}x, "
          f"measured {measured['even'] / measured['uneven']:.2f}x", flush=True)


def pipeline_rows(steps: int | None) -> None:
    """(d): the hetero-pp family's best plan on each mix against the even split of its blocks;
    with ``steps``, both programs of the CPU mix also measured as (b) measures."""
    import planner
    from planner.families.hetero_pipeline.candidates import staged_estimates, staged_plan

    for title, cluster_file, overrides, _, precision in MIXES:
        spec = ModelSpec(str(REPO / "examples/gpt.py"), overrides)
        graph, spec, name, cluster = prepare_model(spec, Cluster.load(cluster_file))
        estimates, grids = staged_estimates(graph, cluster, precision, ("ddp", "zero1", "fsdp"), SearchBudget())
        best = min((staged_plan(e, graph, cluster, grids, spec, name, ()) for e in estimates[:2]),
                   key=lambda plan: plan.estimate.step_time_s)
        chosen = next(e for e in estimates if e.blocks == best.sections["hetero-pp"].blocks
                      and best.sections["hetero-pp"].stage_devices[0] == device_groups(cluster)[e.order[0]].device.name)
        even = staged_plan(dataclasses.replace(chosen, blocks=nearly_even_layers(sum(chosen.blocks), len(chosen.blocks))),
                           graph, cluster, grids, spec, name, ())
        section = best.sections["hetero-pp"]
        print(f"{title}, pipeline per device group:\n"
              f"  ours {best.name}: blocks {'/'.join(map(str, section.blocks))} on "
              f"{'/'.join(section.stage_devices)}: {best.estimate.step_time_s * 1e3:.1f} ms"
              f"{'' if best.estimate.fits else ' (does not fit)'}\n"
              f"  even split {'/'.join(map(str, even.sections['hetero-pp'].blocks))}: "
              f"{even.estimate.step_time_s * 1e3:.1f} ms{'' if even.estimate.fits else ' (does not fit)'}: "
              f"ours {even.estimate.step_time_s / best.estimate.step_time_s:.2f}x", flush=True)
        if steps is None or cluster_file != MIXED:
            continue
        with tempfile.TemporaryDirectory() as scratch:
            scratch = Path(scratch)
            measured = {label: measured_step_s(planner.compile(plan, scratch / label), steps, scratch)
                        for label, plan in (("even", even), ("ours", best))}
        print(f"  measured on CPU gloo, world 4, slow ranks 2x (median of {steps - 2} steps): even split "
              f"{measured['even'] * 1e3:.1f} ms, ours {measured['ours'] * 1e3:.1f} ms: ours "
              f"{measured['even'] / measured['ours']:.2f}x (predicted "
              f"{even.estimate.step_time_s / best.estimate.step_time_s:.2f}x)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--simulated", action="store_true", help="(a) only: nothing launched")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per program (>= 3; default 8)")
    parser.add_argument("--pipelines", action="store_true", help="(d) only: pipelines per device group")
    options = parser.parse_args()
    if options.pipelines:
        pipeline_rows(None if options.simulated else max(3, options.steps))
        return
    simulated_rows()
    if not options.simulated:
        measured_rows(max(3, options.steps))


if __name__ == "__main__":
    main()
