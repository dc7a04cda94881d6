"""Predicted against measured step time of the MoE modes of ``examples/moe.py``, on this machine.

    python benchmarks/moe_measured_vs_predicted.py [--quick-profile] [--steps 12]

1. Profiles this machine for 4 processes (``planner profile``: matmul and streaming
   throughput, gloo all-reduce alpha/beta) into a cluster.
2. Plans ``examples/moe.py`` (2 layers, width 128, 8 experts, top-2, expert FFN 512,
   capacity factor 1.25, 16 sequences of 64 tokens) for that cluster with every MoE layer in
   one fixed mode (``search.moe_search``'s fixed plans: experts replicated, expert parallel,
   experts sliced) and as the search chooses (the dense part data parallel in the flavour
   the search picks, or ``--flavour``), and compiles each plan.
3. Runs each under ``torchrun --nproc_per_node 4 launch.py --steps N`` and reads the mean
   step time (first step excluded).
4. Prints predicted against measured, the error, and whether the simulator orders the
   modes as the measurements do.

Close other work first. On a 2-core machine 4 processes share 2 cores: the profile measures
that sharing too (it runs 4 processes), but the timings are noisy; read the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import planner
from cost_model.profile import profile_machine
from cost_model.simulator import simulated
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.data_parallel import FSDP_UNIT_FLAVOURS, fsdp_units
from search.moe_search import search_moe_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measured_vs_predicted import measure  # noqa: E402  (a sibling script, not a package)

ROOT = Path(__file__).resolve().parent.parent
MODEL = {"n_layer": 2, "n_embd": 128, "n_head": 4, "n_expert": 8, "top_k": 2, "ffn": 512, "vocab_size": 512,
         "seq_len": 64, "batch_size": 16, "capacity_factor": 1.25}
WORLD = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick-profile", action="store_true", help="a shorter, noisier profile")
    parser.add_argument("--steps", type=int, default=12, help="training steps per measurement")
    parser.add_argument("--flavour", choices=("searched", "ddp", "fsdp", "zero2"), default="searched",
                        help="how the dense part is data parallel (default: as the search chose)")
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="soap-moe-measured-"))
    print(f"profiling this machine ({WORLD} processes)...", flush=True)
    cluster = profile_machine(nproc=WORLD, quick=options.quick_profile)
    spec = ModelSpec(str(ROOT / "examples/moe.py"), MODEL)
    graph, spec, name, cluster = prepare_model(spec, cluster)
    searched, fixed = search_moe_plan(graph, cluster, spec, name, precision="fp32")
    print(f"model: examples/moe.py {MODEL}")
    print(f"{'plan':<58}{'predicted':>11}{'measured':>11}{'error':>8}")
    results = []
    for label, plan in [*(("fixed", p) for p in fixed), ("searched", searched)]:
        if options.flavour != "searched" and plan.dp_flavour != options.flavour:
            units = fsdp_units(graph) if options.flavour in FSDP_UNIT_FLAVOURS else ()
            plan = simulated(dataclasses.replace(plan, dp_flavour=options.flavour, fsdp_units=units), graph)
        program = planner.compile(plan, work / f"{label}-{len(results)}")
        measured = measure(program, options.steps, nproc=WORLD)
        predicted = plan.estimate.step_time_s
        results.append((plan.name, predicted, measured))
        print(f"{label + ': ' + plan.name:<58}{predicted * 1e3:>9.1f}ms{measured * 1e3:>9.1f}ms"
              f"{predicted / measured - 1:>+8.0%}", flush=True)
    by_prediction = [name for name, *_ in sorted(results, key=lambda r: r[1])]
    by_measurement = [name for name, *_ in sorted(results, key=lambda r: r[2])]
    print("order by prediction:  " + " < ".join(by_prediction))
    print("order by measurement: " + " < ".join(by_measurement))


if __name__ == "__main__":
    main()
