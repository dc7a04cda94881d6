"""What graph codegen reads from the model (codegen/graph_facts.py), on models nobody here wrote."""

from __future__ import annotations

import pytest

import planner
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan

# RoFormer checks its input_ids for padding tokens before the forward unless it is being
# traced (transformers' is_tracing: a fake input); the value is not there on meta tensors.
ROFORMER = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
            "embedding_size": 32, "max_position_embeddings": 32, "vocab_size": 64, "batch_size": 2, "seq_len": 8}


def test_a_forward_that_reads_token_values_unless_traced_compiles_to_a_graph_program(tmp_path):
    pytest.importorskip("transformers")
    graph, spec, name, cluster = prepare_model(ModelSpec("hf:roformer", ROFORMER), "cpu:1x2")
    plan = megatron_plan(graph, cluster, spec, name, tp=2, precision="fp32")
    folder = planner.compile(plan, tmp_path / "roformer")
    assert "(SpmdModule)" in (folder / "model_spmd.py").read_text()
