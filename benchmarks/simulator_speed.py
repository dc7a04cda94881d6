"""Simulator speed: delta vs full re-simulation, and a full simulation at GPT-3 scale.

    python benchmarks/simulator_speed.py

1. A 24-layer GPT (hidden 2048, seq 2048) under Megatron tp=8 x dp=2 on two DGX A100
   nodes: the time of a full simulation (every node costed, segments built, schedule run)
   against a delta re-simulation after one node's strategy changes (``Simulator.replace``),
   as MCMC uses it: each MLP input projection in turn reads its input gathered, then as
   before. The same for tp=4 x pp=2 x dp=2 (1F1B), whose delta also keeps what crosses the
   stage boundary. Target (issue 25): delta at least 5x faster in CPU time. A full
   simulation starts from an empty node-cost cache (``RECENTLY_COSTED.clear()``: both its
   indexes, or the plan's costs are handed over); the figure with that cache warm is
   printed too.
2. GPT-3 175B (96 layers, hidden 12288, seq 2048) on 1024 A100s (128 DGX nodes), Megatron
   tp=8 x pp=8 x dp=16, 1F1B over 192 micro-batches of 1 (global batch 3072): the time of
   one full simulation from an empty node-cost cache, timeline included. Target (issue 25):
   under 0.5 s of CPU time.
Times are medians of several runs, in CPU time (what the simulation itself costs; the wall
clock is printed too, but on a shared machine it adds the other processes' share); tracing
is excluded.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

from torch.distributed.tensor import Replicate

from cost_model.simulation_cache import RECENTLY_COSTED
from cost_model.simulator import Simulator
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan


def median_times(function, repeats: int) -> tuple[float, float]:
    """Median (wall-clock, CPU) seconds of ``function``: on a shared machine the CPU time is
    what the simulation itself costs, the wall clock adds the other processes' share."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        function()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def load_note() -> str:
    """The machine's 1-minute load average against its CPU count, to read wall times by."""
    try:
        return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    except OSError:
        return "load average unknown"


def gpt(layers: int, hidden: int, heads: int, batch: int) -> ModelSpec:
    return ModelSpec(
        "examples/gpt.py",
        {"n_layer": layers, "n_embd": hidden, "n_head": heads, "vocab_size": 51200, "seq_len": 2048, "batch_size": batch},
    ).resolved()


def delta_versus_full() -> None:
    graph, spec, name, cluster = prepare_model(gpt(24, 2048, 16, 64), "dgx-a100-80g:2")
    for layout, plan in (
        ("tp=8 x dp=2", megatron_plan(graph, cluster, spec, name, tp=8, micro_batch=4)),
        ("tp=4 x pp=2 x dp=2, 1F1B", megatron_plan(graph, cluster, spec, name, tp=4, pp=2, micro_batch=4)),
    ):
        delta_speed(graph, plan, f"24-layer GPT, {layout}, {len(graph)} ops")


def delta_speed(graph, plan, label: str) -> None:
    """Print the CPU time of a full simulation of ``plan`` and of a delta re-simulation."""
    projections = [s for s in plan.strategies if s.op.startswith("aten.linear") and s.module.endswith("mlp.c_fc")]
    # One node's change per delta re-simulation: each projection gathered, then restored.
    moves = [(s.node, changed) for s in projections
             for changed in (dataclasses.replace(s, inputs=tuple(tuple(Replicate() for _ in p) for p in s.inputs)), s)]

    def full_simulation() -> None:
        RECENTLY_COSTED.clear()
        Simulator(plan, graph).run()

    full, full_cpu = median_times(full_simulation, repeats=15)
    warm, warm_cpu = median_times(lambda: Simulator(plan, graph).run(), repeats=15)
    simulator = Simulator(plan, graph)
    simulator.run()
    counter = iter(range(10**9))
    delta, delta_cpu = median_times(lambda: simulator.replace(*moves[next(counter) % len(moves)]), repeats=4 * len(moves))
    print(f"{label}: full simulation {full_cpu * 1e3:.2f} ms CPU "
          f"({full * 1e3:.1f} ms wall), delta re-simulation {delta_cpu * 1e3:.2f} ms CPU ({delta * 1e3:.1f} ms wall), "
          f"speed-up {full_cpu / delta_cpu:.1f}x CPU (target >= 5x; {full / delta:.1f}x wall); with the node-cost "
          f"cache warm a full simulation takes {warm_cpu * 1e3:.2f} ms CPU; {load_note()}")


def gpt3_scale() -> None:
    start = time.perf_counter()
    graph, spec, name, cluster = prepare_model(gpt(96, 12288, 96, 3072), "dgx-a100-80g:128")
    traced = time.perf_counter() - start
    plan = megatron_plan(graph, cluster, spec, name, tp=8, pp=8, micro_batch=1, schedule="1f1b", recompute="full")
    result = None

    def simulate() -> None:
        nonlocal result
        RECENTLY_COSTED.clear()
        result = Simulator(plan, graph).run()

    seconds, cpu = median_times(simulate, repeats=5)
    print(f"GPT-3 175B on 1024 A100 (tp=8 pp=8 dp=16, 1F1B, {plan.pipeline.micro_batches} micro-batches): "
          f"full simulation {cpu:.2f} s CPU (target < 0.5 s; {seconds:.2f} s wall; tracing on meta took "
          f"{traced:.1f} s, not counted); {len(result.timeline)} tasks; {load_note()}")
    print(f"  predicted step {result.step_time_s:.2f} s, {result.tflops_per_device:.0f} TFLOP/s per GPU "
          f"(MFU {result.mfu:.1%}), bubble {result.bubble_fraction:.1%} (1F1B formula (p-1)/(m+p-1) = "
          f"{7 / (plan.pipeline.micro_batches + 7):.1%}), peak memory {result.memory.total / 2**30:.1f} GiB per GPU")


if __name__ == "__main__":
    delta_versus_full()
    gpt3_scale()
