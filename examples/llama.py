"""A Llama-3 style decoder-only language model, in plain PyTorch.

The architecture of Meta's Llama 3 (Dubey et al., 2024, "The Llama 3 Herd of Models",
table 3): token embedding, ``n_layer`` pre-RMSNorm blocks of grouped-query causal
self-attention with rotary position embeddings (RoPE, theta 500,000) and a SwiGLU MLP, a
final RMSNorm and an untied language-model head. The blocks live in the ``nn.ModuleList``
``layers`` so the planner sees ``n_layer`` repeats of one structure.

``build(size=...)`` picks a configuration; every other keyword overrides one field of it:

========  ======  =======  =====  ========  ======  =======  ================================
size      layers  width    heads  kv heads  MLP     vocab    parameters
========  ======  =======  =====  ========  ======  =======  ================================
``8b``    32      4,096    32     8         14,336  128,256  8.03B (Llama-3-8B)
``1b``    16      2,048    32     8         8,192   128,256  1.50B (Llama-3.2-1B, head untied)
``tiny``  2       64       4      2         128     256      for tests: one CPU step in ms
========  ======  =======  =====  ========  ======  =======  ================================

The quick start plans the 8B model on two DGX A100 nodes, on meta tensors (nothing is
allocated)::

    python -m planner plan examples/llama.py --cluster dgx-a100-80g:2

and the tiny one runs on this machine::

    python -m planner plan examples/llama.py --cluster cpu:1x2 --set size=tiny -o plan.json

``build()`` returns ``(model, (tokens, targets))``, both int64 of shape (batch_size,
seq_len); ``model(tokens, targets)`` returns the mean next-token cross-entropy (a 0-dim
tensor). Tensors are created with factory functions that follow the ambient
``torch.device(...)``, so building under ``with torch.device("meta"):`` allocates nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    """One Llama configuration (field names follow Meta's reference implementation)."""

    n_layer: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5
    batch_size: int = 8
    seq_len: int = 32


SIZES = {
    # Llama-3-8B (the paper's table 3). The batch: 64 sequences of 4,096 tokens, 256K tokens
    # per step, a global batch that two DGX nodes train at a sensible step time.
    "8b": LlamaConfig(32, 4096, 32, 8, 14336, 128256, batch_size=64, seq_len=4096),
    # Llama-3.2-1B's shape (its head is tied to the embedding; untied here).
    "1b": LlamaConfig(16, 2048, 32, 8, 8192, 128256, batch_size=64, seq_len=4096),
    "tiny": LlamaConfig(2, 64, 4, 2, 128, 256, rope_theta=10_000.0, batch_size=8, seq_len=32),
}


class RMSNorm(nn.Module):
    """Root-mean-square layer normalisation with a learned scale (no bias, no centring)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * self.weight


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's rotation angles, (seq_len, head_dim // 2) each."""
    inverse_frequency = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inverse_frequency)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of features of ``x`` (B, T, heads, head_dim) by its angle."""
    pairs = x.view(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # broadcast over batch and heads
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    """Grouped-query causal self-attention: ``n_kv_heads`` key/value heads shared by groups of
    ``n_heads // n_kv_heads`` query heads."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        group = self.n_heads // self.n_kv_heads
        # Each key/value head serves `group` query heads: repeat it for them.
        k = k[:, :, :, None, :].expand(batch, seq, self.n_kv_heads, group, self.head_dim).reshape(batch, seq, self.n_heads, self.head_dim)
        v = v[:, :, :, None, :].expand(batch, seq, self.n_kv_heads, group, self.head_dim).reshape(batch, seq, self.n_heads, self.head_dim)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One pre-RMSNorm block: x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama-3 style language model whose forward returns the training loss."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # A small normal initialisation (std 0.02) so the first loss is near ln(vocab);
        # on meta tensors these calls do nothing.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Return the mean next-token cross-entropy of ``tokens`` (B, T) against ``targets`` (B, T)."""
        head_dim = self.config.dim // self.config.n_heads
        cos, sin = rotary_tables(tokens.size(1), head_dim, self.config.rope_theta, tokens.device)
        x = self.tok_embeddings(tokens)  # (B, T, dim)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))  # (B, T, vocab)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(size: str = "8b", **overrides: int | float) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Build a Llama and one global batch of random token ids.

    Args:
        size: ``"8b"`` (default), ``"1b"`` or ``"tiny"`` (see the module docstring).
        overrides: any field of ``LlamaConfig`` (``n_layer``, ``dim``, ``n_heads``,
            ``n_kv_heads``, ``ffn_dim``, ``vocab_size``, ``rope_theta``, ``norm_eps``,
            ``batch_size``, ``seq_len``), e.g. ``--set n_layer=4`` on the command line.

    Returns:
        ``(model, (tokens, targets))``, both int64 of shape (batch_size, seq_len) with values
        in [0, vocab_size); ``model(tokens, targets)`` is the loss.
    """
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    unknown = sorted(set(overrides) - set(LlamaConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown Llama field(s) {unknown}; the fields are {', '.join(LlamaConfig.__dataclass_fields__)}")
    config = replace(SIZES[size], **overrides)
    if config.dim % config.n_heads or config.n_heads % config.n_kv_heads or (config.dim // config.n_heads) % 2:
        raise ValueError(
            f"dim={config.dim}, n_heads={config.n_heads}, n_kv_heads={config.n_kv_heads}: dim must split into an even "
            f"head size per head, and n_kv_heads must divide n_heads"
        )
    model = Llama(config)
    tokens = torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len))
    targets = torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len))
    return model, (tokens, targets)


if __name__ == "__main__":
    torch.manual_seed(0)
    llama, batch = build("tiny")
    loss = llama(*batch)
    loss.backward()
    print(f"parameters: {sum(p.numel() for p in llama.parameters()):,}  loss: {loss.item():.4f} "
          f"(ln(vocab) = {math.log(llama.config.vocab_size):.4f})")
