"""Batch norm over the whole global batch in data-parallel programs, as on one device.

A ``BatchNorm`` layer in training normalises with the mean and variance of its batch. Under
data parallelism each rank holds a slice of the batch, so plain DDP normalises every slice
with its own statistics: a different step than one device's (and ``--check`` says so).
``torch.nn.SyncBatchNorm`` computes the statistics over the whole data-parallel group, but
on CUDA only. :func:`synchronise_batch_norm` does the same on any backend.

It keeps the layer's own forward and changes only the normalisation inside it: while the
forward of a batch-norm layer runs, its calls of ``torch.nn.functional.batch_norm`` (or
``torch.batch_norm``) that use batch statistics are answered by one that all-reduces the
per-channel sums over the group (with autograd: the backward all-reduces their gradients),
normalises, and updates the running statistics exactly as one device would. So a subclass
whose forward does more than normalise (timm's ``BatchNormAct2d``: an activation and a drop
after the norm; a norm that adds a learned offset) keeps all of it. A layer in training that
normalises without either function (its own arithmetic, a native op called directly) cannot
be synchronised this way: its first forward raises :class:`BatchNormNotSynchronised`, naming
the class, rather than train another model than one device would. Evaluation (running
statistics) is unchanged.

Cost per layer and step: two all-reduces of ``channels`` floats (plus one of the count) in
forward, and two in backward.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from planner.errors import LaunchError

__all__ = ["BatchNormNotSynchronised", "synchronise_batch_norm"]


class BatchNormNotSynchronised(LaunchError):
    """A batch-norm layer in training normalised without a function this module can
    synchronise, so each rank would normalise its slice of the batch alone (a user's model
    this program cannot train as one device does: ``launch.py`` prints it as one line)."""


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


def _forward_over_group(self: nn.modules.batchnorm._BatchNorm, *args: Any, **kwargs: Any) -> Any:
    """The layer's own forward, with its batch-statistics normalisations taken over the group."""
    statistics = _StatisticsOverGroup(self._statistics_group)
    with statistics:
        output = self._single_device_forward(*args, **kwargs)
    if self.training and not statistics.normalisations:
        raise BatchNormNotSynchronised(
            f"{type(self).__module__}.{type(self).__qualname__} is a batch-norm layer whose forward, in training, "
            f"normalises without torch.nn.functional.batch_norm, so its statistics cannot be taken over the "
            f"data-parallel ranks and each would normalise its own slice of the batch (another model than one "
            f"device trains); make its forward call torch.nn.functional.batch_norm (or super().forward), or plan it "
            f"without data parallelism"
        )
    return output


# How the two functions a batch-norm forward normalises with take their arguments.
_FUNCTIONAL_SIGNATURE = inspect.signature(F.batch_norm)
_TORCH_PARAMETERS = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps",
                     "cudnn_enabled")


def _arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call of ``F.batch_norm`` or ``torch.batch_norm`` by name."""
    if func is F.batch_norm:
        bound = _FUNCTIONAL_SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)
    return {**dict(zip(_TORCH_PARAMETERS, args)), **kwargs}


class _StatisticsOverGroup(TorchFunctionMode):
    """While active, answers ``F.batch_norm``/``torch.batch_norm`` calls in training with the
    statistics over ``group``; counts the normalisations it saw (any mode)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.normalisations = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        if func is not F.batch_norm and func is not torch.batch_norm:
            return func(*args, **kwargs)
        self.normalisations += 1
        call = _arguments(func, args, kwargs)
        if not call["training"]:
            return func(*args, **kwargs)  # running statistics: the same on every rank
        return _batch_norm_over_group(call["input"], call["running_mean"], call["running_var"], call["weight"],
                                      call["bias"], call["momentum"], call["eps"], self.group)


def _batch_norm_over_group(x: torch.Tensor, running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                           weight: torch.Tensor | None, bias: torch.Tensor | None, momentum: float | None, eps: float,
                           group: dist.ProcessGroup) -> torch.Tensor:
    """``F.batch_norm(..., training=True)`` with the mean and variance of the whole batch the
    ranks of ``group`` hold; the running statistics (when given) move as the native kernel
    moves them: ``(1 - momentum) * running + momentum * batch`` (variance unbiased)."""
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
    normalised = centred * torch.rsqrt(variance.view(shape) + eps)
    if weight is not None:
        normalised = normalised * weight.view(shape)
    if bias is not None:
        normalised = normalised + bias.view(shape)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            factor = 0.0 if momentum is None else float(momentum)
            unbiased = variance * (count / (count - 1)) if count > 1 else variance
            running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
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
