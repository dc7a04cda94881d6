"""A VGG-16-shaped CNN for ``benchmarks/slow_networks.py`` (Simonyan & Zisserman 2015,
configuration D: 13 3x3 convolutions in 5 stages of 64, 128, 256, 512, 512 channels, each
stage ended by 2x2 max pooling, then fully connected 25,088 -> 4,096 -> 4,096 -> 1,000;
138M parameters, 124M of them in the fully connected layers). ``build()`` follows the
examples' convention: ``(model, (images, labels))``, ``model(images, labels)`` the loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

STAGES = ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))  # (channels, convolutions)


class VGG16(nn.Module):
    """VGG-16 (configuration D) on 224 x 224 images."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for width, count in STAGES:
            for _ in range(count):
                layers += [nn.Conv2d(channels, width, kernel_size=3, padding=1), nn.ReLU()]
                channels = width
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(1), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
            nn.Linear(4096, num_classes),
        )

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.classifier(self.features(images)), labels)


def build(batch_size: int = 32, num_classes: int = 1000) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """VGG-16 and one global batch of random 224 x 224 images and labels."""
    model = VGG16(num_classes)
    images = torch.randn(batch_size, 3, 224, 224)
    labels = torch.randint(0, num_classes, (batch_size,))
    return model, (images, labels)
