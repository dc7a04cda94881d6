"""Grouped matmuls are counted (``planner.flop_formulas``): without a formula, a HuggingFace
MoE model's experts (transformers 5 runs them through grouped matmuls) cost nothing."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from planner.api import prepare_model
from planner.flop_formulas import grouped_matmul_flops, register_grouped_matmul_formulas
from planner.model_spec import ModelSpec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_grouped_matmul_flops_by_hand():
    assert grouped_matmul_flops((256, 64), (4, 64, 32)) == 2 * 256 * 64 * 32  # tokens by their expert
    assert grouped_matmul_flops((4, 8, 64), (4, 64, 32)) == 2 * 4 * 8 * 64 * 32  # batched
    assert grouped_matmul_flops((8, 64), (64, 32)) == 2 * 8 * 64 * 32  # grouped over K


def test_pytorch_grouped_mm_is_counted_on_meta_tensors():
    register_grouped_matmul_formulas()
    tokens = torch.empty(256, 64, device="meta", dtype=torch.bfloat16)
    experts = torch.empty(4, 64, 32, device="meta", dtype=torch.bfloat16)
    counter = FlopCounterMode(display=False)
    with counter:
        torch._grouped_mm(tokens, experts, torch.empty(4, device="meta", dtype=torch.int32))
    assert counter.get_total_flops() == 2 * 256 * 64 * 32


def test_a_huggingface_moe_model_counts_its_experts():
    # 8 x 16 tokens, each routed to 2 of 4 SwiGLU experts of width 64 -> 128 per layer.
    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128, seq_len=16,
                  batch_size=8)
    graph, *_ = prepare_model(ModelSpec("hf:mixtral", config), "cpu:1x2")
    grouped = [node for node in graph.nodes if "grouped_mm" in node.op]
    assert grouped, "transformers no longer runs Mixtral's experts through a grouped matmul: update this test"
    routed_rows = 8 * 16 * 2
    per_layer = 2 * routed_rows * 64 * (2 * 128) + 2 * routed_rows * 128 * 64  # gate+up, then down
    assert sum(node.flops for node in grouped) == 2 * per_layer


def test_a_custom_op_without_a_formula_is_named_in_a_warning():
    from planner.flop_formulas import uncounted_custom_ops

    @torch.library.custom_op("soap_test::scaled_mix", mutates_args=())
    def scaled_mix(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w

    @scaled_mix.register_fake
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[1])

    class Mixer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return torch.ops.soap_test.scaled_mix(x, self.w).sum()

    graph, *_ = prepare_model(Mixer(), "cpu:1x2", (torch.randn(4, 8),))
    assert uncounted_custom_ops(graph) == {"soap_test.scaled_mix.default": 1}
    assert any("soap_test.scaled_mix.default (1 node)" in warning for warning in graph.warnings)


def test_our_own_models_carry_no_uncounted_op_warning():
    # gpt.py splits its fused QKV projection: the graph picks the pieces with getitem nodes,
    # which are Python callables, not custom ops.
    graph, *_ = prepare_model(ModelSpec(str(EXAMPLES / "gpt.py"), {"n_layer": 2, "n_embd": 64, "n_head": 4,
                                                                     "seq_len": 16, "vocab_size": 64, "batch_size": 4}),
                              "dgx-h100:1")
    assert any(node.op == "getitem" for node in graph.nodes)
    assert not any("no FLOP formula" in warning for warning in graph.warnings)
