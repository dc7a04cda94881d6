"""The compiled module against the same strategy written by hand with parallelize_module.

    python benchmarks/compiled_vs_handwritten.py [--steps 10] [--width 512]

A GPT block (examples/gpt.py, one layer) at world size 2 on CPU (gloo) with Megatron
tensor parallelism of its MLP: column-parallel c_fc, row-parallel c_proj, the rest
replicated. (PyTorch's DTensor has no sharding rule for CPU flash attention, so a
hand-written parallelize_module plan cannot shard attention here; the MLP is a strategy
both sides express.) The script builds that plan with the planner's own propagation,
compiles it (``planner.compile``) and relaunches itself under torchrun, where both
programs train on the same batches, taking turns step by step: the compiled
``model_spmd.py`` and the model parallelized by hand with
``torch.distributed.tensor.parallel.parallelize_module``. It prints each median step time
(first steps excluded) and the ratio compiled / hand-written; the target is at most 1.05.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 3


def plan_and_compile(width: int, folder: Path) -> None:
    from torch.distributed.tensor import Replicate, Shard

    import planner
    from cost_model.simulator import simulated
    from planner.api import prepare_model
    from planner.model_spec import ModelSpec
    from planner.strategy import Mesh
    from search.layouts import combine
    from search.plan_builder import unsimulated_plan
    from search.propagation import propagate

    spec = ModelSpec(
        str(ROOT / "examples/gpt.py"),
        {"n_layer": 1, "n_embd": width, "n_head": 8, "vocab_size": 1024, "seq_len": 128, "batch_size": 8},
    )
    graph, spec, name, cluster = prepare_model(spec, "cpu:1x2")
    mesh = Mesh((("tp", 2),))
    weights = {
        "blocks.0.mlp.c_fc.weight": Shard(0), "blocks.0.mlp.c_fc.bias": Shard(0),  # column parallel
        "blocks.0.mlp.c_proj.weight": Shard(1),  # row parallel
    }
    tp = propagate(graph, 2, {i.name: Replicate() for i in graph.inputs if i.meta}, weights)
    strategies, inputs = combine(graph, mesh, {"tp": tp})
    plan = simulated(unsimulated_plan(graph, cluster, spec, name, mesh, strategies, inputs, label="mlp-tp"), graph)
    planner.compile(plan, folder)


def handwritten(model, mesh):
    """The same MLP tensor parallelism with PyTorch's tensor-parallel API."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"blocks.0.mlp.c_fc": ColwiseParallel(), "blocks.0.mlp.c_proj": RowwiseParallel()}
    return parallelize_module(model, mesh, plan)


def one_step(module, optimizer, args) -> float:
    """Seconds of one training step of ``module`` (forward, backward, optimizer), all ranks."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loss = module(*args)
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    return time.perf_counter() - start


def worker(folder: Path, steps: int) -> None:
    import torch.distributed as dist

    from codegen.runtime import load_program

    program = load_program(folder)
    mesh = program.build_mesh()
    torch.manual_seed(1)
    _, args, kwargs = program.build_model()
    batches = [tuple(torch.randint_like(a, 0, 1024) for a in args) for _ in range(4)]

    model, _, _ = program.build_model()
    compiled = program.parallelize(model, mesh)
    sharded = [program.shard_batch(batch, {}, mesh)[0] for batch in batches]
    model, _, _ = program.build_model()
    by_hand = handwritten(model, mesh)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (compiled, by_hand)]
    # The two programs take turns, step by step, so a slow spell of this shared machine
    # hits both alike; medians, after the warm-up steps.
    compiled_times, handwritten_times = [], []
    for step in range(WARMUP + steps):
        compiled_times.append(one_step(compiled, optimizers[0], sharded[step % len(sharded)]))
        handwritten_times.append(one_step(by_hand, optimizers[1], batches[step % len(batches)]))
    compiled_s = statistics.median(compiled_times[WARMUP:])
    handwritten_s = statistics.median(handwritten_times[WARMUP:])
    if dist.get_rank() == 0:
        print(f"compiled model_spmd.py : {compiled_s * 1e3:8.1f} ms/step (median of {steps})")
        print(f"parallelize_module     : {handwritten_s * 1e3:8.1f} ms/step (median of {steps})")
        print(f"ratio compiled / hand-written: {compiled_s / handwritten_s:.2f} (target <= 1.05)")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=512, help="hidden size of the block")
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if "RANK" in os.environ:
        worker(options.folder, options.steps)
        return
    folder = Path(tempfile.mkdtemp(prefix="soap-bench-")) / "program"
    plan_and_compile(options.width, folder)
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc_per_node", "2", __file__, "--folder", str(folder), "--steps", str(options.steps)]
    sys.exit(subprocess.run(command).returncode)


if __name__ == "__main__":
    main()
