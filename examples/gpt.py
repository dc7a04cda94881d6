"""A GPT-2 style decoder-only language model (in the manner of nanoGPT).

Token and position embeddings, ``n_layer`` pre-LayerNorm blocks (causal self-attention with
``F.scaled_dot_product_attention(is_causal=True)``, or with ``attention="eager"`` an explicit
``AttentionCore`` module, then a GELU MLP), a final LayerNorm and
a language-model head. The blocks live in the ``nn.ModuleList`` ``blocks`` so the planner sees
``n_layer`` repeats of one structure.

``build()`` returns ``(model, (idx, targets))``: token ids and next-token targets, both int64
of shape (batch_size, seq_len). ``model(idx, targets)`` returns the cross-entropy loss, a 0-dim
tensor averaged over every token of the batch (each sample has the same number of tokens, so
data-parallel gradient averaging is exact).

Use it with the CLI (every keyword of ``build`` can be overridden with ``--set``)::

    python -m planner plan examples/gpt.py --cluster cpu:1x2 --set n_layer=4

GPT-2 small (124M parameters with tied embeddings, as OpenAI's; 163M untied)::

    python -m planner plan examples/gpt.py --cluster <cluster> --set n_layer=12 \\
        --set n_head=12 --set n_embd=768 --set vocab_size=50257 --set seq_len=1024 \\
        --set tie_weights=true

The defaults are tiny so one CPU step takes milliseconds. Tensors are created with factory
functions that follow the ambient ``torch.device(...)``, so building under
``with torch.device("meta"):`` allocates no memory, even for the big configurations.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(hd) + causal mask) v with attention dropout, written out: the
    (T, T) scores and probabilities exist as tensors. It is Megatron-LM's "core attention",
    the part that selective recomputation recomputes in backward instead of keeping; being
    its own module lets data-parallel programs checkpoint it alone."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.attn_dropout = nn.Dropout(dropout)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seq, head_dim = q.size(-2), q.size(-1)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))  # (B, nh, T, T)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        probs = F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)  # (B, nh, T, T)
        return self.attn_dropout(probs) @ v  # (B, nh, T, hd)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection (GPT-2's ``c_attn``);
    ``attention`` is ``"sdpa"`` (one fused op) or ``"eager"`` (``AttentionCore``)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, attention: str = "sdpa") -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(
                f"n_embd={n_embd} is not divisible by n_head={n_head}; pick n_embd as a multiple of n_head"
            )
        if attention not in ("sdpa", "eager"):
            raise ValueError(f"attention={attention!r} is not an implementation of this GPT; pick 'sdpa' or 'eager'")
        self.n_head = n_head
        self.dropout = dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.core = AttentionCore(dropout) if attention == "eager" else None
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.size()
        head_dim = width // self.n_head
        q, k, v = self.c_attn(x).split(width, dim=2)  # 3 x (B, T, C)
        q = q.view(batch, seq, self.n_head, head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(batch, seq, self.n_head, head_dim).transpose(1, 2)  # (B, nh, T, hd)
        v = v.view(batch, seq, self.n_head, head_dim).transpose(1, 2)  # (B, nh, T, hd)
        if self.core is not None:
            y = self.core(q, k, v)  # (B, nh, T, hd)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The position-wise feed-forward network: C -> 4C -> GELU -> C."""

    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, attention: str = "sdpa") -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, attention)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 style language model whose forward returns the training loss."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float,
        tie_weights: bool,
        attention: str = "sdpa",
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, attention) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        if tie_weights:
            # Off by default: a parameter read by two ops (embedding and head) is a harder
            # case for sharding, and the small default model does not need the savings.
            self.lm_head.weight = self.wte.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's initialisation (std 0.02); PyTorch's defaults give a much larger initial
        # loss than ln(vocab_size). On meta tensors these calls do nothing.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Return the mean next-token cross-entropy of ``idx`` (B, T) against ``targets`` (B, T)."""
        seq = idx.size(1)
        positions = torch.arange(seq, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(positions))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(
    batch_size: int = 8,
    seq_len: int = 32,
    vocab_size: int = 256,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    dropout: float = 0.0,
    tie_weights: bool = False,
    attention: str = "sdpa",
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Build the GPT and one global batch of random token ids.

    Args:
        batch_size: sequences in the global batch (dim 0 of both inputs).
        seq_len: tokens per sequence; also the number of learned positions.
        vocab_size: size of the vocabulary (GPT-2: 50257).
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: model width.
        dropout: dropout probability (0 keeps runs deterministic, e.g. for parity checks).
        tie_weights: share the token embedding with the LM head, as GPT-2 does.
        attention: ``"sdpa"`` (``F.scaled_dot_product_attention``, one fused op that keeps
            no (T, T) tensor) or ``"eager"`` (``AttentionCore``: scores and probabilities
            as (T, T) tensors, which selective recomputation drops).

    Returns:
        ``(model, (idx, targets))``, both int64 of shape (batch_size, seq_len) with values
        in [0, vocab_size); ``model(idx, targets)`` is the loss.
    """
    model = GPT(vocab_size, seq_len, n_layer, n_head, n_embd, dropout, tie_weights, attention)
    idx = torch.randint(0, vocab_size, (batch_size, seq_len))
    targets = torch.randint(0, vocab_size, (batch_size, seq_len))
    return model, (idx, targets)


if __name__ == "__main__":
    torch.manual_seed(0)
    gpt, batch = build()
    loss = gpt(*batch)
    loss.backward()
    print(f"parameters: {sum(p.numel() for p in gpt.parameters()):,}  loss: {loss.item():.4f}")
