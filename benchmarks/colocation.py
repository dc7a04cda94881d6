"""Two data-parallel jobs sharing the same devices: predicted and measured step times.

    python benchmarks/colocation.py                    # both parts
    python benchmarks/colocation.py --measured-only --worlds 2 --steps 12
    python benchmarks/colocation.py --simulated-only --gpus 8 64

(a) Measured, CPU gloo at world 2 and 4: job A is examples/gpt.py and job B examples/cnn.py,
both DDP, planned for ``cpu:1xW`` (``planner.plan``) and compiled co-located (``planner
compile --colocate``). Four torchrun runs each: job A alone (its own ``job_a/launch.py``), job
B alone, both one after the other (``launch.py --one-after-the-other``: each job's step whole)
and both co-located (``launch.py``: crossover order, one job's all-reduces in flight under the
other's compute). Measured: the median step (a round: one step of each job) after the first,
between barriers, the median of ``--repeats`` runs of each kind, interleaved; predicted: ``planner.colocate`` (the simulator's step of each plan alone,
their sum, and the co-located round).

What a 2-core host can show, and what it cannot: the co-located program runs, each job
trains bit-identically to alone (its ``--check``), and its round is no longer than one
after the other by more than noise. It cannot show the gain a GPU cluster would see: W
processes share 2 cores, so one job's "compute" and the other's all-reduce (gloo reduces on
the CPU too) contend for the same cores instead of running on a GPU and a NIC side by side;
the models are tiny (their all-reduces last microseconds), and other processes on the host
add noise. The figures are a smoke test of the program, not of the idea.

(b) Simulated, CrossoverScheduler's setting: two data-parallel jobs (DDP, mixed precision:
fp16 on V100, bf16 on A100) of ResNet-50 (He et al. 2016; ``hf:resnet``, whose default
config is ResNet-50: bottleneck blocks 3-4-6-3, 25.6M parameters, 224 x 224 images, 32 per
GPU) and BERT-Large (Devlin et al. 2019: 24 layers, width 1,024, 16 heads, 4,096 FFN, 335M
parameters; sequence 128, 16 per GPU) on 8 to 64 V100s (AWS p3.16xlarge: 25 Gb/s,
p3dn.24xlarge: 100 Gb/s) or A100s (Google Cloud a2-highgpu-8g: 100 Gb/s, and the same
machines at 25 Gb/s), eight GPUs a machine, NCCL over sockets (``planner.ethernet_presets``).
Per pair: one after the other, co-located, and the co-located gain (``planner.colocate``;
the split arrangement is left out, it re-plans each job on half the machines).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import planner  # noqa: E402
from planner.cluster import Cluster  # noqa: E402
from planner.cluster_edits import with_inter_node  # noqa: E402
from planner.colocation import COLOCATED, SEQUENTIAL  # noqa: E402
from planner.ethernet_presets import SOCKET_LATENCY, socket_bandwidth  # noqa: E402
from planner.model_spec import ModelSpec  # noqa: E402

GPT = ModelSpec(str(REPO / "examples" / "gpt.py"), {"batch_size": 8})
CNN = ModelSpec(str(REPO / "examples" / "cnn.py"), {"batch_size": 8})
# The median step (round) after the first, as each launch.py prints it: steadier than the mean
# on a host shared with other work.
ALONE_LINE = re.compile(r"mean step time: .*?; median ([\d.]+) ms")
ROUND_LINE = re.compile(r"mean round \(one step of each job\) .*?; median ([\d.]+) ms")

# ResNet-50: transformers' ResNetConfig defaults are ResNet-50 (microsoft/resnet-50).
RESNET50 = ("ResNet-50", "hf:resnet", {}, 32)
# BERT-Large (Devlin et al. 2019, table 1 / section 3: L=24, H=1024, A=16, FFN 4H), sequence 128.
BERT_LARGE = ("BERT-Large", "hf:bert", {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                                        "intermediate_size": 4096, "seq_len": 128}, 16)
PAIRS = ((RESNET50, RESNET50), (BERT_LARGE, BERT_LARGE), (RESNET50, BERT_LARGE))
# GPU -> (machine preset of eight, precision); the network is set by the sweep.
MACHINES = {"V100": ("p3.16xlarge", "fp16"), "A100": ("a2-highgpu-8g", "bf16")}
GPUS_PER_MACHINE = 8


# ----------------------------------------------------------------- (a) measured on CPU gloo


def torchrun(world: int, *arguments: str) -> str:
    """stdout of ``torchrun --nproc_per_node world ARGUMENTS`` (this checkout on the path)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(port)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), *arguments],
                          env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"torchrun {' '.join(arguments)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def measured_row(world: int, steps: int, repeats: int, folder: Path) -> dict[str, tuple[float, float]]:
    """(predicted, measured) seconds of: A alone, B alone, one after the other, co-located;
    measured: the median over ``repeats`` runs of each run's median step."""
    plans = [planner.plan(spec, f"cpu:1x{world}", dp_flavour="ddp", precision="fp32") for spec in (GPT, CNN)]
    out = planner.compile_colocated(plans, folder / f"world{world}")
    predicted = planner.colocate(plans, split=False)
    by_name = {arrangement.name: arrangement.round_s for arrangement in predicted.arrangements}

    runs = {
        "A alone": (ALONE_LINE, [str(out / "job_a" / "launch.py")]),
        "B alone": (ALONE_LINE, [str(out / "job_b" / "launch.py")]),
        SEQUENTIAL: (ROUND_LINE, [str(out / "launch.py"), "--one-after-the-other"]),
        COLOCATED: (ROUND_LINE, [str(out / "launch.py")]),
    }
    measured: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):  # the four runs interleaved, so slow spells of the host touch each alike
        for name, (pattern, arguments) in runs.items():
            text = torchrun(world, *arguments, "--steps", str(steps))
            measured[name].append(float(pattern.search(text).group(1)) / 1e3)
    a_alone, b_alone, sequential, colocated = (sorted(values)[len(values) // 2] for values in measured.values())
    return {"A alone": (predicted.alone_s[0], a_alone), "B alone": (predicted.alone_s[1], b_alone),
            SEQUENTIAL: (by_name[SEQUENTIAL], sequential), COLOCATED: (by_name[COLOCATED], colocated)}


def print_measured(worlds: list[int], steps: int, repeats: int) -> None:
    print(f"(a) CPU gloo, job A = examples/gpt.py, job B = examples/cnn.py, both DDP; median of {steps - 1} steps "
          f"after the first, median of {repeats} runs; ms predicted / measured", flush=True)
    columns = ("A alone", "B alone", SEQUENTIAL, COLOCATED)
    print(f"{'world':>5}  " + "  ".join(f"{name:>24}" for name in columns) + "  co-located / one after the other")
    with tempfile.TemporaryDirectory() as folder:
        for world in worlds:
            row = measured_row(world, steps, repeats, Path(folder))
            cells = "  ".join(f"{row[name][0] * 1e3:>11.2f} / {row[name][1] * 1e3:>9.2f}" for name in columns)
            ratio = [row[COLOCATED][k] / row[SEQUENTIAL][k] for k in (0, 1)]
            print(f"{world:>5}  {cells}  predicted {ratio[0]:.2f}, measured {ratio[1]:.2f}", flush=True)


# ----------------------------------------------------------------- (b) simulated GPU clusters


def cluster(gpu: str, gpus: int, gbps: float) -> Cluster:
    """``gpus`` of ``gpu`` on machines of eight, their network at ``gbps`` per machine (NCCL
    sockets: ``planner.ethernet_presets``)."""
    preset, _ = MACHINES[gpu]
    base = Cluster.preset(preset, nodes=max(1, gpus // GPUS_PER_MACHINE))
    return with_inter_node(base, socket_bandwidth(gbps, GPUS_PER_MACHINE), SOCKET_LATENCY)


def job_plan(model: tuple, gpu: str, gpus: int, gbps: float, cache: dict) -> planner.Plan:
    """A data-parallel (DDP) plan of ``model`` on the cluster, its global batch ``per GPU x gpus``."""
    name, source, overrides, per_gpu = model
    key = (name, gpu, gpus, gbps)
    if key not in cache:
        spec = ModelSpec(source, {**overrides, "batch_size": per_gpu * gpus})
        cache[key] = planner.plan(spec, cluster(gpu, gpus, gbps), dp_flavour="ddp", precision=MACHINES[gpu][1])
    return cache[key]


def print_simulated(gpus_list: list[int], bandwidths: list[float]) -> None:
    print("\n(b) simulated: two DDP jobs time-sharing every GPU (CrossoverScheduler's setting); ms per round "
          "(one step of each job)", flush=True)
    print(f"{'jobs':<24} {'GPUs':>10} {'Gb/s':>5} {'A alone':>9} {'B alone':>9} {'one after other':>16} "
          f"{'co-located':>11} {'gain':>6}  A / B slowdown co-located")
    cache: dict = {}
    for first, second in PAIRS:
        for gpu in MACHINES:
            for gpus in gpus_list:
                for gbps in bandwidths[:1] if gpus <= GPUS_PER_MACHINE else bandwidths:  # one machine: NVLink only
                    plans = [job_plan(model, gpu, gpus, gbps, cache) for model in (first, second)]
                    result = planner.colocate(plans, split=False)
                    by_name = {arrangement.name: arrangement for arrangement in result.arrangements}
                    sequential, colocated = by_name[SEQUENTIAL], by_name[COLOCATED]
                    slow = " / ".join(f"{step / alone:.2f}x" for step, alone in zip(colocated.job_step_s, result.alone_s))
                    fits = "" if colocated.fits else "  (both jobs do not fit in memory)"
                    network = "-" if gpus <= GPUS_PER_MACHINE else f"{gbps:g}"
                    print(f"{first[0] + ' + ' + second[0]:<24} {f'{gpus} {gpu}':>10} {network:>5} "
                          f"{result.alone_s[0] * 1e3:>9.1f} {result.alone_s[1] * 1e3:>9.1f} {sequential.round_s * 1e3:>16.1f} "
                          f"{colocated.round_s * 1e3:>11.1f} {sequential.round_s / colocated.round_s:>5.2f}x  {slow}{fits}",
                          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4], help="CPU gloo world sizes measured")
    parser.add_argument("--steps", type=int, default=12, help="steps per measured run (the first is left out)")
    parser.add_argument("--repeats", type=int, default=3, help="measured runs of each kind (their median is shown)")
    parser.add_argument("--gpus", nargs="+", type=int, default=[8, 16, 32, 64])
    parser.add_argument("--bandwidths", nargs="+", type=float, default=[25, 100], help="Gb/s per machine")
    parts = parser.add_mutually_exclusive_group()
    parts.add_argument("--measured-only", action="store_true")
    parts.add_argument("--simulated-only", action="store_true")
    options = parser.parse_args()
    if not options.simulated_only:
        print_measured(options.worlds, options.steps, options.repeats)
    if not options.measured_only:
        print_simulated(options.gpus, options.bandwidths)


if __name__ == "__main__":
    main()
