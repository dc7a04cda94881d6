"""A VGG-16-shaped image classifier: a convolutional trunk and large fully connected layers.

VGG-16 (Simonyan and Zisserman, "Very Deep Convolutional Networks for Large-Scale Image
Recognition", ICLR 2015, configuration D): 13 3x3 convolutions with ReLU in five blocks
(64, 128, 256, 512, 512 channels; 2, 2, 3, 3, 3 convolutions), a 2x2 max-pool after each
block, then a flatten and three fully connected layers (4096, 4096, classes). At 224 pixels
it holds 138M parameters, 124M of them in the fully connected layers, while the
convolutions do almost all of its 15.5 GFLOPs per image: the shape layer separation
(Stanza) is for. Dropout is left out so a sharded step can be checked against one device.

``build()`` returns ``(model, (images, labels))``; ``model(images, labels)`` returns the
mean cross-entropy. ``width`` scales every channel count (64 at full size) and ``hidden``
the fully connected layers (4096), so tests run it tiny::

    python -m planner plan examples/vgg.py --cluster cpu:1x4 --set width=4 --set hidden=32 \\
        --set image_size=32 --set batch_size=12 --family layer-separation -o s.json

Tensors are created with factory functions that follow the ambient ``torch.device(...)``,
so building under ``with torch.device("meta"):`` allocates no memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# VGG-16's convolutions per block and their channels at width 64 (configuration D).
BLOCKS = ((2, 1), (2, 2), (3, 4), (3, 8), (3, 8))


class VGG(nn.Module):
    """``features`` (the convolutions and pools), a flatten, ``classifier`` (three linears)."""

    def __init__(self, channels: int, image_size: int, num_classes: int, width: int, hidden: int) -> None:
        super().__init__()
        if image_size % 32:
            raise ValueError(f"image_size={image_size} is not a multiple of 32 (five 2x2 poolings); pick e.g. 32 or 224")
        layers: list[nn.Module] = []
        previous = channels
        for convolutions, multiple in BLOCKS:
            for _ in range(convolutions):
                layers += [nn.Conv2d(previous, width * multiple, kernel_size=3, padding=1), nn.ReLU()]
                previous = width * multiple
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        side = image_size // 32
        self.classifier = nn.Sequential(
            nn.Flatten(1),
            nn.Linear(previous * side * side, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of ``images`` (B, C, H, W) against ``labels`` (B,)."""
        return F.cross_entropy(self.classifier(self.features(images)), labels)


def build(
    batch_size: int = 8,
    channels: int = 3,
    image_size: int = 224,
    num_classes: int = 1000,
    width: int = 64,
    hidden: int = 4096,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """VGG-16 (at the defaults) and one global batch of random images and labels.

    The default batch, 8 images of 224 x 224, is what ``launch.py --check`` can afford on a
    CPU: every rank also runs the whole batch on one device, at about 66 MB of activations an
    image (13.5M ReLU outputs and 1.5M pooling indices), beside several copies of the 138M
    weights. It divides over 1, 2, 4 and 8 ranks, and layer separation can split 4 ranks
    2 + 2 and 8 ranks 4 + 4. Stanza's best split, one head rank for seven trunk ranks, needs
    a batch that 7 divides too: ``--set batch_size=168`` (or 56).
    """
    model = VGG(channels, image_size, num_classes, width, hidden)
    images = torch.randn(batch_size, channels, image_size, image_size)
    labels = torch.randint(0, num_classes, (batch_size,))
    return model, (images, labels)
