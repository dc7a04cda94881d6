"""The global gradient norm of a program whose ranks hold overlapping parts of the model.

``--clip-grad-norm`` scales the gradients so that their global L2 norm, the one
``torch.nn.utils.clip_grad_norm_`` takes on one device, is at most the limit. In a dense
program every rank holds the same tensors or a DTensor shard of them, and
``training_loop.clip_gradients`` sums per mesh axis. An MoE program's ranks hold parts of the
model's parameters in shapes no mesh describes: a rank's own experts (rows of the stacked
expert weight), a hot expert copied on several ranks, a slice of every expert, experts
sharded again over the ranks holding the same copies (FSDP2 over a copy mesh), beside dense
weights replicated by DDP or sharded by FSDP2.

Every one of those is a set of boxes of a model parameter: the chunks a checkpoint writes for
it (``derived_checkpoint.as_saved``: a ``DerivedPart``'s chunks, a DTensor's local shard at
its global offset, a plain tensor whole). Gradients are laid out like their parameters and,
once backward has synchronised them (DDP's all-reduce, FSDP2's reduce-scatter, the copies'
sum in ``moe.sum_copies``), two ranks holding the same box hold the same gradient in it. So
the squared norm of the whole model is the sum over every rank of each box's squared norm
divided by the number of ranks holding that box: each expert's gradient counted once whatever
its copies, each replicated weight once whatever the data-parallel degree. The counts are
found once, before the first step, by gathering every rank's boxes; then each step costs one
all-reduce of one number.

Boxes of one parameter must be equal or disjoint (partly overlapping ones would be counted
twice where they overlap); the set-up checks it, and refuses partial sums, which are not yet
gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import (
    compute_local_shape_and_global_offset,  # DTensor's shard maths
)

from codegen.runtime.derived_checkpoint import DerivedPart, as_saved, saved_parameters
from planner.errors import LaunchError

__all__ = ["HeldPartsNorm", "box_holders", "held_boxes"]

# (parameter name, offsets in the whole parameter, sizes): one box of a model parameter.
Box = tuple[str, tuple[int, ...], tuple[int, ...]]


def held_boxes(value: torch.Tensor, name: str, derivation) -> list[tuple[Box, torch.Tensor]]:
    """The boxes of model parameter ``name`` that ``value`` (a parameter or its gradient,
    with the parameter's ``derivation``) holds, each with its local values; empty boxes left out."""
    saved = as_saved(value, derivation)
    if isinstance(saved, DerivedPart):
        found = [((name, tuple(chunk.offsets), tuple(chunk.sizes)), view) for chunk, view in saved.chunks()]
    elif isinstance(saved, DTensor):
        if any(placement.is_partial() for placement in saved.placements):
            raise LaunchError(
                f"{name}: its gradient is a partial sum ({saved.placements}) when the step clips it, so its norm is "
                f"unknown; leave --clip-grad-norm out for this plan"
            )
        shape, offsets = compute_local_shape_and_global_offset(saved.shape, saved.device_mesh, saved.placements)
        found = [((name, tuple(offsets), tuple(shape)), saved.to_local())]
    else:
        found = [((name, (0,) * saved.dim(), tuple(saved.shape)), saved)]
    return [(box, local) for box, local in found if all(size > 0 for size in box[2])]


def _overlap_without_equal(first: Box, second: Box) -> bool:
    """Whether two boxes of one parameter share elements without being the same box."""
    if first == second:
        return False
    return all(a < b + m and b < a + n for a, n, b, m in zip(first[1], first[2], second[1], second[2]))


def box_holders(everyone: list[list[Box]]) -> dict[Box, int]:
    """How many ranks hold each box, from every rank's list of the boxes it holds.

    Raises:
        LaunchError: two boxes of one parameter that partly overlap (counted twice where
            they do), naming the parameter.
    """
    holders: dict[Box, int] = {}
    for boxes in everyone:
        for box in boxes:
            holders[box] = holders.get(box, 0) + 1
    by_name: dict[str, list[Box]] = {}
    for box in holders:
        by_name.setdefault(box[0], []).append(box)
    for name, boxes in by_name.items():
        for position, first in enumerate(boxes):
            clash = next((second for second in boxes[position + 1:] if _overlap_without_equal(first, second)), None)
            if clash is not None:
                raise LaunchError(
                    f"{name}: two ranks hold parts of it that partly overlap ({first[1:]} and {clash[1:]}), so "
                    f"--clip-grad-norm cannot count each element once; leave --clip-grad-norm out for this plan"
                )
    return holders


class HeldPartsNorm:
    """Clips the gradients of ``module`` (this rank's, as ``parallelize`` returned it; its
    parameters recorded in ``model`` as ``derived_checkpoint.saved_parameters`` reads them)
    by the global norm over every rank of ``group`` (None: the world); see the module docstring.

    Construction is a collective of ``group``: every rank must build it, before the first step.

    Raises:
        LaunchError: a parameter the model does not record, or two ranks holding parts of a
            parameter that partly overlap.
    """

    def __init__(self, model: nn.Module, module: nn.Module, group=None) -> None:
        self.module, self.group = module, group
        entries = saved_parameters(model)
        self._names: dict[int, tuple[str, object]] = {}
        for param in module.parameters():
            if id(param) not in entries:
                raise LaunchError(
                    f"this program holds a parameter of shape {tuple(param.shape)} that the model built from the spec "
                    f"does not record, so --clip-grad-norm cannot count it once; leave --clip-grad-norm out for this plan"
                )
            self._names[id(param)] = entries[id(param)]
        mine = sorted({box for param in module.parameters() for box, _ in held_boxes(param.detach(), *self._names[id(param)])})
        everyone: list[list[Box]] = [[] for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(everyone, mine, group=group)
        self.holders = box_holders(everyone)

    def norm(self) -> float:
        """The global L2 norm of the gradients (one all-reduce of one number)."""
        total = torch.zeros((), dtype=torch.float64)
        device = torch.device("cpu")
        for param in self.module.parameters():
            if param.grad is None:
                continue
            device = param.grad.device
            for box, local in held_boxes(param.grad.detach(), *self._names[id(param)]):
                squared = torch.linalg.vector_norm(local, 2).to(torch.float64).cpu() ** 2
                total += squared / self.holders[box]
        summed = total.to(device)
        dist.all_reduce(summed, group=self.group)
        return float(summed.cpu().sqrt())

    def clip(self, max_norm: float) -> float:
        """Scale every gradient so the global norm is at most ``max_norm`` (as
        ``torch.nn.utils.clip_grad_norm_``, whose 1e-6 it adds); returns the norm before clipping."""
        total = self.norm()
        coefficient = max_norm / (total + 1e-6)
        if coefficient < 1.0:
            for param in self.module.parameters():
                if param.grad is not None:
                    param.grad.mul_(coefficient)
        return total
