"""Run by ``tests/test_adasum.py`` under ``torchrun --nproc_per_node 8``: Adasum over real
gloo processes against the single-process reference (``adasum_tree``), exact to float
tolerance. Argument: the folder of a compiled Adasum plan over the 8 ranks. Prints
``adasum ok <checks>`` on rank 0 when every check passed; raises otherwise."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from codegen.runtime.program import load_program
from planner.families.adasum.runtime import adasum_exchange, adasum_tree

SIZES = (15, 1, 7)  # three tensors in one flat buffer, one of a single element
TOLERANCE = dict(rtol=1e-6, atol=1e-7)


def rank_gradient(rank: int) -> torch.Tensor:
    """Rank ``rank``'s flat gradient; rank 3's middle tensor is zero (coefficient 1)."""
    generator = torch.Generator().manual_seed(100 + rank)
    flat = torch.randn(sum(SIZES), generator=generator)
    if rank == 3:
        flat[SIZES[0]] = 0.0
    return flat


def check_exchange(rank: int) -> int:
    """adasum_exchange over ranks 0..n-1 for n = 2, 4, 8 equals adasum_tree of their gradients."""
    for count in (2, 4, 8):
        if rank < count:
            got = adasum_exchange(rank_gradient(rank), SIZES, list(range(count)), rank)
            expected = adasum_tree([rank_gradient(r) for r in range(count)], SIZES)
            torch.testing.assert_close(got, expected, **TOLERANCE, msg=f"n={count} rank {rank}")
        dist.barrier()
    return 3


def check_program(folder: str, rank: int) -> int:
    """The compiled program's DDP hook: every rank's gradients equal the reference Adasum of
    the node averages (ranks 2k and 2k+1 averaged, then Adasum over the 4 nodes, per tensor)
    of the gradients one process computes on each rank's slice of the batch."""
    program = load_program(folder)
    mesh = program.build_mesh()
    model, module, args, kwargs = program.build_module(mesh)
    program.forward_backward(module, args, kwargs, mesh)
    got = [parameter.grad for parameter in module.parameters()]

    reference, _, _ = program.build_model()
    world, local = dist.get_world_size(), program.plan.sections["adasum"].local
    slices = [tuple(torch.chunk(arg, world)[r] for arg in args) for r in range(world)]
    per_rank = []
    for part in slices:
        reference.zero_grad()
        reference(*part).backward()
        per_rank.append([parameter.grad.clone() for parameter in reference.parameters()])
    for index, gradient in enumerate(got):
        nodes = [sum(per_rank[r][index] for r in range(start, start + local)) / local for start in range(0, world, local)]
        expected = adasum_tree([node.flatten() for node in nodes], [gradient.numel()]).view_as(gradient)
        torch.testing.assert_close(gradient, expected, **TOLERANCE, msg=f"parameter {index} on rank {rank}")
    return len(got)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checks = check_exchange(rank) + check_program(sys.argv[1], rank)
    dist.barrier()
    if rank == 0:
        print(f"adasum ok {checks}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
