"""Tests of planner/moe_blocks.py: which modules are MoE layers, and their shape."""

from __future__ import annotations

import pytest
import torch

from examples.gpt import build as build_gpt
from examples.moe import build as build_moe
from planner.model_spec import ModelSpec
from planner.moe_blocks import HF_STACKED_EXPERTS, find_moe_blocks


def test_every_other_block_of_the_moe_gpt_is_found_with_its_shape():
    with torch.device("meta"):
        model, _ = build_moe(n_layer=4, moe_every=2, n_expert=8, top_k=2, capacity_factor=0, n_embd=32, ffn=48)
    blocks = find_moe_blocks(model)
    assert [block.module for block in blocks] == ["blocks.1.moe", "blocks.3.moe"]
    block = blocks[0]
    assert (block.experts, block.top_k, block.capacity_factor, block.hidden, block.ffn) == (8, 2, 0.0, 32, 48)
    assert block.expert_parameters == model.get_submodule("blocks.1.moe.experts").w_in.numel() * 2
    for name in (block.router, *block.expert_weights):
        model.get_parameter(f"{block.module}.{name}")  # the names resolve


def test_a_dense_model_or_a_look_alike_is_not_an_moe_layer():
    assert find_moe_blocks(build_gpt()[0]) == ()
    look_alike = torch.nn.Module()
    look_alike.router = torch.nn.Linear(8, 4)  # a bias: not a router of ours
    look_alike.experts = torch.nn.Module()
    look_alike.experts.w_in = torch.nn.Parameter(torch.zeros(4, 8, 16))
    look_alike.experts.w_out = torch.nn.Parameter(torch.zeros(4, 16, 8))
    look_alike.top_k, look_alike.capacity_factor = 2, 1.0
    assert find_moe_blocks(look_alike) == ()


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_huggingface_moe_blocks_are_found_with_their_shape(model_type):
    overrides = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                 "vocab_size": 64, "intermediate_size": 48}
    experts_key = {"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts"}.get(model_type, "num_experts")
    overrides |= {experts_key: 4, "num_experts_per_tok": 2}
    if model_type not in ("mixtral", "olmoe"):  # their experts are intermediate_size wide
        overrides["moe_intermediate_size"] = 40
    if model_type == "deepseek_v3":
        overrides |= {"first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
    model, _, _ = ModelSpec(f"hf:{model_type}", overrides).build("meta")
    blocks = find_moe_blocks(model)
    ffn = 48 if model_type in ("mixtral", "olmoe") else 40
    dense_first = 1 if model_type == "deepseek_v3" else 0
    assert [b.module for b in blocks] == [f"model.layers.{i}.mlp" for i in range(dense_first, 2)]
    assert all((b.experts, b.top_k, b.hidden, b.ffn, b.matmuls, b.capacity_factor) == (4, 2, 32, ffn, 3, 0.0) for b in blocks)
    assert all(b.runtime == HF_STACKED_EXPERTS for b in blocks)


def test_deepseek_v3s_group_limited_routing_is_read_from_its_router():
    """DeepSeek-V3 routes each token among ``topk_group`` of ``n_group`` expert groups (its
    node limit when groups lie on nodes); a router that limits nothing records no groups."""
    overrides = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                 "vocab_size": 64, "intermediate_size": 48, "moe_intermediate_size": 40, "n_routed_experts": 8,
                 "num_experts_per_tok": 2, "first_k_dense_replace": 1}
    limited, _, _ = ModelSpec("hf:deepseek_v3", overrides | {"n_group": 4, "topk_group": 2}).build("meta")
    assert [b.routing_groups for b in find_moe_blocks(limited)] == [(4, 2)]
    free, _, _ = ModelSpec("hf:deepseek_v3", overrides | {"n_group": 4, "topk_group": 4}).build("meta")
    assert [b.routing_groups for b in find_moe_blocks(free)] == [()]
    mixtral, _, _ = ModelSpec("hf:mixtral", {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
                                            "num_key_value_heads": 4, "vocab_size": 64, "intermediate_size": 48,
                                            "num_local_experts": 4, "num_experts_per_tok": 2}).build("meta")
    assert [b.routing_groups for b in find_moe_blocks(mixtral)] == [()]


def test_gpt_oss_block_is_found_and_priced_as_a_swiglu_of_its_width():
    """gpt-oss's ``GptOssMLP``: a router with a bias, experts stored transposed with biases.
    Its routed token costs a SwiGLU's three hidden x ffn matmuls: 2 x 3 x 32 x 40 = 7680
    forward FLOPs; round-robin over 4 devices, each holds one expert: 3 x 32 x 40 fp32 elements."""
    from cost_model.moe_layers import moe_layer_of, price_layout
    from planner.cluster import Cluster
    from planner.strategy import ExpertLayout, ExpertPlacement

    overrides = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                 "head_dim": 8, "vocab_size": 64, "intermediate_size": 40, "num_local_experts": 4,
                 "num_experts_per_tok": 2}
    model, _, _ = ModelSpec("hf:gpt_oss", overrides).build("meta")
    blocks = find_moe_blocks(model)
    assert [b.module for b in blocks] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    block = blocks[0]
    assert (block.experts, block.top_k, block.hidden, block.ffn, block.matmuls, block.capacity_factor) == (4, 2, 32, 40, 3, 0.0)
    assert (block.router, block.runtime) == ("router.weight", HF_STACKED_EXPERTS)
    assert block.expert_weights == ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj",
                                    "experts.down_proj_bias")
    for name in (block.router, *block.expert_weights):
        model.get_parameter(f"{block.module}.{name}")  # the names resolve
    assert moe_layer_of(block, 64).flops_per_copy() == 2 * 3 * 32 * 40
    layout = ExpertLayout(module=block.module, mode="expert_parallel", experts=4, top_k=2, capacity_factor=0.0,
                          axis="dp", placement=ExpertPlacement.round_robin(4, 4))
    cluster = Cluster.parse("cpu:1x4")
    # Priced as Mixtral's block of the same shape (its biases are adds: 2F + C of 3CF elements).
    mixtral, _, _ = ModelSpec("hf:mixtral", {**overrides, "num_hidden_layers": 1}).build("meta")
    same_shape = find_moe_blocks(mixtral)[0]
    assert (same_shape.hidden, same_shape.ffn, same_shape.experts, same_shape.top_k) == (32, 40, 4, 2)
    cost = price_layout(block, layout, 64, cluster, "fp32")
    assert cost == price_layout(same_shape, layout, 64, cluster, "fp32")
    assert cost.forward_comm_s > 0 and cost.weight_bytes == pytest.approx(4 * 3 * 32 * 40 * 4 / 4)
