"""Host time per op: what the CPU spends issuing one ATen op, eager and on DTensors.

    python benchmarks/host_dispatch.py

A GPU runs a kernel while the host issues the next ones, so a step whose kernels are shorter
than the host's time per op waits for the host (``cost_model.host_dispatch``). The host's
share does not depend on the device: PyTorch's dispatcher, autograd and DTensor's sharding
propagation run on the CPU either way. This script measures it on tiny CPU tensors (whose
kernels take well under a microsecond) for a transformer MLP block (linear, GELU, linear,
residual add, layer norm; bias and weights as a graph program holds them): the forward with
autograd recording, and the backward, per ATen op, on plain tensors and on DTensors sharded on
the batch over a one-rank mesh (sharding propagation and dispatch, no communication). The
DTensor figures less the plain ones are DTensor's own dispatch per op, the value behind
``cost_model.defaults.DTENSOR_DISPATCH_S``.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

WIDTH, ROWS = 8, 4
REPEATS, ROUNDS = 300, 7


class _OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _block(x, w1, b1, w2, b2, gamma, beta):
    hidden = F.gelu(F.linear(x, w1, b1))
    return F.layer_norm(x + F.linear(hidden, w2, b2), (WIDTH,), gamma, beta)


def _tensors(to_dtensor):
    torch.manual_seed(0)
    shapes = [(ROWS, WIDTH), (4 * WIDTH, WIDTH), (4 * WIDTH,), (WIDTH, 4 * WIDTH), (WIDTH,), (WIDTH,), (WIDTH,)]
    values = [torch.randn(shape, device="cpu") for shape in shapes]
    return [to_dtensor(v, index == 0).requires_grad_() for index, v in enumerate(values)]


def _microseconds_per_call(run) -> float:
    """Median over rounds of the mean time of one call, in microseconds."""
    for _ in range(REPEATS // 10):
        run()
    rounds = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(REPEATS):
            run()
        rounds.append((time.perf_counter() - start) / REPEATS * 1e6)
    return statistics.median(rounds)


def measure(to_dtensor) -> dict[str, float]:
    """Host microseconds per forward op and per backward op of the block."""
    tensors = _tensors(to_dtensor)

    def forward():
        return _block(*tensors).sum()

    def forward_backward():
        forward().backward()

    # Ops counted on plain tensors: DTensor runs the same ATen ops on the local shards.
    plain = _tensors(lambda v, _: v)
    with _OpCounter() as counted:
        out = _block(*plain).sum()
    forward_ops = counted.ops
    with _OpCounter() as counted:
        out.backward()
    backward_ops = counted.ops
    forward_us = _microseconds_per_call(forward)
    both_us = _microseconds_per_call(forward_backward)
    return {"forward_ops": forward_ops, "backward_ops": backward_ops,
            "forward_us_per_op": forward_us / forward_ops,
            "backward_us_per_op": (both_us - forward_us) / backward_ops}


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1,))
    plain = measure(lambda v, _: v)
    sharded = measure(lambda v, is_input: distribute_tensor(v, mesh, [Shard(0) if is_input else Replicate()]))
    print(f"host time per ATen op, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"1 thread ({plain['forward_ops']} forward and {plain['backward_ops']} backward ops of an MLP block)")
    print(f"{'':<10} {'forward':>10} {'backward':>10}")
    print(f"{'eager':<10} {plain['forward_us_per_op']:>8.2f}us {plain['backward_us_per_op']:>8.2f}us")
    print(f"{'DTensor':<10} {sharded['forward_us_per_op']:>8.2f}us {sharded['backward_us_per_op']:>8.2f}us")
    print(f"{'difference':<10} {sharded['forward_us_per_op'] - plain['forward_us_per_op']:>8.2f}us "
          f"{sharded['backward_us_per_op'] - plain['backward_us_per_op']:>8.2f}us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
