"""Predicted against measured step time, on this machine.

    python benchmarks/measured_vs_predicted.py [--quick-profile] [--steps 15]

1. Profiles this machine for 2 processes (``planner profile``: matmul and streaming
   throughput, gloo all-reduce alpha/beta) into a cluster file.
2. Plans examples/gpt.py (4 layers, hidden 256, seq 128, batch 16) for that cluster as DDP
   and as FSDP, and compiles each plan.
3. Runs each under ``torchrun --nproc_per_node 2 launch.py --steps N`` and reads the mean
   step time (first step excluded).
4. Prints predicted vs measured and the relative error.

Close other work first: the machine has 2 cores, and a busy core skews both the profile and
the measurement.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import planner
from cost_model.profile import profile_machine
from planner.model_spec import ModelSpec

MODEL = {"n_layer": 4, "n_embd": 256, "n_head": 8, "vocab_size": 1024, "seq_len": 128, "batch_size": 16}
ROOT = Path(__file__).resolve().parent.parent


def measure(program: Path, steps: int, nproc: int = 2) -> float:
    """Mean step time in seconds reported by ``torchrun --nproc_per_node nproc launch.py --steps``."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc_per_node", str(nproc), str(program / "launch.py"), "--steps", str(steps)]
    output = subprocess.run(command, capture_output=True, text=True, timeout=600)
    match = re.search(r"mean step time: ([0-9.]+) ms", output.stdout)
    if output.returncode != 0 or not match:
        raise SystemExit(f"{' '.join(command)} failed:\n{output.stdout}\n{output.stderr[-2000:]}")
    return float(match[1]) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick-profile", action="store_true", help="a shorter, noisier profile")
    parser.add_argument("--steps", type=int, default=15, help="training steps per measurement")
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="soap-measured-"))
    print("profiling this machine (2 processes)...", flush=True)
    cluster = profile_machine(nproc=2, quick=options.quick_profile)
    cluster.save(work / "cluster.toml")
    device = cluster.nodes[0].device
    print(f"  {device.name}: {device.flops_for('float32') / 1e9:.1f} GFLOP/s fp32, "
          f"{device.memory_bandwidth / 1e9:.1f} GB/s, all-reduce alpha {cluster.nodes[0].intra_link.latency * 1e6:.0f} us, "
          f"beta {cluster.nodes[0].intra_link.bandwidth / 1e9:.2f} GB/s")
    spec = ModelSpec(str(ROOT / "examples/gpt.py"), MODEL)
    print(f"model: examples/gpt.py {MODEL}")
    print(f"{'plan':<14}{'predicted':>12}{'measured':>12}{'error':>9}")
    for flavour in ("ddp", "fsdp"):
        plan = planner.plan(spec, cluster, dp_flavour=flavour)
        program = planner.compile(plan, work / flavour)
        measured = measure(program, options.steps)
        predicted = plan.estimate.step_time_s
        print(f"{plan.name:<14}{predicted * 1e3:>10.1f}ms{measured * 1e3:>10.1f}ms{predicted / measured - 1:>+9.0%}", flush=True)


if __name__ == "__main__":
    main()
