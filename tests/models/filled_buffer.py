"""A small model that builds tensors and fills them in place, as outside models do.

Each write below is one a real model makes, on a tensor the forward made itself (so the
traced graph holds it as an intermediate, then views of it, then in-place ops on the views):

- the keys are assembled in a ``new_empty`` buffer, the per-head part copied into one slice
  and a part shared by the heads assigned (broadcast) into the other, as DeepSeek-V3's
  attention assembles its rope and non-rope parts;
- a router marks its top expert with ``scatter_`` into a ``zeros_like`` of its scores;
- the first position's features are scaled in place through a view taken *before* the
  write and read after it (``first = mixed[:, 0]; first.mul_(0.5)``);
- the classifier's input is a ``new_zeros`` buffer with the features assigned into a slice
  and a bias column written with ``fill_``.

Every write sits between parameters and the loss, so a program that loses one (writes into
a copy, or leaves the gradient of the written part behind) fails the parity check on the
loss or on a gradient. Follows the model-spec contract (``planner.model_spec``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FilledBuffer(nn.Module):
    """Attention with keys assembled by slices, a scatter router, in-place scaling, a head."""

    def __init__(self, width: int, heads: int, shared: int, experts: int, vocab: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = width // heads
        self.shared = shared  # key features shared by every head (DeepSeek-V3's rope part)
        self.embed = nn.Embedding(vocab, width)
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, heads * (self.head_dim - shared))
        self.key_shared = nn.Linear(width, shared)
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.gate = nn.Linear(width, experts, bias=False)
        self.head = nn.Linear(width + 1, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (B, S, W)
        batch, seq, width = h.shape
        own = self.head_dim - self.shared
        q = self.query(h).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        k_own = self.key(h).view(batch, seq, self.heads, own).transpose(1, 2)  # (B, H, S, D - R)
        k_shared = self.key_shared(h).view(batch, 1, seq, self.shared)  # (B, 1, S, R)
        keys = k_own.new_empty(batch, self.heads, seq, self.head_dim)
        keys[..., :own].copy_(k_own)
        keys[..., own:] = k_shared  # broadcast over the heads
        v = self.value(h).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        attended = F.scaled_dot_product_attention(q, keys, v, is_causal=True)
        mixed = self.out(attended.transpose(1, 2).reshape(batch, seq, width))  # (B, S, W)

        scores = self.gate(mixed).softmax(dim=-1)  # (B, S, E)
        chosen = torch.zeros_like(scores).scatter_(-1, scores.argmax(dim=-1, keepdim=True), 1.0)
        mixed = mixed * (scores * chosen).sum(dim=-1, keepdim=True)

        first = mixed[:, 0]  # a view taken before the write below and read after it
        first.mul_(0.5)
        features = mixed.new_zeros(batch, seq, width + 1)
        features[..., :width] = mixed + first.unsqueeze(1)
        features[..., width:].fill_(1.0)  # a bias column
        logits = self.head(features)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build(batch_size: int = 4, seq_len: int = 8, width: int = 32, heads: int = 4, shared: int = 4, experts: int = 4,
          vocab: int = 64):
    model = FilledBuffer(width, heads, shared, experts, vocab)
    ids = torch.randint(0, vocab, (batch_size, seq_len))
    return model, (ids, torch.randint(0, vocab, (batch_size, seq_len)))
