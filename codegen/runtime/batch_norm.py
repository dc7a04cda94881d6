"""Batch norm over the whole global batch in data-parallel programs, as on one device.

A ``BatchNorm`` layer in training normalises with the mean and variance of its batch. Under
data parallelism each rank holds a slice of the batch, so plain DDP normalises every slice
with its own statistics: a different step than one device's (and ``--check`` says so).
``torch.nn.SyncBatchNorm`` computes the statistics over the whole data-parallel group, but
on CUDA only. :func:`synchronise_batch_norm` does the same on any backend: it replaces the
forward of each batch-norm layer of the model with one that all-reduces the per-channel sums
over the group (with autograd: the backward all-reduces their gradients), normalises, and
updates the running statistics exactly as one device would. Evaluation mode is unchanged.

Cost per layer and step: two all-reduces of ``channels`` floats (plus one of the count) in
forward, and two in backward.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["synchronise_batch_norm"]


def synchronise_batch_norm(model: nn.Module, group: dist.ProcessGroup) -> int:
    """Make every batch-norm layer of ``model`` use the statistics of the whole batch held by
    the ranks of ``group`` in training; returns how many layers it changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, nn.SyncBatchNorm):
            module._single_device_forward = module.forward
            module._statistics_group = group
            module.forward = types.MethodType(_forward_over_group, module)
            changed += 1
    return changed


def _forward_over_group(self: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    uses_batch_statistics = self.training or not self.track_running_stats
    if not uses_batch_statistics:
        return self._single_device_forward(x)
    self._check_input_dim(x)
    group = self._statistics_group
    reduced = [0, *range(2, x.dim())]  # every dim but the channels
    shape = [1, -1] + [1] * (x.dim() - 2)
    # Statistics in at least fp32, as the native kernel keeps them under autocast; fp64 stays fp64.
    values = x.to(torch.promote_types(x.dtype, torch.float32))
    # In the statistics' dtype: an fp32 count would round the fp64 Bessel factor count / (count - 1).
    count = torch.tensor(float(values.numel() // values.shape[1]), dtype=values.dtype, device=x.device)
    dist.all_reduce(count, group=group)
    mean = _SumOverGroup.apply(values.sum(reduced), group) / count
    centred = values - mean.view(shape)
    variance = _SumOverGroup.apply(centred.square().sum(reduced), group) / count  # biased, as the kernel normalises
    normalised = centred * torch.rsqrt(variance.view(shape) + self.eps)
    if self.affine:
        normalised = normalised * self.weight.view(shape) + self.bias.view(shape)
    if self.training and self.track_running_stats:
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
            unbiased = variance * (count / (count - 1)) if count > 1 else variance
            self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
            self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)
    return normalised.to(x.dtype)


class _SumOverGroup(torch.autograd.Function):
    """The sum over the group's ranks of each rank's tensor; its gradient is the sum over the
    ranks of the gradients (every rank's loss reads the sum)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        total = value.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None
