"""Attention masks read from traced graphs (``planner.attention_masks``), priced and compiled
as the kernel that will run.

Tiny Hugging Face decoders built from their configs (never downloaded) hand
``scaled_dot_product_attention`` an explicit mask when traced; the trace must prove it
causal (sliding for Mistral's window), never for an encoder or a mask that reads data.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cost_model import defaults
from cost_model.compute import op_times
from cost_model.gpu_kernels import GENERATIONS, attention_efficiency, attention_times
import planner.attention_masks as masks
from planner.attention_masks import sliding_window
from planner.cluster import Cluster
from planner.hf_models import build_hf
from planner.trace import trace

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128, "seq_len": 16}
A100_DEVICE = Cluster.preset("dgx-a100-80g").device_of(0)


def attention_kinds(graph) -> list[str | None]:
    return [node.attention_mask_kind for node in graph.nodes if node.op.startswith("aten.scaled_dot_product_attention")]


def traced_hf(model_type: str, **overrides):
    model, args, kwargs = build_hf(model_type, overrides, torch.device("meta"))
    return trace(model, args, kwargs)


@pytest.mark.parametrize("model_type, overrides", [
    ("llama", TINY),
    ("qwen2", TINY),
    ("gemma", {**TINY, "head_dim": 16}),
    ("mistral", {**TINY, "sliding_window": 64}),  # a window longer than the sequence: causal
    ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128, "seq_len": 16}),
])
def test_hf_decoders_masks_are_causal(model_type, overrides):
    kinds = attention_kinds(traced_hf(model_type, **overrides))
    assert kinds and all(kind == "causal" for kind in kinds), kinds


def test_mistral_sliding_window_is_read_as_a_window():
    kinds = attention_kinds(traced_hf("mistral", **{**TINY, "sliding_window": 4}))
    assert kinds == ["sliding:4", "sliding:4"]
    assert sliding_window(kinds[0]) == 4


def test_encoder_is_not_causal():
    # BERT's mask comes from an all-ones attention mask: every pair is allowed, as no mask.
    graph = traced_hf("bert", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=128, seq_len=16)
    kinds = attention_kinds(graph)
    assert kinds and all(kind == "none" for kind in kinds), kinds


class MaskedAttention(nn.Module):
    """SDPA over (B, 2, S, 8) heads with a mask the forward builds (``how``) or is given."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.proj(x).view(batch, seq, 2, 8).transpose(1, 2)
        ones = torch.ones(seq, seq, dtype=torch.bool, device=x.device)
        if self.how == "given":
            pass
        elif self.how == "tril":
            mask = ones.tril()
        elif self.how == "additive":  # 0 on and below the diagonal, -inf above (float masks)
            mask = torch.zeros(seq, seq, device=x.device).masked_fill(~ones.tril(), float("-inf"))
        elif self.how == "upper":
            mask = ones.triu()
        elif self.how == "band":
            mask = ones.tril() & ~ones.tril(-3)
        elif self.how == "random":
            mask = torch.rand(seq, seq, device=x.device) > 0.5
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum()


@pytest.mark.parametrize("how, kind", [
    ("tril", "causal"), ("additive", "causal"), ("band", "sliding:3"), ("upper", "arbitrary"),
    ("random", "arbitrary"), ("given", "arbitrary"),
])
def test_user_model_masks(how, kind):
    x = torch.randn(2, 12, 16)
    mask = torch.rand(12, 12) > 0.5 if how == "given" else None
    graph = trace(MaskedAttention(how), (x, mask) if mask is not None else (x,))
    assert attention_kinds(graph) == [kind]


def test_unchecked_when_too_long(monkeypatch):
    # A mask that is no comparison of positions is compared element by element, up to a size.
    monkeypatch.setattr(masks, "MAX_CHECKED_ELEMENTS", 11 * 11)
    graph = trace(MaskedAttention("tril"), (torch.randn(2, 12, 16),))
    assert attention_kinds(graph) == ["arbitrary"]


class PositionMask(nn.Module):
    """SDPA whose boolean mask compares key positions with query positions (``how``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.proj(x).view(batch, seq, 2, 8).transpose(1, 2)
        k_idx = torch.arange(seq, device=x.device).view(1, 1, 1, seq)
        q_idx = torch.arange(seq, device=x.device).view(1, 1, seq, 1)
        mask = {
            "k <= q": lambda: k_idx <= q_idx,
            "q >= k": lambda: q_idx >= k_idx,
            "k < q": lambda: k_idx < q_idx,  # the diagonal left out: not causal
            "k >= q": lambda: k_idx >= q_idx,
            "band": lambda: (k_idx <= q_idx) & (k_idx > q_idx - 3),
            "band swapped": lambda: (q_idx - 3 < k_idx) & (q_idx >= k_idx),
            "unsorted keys": lambda: k_idx.flip(-1) >= q_idx.flip(-2),  # S-1-j >= S-1-i: causal, keys descending
            "every pair": lambda: (k_idx >= 0) & (q_idx >= k_idx - seq),
        }[self.how]().expand(batch, 1, seq, seq)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum()


POSITION_MASKS = {"k <= q": "causal", "q >= k": "causal", "k < q": "arbitrary", "k >= q": "arbitrary",
                  "band": "sliding:3", "band swapped": "sliding:3", "unsorted keys": "causal", "every pair": "none"}


@pytest.mark.parametrize("how", sorted(POSITION_MASKS))
def test_comparisons_of_positions_are_decided_as_element_by_element(how, monkeypatch):
    # Held lazy (the limit is below 12 x 12), a comparison of positions is decided from where
    # it cuts the sorted keys; it must agree with the element-by-element check, which decides
    # the small eager masks (and, here, the unsorted keys).
    eager = attention_kinds(trace(PositionMask(how), (torch.randn(2, 12, 16),)))
    monkeypatch.setattr(masks, "EAGER_ELEMENTS", 16)
    lazy = attention_kinds(trace(PositionMask(how), (torch.randn(2, 12, 16),)))
    assert eager == lazy == [POSITION_MASKS[how]]


def test_causal_masks_of_long_sequences_are_proven_quickly(monkeypatch):
    # Nothing is compared element by element: a 32k-token mask (2^30 pairs) is decided from
    # its positions.
    monkeypatch.setattr(masks, "MAX_CHECKED_ELEMENTS", 0)
    graph = traced_hf("llama", **{**TINY, "seq_len": 32768, "max_position_embeddings": 32768, "batch_size": 1})
    assert set(attention_kinds(graph)) == {"causal"}


def test_compact_masks_of_long_sequences_are_checked_by_row_blocks(monkeypatch):
    # Lazy elementwise values and the row-blocked comparison: with tiny limits the 12 x 12
    # mask is never held whole, and is still proven causal.
    monkeypatch.setattr(masks, "EAGER_ELEMENTS", 16)
    graph = trace(MaskedAttention("band"), (torch.randn(2, 12, 16),))
    assert attention_kinds(graph) == ["sliding:3"]


def test_causal_mask_is_priced_as_the_causal_kernel():
    # A tiny Llama with 2 heads of 128 at 512 tokens, batch 2: its traced attention carries an
    # explicit mask and no is_causal, and costs what the causal FlashAttention model gives.
    graph = traced_hf("llama", hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=128, seq_len=512, batch_size=2)
    node = next(n for n in graph.nodes if n.op.startswith("aten.scaled_dot_product_attention"))
    assert node.attrs[5:6] != (True,) and len(node.inputs) == 4  # q, k, v and the mask
    a100 = GENERATIONS["A100"]
    causal = attention_times(2 * 2, 512, 512, 128, True, A100_DEVICE, "bf16", a100)
    full = attention_times(2 * 2, 512, 512, 128, False, A100_DEVICE, "bf16", a100)
    assert op_times(node, 1.0, A100_DEVICE, "bf16") == pytest.approx(causal)
    unproven = dataclasses.replace(node, attention_mask_kind="arbitrary")
    assert op_times(unproven, 1.0, A100_DEVICE, "bf16") == pytest.approx(full)
    # Half the FLOPs: time x the reached throughput (peak at the sustained clock x 0.73 x the
    # shape efficiency).
    def forward_flops(causal_flag: bool, forward: float) -> float:
        shape = attention_efficiency(4, 512, 512, 128, causal_flag, a100)
        return (forward - defaults.KERNEL_OVERHEAD_S) * 312e12 * a100.sustained_clock * 0.73 * shape

    assert forward_flops(True, causal[0]) == pytest.approx(0.5 * forward_flops(False, full[0]))
    assert forward_flops(False, full[0]) == pytest.approx(4 * 4 * 512 * 512 * 128)
