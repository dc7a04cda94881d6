"""Small stand-ins for what models nobody here wrote do, each once a silently wrong or failed program.

Each factory follows the model-spec contract (``planner.model_spec``): keyword arguments in,
``(model, inputs)`` out, tensors made by factory functions (building under
``torch.device("meta")`` allocates nothing); every model returns its loss; batches divide by 4.

- ``batch_norm_act``: a batch-norm subclass whose forward adds an activation after the norm
  (timm's ``BatchNormAct2d``, which timm-built vision models use everywhere). Data-parallel
  programs once replaced its forward with a synchronised plain norm, dropping the activation.
- ``recurrent``: an ``nn.LSTM`` then an ``nn.GRU``, whose weights once failed to materialise
  (``torch.utils.swap_tensors`` refuses the weak references recurrent layers keep).
- ``set_order_masks``: masks built while iterating a ``set`` of strings, so the traced op
  order follows Python's string hashing (``PYTHONHASHSEED``); plans once named ops by that
  order, and a plan made in one process did not fit the model traced in another.
  ``order="listed"`` and ``order="reversed"`` build the same masks in a fixed order or its
  reverse instead (the same computation traced in two orders, in one process).
- ``moves_its_head``: a forward that calls ``self.head.to(x.device)``, which ``torch.export``
  cannot trace (it refuses to swap the head's weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BatchNormAct2d(nn.BatchNorm2d):
    """Batch norm then an activation, in one layer (as timm's ``BatchNormAct2d``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, factor, self.eps)
        return F.silu(x)


class BatchNormActNet(nn.Module):
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.norm = BatchNormAct2d(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        features = self.norm(self.stem(images)).mean((2, 3))
        return F.cross_entropy(self.head(features), labels)


def batch_norm_act(batch_size: int = 8, channels: int = 8, classes: int = 4):
    return BatchNormActNet(channels, classes), (torch.randn(batch_size, 3, 6, 6), torch.randint(0, classes, (batch_size,)))


class Recurrent(nn.Module):
    def __init__(self, width: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(width, hidden, num_layers=2, batch_first=True)
        self.gru = nn.GRU(hidden, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, sequence: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(sequence)
        hidden, _ = self.gru(hidden)
        return F.cross_entropy(self.head(hidden[:, -1]), labels)


def recurrent(batch_size: int = 8, steps: int = 5, width: int = 6, hidden: int = 8, classes: int = 4):
    model = Recurrent(width, hidden, classes)
    return model, (torch.randn(batch_size, steps, width), torch.randint(0, classes, (batch_size,)))


MASK_KINDS = ("low", "high", "band", "clipped", "energy", "halves")


class SetOrderMasks(nn.Module):
    """Six masks of the projection, each a different op (or ops of different arity), built in
    the order of ``set(MASK_KINDS)`` (or as listed, or reversed), then summed in a fixed order."""

    def __init__(self, width: int, classes: int, order: str) -> None:
        super().__init__()
        self.project = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)
        self.order = order

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.project(x)
        kinds = {"set": set(MASK_KINDS), "reversed": MASK_KINDS[::-1], "listed": MASK_KINDS}[self.order]
        masks = {kind: self.mask(kind, h) for kind in kinds}
        for kind in MASK_KINDS:
            h = h + masks[kind]
        return F.cross_entropy(self.head(h), labels)

    @staticmethod
    def mask(kind: str, h: torch.Tensor) -> torch.Tensor:
        half = h.shape[-1] // 2
        return {
            "low": lambda: (h < 0).to(h.dtype),
            "high": lambda: torch.sigmoid(h),
            "band": lambda: torch.where(h.abs() < 1, h, h * 0.5),
            "clipped": lambda: torch.tanh(h).clamp(-0.5, 0.5),
            "energy": lambda: h.square().mean(-1, keepdim=True),
            "halves": lambda: torch.cat([h[:, :half], h[:, half:] * 2], dim=-1),
        }[kind]()


def set_order_masks(batch_size: int = 8, width: int = 16, classes: int = 4, order: str = "set"):
    model = SetOrderMasks(width, classes, order)
    return model, (torch.randn(batch_size, width), torch.randint(0, classes, (batch_size,)))


class MovesItsHead(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.body(x))
        self.head.to(x.device)  # keeps the head with its input: a no-op once the model is there
        return F.cross_entropy(self.head(hidden), labels)


def moves_its_head(batch_size: int = 8, width: int = 8, classes: int = 4):
    return MovesItsHead(width, classes), (torch.randn(batch_size, width), torch.randint(0, classes, (batch_size,)))
