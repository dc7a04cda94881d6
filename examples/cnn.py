"""A small convolutional image classifier.

Three 3x3 convolutions with ReLU (max-pooling after the first two), then a flatten and a
two-layer fully connected head. There is no BatchNorm on purpose: its batch statistics would
differ between a single device and data-parallel ranks, so a plan could not be checked for
exact parity.

``build()`` returns ``(model, (images, labels))``: float images (batch_size, channels,
image_size, image_size) and int64 labels (batch_size,). ``model(images, labels)`` returns the
cross-entropy loss, a 0-dim tensor averaged over the batch, so averaging gradients across
data-parallel ranks gives exactly the single-device gradient.

Use it with the CLI (every keyword of ``build`` can be overridden with ``--set``)::

    python -m planner plan examples/cnn.py --cluster cpu:1x2 --set width=64 --set image_size=32

Sizes are tiny by default so one CPU step takes milliseconds. Tensors are created with
factory functions that follow the ambient ``torch.device(...)``, so building under
``with torch.device("meta"):`` allocates no memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CNN(nn.Module):
    """Conv(3x3)+ReLU+MaxPool, Conv+ReLU+MaxPool, Conv+ReLU, Flatten, Linear+ReLU, Linear."""

    def __init__(self, channels: int, image_size: int, num_classes: int, width: int) -> None:
        super().__init__()
        if image_size % 4 != 0:
            raise ValueError(
                f"image_size={image_size} is not divisible by 4 (two 2x2 poolings); pick a multiple of 4"
            )
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(),
        )
        pooled = image_size // 4
        self.classifier = nn.Sequential(
            nn.Flatten(1),
            nn.Linear(2 * width * pooled * pooled, 4 * width),
            nn.ReLU(),
            nn.Linear(4 * width, num_classes),
        )

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Return the mean cross-entropy of ``images`` (B, C, H, W) against ``labels`` (B,)."""
        features = self.features(images)  # (B, 2w, H/4, W/4)
        logits = self.classifier(features)  # (B, num_classes)
        return F.cross_entropy(logits, labels)


def build(
    batch_size: int = 8,
    channels: int = 3,
    image_size: int = 16,
    num_classes: int = 10,
    width: int = 16,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Build the CNN and one global batch of random images and labels.

    Args:
        batch_size: images in the global batch (dim 0 of both inputs).
        channels: input channels (3 for RGB).
        image_size: height and width of the square images; a multiple of 4.
        num_classes: number of classes.
        width: channels of the first convolution (the later ones use twice as many).

    Returns:
        ``(model, (images, labels))`` with images float32 (batch_size, channels, image_size,
        image_size) and labels int64 (batch_size,) in [0, num_classes);
        ``model(images, labels)`` is the loss.
    """
    model = CNN(channels, image_size, num_classes, width)
    images = torch.randn(batch_size, channels, image_size, image_size)
    labels = torch.randint(0, num_classes, (batch_size,))
    return model, (images, labels)


if __name__ == "__main__":
    torch.manual_seed(0)
    cnn, batch = build()
    loss = cnn(*batch)
    loss.backward()
    print(f"parameters: {sum(p.numel() for p in cnn.parameters()):,}  loss: {loss.item():.4f}")
