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

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import (
    compute_local_shape_and_global_offset,  # DTensor's shard maths
)

from codegen.runtime.derived_checkpoint import DerivedPart, as_saved, saved_parameters
from planner.errors import LaunchError

__all__ = ["HeldPart", "HeldPartsNorm", "box_holders", "held_boxes"]

# (parameter name, offsets in the whole parameter, sizes): one box of a model parameter.
Box = tuple[str, tuple[int, ...], tuple[int, ...]]


@dataclass
class HeldPart:
    """What one parameter (or its gradient) of a rank holds of model parameter ``boxes[0][0]``:
    its ``boxes`` and its ``local`` values. With more than one box, box i is dim-0 row i of
    ``local`` (a rank's experts, ``DerivedPart.chunks``); else the one box is all of ``local``."""

    boxes: list[Box]
    local: torch.Tensor

    def squares(self) -> torch.Tensor:
        """The squared L2 norm of each box's values, in float64, on ``local``'s device."""
        rows = len(self.boxes)
        flat = self.local.reshape(rows, self.local.numel() // rows if rows else 0)
        return torch.linalg.vector_norm(flat, 2, dim=1, dtype=torch.float64) ** 2


def held_boxes(value: torch.Tensor, name: str, derivation) -> HeldPart:
    """The boxes of model parameter ``name`` that ``value`` (a parameter or its gradient,
    with the parameter's ``derivation``) holds, as a checkpoint writes them (empty ones too:
    a padding shard of FSDP2)."""
    saved = as_saved(value, derivation)
    if isinstance(saved, DerivedPart):
        boxes = [(name, tuple(chunk.offsets), tuple(chunk.sizes)) for chunk, _ in saved.chunks()]
        return HeldPart(boxes, saved.local)
    if isinstance(saved, DTensor):
        if any(placement.is_partial() for placement in saved.placements):
            raise LaunchError(
                f"{name}: its gradient is a partial sum ({saved.placements}) when the step clips it, so its norm is "
                f"unknown; leave --clip-grad-norm out for this plan"
            )
        shape, offsets = compute_local_shape_and_global_offset(saved.shape, saved.device_mesh, saved.placements)
        return HeldPart([(name, tuple(offsets), tuple(shape))], saved.to_local())
    return HeldPart([(name, (0,) * saved.dim(), tuple(saved.shape))], saved)


def _is_empty(box: Box) -> bool:
    return any(size == 0 for size in box[2])


def _overlap_without_equal(first: Box, second: Box) -> bool:
    """Whether two boxes of one parameter share elements without being the same box."""
    if first == second:
        return False
    return all(a < b + m and b < a + n for a, n, b, m in zip(first[1], first[2], second[1], second[2]))


def _partial_overlap(boxes: list[Box]) -> tuple[Box, Box] | None:
    """Two of ``boxes`` (distinct boxes of one parameter) that share elements, or None.
    A sweep along the dim where the boxes start at the most places: the parts a layout makes
    (FSDP2's shards, a rank's experts, expert slices) are disjoint along it, so few boxes are
    open at once and thousands of ranks' boxes are checked in about n log n."""
    if len(boxes) < 2 or not boxes[0][1]:
        return None
    dims = range(len(boxes[0][1]))
    sweep = max(dims, key=lambda dim: len({box[1][dim] for box in boxes}))
    open_boxes: list[Box] = []
    for box in sorted(boxes, key=lambda box: box[1][sweep]):
        start = box[1][sweep]
        open_boxes = [other for other in open_boxes if other[1][sweep] + other[2][sweep] > start]
        clash = next((other for other in open_boxes if _overlap_without_equal(other, box)), None)
        if clash is not None:
            return clash, box
        open_boxes.append(box)
    return None


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
        clash = _partial_overlap(boxes)
        if clash is not None:
            raise LaunchError(
                f"{name}: two ranks hold parts of it that partly overlap ({clash[0][1:]} and {clash[1][1:]}), so "
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
        self._device = next((param.device for param in module.parameters()), torch.device("cpu"))
        # What this rank cannot count is said by every rank after the gather, not raised
        # before it: a rank that left early would leave the others waiting in the collective.
        try:
            parts, problem = self._held_parts(model), None
        except LaunchError as error:
            parts, problem = {}, str(error)
        mine = sorted({box for part in parts.values() for box in part.boxes if not _is_empty(box)})
        gathered: list[tuple[str | None, list[Box]]] = [(None, []) for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(gathered, (problem, mine), group=group)
        problem = next((said for said, _ in gathered if said is not None), None)
        if problem is not None:
            raise LaunchError(problem)
        everyone = [boxes for _, boxes in gathered]
        self.holders = box_holders(everyone)
        # Each box's share of the sum: 1 / its holders (0 for an empty box, which adds nothing).
        self._shares = {
            key: torch.tensor([0.0 if _is_empty(box) else 1.0 / self.holders[box] for box in part.boxes],
                              dtype=torch.float64, device=part.local.device)
            for key, part in parts.items()
        }

    def _held_parts(self, model: nn.Module) -> dict[int, HeldPart]:
        """id of each parameter of this rank -> what it holds (``held_boxes``); records the
        names its gradients are counted under."""
        entries = saved_parameters(model)
        self._names: dict[int, tuple[str, object]] = {}
        for param in self.module.parameters():
            if id(param) not in entries:
                raise LaunchError(
                    f"this program holds a parameter of shape {tuple(param.shape)} that the model built from the spec "
                    f"does not record, so --clip-grad-norm cannot count it once; leave --clip-grad-norm out for this plan"
                )
            self._names[id(param)] = entries[id(param)]
        return {id(param): held_boxes(param.detach(), *self._names[id(param)]) for param in self.module.parameters()}

    def norm(self) -> float:
        """The global L2 norm of the gradients: each box's squared norm over its holders,
        summed on the device, then one all-reduce of one number (one host sync a step)."""
        total = None
        for param in self.module.parameters():
            if param.grad is None:
                continue
            part = held_boxes(param.grad.detach(), *self._names[id(param)])
            term = (part.squares() * self._shares[id(param)]).sum()
            total = term if total is None else total + term
        if total is None:  # no gradients on this rank: it still joins the all-reduce
            total = torch.zeros((), dtype=torch.float64, device=self._device)
        dist.all_reduce(total, group=self.group)
        return float(total.sqrt())

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
