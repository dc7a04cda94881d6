"""Host time per pipeline action: what ``torch.distributed.pipelining``'s schedule spends on
each micro-batch's forward and backward beyond the stage's own ops.

    python benchmarks/pipeline_host.py

A compiled pipeline (``codegen/runtime/pipeline.py``) runs one ``PipelineStage`` per rank
under ``ScheduleGPipe`` / ``Schedule1F1B``. Per micro-batch each stage runs a forward action
and a backward action, and each carries Python bookkeeping (the schedule's action loop, the
stage's argument checks, output chunk storage, ``autograd.backward`` of the stage's outputs)
and a point-to-point send or receive with its ``irecv``/``isend`` work handles. The
simulator charges the stage's ops (their per-op dispatch included) and each transfer's link
time, but none of that per-action host work.

This script measures it at world 2 over gloo on stages of one tiny ``nn.Linear`` (8x8, 4
rows: ops of about a microsecond) under 1F1B (GPipe at 1), with 1, 4, 8 and 16 micro-batches per step:
the step time's slope over micro-batches is one micro-batch's cost on the busier stage (its
forward and backward actions, their transfers, and the linear's own ops), and the same
linear's forward and backward run eagerly without a schedule (measured in the same process)
is subtracted, leaving the schedule's host seconds per micro-batch, i.e. per pair of
(forward, backward) actions. Median of ``ROUNDS`` rounds of ``STEPS`` steps, one thread per
rank.

Measured (this project's shared 2-core x86_64 VM, torch 2.13.0, lightly loaded):
step 0.71 / 2.01 / 2.83 / 6.87 ms at 1 / 4 / 8 / 16 micro-batches, slope 404 us per
micro-batch, the linear's eager forward and backward 30 us: 374 us of schedule host work
per micro-batch. The figure follows the host's load: at a load average of 4.7 on the 2
cores (other jobs) the same script gave 5.7 ms per micro-batch, each rank waiting for a core
at every transfer, so it measures the host's contention as much as the schedule. Not priced
by the simulator: on ``examples/clusters/mixed.toml`` the GPT
example's pp=2 program (1F1B, 4 micro-batches) runs 5 micro-batch passes on its critical
path, 1.9 ms of a measured 44 ms step (4%), and this work is not stretched by ``launch.py
--slowdown-from-cluster`` while the measured pipeline/uneven-DDP ratio grows with it (1.36x
at 1, 1.75x at 16): the gap is in the ops (DTensor's dispatch on every op of every
micro-batch, now priced: ``cost_model.host_dispatch.dtensor_dispatch``).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WIDTH, ROWS = 8, 4
MICRO_BATCHES = (1, 4, 8, 16)
STEPS, ROUNDS = 30, 5


def _step_seconds(rank: int, micro_batches: int) -> float:
    """Median seconds of one pipeline step with ``micro_batches`` micro-batches."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    module = nn.Linear(WIDTH, WIDTH)
    example = torch.zeros(ROWS, WIDTH, requires_grad=rank == 1)
    output = torch.zeros(ROWS, WIDTH, requires_grad=True)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"), input_args=(example,), output_args=(output,))
    kind = Schedule1F1B if micro_batches >= 2 else ScheduleGPipe
    schedule = kind(stage, micro_batches, loss_fn=lambda out, target: out.sum())
    batch = torch.randn(ROWS * micro_batches, WIDTH)
    target = torch.zeros(ROWS * micro_batches, WIDTH)
    rounds = []
    for _ in range(ROUNDS + 1):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(STEPS):
            if rank == 0:
                schedule.step(batch)
            else:
                schedule.step(target=target)
        dist.barrier()
        rounds.append((time.perf_counter() - start) / STEPS)
    return statistics.median(rounds[1:])


def _eager_seconds() -> float:
    """Median seconds of the stage's linear forward and backward run eagerly, no schedule."""
    module = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    rounds = []
    for _ in range(ROUNDS + 1):
        start = time.perf_counter()
        for _ in range(STEPS * 10):
            module(x).sum().backward()
        rounds.append((time.perf_counter() - start) / (STEPS * 10))
    return statistics.median(rounds[1:])


def _worker(rank: int, init_file: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        steps = {m: _step_seconds(rank, m) for m in MICRO_BATCHES}
        eager = _eager_seconds()
        if rank == 0:
            results.update(steps=steps, eager=eager)
    finally:
        dist.destroy_process_group()


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(os.path.join(folder, "init"), results), nprocs=2)
        steps, eager = dict(results["steps"]), results["eager"]
    print(f"host: {platform.machine()} {platform.processor() or platform.platform()}, torch {torch.__version__}, "
          f"gloo at world 2, 1 thread per rank")
    for m, seconds in steps.items():
        print(f"  {m:3d} micro-batches: step {seconds * 1e3:8.3f} ms")
    per_micro_batch = slope(list(steps), list(steps.values()))
    print(f"step time per micro-batch (slope):          {per_micro_batch * 1e6:8.1f} us")
    print(f"the stage's linear forward+backward, eager: {eager * 1e6:8.1f} us")
    print(f"schedule host work per micro-batch (forward and backward action, with their send/recv): "
          f"{(per_micro_batch - eager) * 1e6:.1f} us")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
