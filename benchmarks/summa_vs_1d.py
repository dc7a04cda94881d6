"""Measured against predicted step time of 2.5-D SUMMA against 1-D tensor parallelism, for a
wide MLP on CPU gloo at world 8 (issue 10, item 5(d)).

    python benchmarks/summa_vs_1d.py                        # launches torchrun at world 8
    python benchmarks/summa_vs_1d.py --hidden 512 --tokens 1024 --steps 5

The MLP: ``y = gelu(x W1^T) W2^T`` with x [T, h], W1 [4h, h], W2 [h, 4h], fp32, T tokens.
One step is the forward and the backward (every gradient computed; no optimizer).

  1-D (tp = 8, Megatron-LM): fc1 column parallel (x whole on every rank, dx all-reduced in
      backward), fc2 row parallel (its partial sums all-reduced in forward).
  2.5-D (q = 2, d = 2, mesh dep x row x col): both matmuls by ``codegen.runtime.summa``'s
      SUMMA on each depth slice's T/2 rows; x, the hidden activation and y in the block layout;
      the weight gradients all-reduced over depth.

Measured: the mean over ``--steps`` timed steps (after two warm-up steps) of the slowest
rank's step. Predicted: ``cost_model.summa.matmul_cost`` of the two matmuls on the ``cpu``
cluster preset (``cpu:1x8``), forward + backward (``total_s``), with the GELU left out.
Printed: both per layout, their ratio (measured / predicted), and 1-D over 2.5-D measured
and predicted. Both layouts' gradients are checked against one device first, so the timed
code computes the right thing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORLD, Q, D = 8, 2, 2


def predicted(hidden: int, tokens: int) -> dict[str, float]:
    """Seconds per step of each layout's two matmuls, from the cost model."""
    from cost_model.summa import Grid, MatmulShape, matmul_cost
    from planner.cluster import Cluster

    cluster = Cluster.parse(f"cpu:1x{WORLD}")
    ranks = list(range(WORLD))
    fc1, fc2 = MatmulShape(1, tokens, hidden, 4 * hidden), MatmulShape(1, tokens, 4 * hidden, hidden)
    one_d = (matmul_cost(fc1, Grid("1d_column", WORLD), cluster, ranks, "fp32").total_s
             + matmul_cost(fc2, Grid("1d_row", WORLD), cluster, ranks, "fp32").total_s)
    grid = Grid("2.5d", Q, D)
    summa = matmul_cost(fc1, grid, cluster, ranks, "fp32").total_s + matmul_cost(fc2, grid, cluster, ranks, "fp32").total_s
    return {"1-D": one_d, "2.5-D": summa}


def worker(hidden: int, tokens: int, steps: int) -> None:
    """One rank: check both layouts against one device, then time them; rank 0 prints."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from codegen.runtime.summa import SummaGroups, split_rows_2d, split_weight_2d, summa_matmul

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden)
    w1 = torch.randn(4 * hidden, hidden) / hidden**0.5
    w2 = torch.randn(hidden, 4 * hidden) / (4 * hidden) ** 0.5
    target = torch.randn(tokens, hidden)

    # ---- 1-D: Megatron's f (identity forward, all-reduce backward) and g (the reverse).
    class _CopyToTp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            dist.all_reduce(grad)
            return grad

    class _ReduceFromTp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            t = t.contiguous()
            dist.all_reduce(t)
            return t

        @staticmethod
        def backward(ctx, grad):
            return grad

    cols = 4 * hidden // WORLD
    w1_1d = w1[rank * cols:(rank + 1) * cols].clone().requires_grad_()  # column parallel: [4h/p, h]
    w2_1d = w2[:, rank * cols:(rank + 1) * cols].clone().requires_grad_()  # row parallel: [h, 4h/p]

    def one_d(x_in):
        hidden_act = F.gelu(_CopyToTp.apply(x_in) @ w1_1d.T)  # [T, 4h/p]
        return _ReduceFromTp.apply(hidden_act @ w2_1d.T)  # [T, h], all-reduced

    # ---- 2.5-D on a dep x row x col mesh: rank (k, i, j) holds rows chunk k q + i, columns chunk j.
    mesh = init_device_mesh("cpu", (D, Q, Q), mesh_dim_names=("dep", "row", "col"))
    grid = SummaGroups.from_mesh(mesh, "row", "col", "dep")
    w1_25 = split_weight_2d(w1.T, grid).clone().requires_grad_()  # [h/q, 4h/q]
    w2_25 = split_weight_2d(w2.T, grid).clone().requires_grad_()  # [4h/q, h/q]

    def summa(x_block):
        return summa_matmul(F.gelu(summa_matmul(x_block, w1_25, grid)), w2_25, grid)  # [T/(d q), h/q]

    # ---- both against one device (gradients of the weights, this rank's shards).
    full_w1, full_w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    ((F.gelu(x @ full_w1.T) @ full_w2.T - target) ** 2).sum().backward()
    x_1d = x.clone().requires_grad_()
    ((one_d(x_1d) - target) ** 2).sum().backward()
    x_25 = split_rows_2d(x, grid).clone().requires_grad_()
    ((summa(x_25) - split_rows_2d(target, grid)) ** 2).sum().backward()
    errors = [
        (w1_1d.grad - full_w1.grad[rank * cols:(rank + 1) * cols]).abs().max(),
        (w2_1d.grad - full_w2.grad[:, rank * cols:(rank + 1) * cols]).abs().max(),
        (w1_25.grad - split_weight_2d(full_w1.grad.T, grid)).abs().max(),
        (w2_25.grad - split_weight_2d(full_w2.grad.T, grid)).abs().max(),
    ]
    worst = torch.stack(errors).max()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    scale = full_w1.grad.abs().max()
    if worst > 1e-4 * max(1.0, float(scale)):
        raise SystemExit(f"gradients differ from one device by {float(worst):.3e}: not timing a wrong program")

    def timed(step) -> float:
        for _ in range(2):
            step()
        seconds = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
            seconds.append(float(elapsed))
        return sum(seconds) / len(seconds)

    def step_1d():
        x_in = x.clone().requires_grad_()
        one_d(x_in).sum().backward()

    def step_25():
        x_in = x_25.detach().clone().requires_grad_()
        summa(x_in).sum().backward()

    measured = {"1-D": timed(step_1d), "2.5-D": timed(step_25)}
    if rank == 0:
        guess = predicted(hidden, tokens)
        print(f"wide MLP h={hidden} (fc1 {hidden}->{4 * hidden}, fc2 {4 * hidden}->{hidden}), T={tokens} tokens, fp32, "
              f"world {WORLD} on CPU gloo; {steps} timed steps; gradients checked against one device "
              f"(worst {float(worst):.1e})")
        print(f"{'layout':<22}{'measured s':>12}{'predicted s':>13}{'measured/predicted':>20}")
        names = {"1-D": f"1-D tp={WORLD}", "2.5-D": f"2.5-D q={Q} d={D}"}
        for key in ("1-D", "2.5-D"):
            print(f"{names[key]:<22}{measured[key]:>12.4f}{guess[key]:>13.4f}{measured[key] / guess[key]:>20.2f}")
        print(f"1-D / 2.5-D: measured {measured['1-D'] / measured['2.5-D']:.2f}x, "
              f"predicted {guess['1-D'] / guess['2.5-D']:.2f}x")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.hidden % (WORLD // 2) or options.tokens % (Q * D):
        parser.error(f"--hidden must be a multiple of {WORLD // 2} and --tokens of {Q * D}")
    if options.worker:
        worker(options.hidden, options.tokens, options.steps)
        return
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), __file__, "--worker",
               "--hidden", str(options.hidden), "--tokens", str(options.tokens), "--steps", str(options.steps)]
    raise SystemExit(subprocess.run(command, env=env, cwd=REPO, check=False).returncode)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
