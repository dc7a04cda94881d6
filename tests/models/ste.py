"""A model whose backward is not the autograd of its forward: activations are quantized with
a straight-through estimator (STE), as quantization-aware training does.

``RoundSTE`` rounds in forward (to multiples of 1/4) and passes the gradient through
unchanged in backward. The autograd of ``round`` is zero almost everywhere, so a program
that replays the traced forward ops and differentiates them would train on zero gradients
below every quantizer. ``build()`` returns ``(model, (x, y))``: float inputs
(batch, seq, width) and regression targets; ``model(x, y)`` is the mean squared error.

With ``hook="backward"`` the blocks' down projections carry a module backward hook instead
(``register_full_backward_hook``, here scaling the gradient that flows back through them);
with ``hook="tensor"`` forward calls ``Tensor.register_hook`` on the hidden activations. Both
change the gradients the same way a custom Function does: outside the traced graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RoundSTE(torch.autograd.Function):
    """Round to multiples of ``1 / levels`` in forward; identity gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, levels: float) -> torch.Tensor:
        return torch.round(x * levels) / levels

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None  # straight through: d(round)/dx taken as 1


class Quantize(nn.Module):
    def __init__(self, levels: float = 4.0) -> None:
        super().__init__()
        self.levels = levels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RoundSTE.apply(x, self.levels)


def _halve(grad: torch.Tensor) -> torch.Tensor:
    return grad * 0.5


class Block(nn.Module):
    """Pre-norm MLP block with quantized hidden activations: x + down(q(gelu(up(norm(x)))))."""

    def __init__(self, width: int, hook: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.quant = Quantize() if hook == "none" else nn.Identity()
        self.down = nn.Linear(4 * width, width)
        self.tensor_hook = hook == "tensor"
        if hook == "backward":
            self.down.register_full_backward_hook(lambda module, grad_input, grad_output: (_halve(grad_input[0]),))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.up(self.norm(x)))
        if self.tensor_hook and hidden.requires_grad:
            hidden.register_hook(_halve)
        return x + self.down(self.quant(hidden))


class QuantizedNet(nn.Module):
    def __init__(self, width: int, n_layer: int, hook: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, hook) for _ in range(n_layer))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)


def build(batch_size: int = 8, seq_len: int = 8, width: int = 32, n_layer: int = 2, hook: str = "none"):
    """The model and one batch; ``hook``: ``"none"`` (RoundSTE quantizers), ``"backward"``
    (module backward hooks) or ``"tensor"`` (``Tensor.register_hook`` in forward)."""
    if hook not in ("none", "backward", "tensor"):
        raise ValueError(f"hook must be none, backward or tensor, got {hook!r}")
    model = QuantizedNet(width, n_layer, hook)
    return model, (torch.randn(batch_size, seq_len, width), torch.randn(batch_size, seq_len, width))
