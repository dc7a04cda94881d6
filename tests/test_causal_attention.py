"""Graph programs call the causal kernel where the traced mask is proven causal
(``codegen.causal_attention``), and keep the mask where the plan splits the query's sequence.

That the program still trains exactly like one device is checked by the tiny Llama and GPT-2
Megatron programs of ``tests/test_spmd_parity.py`` (their masks are causal).
"""

from __future__ import annotations

import dataclasses
import re

from torch.distributed.tensor import Replicate, Shard

import planner
from codegen.causal_attention import CAUSAL_KERNEL_COMMENT, causal_arguments, runs_causal_kernel
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan

HF_LLAMA_TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "vocab_size": 128, "batch_size": 4, "seq_len": 16}
SDPA = "aten.scaled_dot_product_attention.default"


def llama_megatron():
    graph, spec, name, cluster = prepare_model(ModelSpec("hf:llama", HF_LLAMA_TINY), "cpu:1x2")
    plan = megatron_plan(graph, cluster, spec, name, tp=2, sequence_parallel=False, precision="fp32")
    return graph, plan


def test_megatron_llama_program_calls_the_causal_kernel(tmp_path):
    graph, plan = llama_megatron()
    attention = [node for node in graph.nodes if node.op == SDPA]
    assert attention and all(node.attention_mask_kind == "causal" for node in attention)
    source = (planner.compile(plan, tmp_path / "out") / "model_spmd.py").read_text()
    calls = [line for line in source.splitlines() if "self.attention(" in line]
    # Each repeated block is written once (codegen.block_fold): one call for the blocks.
    assert calls and all(re.search(r", None, .*is_causal=True\)", line) for line in calls), calls
    assert CAUSAL_KERNEL_COMMENT in source


def test_query_split_on_the_sequence_keeps_the_mask():
    graph, plan = llama_megatron()
    node = next(node for node in graph.nodes if node.op == SDPA)
    strategy = next(s for s in plan.strategies if s.node == node.name)
    assert runs_causal_kernel(SDPA, node, strategy)
    on_sequence = dataclasses.replace(strategy, inputs=((Shard(2),),) + strategy.inputs[1:])
    assert not runs_causal_kernel(SDPA, node, on_sequence)
    assert runs_causal_kernel(SDPA, node, dataclasses.replace(strategy, inputs=((Replicate(),),) + strategy.inputs[1:]))
    # A mask not proven causal is replayed as traced.
    assert not runs_causal_kernel(SDPA, dataclasses.replace(node, attention_mask_kind="arbitrary"), strategy)


def test_causal_arguments_drop_the_mask():
    args, kwargs = causal_arguments(SDPA, ["q", "k", "v", "mask"], {"scale": 0.25})
    assert (args, kwargs) == (["q", "k", "v", None], {"scale": 0.25, "is_causal": True})
    args, kwargs = causal_arguments(SDPA, ["q", "k", "v", "mask", 0.1, False], {})
    assert (args, kwargs) == (["q", "k", "v", None, 0.1, True], {})
    args, kwargs = causal_arguments(SDPA, ["q", "k", "v"], {"attn_mask": "mask", "dropout_p": 0.0})
    assert (args, kwargs) == (["q", "k", "v"], {"dropout_p": 0.0, "is_causal": True})
