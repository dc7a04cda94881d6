"""Qwen3-235B-A22B as a model-spec factory for ``benchmarks/moe_frontier.py``.

Its published config.json sets ``head_dim`` 128 (64 query heads of 128 over a 4,096-wide
residual), but transformers' ``Qwen3MoeConfig`` declares no such field: the attention reads
it with ``getattr`` and otherwise takes hidden / heads = 64, half the real projections. An
``hf:qwen3_moe`` spec refuses fields the default config lacks (a typo guard), so this file
builds the model from the full published config itself, with the batch an ``hf:`` spec would
build (input ids and labels equal to them).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# Qwen/Qwen3-235B-A22B config.json (Hugging Face hub).
QWEN3_235B = {"hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
              "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
              "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960}


def build(batch_size: int = 8, seq_len: int = 4096):
    """(model, inputs): Qwen3-235B-A22B in training mode and one global batch of token ids
    with labels (created under the caller's device, ``meta`` when planning)."""
    config = AutoConfig.for_model("qwen3_moe", **QWEN3_235B)
    config.use_cache = False  # training never reuses past keys and values
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    input_ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    return model, {"input_ids": input_ids, "labels": input_ids.clone()}
