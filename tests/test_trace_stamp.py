"""Blocks traced once per kind and copied (``planner.trace_stamp``) give the full trace's graph.

For tiny HuggingFace decoders (Llama; Mixtral, Qwen3-MoE and DeepSeek-V3 with dense first
layers before MoE ones), tracing with copied blocks must give exactly what exporting every
block gives: the same generated code of the graph module (every node, name, argument and
placeholder in order), the same ``OpNode``s (shapes, parameters, module paths, FLOPs, bytes),
parameters in the same order, buffers and repeated blocks; and every fx node keeps the same
module stack. Where blocks are not provably alike, every block is traced and the note says why.
"""

from __future__ import annotations

import pytest
import torch

from planner.model_spec import ModelSpec
from planner.trace import trace
from planner.trace_stamp import plan_stamping

BASE = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
        "intermediate_size": 48, "batch_size": 2, "seq_len": 8}
MODELS = {
    "llama": ({**BASE, "num_hidden_layers": 4}, "model.layers: 3 of 4 blocks traced, 1 copied"),
    "mixtral": ({**BASE, "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2},
                "model.layers: 3 of 4 blocks traced, 1 copied"),
    "qwen3_moe": ({**BASE, "num_hidden_layers": 4, "moe_intermediate_size": 40, "num_experts": 4, "num_experts_per_tok": 2},
                  "model.layers: 3 of 4 blocks traced, 1 copied"),
    # Two dense layers, then MoE ones: the pair MoE-after-MoE is traced twice (layers 3 and
    # 4), layer 5 is copied from layer 4 (its predecessor is MoE too; layer 2's is dense); the
    # stack holds two runs of blocks (planner.graph.BlockRun), dense 0-1 and MoE 2-5.
    "deepseek_v3": ({**BASE, "num_hidden_layers": 6, "num_key_value_heads": 4, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 40, "first_k_dense_replace": 2, "n_group": 1,
                     "topk_group": 1}, "model.layers: 5 of 6 blocks traced, 1 copied"),
}


def _node_facts(graph) -> list[dict]:
    return [dict(vars(node)) for node in graph.nodes]


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_copied_blocks_give_the_full_trace(model_type):
    overrides, note = MODELS[model_type]
    model, args, kwargs = ModelSpec(f"hf:{model_type}", overrides).build("meta")
    full = trace(model, args, kwargs, copy_blocks=False)
    copied = trace(model, args, kwargs)
    assert copied.trace_note == note
    assert copied.graph_module.code == full.graph_module.code
    assert _node_facts(copied) == _node_facts(full)
    assert list(copied.parameters.items()) == list(full.parameters.items())
    assert copied.buffers == full.buffers and copied.block_runs == full.block_runs
    if model_type == "deepseek_v3":
        assert [(run.start, run.count, run.kind) for run in copied.block_runs] == [(0, 2, 0), (2, 4, 1)]
    assert copied.moe_blocks == full.moe_blocks and copied.model_fingerprint == full.model_fingerprint
    stacks = [(node.name, node.meta.get("nn_module_stack")) for node in copied.graph_module.graph.nodes]
    assert stacks == [(node.name, node.meta.get("nn_module_stack")) for node in full.graph_module.graph.nodes]
    last = [node for node in copied.graph_module.graph.nodes if f"model.layers.{overrides['num_hidden_layers'] - 1}."
            in str(node.meta.get("nn_module_stack"))]
    assert last, "the copied last block keeps its own module path"


def test_blocks_that_differ_are_traced_whole():
    """A hook on one block, a weight shared between blocks, a layer-type list that makes the
    last block another kind: every block traced, and the note says why."""
    overrides = {**BASE, "num_hidden_layers": 4}
    hooked, _, _ = ModelSpec("hf:llama", overrides).build("meta")
    hooked.model.layers[2].mlp.register_forward_hook(lambda *_: None)
    assert plan_stamping(hooked) == ([], "every block traced (model.layers: model.layers.2.mlp has a hook)")

    shared, _, _ = ModelSpec("hf:llama", overrides).build("meta")
    shared.model.layers[3].mlp.up_proj.weight = shared.model.layers[0].mlp.up_proj.weight
    assert plan_stamping(shared)[1] == ("every block traced (model.layers: model.layers.0.mlp.up_proj.weight is shared "
                                        "with model.layers.3.mlp.up_proj.weight)")

    # layer_types says the last layer differs: the kinds are A A A B, nothing to copy B from.
    typed, _, _ = ModelSpec("hf:llama", overrides).build("meta")
    typed.config.layer_types = ["full_attention"] * 3 + ["sliding_attention"]
    assert plan_stamping(typed)[1] == "every block traced (model.layers: no kind of block repeats often enough to copy one)"


def test_a_loss_over_every_block_traces_whole():
    """Mixtral's balance loss reads every layer's router logits after the stack: the cut graph
    reads blocks other than the last, so the whole model is exported (and the graph is whole)."""
    overrides = {**MODELS["mixtral"][0], "output_router_logits": True}
    model, args, kwargs = ModelSpec("hf:mixtral", overrides).build("meta")
    graph = trace(model, args, kwargs)
    assert graph.trace_note.startswith("every block traced: ")
    assert "after the stack reads block" in graph.trace_note
    assert any("model.layers.3." in node.module for node in graph.nodes)
    assert isinstance(graph.graph_module, torch.fx.GraphModule)

