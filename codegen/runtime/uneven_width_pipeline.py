"""A pipeline whose stages run on different numbers of ranks (FlashFlex / HexiScale layouts,
``planner.families.hetero_pipeline.widths``): stage s runs data parallel over ``widths[s]``
consecutive ranks, each taking 1/widths[s] of every micro-batch's rows.

Why not ``torch.distributed.pipelining``: its stages exchange activations with one peer per
stage over a rectangular pp x dp mesh, so a stage of 2 ranks after one of 1 (the rows of one
micro-batch held by one rank, then split over two) is not expressible. This module keeps the
pipeline family's stage modules (``codegen.pipeline_emit`` writes them, each stage's ops on
DTensors over a one-rank mesh) and replaces only the communication and the schedule.

Units. The program is traced at one *unit* of ``rows = batch / units`` samples, with
``units = micro_batches x lcm(widths)`` (the program's ``MICRO_BATCHES``); micro-batch k is units
``k * lcm .. (k + 1) * lcm - 1``. On stage s, rank j of its ``w`` ranks takes the units
``j * lcm / w .. (j + 1) * lcm / w - 1`` of every micro-batch: its contiguous 1/w of the
micro-batch's rows, run as ``lcm / w`` forwards of one unit each (``unit_owner``). So every
stage's ranks split each micro-batch evenly, and a stage of any width runs the same written
code at the same shapes.

Boundaries. Unit i's activations go from its owner on stage s to its owner on stage s + 1 by
point-to-point sends (``isend``/``recv`` of each value STAGE_OUTPUTS lists); its gradients
come back the same way. Every rank sends and receives its units in one order (forward: rising
unit index; backward: falling), so a blocked receive only ever waits on a rank that is
working towards it: a cycle of waits would need the unit indices to fall all round it.

Schedule: GPipe, all forwards then all backwards (``UnevenWidthRunner.step``); the family
prices these plans as GPipe (``candidates.width_estimates``: every micro-batch in flight on
every stage; its step, sum of stage times + (m - 1) x the slowest, is 1F1B's too).

Gradients. Each unit's loss is the model's loss of its rows (a mean over them); the whole
batch's loss is the mean of the ``units`` equal units' losses, so each unit's loss is
back-propagated divided by ``units``, and a stage's gradients are summed over its ranks (one
all-reduce per parameter over the stage's own process group, ``dist.new_group``) once the
schedule is done: the step equals one device's step on the whole batch. A parameter several
stages hold (tied embeddings) is summed over every rank of those stages, each adding its
stage's sum divided by the stage's width, so every copy takes the same step.

Gradient clipping (``launch.py --clip-grad-norm``) sums squared norms over every rank
(``pp_group`` is the world): a stage of w ranks each hold the same summed gradients, so each
adds its squared norms divided by w (``gradient_holders``; a tied weight by the ranks of every
stage that holds it), and the norm is one device's.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from codegen.runtime.pipeline import tied_holders

__all__ = ["UnevenWidthRunner", "build_width_stage", "stage_of_rank", "unit_owner"]


def stage_of_rank(widths: Sequence[int], rank: int) -> tuple[int, int]:
    """(stage, position among its ranks) of ``rank``: stage s holds the ``widths[s]`` ranks
    after the stages before it."""
    start = 0
    for stage, width in enumerate(widths):
        if rank < start + width:
            return stage, rank - start
        start += width
    raise ValueError(f"rank {rank} is outside the {sum(widths)} ranks of stages of widths {tuple(widths)}")


def unit_owner(widths: Sequence[int], stage: int, unit: int) -> int:
    """The global rank that runs ``unit`` on ``stage``: position ``(unit % lcm) // (lcm / w)``
    of the stage's ``w`` ranks (module docstring), contiguous rows per rank."""
    lcm = math.lcm(*widths)
    width = widths[stage]
    return sum(widths[:stage]) + (unit % lcm) // (lcm // width)


def build_width_stage(stages: Sequence[type], model: nn.Module, mesh: DeviceMesh, widths: Sequence[int],
                      parameters: Mapping[str, Any], stage_parameters: Sequence[Sequence[str]],
                      dropout_modules: Mapping[str, Any] | None = None):
    """This rank's stage module: the class of its stage, over a one-rank mesh of itself (each
    rank of a stage holds the stage whole; its rows come from the schedule)."""
    from codegen.runtime.pipeline import stage_mesh

    if len(stages) != len(widths) or sum(widths) != dist.get_world_size():
        raise ValueError(f"{len(stages)} stage classes on {dist.get_world_size()} ranks do not match the stage "
                         f"widths {tuple(widths)}; compile the plan again")
    stage, _ = stage_of_rank(widths, dist.get_rank())
    return stages[stage](model, stage_mesh(mesh), parameters, stage_parameters[stage], dropout_modules, stage,
                         len(stages))


class UnevenWidthRunner:
    """One training step of a pipeline of stages of different widths (module docstring).

    Args:
        module: this rank's stage module (``build_width_stage``).
        widths: ranks per stage.
        units: units per step (``micro_batches x lcm(widths)``).
        stage_inputs: per stage, ``(name, traced shape of one unit, dtype, placements)`` of
            each value it receives (the program's STAGE_INPUTS; what a stage sends is what
            its forward returns).
        input_names: the model's inputs in the order of stage 0's ``forward``.
        shared: groups of stages that hold the same parameters, with those parameters' names.
    """

    def __init__(self, module, widths: Sequence[int], units: int, stage_inputs: Sequence[Sequence[tuple]],
                 input_names: Sequence[str],
                 shared: Mapping[tuple[int, ...], Sequence[str]] | None = None) -> None:
        self.module, self.widths, self.units = module, tuple(widths), units
        if units % math.lcm(*self.widths):
            raise ValueError(f"{units} units per step do not fill whole micro-batches of lcm{self.widths} units")
        self.rank = dist.get_rank()
        self.stage, _ = stage_of_rank(self.widths, self.rank)
        self.first, self.last = self.stage == 0, self.stage == len(self.widths) - 1
        self.inputs = stage_inputs[self.stage]
        self.input_names = tuple(input_names)
        self.mine = [unit for unit in range(units) if unit_owner(self.widths, self.stage, unit) == self.rank]
        # Groups are made on every rank alike, in one order (dist.new_group is collective).
        starts = [sum(self.widths[:s]) for s in range(len(self.widths) + 1)]
        self.stage_groups = [dist.new_group(list(range(starts[s], starts[s + 1]))) for s in range(len(self.widths))]
        self.stage_group = self.stage_groups[self.stage]
        self._shared = []
        for holders, names in sorted((shared or {}).items()):
            ranks = [rank for s in holders for rank in range(starts[s], starts[s + 1])]
            group = dist.new_group(ranks)
            if self.stage in holders:
                self._shared.append((group, tuple(names)))
        # What the training loop sums gradient norms over (module docstring: clipping).
        self.pp_group = dist.group.WORLD

    def step(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """Forward and backward of one step on the whole batch (every rank holds it; each
        takes its units' rows). Gradients are left in the stage's parameters as one device's
        step would give them; returns the step's loss (mean over the units) on every rank."""
        device = self.module.device
        chunks = _unit_chunks(args, kwargs, self.input_names, self.units) if self.first else None
        kept, sends, losses = [], [], []
        for unit in self.mine:  # forward, units rising
            received = chunks[unit] if self.first else self._receive(unit, device)
            result = self.module(*received)
            if self.last:
                losses.append(result.reshape(()))
                kept.append((unit, received, result))
            else:
                outputs = result if isinstance(result, tuple) else (result,)
                sends += [dist.isend(value.detach().contiguous(), unit_owner(self.widths, self.stage + 1, unit))
                          for value in outputs]
                kept.append((unit, received, outputs))
        for work in sends:
            work.wait()
        sends = []
        for unit, received, produced in reversed(kept):  # backward, units falling
            if self.last:
                (produced / self.units).backward()
            else:
                grads = self._receive_grads(unit, produced, device)
                pairs = [(o, g) for o, g in zip(produced, grads) if g is not None and o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            if not self.first:
                sends += self._send_grads(unit, received)
        for work in sends:
            work.wait()
        self._sum_over_stage()
        self._sum_shared()
        total = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=device)
        dist.all_reduce(total)  # the last stage's units' losses, to every rank
        return total / self.units

    # ------------------------------------------------------------------ point-to-point

    def _receive(self, unit: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Unit ``unit``'s values from its owner on the previous stage, float ones ready for
        their gradients."""
        source = unit_owner(self.widths, self.stage - 1, unit)
        values = []
        for _, shape, dtype, _ in self.inputs:
            value = torch.empty(tuple(shape), dtype=dtype, device=device)
            dist.recv(value, source)
            values.append(value.requires_grad_(dtype.is_floating_point))
        return tuple(values)

    def _receive_grads(self, unit: int, produced: Sequence[torch.Tensor], device) -> list[torch.Tensor | None]:
        """The gradients of what this rank sent for ``unit``, from the next stage's owner
        (one per floating value, zeros where that stage's loss did not depend on it)."""
        source = unit_owner(self.widths, self.stage + 1, unit)
        grads = []
        for value in produced:
            if not value.is_floating_point():
                grads.append(None)
                continue
            grad = torch.empty_like(value, device=device)
            dist.recv(grad, source)
            grads.append(grad)
        return grads

    def _send_grads(self, unit: int, received: Sequence[torch.Tensor]) -> list:
        """The gradients of ``unit``'s received values back to their sender (zeros for one
        this stage's loss did not depend on)."""
        target = unit_owner(self.widths, self.stage - 1, unit)
        works = []
        for value in received:
            if not value.is_floating_point():
                continue
            grad = value.grad if value.grad is not None else torch.zeros_like(value)
            works.append(dist.isend(grad.contiguous(), target))
        return works

    # ------------------------------------------------------------------ gradients

    def gradient_holders(self, param: nn.Parameter) -> int:
        """How many ranks hold ``param``'s whole gradient once the step is done: every rank
        of the stages it is tied over, else every rank of this stage."""
        return tied_holders(self._shared, self.module.params, param) or self.widths[self.stage]

    def _sum_over_stage(self) -> None:
        """Each gradient summed over the stage's ranks (each holds its rows' part)."""
        for param in _unique(self.module):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = _local(param.grad)
            if self.widths[self.stage] > 1:
                dist.all_reduce(grad, group=self.stage_group)

    def _sum_shared(self) -> None:
        """Tied parameters summed over the stages that hold them: every rank of those stages
        adds its stage's sum / its width, so each stage counts once."""
        for group, names in self._shared:
            for name in names:
                grad = _local(self.module.params[name].grad)
                grad.div_(self.widths[self.stage])
                dist.all_reduce(grad, group=group)


def _unique(module) -> list[nn.Parameter]:
    return list({id(p): p for p in module.params.values()}.values())


def _local(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (its storage: changing it changes the DTensor), else itself."""
    return value.to_local() if isinstance(value, DTensor) else value


def _unit_chunks(args: tuple, kwargs: dict, names: Sequence[str], units: int) -> list[tuple]:
    """The model's inputs in stage 0's order, cut along the batch dim into ``units`` equal
    consecutive parts; one tuple per unit."""
    values = list(args) + [kwargs[name] for name in names[len(args):] if name in kwargs]
    if len(values) != len(names):
        missing = [name for name in names[len(args):] if name not in kwargs]
        raise ValueError(f"the pipeline's first stage needs the inputs {list(names)}; missing {missing}")
    parts = [value.chunk(units) if isinstance(value, torch.Tensor) and value.dim() else (value,) * units
             for value in values]
    if any(len(part) != units for part in parts):
        raise ValueError(f"the batch does not split into {units} equal units; compile the plan for this batch size")
    return [tuple(part[unit] for part in parts) for unit in range(units)]
