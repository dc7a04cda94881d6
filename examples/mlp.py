"""A multi-layer perceptron regressor: the smallest model the planner can plan.

``build()`` returns ``(model, (inputs, targets))``: a stack of ``layers`` Linear layers with
ReLU between them, and one global batch of random regression data. ``model(inputs, targets)``
returns the mean-squared-error loss, a 0-dim tensor averaged over the batch, so averaging
gradients across data-parallel ranks gives exactly the single-device gradient.

Use it with the CLI (every keyword of ``build`` can be overridden with ``--set``)::

    python -m planner plan examples/mlp.py --cluster cpu:1x2 --set hidden=1024 --set layers=8

or from Python::

    import torch
    from examples.mlp import build
    torch.manual_seed(0)
    model, inputs = build(hidden=128)
    model(*inputs).backward()

Sizes are tiny by default so one CPU step takes milliseconds. Tensors are created with
factory functions that follow the ambient ``torch.device(...)``, so building under
``with torch.device("meta"):`` allocates no memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """``layers`` Linear layers (in -> hidden -> ... -> hidden -> out) with ReLU between them."""

    def __init__(self, in_features: int, hidden: int, out_features: int, layers: int) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}; pass layers=1 or more")
        widths = [in_features] + [hidden] * (layers - 1) + [out_features]
        modules: list[nn.Module] = []
        for index, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
            modules.append(nn.Linear(fan_in, fan_out))
            if index < layers - 1:  # no activation after the output layer: it is a regressor
                modules.append(nn.ReLU())
        self.net = nn.Sequential(*modules)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Return the MSE loss of ``inputs`` (B, in_features) against ``targets`` (B, out_features)."""
        prediction = self.net(inputs)  # (B, out_features)
        # Mean over every element = mean over the batch of per-sample means (same width per
        # sample), so data-parallel gradient averaging is exact.
        return F.mse_loss(prediction, targets)


def build(
    batch_size: int = 16,
    in_features: int = 32,
    hidden: int = 64,
    out_features: int = 8,
    layers: int = 3,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Build the MLP and one global batch of random regression data.

    Args:
        batch_size: samples in the global batch (dim 0 of both inputs).
        in_features: width of the input.
        hidden: width of the hidden layers.
        out_features: width of the output (and of the targets).
        layers: number of Linear layers (>= 1).

    Returns:
        ``(model, (inputs, targets))`` with inputs (batch_size, in_features) and targets
        (batch_size, out_features), both float32; ``model(inputs, targets)`` is the loss.
    """
    model = MLP(in_features, hidden, out_features, layers)
    inputs = torch.randn(batch_size, in_features)
    targets = torch.randn(batch_size, out_features)
    return model, (inputs, targets)


if __name__ == "__main__":
    torch.manual_seed(0)
    mlp, batch = build()
    loss = mlp(*batch)
    loss.backward()
    print(f"parameters: {sum(p.numel() for p in mlp.parameters()):,}  loss: {loss.item():.4f}")
