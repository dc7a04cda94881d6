"""Cross entropy on logits split over the classes (a vocabulary-parallel loss), without
gathering the logits.

PyTorch's ``torch.distributed.tensor.parallel.loss_parallel()`` runs ``cross_entropy`` on
logits held ``Shard(1)`` (the class dim) as Megatron-LM's vocabulary-parallel cross entropy
does: forward all-reduces three numbers per row over the class-splitting axis (the row's
maximum, its sum of exponentials, and the logit of its target, which only the rank holding
that class contributes), and backward computes each rank's slice of the gradient locally.
DTensor's own rule for the op gathers the whole logits instead.

``loss_parallel`` swaps DTensor's handlers of the log-softmax and NLL ops (forward and
backward) while it is active, and the backward must run under it too. A program's backward
runs wherever its caller calls ``loss.backward()``, so ``VocabularyParallelCrossEntropy``
runs the loss's own forward and backward inside the context, as one autograd Function.

What it sends is what ``cost_model.loss_parallel`` charges.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

_MEAN, _SUM = 1, 2  # ATen's reduction codes


class VocabularyParallelCrossEntropy(torch.autograd.Function):
    """``cross_entropy(logits, target, reduction=..., ignore_index=...)`` under
    ``loss_parallel()``, forward and backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, logits: DTensor, target: Any, reduction: int, ignore_index: int) -> DTensor:  # noqa: D102
        with torch.enable_grad(), loss_parallel():
            leaf = logits.detach().requires_grad_(logits.requires_grad)
            loss = torch.nn.functional.cross_entropy(
                leaf, target, reduction={_MEAN: "mean", _SUM: "sum"}.get(reduction, "none"), ignore_index=ignore_index
            )
        # The small graph from the logits to the loss, differentiated in backward (below).
        ctx.leaf, ctx.loss = leaf, loss
        return loss.detach()

    @staticmethod
    def backward(ctx, grad: DTensor):  # noqa: D102
        leaf, loss = ctx.leaf, ctx.loss
        del ctx.leaf, ctx.loss
        with loss_parallel():
            (logits_grad,) = torch.autograd.grad(loss, leaf, grad)
        return logits_grad, None, None, None


def vocabulary_parallel_cross_entropy(
    op: Callable, input: Any, target: Any, weight: Any = None, reduction: int = _MEAN, ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> Any:
    """``op`` (``aten.cross_entropy_loss``) on logits split over the classes, by
    ``loss_parallel`` (module docstring).

    A mean on a mesh of more than one axis (rows split over ``dp`` too) is the loss summed
    over this rank's rows divided by the count of targets that are not ``ignore_index``, each
    summed over the ranks: ``loss_parallel`` takes means on one-axis meshes only, and a mean
    of per-rank means is wrong where ranks count different numbers of targets. Class weights
    and label smoothing, which ``loss_parallel`` does not take, run through DTensor's own
    rule (which gathers the logits)."""
    if weight is not None or label_smoothing != 0.0 or not isinstance(input, DTensor):
        return op(input, target, weight, reduction, ignore_index, label_smoothing)
    if reduction == _MEAN and input.device_mesh.ndim > 1:
        total = VocabularyParallelCrossEntropy.apply(input, target, _SUM, ignore_index)
        counted = (target != ignore_index).sum()
        return total / counted
    return VocabularyParallelCrossEntropy.apply(input, target, reduction, ignore_index)
