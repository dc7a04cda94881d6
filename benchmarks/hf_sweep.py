"""Sweep HuggingFace model types end to end: plan, compile, one training step against one device.

For each ``hf:<model_type>`` named on the command line (or a group: ``decoders``, ``moe``,
``recurrent``, ``encoders``, ``seq2seq``, ``vision``), a tiny config (2 layers, widths of 64,
a 128-token vocabulary, 16-token sequences; the overrides are the config's own fields, in
``SWEEP`` below) is planned by the default search on ``cpu:1xWORLD``, compiled, and checked
by ``launch.py --check``'s comparison. Where the searched plan keeps every weight whole (pure
data parallelism), Megatron-LM's layout with ``tp=WORLD`` is compiled and checked as well, so
the graph-program emitter sees the model's ops with split weights. All programs are checked
in ONE torchrun launch of ``tests/dist_check_many.py`` (starting processes costs seconds).

    python benchmarks/hf_sweep.py decoders --world 2
    python benchmarks/hf_sweep.py gptj mpt --world 2 --out /tmp/sweep

Types in ``IN_FLOAT64`` are checked in float64 (``launch.py --check --fp64``): their
single-device fp32 step is itself too far from exact for the fp32 tolerance to judge.

Prints one row per model type: the searched plan, whether it compiled, the parity result
(max error, or the first line of the failure), and the same for the forced tensor-parallel
layout; a refusal (a ``PlannerError``) is printed as its one line.

Measured on transformers 5.24.0 with ``--world 2``, one group at a time: 160 types (66 of them
added for 5.24, marked in ``SWEEP``); 142 pass every check they get. Refused in one line:
JetMoE, LongCat-Flash, LED, Nystromformer, M2M-100, FSMT, LongT5, Switch Transformers
(``torch.export`` cannot trace them), PhiMoE (its router's own backward, which only data
parallelism keeps, mixes the samples of the batch), DBRX (does not build in 5.24), and
RecurrentGemma's forced tp layout (a custom autograd Function). Failing, open: the forced tp
programs of Dory, RWKV, Kimi-Linear, Bailing-Hybrid, DeepSeek-V3.2, GLM-MoE-DSA and AXK2 (the
README's "Known not to run" says how each fails).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torch.distributed.tensor import Shard

import planner
from planner.api import prepare_model
from planner.errors import PlannerError
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan

REPO = Path(__file__).resolve().parents[1]
DIST_CHECK_MANY = REPO / "tests" / "dist_check_many.py"

_TEXT = {"vocab_size": 128, "seq_len": 16, "batch_size": 4}
# A llama-shaped decoder: the config fields most decoders share.
_DECODER = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, **_TEXT}
_GPT2_LIKE = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64, **_TEXT}
_ENCODER = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "max_position_embeddings": 64, **_TEXT}
_SEQ2SEQ = {"encoder_layers": 2, "decoder_layers": 2, "d_model": 64, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
            "encoder_attention_heads": 4, "decoder_attention_heads": 4, "max_position_embeddings": 64, **_TEXT}
_IMAGES = {"batch_size": 4, "num_labels": 10}
_VIT = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "image_size": 32, "patch_size": 8, **_IMAGES}
_MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
# The same fields under the names later configs give them (transformers 5.24).
_WINDOW = {"head_dim": 16, "sliding_window": 8}  # a window shorter than the 16-token sequence
_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_ROUTED = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
           "n_group": 1, "topk_group": 1}
# Multi-head latent attention (DeepSeek-V2's low-rank queries and keys/values): one key/value
# head per query head (with fewer, SDPA's grouped-query broadcast fails under torch.export).
_MLA = {"num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
        "v_head_dim": 16}
# Gated-delta-net linear attention (Qwen3-Next's) before one full-attention layer.
_LINEAR = {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 16,
           "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4}

# model type -> tiny overrides (the config's own field names), by group.
SWEEP: dict[str, dict[str, dict]] = {
    "decoders": {
        "gptj": {**_GPT2_LIKE, "rotary_dim": 8},
        "codegen": {**_GPT2_LIKE, "rotary_dim": 8},
        "gpt_bigcode": _GPT2_LIKE,
        "gpt_neo": {"num_layers": 2, "attention_layers": ["global", "local"], "hidden_size": 64,
                    "num_heads": 4, "max_position_embeddings": 64, "window_size": 8, **_TEXT},
        "mpt": {"n_layers": 2, "d_model": 64, "n_heads": 4, "max_seq_len": 64, **_TEXT},
        "persimmon": {key: value for key, value in _DECODER.items() if key != "num_key_value_heads"},
        "nemotron": {**_DECODER, "head_dim": 16},
        "glm": {**_DECODER, "head_dim": 16, "pad_token_id": 0},
        "glm4": {**_DECODER, "head_dim": 16, "pad_token_id": 0},
        "helium": {**_DECODER, "head_dim": 16},
        "exaone4": _DECODER,
        "phi3": {**_DECODER, "pad_token_id": 0},
        "cohere2": {**_DECODER, "head_dim": 16},
        "olmo": _DECODER,
        "olmo3": _DECODER,
        "gemma3_text": {**_DECODER, "head_dim": 16},
        "smollm3": {**_DECODER, "pad_token_id": 0},
        "ministral": {**_DECODER, "head_dim": 16},
        "seed_oss": {**_DECODER, "head_dim": 16},
        "arcee": _DECODER,
        "apertus": _DECODER,
        "internlm3": {**_DECODER, "head_dim": 16},
        "biogpt": {**_ENCODER},
        "xglm": {"num_layers": 2, "d_model": 64, "ffn_dim": 128, "attention_heads": 4,
                 "max_position_embeddings": 64, **_TEXT},
        "ctrl": {"n_layer": 2, "n_embd": 64, "dff": 128, "n_head": 4, "n_positions": 64, **_TEXT},
        "gpt_oss": {**_DECODER, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
        # types added for transformers 5.24 (those that build from a tiny config)
        "qwen3": {**_DECODER, "head_dim": 16},
        "olmo2": {**_DECODER, "pad_token_id": 0},
        "granite": _DECODER,
        "cohere": _DECODER,
        "starcoder2": {**_DECODER, "sliding_window": 8},
        "stablelm": _DECODER,
        "gemma2": {**_DECODER, **_WINDOW, "query_pre_attn_scalar": 16},
        "vaultgemma": {**_DECODER, **_WINDOW, "query_pre_attn_scalar": 16},
        "diffllama": {**_DECODER, "head_dim": 16},
        "ernie4_5": {**_DECODER, "head_dim": 16},
        "hunyuan_v1_dense": {**_DECODER, "head_dim": 16},
        "bitnet": _DECODER,
        "jais2": {**_DECODER, "head_dim": 16},
        "nanochat": {**_DECODER, "pad_token_id": 0},
        "apertus1p5_text": {**_DECODER, "pad_token_id": 0},
        "cwm": {**_DECODER, **_WINDOW},
        "dory": {**_DECODER, **_WINDOW},
        "hyperclovax": {**_DECODER, "head_dim": 16},
        "ministral3": {**_DECODER, **_WINDOW, "pad_token_id": 0},
        "minicpm3": {**_DECODER, **_MLA},
        "youtu": {**_DECODER, **_MLA},
        "granite_swa": {**_DECODER, "sliding_window": 8},
        "gemma4_text": {**_DECODER, **_WINDOW, "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16},
    },
    "moe": {
        "dbrx": {"n_layers": 2, "d_model": 64, "n_heads": 4, "max_seq_len": 64,
                 "ffn_config.ffn_hidden_size": 128, "ffn_config.moe_num_experts": 4, "ffn_config.moe_top_k": 2,
                 "attn_config.kv_n_heads": 2, **_TEXT},
        "jetmoe": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_key_value_heads": 2,
                   "kv_channels": 16, "num_local_experts": 4, "num_experts_per_tok": 2, **_TEXT},
        "deepseek_v2": {**_DECODER, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                        "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
                        "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1,
                        "num_key_value_heads": 4},  # MLA: one key/value head per query head
        "ernie4_5_moe": {**_DECODER, "moe_intermediate_size": 32, "moe_num_experts": 4, "moe_k": 2},
        "glm4_moe": {**_DECODER, "moe_intermediate_size": 32, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
        "hunyuan_v1_moe": {**_DECODER, "head_dim": 16, "num_experts": 4, "moe_topk": 2},
        # types added for transformers 5.24 (those that build from a tiny config)
        "olmoe": {**_DECODER, **_MOE, "pad_token_id": 0},
        "phimoe": {**_DECODER, **_MOE, "sliding_window": 8},
        "granitemoe": {**_DECODER, **_MOE},
        "granitemoeshared": {**_DECODER, **_MOE},
        "granitemoe_swa": {**_DECODER, **_MOE, "sliding_window": 8},
        "minimax_m2": {**_DECODER, **_MOE, "head_dim": 16},
        "llama4_text": {**_DECODER, **_MOE, "head_dim": 16, "intermediate_size_mlp": 128, "attention_chunk_size": 8},
        "cohere2_moe": {**_DECODER, **_WINDOW, "num_experts": 4, "num_experts_per_tok": 2},
        "dots1": {**_DECODER, **_ROUTED, "first_k_dense_replace": 1},
        "exaone_moe": {**_DECODER, **_EXPERTS, "sliding_window": 8, "n_group": 1, "topk_group": 1,
                       "first_k_dense_replace": 1},
        "glm4_moe_lite": {**_DECODER, **_ROUTED, **_MLA},
        # DeepSeek sparse attention: an indexer keeps each query's top index_topk keys.
        "deepseek_v32": {**_DECODER, **_ROUTED, **_MLA, "first_k_dense_replace": 1, "index_head_dim": 16,
                         "index_topk": 8},
        "glm_moe_dsa": {**_DECODER, **_ROUTED, **_MLA, "first_k_dense_replace": 1, "index_head_dim": 16,
                        "index_topk": 8},
        # its rotary embedding is sized by head_dim, which must equal qk_rope_head_dim
        "longcat_flash": {**_DECODER, **_MLA, "head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                          "expert_ffn_hidden_size": 32, "ffn_hidden_size": 128, "zero_expert_num": 2},
        "mimo_v2_flash": {**_DECODER, **_WINDOW, "n_routed_experts": 4, "num_experts_per_tok": 2,
                          "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1, "v_head_dim": 16},
        "solar_open": {key: value for key, value in {**_DECODER, **_ROUTED, "head_dim": 16}.items()
                       if key != "intermediate_size"},
        "afmoe": {**_DECODER, **_WINDOW, **_EXPERTS},
        "axk1": {**_DECODER, **_ROUTED, **_MLA},
        "axk2": {**_DECODER, **_ROUTED, **_MLA, "index_head_dim": 16, "index_topk": 8},
        "beam": {**_DECODER, **_WINDOW, **_EXPERTS, "n_group": 1, "topk_group": 1},
        "flint": {**_DECODER, **_WINDOW, **_EXPERTS, "shared_expert_intermediate_size": 32},
        "hy_v3": {**_DECODER, **_EXPERTS, "head_dim": 16},
        "kolibri1": {key: value for key, value in {**_DECODER, **_WINDOW, **_EXPERTS,
                                                   "shared_expert_intermediate_size": 32}.items()
                     if key != "intermediate_size"},
        "laguna": {**_DECODER, **_WINDOW, **_EXPERTS, "shared_expert_intermediate_size": 32},
        "mellum": {**_DECODER, **_WINDOW, **_EXPERTS},
        "doge": {**_DECODER, "sliding_window": 8, "num_experts": 4, "num_experts_per_tok": 2},
        "deepseek_v4": {**_DECODER, **_WINDOW, "n_routed_experts": 4, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 32, "n_shared_experts": 1, "q_lora_rank": 16, "qk_rope_head_dim": 8,
                        "o_lora_rank": 16, "index_head_dim": 16, "index_topk": 8},
        "inkling_text": {**_DECODER, **_WINDOW, "n_routed_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32, "n_shared_experts": 1, "swa_head_dim": 16},
    },
    "recurrent": {
        "mamba": {"num_hidden_layers": 2, "hidden_size": 64, "state_size": 8, "expand": 2, **_TEXT},
        "mamba2": {"num_hidden_layers": 2, "hidden_size": 64, "state_size": 8, "expand": 2, "num_heads": 8,
                   "head_dim": 16, "n_groups": 1, "chunk_size": 8, **_TEXT},
        "falcon_mamba": {"num_hidden_layers": 2, "hidden_size": 64, "state_size": 8, "expand": 2, **_TEXT},
        "rwkv": {"num_hidden_layers": 2, "hidden_size": 64, "attention_hidden_size": 64, "intermediate_size": 128,
                 "context_length": 64, **_TEXT},
        "recurrent_gemma": {"num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128,
                            "num_attention_heads": 4, "num_key_value_heads": 1, "lru_width": 64,
                            "attention_window_size": 8, **_TEXT},
        "jamba": {**_DECODER, "num_experts": 4, "num_experts_per_tok": 2, "attn_layer_period": 2,
                  "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1, "mamba_d_state": 8,
                  "mamba_expand": 2, "use_mamba_kernels": False},
        "zamba": {"num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                  "num_key_value_heads": 4, "attention_head_dim": 32, "layers_block_type": ["mamba", "hybrid", "hybrid"], "mamba_d_state": 8, "mamba_expand": 2,
                  "n_mamba_heads": 2, "use_mamba_kernels": False, **_TEXT},
        # types added for transformers 5.24 (those that build from a tiny config)
        "bamba": {**_DECODER, "mamba_n_heads": 8, "mamba_d_state": 8, "mamba_chunk_size": 8, "mamba_d_head": 16,
                  "attn_layer_indices": [1]},
        "falcon_h1": {**_DECODER, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_chunk_size": 8,
                      "mamba_d_head": 16},
        "lfm2": {**_DECODER, "layer_types": ["conv", "full_attention"], "block_multiple_of": 16},
        "granitemoehybrid": {**_DECODER, **_MOE, "shared_intermediate_size": 32, "mamba_n_heads": 8,
                             "mamba_d_state": 8, "mamba_chunk_size": 8, "mamba_d_head": 16,
                             "layer_types": ["mamba", "attention"]},
        "nemotron_h": {**_DECODER, **_ROUTED, "head_dim": 16, "ssm_state_size": 8, "mamba_num_heads": 8,
                       "mamba_head_dim": 16, "chunk_size": 8, "moe_shared_expert_intermediate_size": 32},
        "qwen3_5_text": {**_DECODER, **_LINEAR},
        "qwen3_next": {**_DECODER, **_LINEAR, **_EXPERTS, "shared_expert_intermediate_size": 32},
        "qwen3_5_moe_text": {key: value for key, value in {**_DECODER, **_LINEAR, **_EXPERTS,
                                                           "shared_expert_intermediate_size": 32}.items()
                             if key != "intermediate_size"},
        "lara_mini": {key: value for key, value in {**_DECODER, **_LINEAR, **_EXPERTS, "sliding_window": 8,
                                                    "shared_expert_intermediate_size": 32}.items()
                      if key != "intermediate_size"},
        "zamba2": {**_DECODER, "head_dim": 16, "layers_block_type": ["mamba", "hybrid"], "hybrid_layer_ids": [1],
                   "chunk_size": 8, "adapter_rank": 8, "attention_hidden_size": 128, "attention_head_dim": 32,
                   "mamba_headdim": 16, "mamba_d_state": 8, "pad_token_id": 0},
        "kimi_linear": {**_DECODER, **_EXPERTS, **_MLA, "head_dim": 16, "n_shared_experts": 1, "pad_token_id": 0,
                        "layer_types": ["linear_attention", "full_attention"], "linear_head_dim": 16,
                        "qk_head_dim": 24},
        "olmo_hybrid": {**_DECODER, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "pad_token_id": 0,
                        "layer_types": ["linear_attention", "full_attention"]},
        "bailing_hybrid": {**_DECODER, **_EXPERTS, **_MLA, "head_dim": 16, "n_shared_experts": 1, "n_group": 1,
                           "topk_group": 1, "first_k_dense_replace": 1, "pad_token_id": 0,
                           "layer_types": ["linear_attention", "full_attention"], "linear_head_dim": 16,
                           "qk_head_dim": 24},
        # lightning (linear) attention every other layer
        "minimax": {**_DECODER, **_WINDOW, **_MOE, "block_size": 8},
        "xlstm": {"num_hidden_layers": 2, "hidden_size": 64, "embedding_dim": 64, "num_heads": 4, "chunk_size": 8,
                  **_TEXT},
    },
    "encoders": {
        "xlnet": {"n_layer": 2, "d_model": 64, "n_head": 4, "d_inner": 128, **_TEXT},
        "deberta": {**_ENCODER},
        "deberta-v2": {**_ENCODER},
        "albert": {**_ENCODER, "embedding_size": 32},
        "mpnet": {**_ENCODER},
        "funnel": {"block_sizes": [1, 1], "d_model": 64, "n_head": 4, "d_head": 16, "d_inner": 128, **_TEXT},
        "mobilebert": {**_ENCODER, "embedding_size": 32, "intra_bottleneck_size": 32, "true_hidden_size": 32,
                       "num_feedforward_networks": 2},
        "squeezebert": {**_ENCODER, "embedding_size": 64},
        "camembert": {**_ENCODER, "pad_token_id": 1},
        "xlm-roberta": {**_ENCODER, "pad_token_id": 1},
        "convbert": {**_ENCODER, "embedding_size": 64},
        "roformer": {**_ENCODER, "embedding_size": 64},
        "megatron-bert": _ENCODER,
        "modernbert": {**_ENCODER, "local_attention": 8, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "cls_token_id": 2, "sep_token_id": 1},
        "nomic_bert": _ENCODER,
        "big_bird": {**_ENCODER, "attention_type": "original_full"},
        "ernie": _ENCODER,
        "nystromformer": {**_ENCODER, "num_landmarks": 4, "segment_means_seq_len": 16},
        "fnet": {key: value for key, value in _ENCODER.items() if key != "num_attention_heads"},
        "data2vec-text": {**_ENCODER, "pad_token_id": 1},
        "esm": {**_ENCODER, "pad_token_id": 1, "mask_token_id": 2},
    },
    "seq2seq": {
        "mt5": {"num_layers": 2, "num_decoder_layers": 2, "d_model": 64, "d_ff": 128, "num_heads": 4, "d_kv": 16,
                **_TEXT},
        "umt5": {"num_layers": 2, "num_decoder_layers": 2, "d_model": 64, "d_ff": 128, "num_heads": 4, "d_kv": 16,
                 **_TEXT},
        "longt5": {"num_layers": 2, "num_decoder_layers": 2, "d_model": 64, "d_ff": 128, "num_heads": 4, "d_kv": 16,
                   **_TEXT},
        "mbart": _SEQ2SEQ,
        "pegasus": _SEQ2SEQ,
        "marian": {**_SEQ2SEQ, "decoder_vocab_size": 128, "pad_token_id": 127, "decoder_start_token_id": 127},
        "blenderbot": _SEQ2SEQ,
        "blenderbot-small": _SEQ2SEQ,
        "led": {**{key: value for key, value in _SEQ2SEQ.items() if key != "max_position_embeddings"}, "max_encoder_position_embeddings": 64, "max_decoder_position_embeddings": 64,
                "attention_window": [8, 8]},
        "plbart": _SEQ2SEQ,
        "m2m_100": _SEQ2SEQ,
        "fsmt": {"encoder_layers": 2, "decoder_layers": 2, "d_model": 64, "encoder_ffn_dim": 128,
                 "decoder_ffn_dim": 128, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                 "src_vocab_size": 128, "tgt_vocab_size": 128, "max_position_embeddings": 64, "seq_len": 16,
                 "batch_size": 4},
        "switch_transformers": {"num_layers": 2, "num_decoder_layers": 2, "d_model": 64, "d_ff": 128,
                                "num_heads": 4, "d_kv": 16, "num_experts": 4, "encoder_sparse_step": 2,
                                "decoder_sparse_step": 2, **_TEXT},
        "prophetnet": {"num_encoder_layers": 2, "num_decoder_layers": 2, "hidden_size": 64,
                       "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_encoder_attention_heads": 4,
                       "num_decoder_attention_heads": 4, "max_position_embeddings": 64, **_TEXT},
    },
    "vision": {
        "beit": {**_VIT, "use_mask_token": False},
        "deit": _VIT,
        "dinov2": {key: value for key, value in _VIT.items() if key != "intermediate_size"},
        "data2vec-vision": _VIT,
        "vit_msn": _VIT,
        "ijepa": _VIT,
        "segformer": {"num_encoder_blocks": 2, "depths": [1, 1], "sr_ratios": [2, 1], "hidden_sizes": [16, 32],
                      "patch_sizes": [7, 3], "strides": [4, 2], "num_attention_heads": [1, 2],
                      "mlp_ratios": [2, 2], "image_size": 32, **_IMAGES},
        "efficientnet": {"image_size": 32, "hidden_dim": 320,  # round_filters(1280) at width 0.25
                         "width_coefficient": 0.25, "depth_coefficient": 0.25,
                         **_IMAGES},
        "mobilenet_v1": {"image_size": 32, "depth_multiplier": 0.25, **_IMAGES},
        "mobilenet_v2": {"image_size": 32, "depth_multiplier": 0.25, **_IMAGES},
        "regnet": {"depths": [1, 1], "hidden_sizes": [16, 32], "embedding_size": 16, "groups_width": 8,
                   "image_size": 32, **_IMAGES},
        # three stages: the default down_ops (nested lists, which overrides cannot set) fit them
        "levit": {"image_size": 64, "hidden_sizes": [64, 128, 192], "num_attention_heads": [4, 8, 12],
                  "depths": [1, 1, 1], "key_dim": [16, 16, 16], "mlp_ratio": [2, 2, 2], "attention_ratio": [2, 2, 2],
                  **_IMAGES},
        "poolformer": {"depths": [1, 1], "hidden_sizes": [16, 32], "num_encoder_blocks": 2,
                       "patch_sizes": [7, 3], "strides": [4, 2], "padding": [2, 1], "image_size": 32, **_IMAGES},
        "convnextv2": {"depths": [1, 1], "hidden_sizes": [16, 32], "num_stages": 2, "image_size": 32, **_IMAGES},
        "swinv2": {"depths": [1, 1], "num_heads": [2, 4], "embed_dim": 16, "image_size": 32, "patch_size": 4,
                   "window_size": 4, **_IMAGES},
        "bit": {"depths": [1, 1], "hidden_sizes": [128, 256], "embedding_size": 32, "image_size": 32,
                "layer_type": "bottleneck", **_IMAGES},
        "focalnet": {"depths": [1, 1], "embed_dim": 16, "focal_levels": [2, 2], "focal_windows": [3, 3],
                     "image_size": 32, "patch_size": 4, **_IMAGES},
        "pvt": {"num_encoder_blocks": 2, "depths": [1, 1], "sequence_reduction_ratios": [2, 1],
                "hidden_sizes": [16, 32], "patch_sizes": [4, 2], "strides": [4, 2], "num_attention_heads": [1, 2],
                "mlp_ratios": [2, 2], "image_size": 32, **_IMAGES},
        "pvt_v2": {"num_encoder_blocks": 2, "depths": [1, 1], "sr_ratios": [2, 1], "hidden_sizes": [16, 32],
                   "patch_sizes": [7, 3], "strides": [4, 2], "num_attention_heads": [1, 2], "mlp_ratios": [2, 2],
                   "image_size": 32, **_IMAGES},
        "hiera": {"embed_dim": 16, "depths": [1, 1], "num_heads": [1, 2], "image_size": [32, 32],
                  "patch_size": [3, 3], "patch_stride": [2, 2], "patch_padding": [1, 1], "masked_unit_size": [4, 4],
                  "query_stride": [2, 2], "embed_dim_multiplier": 2.0, "num_query_pool": 1, **_IMAGES},
    },
}
ALL = {name: overrides for group in SWEEP.values() for name, overrides in group.items()}
# Types whose single-device fp32 step differs from the same step in float64 by more than the
# fp32 tolerance (57x, 179x and 51x at these sizes; their last batch norms normalise over 4
# values per channel), so their programs are checked in float64 instead.
IN_FLOAT64 = {"mobilenet_v1", "mobilenet_v2", "levit"}


def _first_line(text: str, limit: int = 160) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _splits_weights(plan: planner.Plan) -> bool:
    return any(isinstance(p, Shard) for s in plan.strategies for ps in s.params.values() for p in ps)


def _plan_and_compile(name: str, world: int, out: Path, effort: float, force_tp: bool) -> dict:
    """Plan ``hf:name`` (and Megatron's tp layout when the plan splits no weight), compile them."""
    row: dict = {"model": name, "folders": {}}
    started = time.perf_counter()
    try:
        spec = ModelSpec(f"hf:{name}", ALL.get(name, {}))
        plan = planner.plan(spec, f"cpu:1x{world}", effort=effort, progress=False)
    except PlannerError as error:
        row["plan"] = f"refused: {_first_line(str(error))}"
        return row
    except Exception as error:  # noqa: BLE001 - a traceback from our internals is itself a finding
        row["plan"] = f"CRASH {type(error).__name__}: {_first_line(str(error))}"
        return row
    row["plan"] = plan.name + (" [weights split]" if _splits_weights(plan) else "")
    row["plan_s"] = time.perf_counter() - started
    try:
        row["folders"]["searched"] = planner.compile(plan, out / name)
        source = (row["folders"]["searched"] / "model_spmd.py").read_text()
        row["compile"] = "graph" if "(SpmdModule)" in source else "module"
    except PlannerError as error:
        row["compile"] = f"refused: {_first_line(str(error))}"
    except Exception as error:  # noqa: BLE001
        row["compile"] = f"CRASH {type(error).__name__}: {_first_line(str(error))}"
    if force_tp and not _splits_weights(plan):
        try:
            graph, full_spec, model_name, cluster = prepare_model(spec, f"cpu:1x{world}")
            forced = megatron_plan(graph, cluster, full_spec, model_name, tp=world, precision="fp32")
            row["tp"] = forced.name + (" [weights split]" if _splits_weights(forced) else " [NO weight split]")
            row["folders"]["tp"] = planner.compile(forced, out / f"{name}_tp")
        except PlannerError as error:
            row["tp"] = f"refused: {_first_line(str(error))}"
        except Exception as error:  # noqa: BLE001
            row["tp"] = f"CRASH {type(error).__name__}: {_first_line(str(error))}"
    return row


def _parity_cell(result: str) -> str:
    """``ok 2.2e-08`` for a pass (its max abs error), else the failure's first 160 characters."""
    passed = re.match(r"ok parity ok: max_abs_err=(\S+)", result)
    if passed:
        return f"ok {passed.group(1)}" + (" (fp64)" if "compared in float64" in result else "")
    return _first_line(result.replace("|", ";"))


def _check_all(rows: list[dict], world: int, out: Path) -> None:
    """Parity-check every compiled folder in one torchrun launch; store each RESULT line."""
    folders = [folder for row in rows for folder in row["folders"].values()]
    if not folders:
        return
    arguments = [argument for row in rows for folder in row["folders"].values()
                 for argument in ((["--fp64"] if row["model"] in IN_FLOAT64 else []) + [str(folder)])]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), str(DIST_CHECK_MANY),
               *arguments]
    launch = subprocess.run(command, cwd=out, capture_output=True, text=True, timeout=1800,
                            env={**__import__("os").environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    results = {}
    for line in launch.stdout.splitlines():
        match = re.match(r"RESULT (\S+) (.*)", line)
        if match:
            results[match.group(1)] = match.group(2)
    for row in rows:
        for kind, folder in row["folders"].items():
            result = results.get(str(folder))
            if result is None:
                result = f"no RESULT (launch rc={launch.returncode}): {_first_line(launch.stderr[-600:])}"
            row[f"parity_{kind}"] = _parity_cell(result)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help=f"model types or groups ({', '.join(SWEEP)})")
    parser.add_argument("--world", type=int, default=2, help="processes (cpu:1xWORLD), default 2")
    parser.add_argument("--effort", type=float, default=0.25, help="search effort, default 0.25")
    parser.add_argument("--out", type=Path, default=None, help="folder for the programs (default: a temporary one)")
    parser.add_argument("--no-tp", action="store_true", help="do not force Megatron's tp layout on DP plans")
    options = parser.parse_args(argv)
    names = [model for item in options.models for model in (SWEEP[item] if item in SWEEP else [item])]
    out = options.out or Path(tempfile.mkdtemp(prefix="hf_sweep_"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        rows.append(_plan_and_compile(name, options.world, out, options.effort, not options.no_tp))
        row = rows[-1]
        print(f"planned {name}: {row['plan']} | compile {row.get('compile', '-')} | tp {row.get('tp', '-')}",
              flush=True)
    _check_all(rows, options.world, out)
    print(f"\n| model | searched plan | compile | parity | forced tp | tp parity |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['plan']} | {row.get('compile', '-')} | {row.get('parity_searched', '-')} | "
              f"{row.get('tp', '-')} | {row.get('parity_tp', '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
