"""Predicted against measured step time on this machine, before and after calibration,
cross-validated.

    python benchmarks/measured_vs_predicted.py [--steps 12] [--repeats 2] [--out DIR] [--fresh] [--pooled]

1. Plans examples/gpt.py (4 layers, hidden 128, seq 64, batch 16) as DDP, FSDP, ZeRO-1,
   tensor parallel (Megatron tp), pipeline (pp, 2 micro-batches) and DDP with full
   recomputation at 2 processes (9 plans: also ZeRO-2, FSDP and tp with recomputation), and
   as DDP, FSDP, ZeRO-1, ZeRO-2, tp2 x dp2, tp4, pp2 x dp2, and DDP, FSDP and tp2 x dp2 with
   full recomputation at 4 (10 plans), on the ``cpu`` preset; compiles each.
2. Runs each under ``torchrun --nproc_per_node N launch.py --steps S --profile``, in
   ``--repeats`` passes over all the plans, and keeps the measured.json files in ``--out`` (a
   later run with the same ``--out`` reuses them); a plan's measured step time is the median
   of the clean steps of all its passes.
3. For each plan, calibrates the cost model (``planner calibrate``) on the OTHER plans of
   the same world size (leave one out) and predicts the plan with that cluster.
4. Prints per plan: measured (median of the clean steps and their spread), predicted by the
   preset, predicted after calibration, and the errors; then the median absolute error and
   Spearman's rank correlation of predicted against measured step times.

Why per world size: on this 2-core machine 4 processes share 2 cores, so a "device" of the
4-process cluster is half a core: another machine than a device of the 2-process cluster,
with its own cluster file. ``--pooled`` calibrates on every other plan instead, to show it.

Figures are noisy when other work shares the cores; each measured figure is a median, and
the script prints the host's load average when it starts and after measuring. A second run
with the same ``--out`` and no ``--fresh`` measures nothing (plans already measured there
are reused, pass by pass), so it re-scores old measurements with the current cost model;
``--fresh`` measures every plan again; a larger ``--repeats`` adds passes to what is there.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import planner  # noqa: E402
from cost_model.calibration import CalibrationCase, calibration_values, load_measured, step_time_with  # noqa: E402
from cost_model.simulator import Simulator  # noqa: E402
from planner import baselines  # noqa: E402
from planner.compare import calibrate, plan_and_graph  # noqa: E402
from planner.cluster import Cluster  # noqa: E402
from planner.model_spec import ModelSpec  # noqa: E402

MODEL = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 1024, "seq_len": 64, "batch_size": 16}


def make_plans(spec: ModelSpec) -> dict[str, planner.Plan]:
    """The plans measured, by a short name (world size first)."""
    plans = {}
    for world in (2, 4):
        cluster = f"cpu:1x{world}"
        for flavour in ("ddp", "fsdp", "zero1"):
            plans[f"w{world} {flavour}"] = planner.plan(spec, cluster, dp_flavour=flavour, progress=False)
        plans[f"w{world} tp2"] = baselines.megatron(spec, cluster, tp=2, precision="fp32")
        plans[f"w{world} pp2"] = baselines.megatron(spec, cluster, pp=2, micro_batch=MODEL["batch_size"] // world,
                                                     precision="fp32")
    for world in (2, 4):
        ddp = plans[f"w{world} ddp"]
        plans[f"w{world} ddp+recompute"] = dataclasses.replace(ddp, recompute="full", estimate=planner.simulate(
            dataclasses.replace(ddp, recompute="full")))
    plans["w4 tp4"] = baselines.megatron(spec, "cpu:1x4", tp=4, precision="fp32")
    for world in (2, 4):
        cluster = f"cpu:1x{world}"
        plans[f"w{world} zero2"] = planner.plan(spec, cluster, dp_flavour="zero2", progress=False)
        fsdp = plans[f"w{world} fsdp"]
        plans[f"w{world} fsdp+recompute"] = dataclasses.replace(fsdp, recompute="full", estimate=planner.simulate(
            dataclasses.replace(fsdp, recompute="full")))
        plans[f"w{world} tp2+recompute"] = baselines.megatron(spec, cluster, tp=2, recompute="full", precision="fp32")
    return plans


def measure(plan: planner.Plan, folder: Path, steps: int, measured: Path, compile_first: bool) -> Path:
    """Run the program in ``folder`` (compiled from ``plan`` first if asked: compiling
    replaces the folder) with ``--profile measured``; returns ``measured``."""
    if compile_first:
        planner.compile(plan, folder, force=True)
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc_per_node", str(plan.world_size), str(folder / "launch.py"), "--steps", str(steps),
               "--log-every", str(steps), "--profile", str(measured)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    output = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    if output.returncode != 0 or not measured.is_file():
        raise SystemExit(f"{' '.join(command)} failed:\n{output.stdout[-3000:]}\n{output.stderr[-3000:]}")
    return measured


def merged(paths: list[Path], statistic: str = "median"):
    """One run from the passes over a plan: the first pass's profile, every pass's clean
    steps, and as the step time their median, or their fastest (``min``: on a host others
    load, contention only ever slows a step, so the fastest is the least disturbed)."""
    runs = [load_measured(path) for path in paths]
    steps = tuple(step for run in runs for step in run.step_times_s)
    chosen = min(steps) if statistic == "min" else statistics.median(steps)
    return dataclasses.replace(runs[0], step_times_s=steps, step_time_s=chosen)


def _load() -> str:
    """The host's load averages, as ``uptime`` shows them."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def spearman(left: list[float], right: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        start = 0
        while start < len(order):
            end = start
            while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
                end += 1
            for index in order[start:end + 1]:
                result[index] = (start + end) / 2
            start = end + 1
        return result

    a, b = ranks(left), ranks(right)
    mean_a, mean_b = statistics.fmean(a), statistics.fmean(b)
    covariance = sum((x - mean_a) * (y - mean_b) for x, y in zip(a, b))
    scale = (sum((x - mean_a) ** 2 for x in a) * sum((y - mean_b) ** 2 for y in b)) ** 0.5
    return covariance / scale if scale else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps per run (about a third profiled)")
    parser.add_argument("--out", default=None,
                        help="keep the programs and measured.json files here; plans measured there before are reused")
    parser.add_argument("--fresh", action="store_true", help="measure every plan again, even if --out holds it")
    parser.add_argument("--repeats", type=int, default=2,
                        help="passes over the plans (default 2); a plan's step time is the median over all its passes")
    parser.add_argument("--statistic", choices=("median", "min"), default="median",
                        help="a plan's measured step time: the median of its clean steps (default) or the fastest")
    parser.add_argument("--pooled", action="store_true", help="calibrate on every other plan, whatever its world size")
    options = parser.parse_args()
    work = Path(options.out or tempfile.mkdtemp(prefix="soap-measured-"))
    spec = ModelSpec(str(ROOT / "examples/gpt.py"), MODEL)
    print(f"model: examples/gpt.py {MODEL}; work folder {work}; load average {_load()}", flush=True)
    plans = make_plans(spec)
    files: dict[str, list[Path]] = {name: [] for name in plans}
    for repeat in range(options.repeats):  # passes over every plan, so a busy spell hits them all alike
        for name, plan in plans.items():
            folder = work / name.replace(" ", "_").replace("+", "plus")
            target = folder / ("measured.json" if repeat == 0 else f"measured-{repeat + 1}.json")
            if not target.is_file() or options.fresh:
                measure(plan, folder, options.steps, target, compile_first=repeat == 0)
                print(f"  measured {name} (pass {repeat + 1}): {load_measured(target).step_time_s * 1e3:.1f} ms", flush=True)
            files[name].append(target)  # reused when an earlier run measured it into the same --out
    print(f"measured; load average {_load()} (1, 5, 15 minutes; {os.cpu_count()} cores)", flush=True)
    runs = {name: merged(paths, options.statistic) for name, paths in files.items()}
    cases = {}
    for name, run in runs.items():
        plan, graph = plan_and_graph(run.plan_data, run.source)
        cases[name] = CalibrationCase(plan=plan, graph=graph, measured_step_s=run.step_time_s, name=name)
    for world in sorted({name[:2] for name in runs}):
        chosen = [name for name in runs if name[:2] == world]
        base = Cluster.preset("cpu", devices_per_node=cases[chosen[0]].plan.world_size)
        cluster, fit = calibrate([runs[name] for name in chosen], base, [cases[name] for name in chosen])
        shown = ", ".join(f"{key} {value:.3g}" for key, value in fit.values.items())
        print(f"{world} calibrated on all its {len(chosen)} plans: {shown}", flush=True)
    rows = []
    for name, run in runs.items():
        others = [other for other in runs if other != name and (options.pooled or other[:2] == name[:2])]
        base = Cluster.preset("cpu", devices_per_node=cases[name].plan.world_size)
        cluster, _ = calibrate([runs[other] for other in others], base, [cases[other] for other in others])
        preset = step_time_with(cases[name], calibration_values(base))
        after = Simulator(dataclasses.replace(cases[name].plan, cluster=cluster), cases[name].graph).run(trace=False).step_time_s
        rows.append((name, run.step_time_s, run.noise, preset, after))
    print(f"\n{'plan':<20}{'measured':>11}{'spread':>8}{'preset':>11}{'error':>8}{'calibrated':>12}{'error':>8}")
    for name, measured, noise, preset, after in rows:
        print(f"{name:<20}{measured * 1e3:>9.1f}ms{noise:>8.0%}{preset * 1e3:>9.1f}ms{preset / measured - 1:>+8.0%}"
              f"{after * 1e3:>10.1f}ms{after / measured - 1:>+8.0%}")
    measured = [row[1] for row in rows]
    for label, index in (("preset", 3), ("calibrated (leave one out)", 4)):
        predicted = [row[index] for row in rows]
        errors = [abs(p / m - 1) for p, m in zip(predicted, measured)]
        print(f"{label:<28} median |error| {statistics.median(errors):.0%}   Spearman {spearman(predicted, measured):.2f}"
              f"   over {len(rows)} plans")
    for world in ("w2", "w4"):
        chosen = [row for row in rows if row[0].startswith(world)]
        if len(chosen) > 2:
            errors = [abs(r[4] / r[1] - 1) for r in chosen]
            print(f"  within {world} ({len(chosen)} plans): calibrated median |error| {statistics.median(errors):.0%}, "
                  f"Spearman {spearman([r[4] for r in chosen], [r[1] for r in chosen]):.2f}; "
                  f"preset Spearman {spearman([r[3] for r in chosen], [r[1] for r in chosen]):.2f}")


if __name__ == "__main__":
    main()
