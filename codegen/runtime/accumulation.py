"""Gradient accumulation: one training step's forward and backward over micro-batches.

A plan with ``accumulation_steps = k`` (and no pipeline) cuts the global batch into k
micro-batches of consecutive samples, gives each rank its part of each (the program's
``shard_batch``) and runs forward and backward on them in turn, so only one micro-batch's
activations are alive at a time. Each micro-batch's loss is
divided by k before its backward: for a loss that averages over the samples (cross-entropy,
MSE), the summed gradients then equal those of the whole batch, as on one device.

DDP (and ZeRO-1, which is DDP plus a sharded optimizer) skips its gradient all-reduce for
all but the last micro-batch (``no_sync``), so gradients are reduced once per step. FSDP2
(FSDP, ZeRO-2) reduce-scatters every micro-batch's gradients into the sharded gradient,
keeping no unsharded gradient between micro-batches; the simulator prices both so.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from planner.errors import LaunchError
from planner.model_loss import extract_loss

__all__ = ["forward_backward", "micro_batches"]


def micro_batches(args: tuple, kwargs: dict, steps: int, batch: int) -> list[tuple[tuple, dict]]:
    """``steps`` micro-batches of a batch of ``batch`` samples: every tensor whose first
    dimension is ``batch`` is cut into equal consecutive parts (as pipelines cut theirs);
    anything else (a mask shared by the samples, a flag) is passed whole to each."""
    if batch % steps:
        raise LaunchError(f"a batch of {batch} samples does not split into {steps} micro-batches; re-plan")
    size = batch // steps

    def part(value: Any, index: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
            return value[index * size : (index + 1) * size]
        return value

    return [
        (tuple(part(value, index) for value in args), {key: part(value, index) for key, value in kwargs.items()})
        for index in range(steps)
    ]


def forward_backward(
    module: torch.nn.Module, args: tuple, kwargs: dict, steps: int, batch: int, shard: Callable[[tuple, dict], tuple[tuple, dict]],
    loss_weight: float = 1.0,
) -> tuple[torch.Tensor, Any]:
    """One step's forward and backward of ``module`` on a global batch of ``batch`` samples
    in ``steps`` micro-batches (see the module docstring): each micro-batch is cut from the
    global batch, then ``shard`` (the program's ``shard_batch``) gives this rank its part.
    Returns this rank's loss (the mean of the micro-batches' losses) and the module's output
    when it ran in one piece (``None`` when accumulated: there is no single output).
    ``loss_weight``: what the loss is multiplied by before backward (a rank of uneven batch
    shares weights its gradient by its share: ``Program.loss_weight``); the loss returned is
    not multiplied."""
    if steps == 1:
        local_args, local_kwargs = shard(args, kwargs)
        output = module(*local_args, **local_kwargs)
        loss = extract_loss(output)
        (loss * loss_weight if loss_weight != 1.0 else loss).backward()
        return loss, output
    if loss_weight != 1.0:
        # Uneven shares accumulate through the program's own forward_backward (each rank's
        # micro-batches of its share: planner.families.uneven_dp), never through equal cuts.
        raise LaunchError("this uneven program has no forward_backward of its own for gradient accumulation "
                          "(compiled before uneven shares could accumulate); compile the plan again")
    parts = micro_batches(args, kwargs, steps, batch)
    losses = []
    for index, (part_args, part_kwargs) in enumerate(parts):
        last = index == len(parts) - 1
        local_args, local_kwargs = shard(part_args, part_kwargs)
        # DDP reduces gradients after the last micro-batch only; FSDP2 has no no_sync.
        quiet = module.no_sync() if hasattr(module, "no_sync") and not last else contextlib.nullcontext()
        with quiet:
            loss = extract_loss(module(*local_args, **local_kwargs))
            (loss / steps).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean(), None
