"""What graph codegen reads from the model (codegen/graph_facts.py), on models nobody here wrote."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import planner
from codegen.graph_facts import model_facts
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from planner.trace import trace
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


class _InPlaceDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.dropout = nn.Linear(8, 8), nn.Dropout(0.5, inplace=True)

    def forward(self, x):
        return self.dropout(self.linear(x)).mean()


def test_in_place_dropout_reads_its_probability_from_its_module():
    # MobileNet's classifier dropout (p=0.999, inplace=True) traces to aten.dropout_; with its
    # probability baked in, --check could not switch it off in a graph program.
    with torch.device("meta"):
        model, x = _InPlaceDropout(), torch.randn(4, 8)
    graph = trace(model, (x,))
    dropout = next(node for node in graph.nodes if node.op.startswith("aten.dropout_"))
    assert model_facts(model, (x,), {}, graph).dropout_modules == {dropout.name: "dropout"}


class DropPath(nn.Module):
    """Stochastic depth as timm and HuggingFace write it."""

    def __init__(self, drop_prob: float):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        keep = 1 - self.drop_prob
        mask = (keep + torch.rand((x.shape[0], 1), dtype=x.dtype, device=x.device)).floor()
        return x.div(keep) * mask


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.drop_path = nn.Linear(8, 8), DropPath(0.25)

    def forward(self, x):
        return (x + self.drop_path(self.linear(x))).mean()


def test_drop_path_reads_its_keep_probability_from_its_module():
    # BEiT, SwinV2, SegFormer, FocalNet: the traced add and div hold keep = 0.75; the
    # program reads 1 - drop_prob at run time instead, so --check's drop_prob = 0 reaches it.
    with torch.device("meta"):
        model, x = _Residual(), torch.randn(4, 8)
    graph = trace(model, (x,))
    owners = model_facts(model, (x,), {}, graph).dropout_modules
    keep_ops = sorted(node.op for node in graph.nodes if node.name in owners)
    assert keep_ops == ["aten.add.Tensor", "aten.div.Tensor"]
    assert set(owners.values()) == {("drop_path", "drop_prob")}
