"""A GPT whose feed-forward networks are top-k routed Mixture-of-Experts layers.

The same decoder as ``examples/gpt.py`` (token and position embeddings, pre-LayerNorm blocks
with causal self-attention, a final LayerNorm and a language-model head), with the MLP of
every ``moe_every``-th block replaced by ``MoE``: a router picks ``top_k`` of ``n_expert``
GELU MLPs for each token, each expert takes at most ``capacity`` tokens (the rest are
dropped: they skip the layer and keep their residual), and the chosen experts' outputs are
summed with the router's weights. The loss adds Switch Transformer's load-balancing term,
``aux_loss_coef x n_expert x sum_e (share of routed tokens to e) x (mean router prob of e)``,
which is 1 x the coefficient when the routing is uniform.

Routing is written with static shapes, as GShard writes it, so tracing on meta tensors sees
the whole layer: a token's place in its expert's buffer is a running count over the tokens
before it (top-1 choices of every token first, then top-2, ...), the experts run as one
batched matmul over an (experts, capacity, width) buffer, and dropped choices land in an
overflow row that is never read. ``capacity_factor=0`` is dropless: every expert's buffer
holds every token.

``build()`` returns ``(model, (idx, targets))`` like ``examples/gpt.py``; ``model(idx,
targets)`` returns the loss::

    python -m planner plan examples/moe.py --cluster cpu:1x4
    python -m planner plan examples/moe.py --cluster <cluster> --set n_expert=64 --set top_k=2
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    """``n_expert`` GELU MLPs (C -> F -> C) stored as stacked weights, run as one batched
    matmul over a buffer of shape (n_expert, capacity, C)."""

    def __init__(self, n_expert: int, n_embd: int, ffn: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(n_expert, n_embd, ffn))
        self.w_out = nn.Parameter(torch.empty(n_expert, ffn, n_embd))

    def forward(self, buffer: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(torch.bmm(buffer, self.w_in), approximate="tanh")  # (E, cap, F)
        return torch.bmm(hidden, self.w_out)  # (E, cap, C)


class MoE(nn.Module):
    """Top-k routing to ``n_expert`` experts with a capacity (see the module docstring).
    ``forward`` returns the layer's output and its load-balancing loss."""

    def __init__(self, n_embd: int, n_expert: int, top_k: int, capacity_factor: float, ffn: int) -> None:
        super().__init__()
        if not 1 <= top_k <= n_expert:
            raise ValueError(f"top_k={top_k} must be between 1 and n_expert={n_expert}")
        if capacity_factor < 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be >= 0 (0: dropless)")
        self.n_expert, self.top_k, self.capacity_factor = n_expert, top_k, capacity_factor
        self.router = nn.Linear(n_embd, n_expert, bias=False)
        self.experts = Experts(n_expert, n_embd, ffn)

    def capacity(self, tokens: int) -> int:
        """Tokens each expert takes at most: the factor times an even share of the routed
        choices, or every token when dropless."""
        if self.capacity_factor == 0:
            return tokens
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.n_expert))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, width = x.shape
        tokens = x.reshape(batch * seq, width)  # (N, C)
        count, experts = tokens.size(0), self.n_expert
        capacity = self.capacity(count)
        probs = F.softmax(self.router(tokens).float(), dim=-1)  # (N, E)
        gate, chosen = probs.topk(self.top_k, dim=-1)  # (N, k) each
        gate = (gate / gate.sum(dim=-1, keepdim=True)).to(x.dtype)  # the k weights sum to 1

        # A choice's slot in its expert's buffer: how many choices of that expert come before
        # it, all top-1 choices first (in token order), then all top-2, ... (GShard's priority).
        one_hot = F.one_hot(chosen.t().reshape(-1), experts)  # (k*N, E), choice-major
        slot = ((one_hot.cumsum(dim=0) - 1) * one_hot).sum(dim=-1)  # (k*N,)
        kept = slot < capacity  # the rest are dropped
        row = chosen.t().reshape(-1) * (capacity + 1) + torch.where(kept, slot, capacity)  # overflow row: capacity

        # Dispatch: each kept choice's token into its expert's row; run every expert at once.
        source = tokens.repeat(self.top_k, 1)  # (k*N, C), choice-major like ``row``
        buffer = tokens.new_zeros(experts * (capacity + 1), width).index_copy(0, row, source)
        buffer = buffer.view(experts, capacity + 1, width)[:, :capacity]  # (E, cap, C)
        output = self.experts(buffer)  # (E, cap, C)

        # Combine: each choice reads its row back (dropped ones read zeros), weighted by its gate.
        padded = torch.cat([output, output.new_zeros(experts, 1, width)], dim=1).reshape(-1, width)
        picked = padded.index_select(0, row) * kept.unsqueeze(-1)  # (k*N, C)
        weights = gate.t().reshape(-1, 1)  # (k*N, 1)
        combined = (picked * weights).view(self.top_k, count, width).sum(dim=0)  # (N, C)

        # Switch Transformer's balance loss: routed share times mean probability, per expert.
        share = one_hot.float().mean(dim=0)  # (E,) each expert's share of the routed choices
        balance = experts * (share * probs.mean(dim=0)).sum()
        return combined.view(batch, seq, width), balance


class Block(nn.Module):
    """Pre-LayerNorm block: x + attn(ln(x)), then x + ffn(ln(x)); the FFN is an MoE layer
    (returning its balance loss) or GPT's dense MLP (balance loss 0)."""

    def __init__(self, n_embd: int, n_head: int, moe: MoE | None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.moe = moe
        self.mlp = None if moe is not None else nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln_1(x))
        if self.moe is None:
            return x + self.mlp(self.ln_2(x)), x.new_zeros(())
        out, balance = self.moe(self.ln_2(x))
        return x + out, balance


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection (as in examples/gpt.py)."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.size()
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, seq, width))


class MoEGPT(nn.Module):
    """GPT with MoE feed-forward layers; ``forward`` returns cross-entropy plus the
    coefficient times the mean balance loss of the MoE layers."""

    def __init__(self, vocab_size: int, seq_len: int, n_layer: int, n_head: int, n_embd: int, n_expert: int,
                 top_k: int, capacity_factor: float, moe_every: int, ffn: int, aux_loss_coef: float) -> None:
        super().__init__()
        if moe_every < 1:
            raise ValueError(f"moe_every={moe_every} must be >= 1 (1: every block is MoE, 2: every other one)")
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.blocks = nn.ModuleList(
            Block(n_embd, n_head, MoE(n_embd, n_expert, top_k, capacity_factor, ffn) if (i + 1) % moe_every == 0 else None)
            for i in range(n_layer)
        )
        self.moe_layers = sum(1 for block in self.blocks if block.moe is not None)
        self.aux_loss_coef = aux_loss_coef
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        for name, param in self.named_parameters():
            if param.dim() >= 2 and not param.is_meta:
                nn.init.normal_(param, mean=0.0, std=0.02)  # GPT-2's initialisation

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(positions)  # (B, T, C)
        balance = x.new_zeros(())
        for block in self.blocks:
            x, layer_balance = block(x)
            balance = balance + layer_balance
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return loss + self.aux_loss_coef * balance / max(1, self.moe_layers)


def build(
    batch_size: int = 8,
    seq_len: int = 32,
    vocab_size: int = 256,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    n_expert: int = 4,
    top_k: int = 2,
    capacity_factor: float = 1.25,
    moe_every: int = 1,
    ffn: int = 512,
    aux_loss_coef: float = 0.01,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Build the MoE GPT and one global batch of random token ids.

    Args:
        batch_size: sequences in the global batch.
        seq_len: tokens per sequence.
        vocab_size: size of the vocabulary.
        n_layer: transformer blocks.
        n_head: attention heads (must divide ``n_embd``).
        n_embd: model width.
        n_expert: experts per MoE layer.
        top_k: experts each token is routed to.
        capacity_factor: each expert takes at most this times an even share of the routed
            choices (Switch Transformer's capacity factor); 0 for dropless.
        moe_every: every ``moe_every``-th block has an MoE layer (1: all of them; 2: every
            other one, as GShard and Switch do), the others a dense MLP.
        ffn: each expert's hidden width. The default (8 x ``n_embd``) makes the experts
            hold most of the weights (94% here), as they do in real MoE models (DeepSeek-V3:
            about 97%): then spreading them over the devices (expert parallelism) saves the
            step more than its all-to-alls cost, and ``planner plan --cluster cpu:2x4 --mesh
            pp=2`` lays the layers out expert parallel (11.9 ms against 12.1 ms replicated).
            At 128 the four experts' gradients (256 KiB a layer) all-reduce in less time
            than the four latency-bound all-to-alls per micro-batch take on gloo, and the
            search rightly keeps them replicated.
        aux_loss_coef: weight of the load-balancing loss (Switch: 0.01).
    """
    model = MoEGPT(vocab_size, seq_len, n_layer, n_head, n_embd, n_expert, top_k, capacity_factor, moe_every, ffn,
                   aux_loss_coef)
    idx = torch.randint(0, vocab_size, (batch_size, seq_len))
    targets = torch.randint(0, vocab_size, (batch_size, seq_len))
    return model, (idx, targets)


if __name__ == "__main__":
    torch.manual_seed(0)
    moe_gpt, batch = build()
    loss = moe_gpt(*batch)
    loss.backward()
    print(f"parameters: {sum(p.numel() for p in moe_gpt.parameters()):,}  loss: {loss.item():.4f}")
