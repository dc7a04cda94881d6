"""Small models with the features outside models bring, for the zoo (tests/test_zoo.py).

Each factory follows the model-spec contract (``planner.model_spec``): keyword arguments in,
``(model, inputs)`` out, every tensor made with factory functions so that building under
``torch.device("meta")`` allocates nothing. Every model returns its loss. Sizes are tiny and
every batch divides by 4.

- ``multi_output``: ops with several outputs (``max.dim``, ``min.dim``, ``topk``, ``sort``,
  ``var_mean``, ``aminmax``) whose outputs are indexed;
- ``tensor_constants``: tensors the forward makes from Python data (``torch.tensor(...)``,
  indexing with a list), which export lifts as constants;
- ``functional_dropout``: dropout whose probability is a float attribute (``F.dropout(x,
  self.p, self.training)``) and attention with ``dropout_p``, beside an ``nn.Dropout``;
- ``resnet``: a ResNet-style convolution net (stem, two residual stages, batch norm,
  global average pooling, a linear head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MultiOutput(nn.Module):
    """A projection, then features from multi-output ops, then a classifier."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.project = nn.Linear(width, width)
        self.head = nn.Linear(width + 6, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.project(x))  # (B, W)
        largest, where = h.max(dim=-1, keepdim=True)
        smallest, _ = torch.min(h, dim=-1, keepdim=True)
        top, _ = h.topk(2, dim=-1)
        ordered, order = h.sort(dim=-1, descending=True)
        variance, mean = torch.var_mean(h, dim=-1, keepdim=True)
        low, high = torch.aminmax(h, dim=-1, keepdim=True)
        spread = (ordered[:, :1] - ordered[:, -1:]) + order[:, :1].float() * 0.01 + where.float() * 0.01
        summary = [largest, smallest, top.sum(-1, keepdim=True), variance + mean, spread, high - low]
        features = torch.cat([h, *summary], dim=-1)  # (B, W + 6)
        return F.cross_entropy(self.head(features), labels)


def multi_output(batch_size: int = 8, width: int = 16, classes: int = 8):
    model = MultiOutput(width, classes)
    return model, (torch.randn(batch_size, width), torch.randint(0, classes, (batch_size,)))


class TensorConstants(nn.Module):
    """Constants made from Python data in forward: export lifts them out of the graph."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.project = nn.Linear(width, width)
        self.head = nn.Linear(width // 2, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.project(x) * torch.tensor(0.5)  # a CPU scalar: mixes with any device
        weights = torch.tensor([1.0, -2.0, 0.25, 3.0], device=x.device).repeat(h.shape[-1] // 4)
        h = torch.relu(h + weights)
        h = h[:, [index for index in range(0, h.shape[-1], 2)]]  # list indexing: an index constant
        return F.cross_entropy(self.head(h), labels)


def tensor_constants(batch_size: int = 8, width: int = 16, classes: int = 8):
    model = TensorConstants(width, classes)
    return model, (torch.randn(batch_size, width), torch.randint(0, classes, (batch_size,)))


class FunctionalDropout(nn.Module):
    """Self-attention with ``dropout_p`` and functional dropout with a float ``p``, as
    HuggingFace's seq2seq models write them, next to an ``nn.Dropout``."""

    def __init__(self, width: int, heads: int, vocab: int, p: float) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)
        self.p = p  # a float attribute, read by F.dropout: no module owns it
        self.attention_dropout = p  # read by attention as dropout_p, as HuggingFace's attention does
        self.dropout = nn.Dropout(p)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (B, S, W)
        batch, seq, width = h.shape
        q, k, v = self.qkv(h).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attention_dropout if self.training else 0.0, is_causal=True
        )
        attended = attended.transpose(1, 2).reshape(batch, seq, width)
        h = h + F.dropout(self.out(attended), self.p, self.training)
        logits = self.head(self.dropout(h))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def functional_dropout(batch_size: int = 8, seq_len: int = 8, width: int = 32, heads: int = 4, vocab: int = 64, p: float = 0.1):
    model = FunctionalDropout(width, heads, vocab, p)
    ids = torch.randint(0, vocab, (batch_size, seq_len))
    return model, (ids, torch.randint(0, vocab, (batch_size, seq_len)))


class ResidualBlock(nn.Module):
    """conv-bn-relu-conv-bn plus the input (projected when the shape changes), relu."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet(nn.Module):
    """Stem conv-bn-relu, two residual stages (the second halves the resolution), global
    average pooling, a linear classifier."""

    def __init__(self, channels: int, width: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.stages = nn.Sequential(ResidualBlock(width, width, 1), ResidualBlock(width, 2 * width, 2))
        self.head = nn.Linear(2 * width, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        features = self.stages(self.stem(images))
        pooled = F.adaptive_avg_pool2d(features, 1).flatten(1)
        return F.cross_entropy(self.head(pooled), labels)


def resnet(batch_size: int = 8, channels: int = 3, image_size: int = 8, width: int = 8, classes: int = 10):
    model = ResNet(channels, width, classes)
    images = torch.randn(batch_size, channels, image_size, image_size)
    return model, (images, torch.randint(0, classes, (batch_size,)))
