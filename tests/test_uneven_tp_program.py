"""Uneven tensor parallelism's compiled programs (``planner/families/uneven_tp/``) in real gloo
processes, world 4 on ``examples/clusters/mixed.toml`` (two fast, two slow devices).

- One launch of ``tests/dist_check_many.py`` checks, against one device (outputs, loss,
  gradients, updated parameters): the GPT example's uneven-tp plan (the candidate
  ``--family uneven-tp`` chooses, ``tests/test_uneven_tp.py``: its MLPs fused), the same GPT
  with its layers forced through all three kinds and a fused MLP at odd shares (batch
  3/2/2/1 of the 8 rows, column and row at shares that do not divide evenly), the CNN (its
  classifier's linears fused around the relu, the convolutions whole) and a tiny
  HuggingFace Llama (bias-free projections; its MLPs fused: gate and up columns, silu and
  mul on the slices, down a row) and a tiny VGG whose classifier.3 is the column of one
  fused group and the row of the group before it, left unfused (``vgg_second_group``).
  Every gather is the unpadded all-gather-v.
- Checkpoints: a step of the uneven-tp program (every kind), resumed for one on the even
  DDP program of the same model, then one more on the uneven-tp one again: each rank saves
  its slices under the model's parameter names (``codegen.runtime.derived_checkpoint``).
  All 3 losses are one device's.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

import planner
from planner.api import prepare_model
from planner.cluster import Cluster
from planner.families.uneven_tp.candidates import uneven_tp_plan
from planner.families.uneven_tp.section import LayerSplit, UnevenTpSection
from planner.model_spec import ModelSpec
from search.data_parallel import data_parallel_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_parity import check_many, result_of  # noqa: E402
from test_uneven_program import CNN, GPT, LLAMA, MIXED, resume_there_and_back  # noqa: E402  the models uneven data parallelism checks



def accpar_plan(spec: ModelSpec, allow_whole: bool = True) -> planner.Plan:
    """The uneven-tp plan of ``spec`` on the mixed cluster (``allow_whole=False``: every
    linear layer split, where the search would leave the small ones whole)."""
    graph, spec, name, cluster = prepare_model(spec, Cluster.load(MIXED))
    plan = uneven_tp_plan(graph, cluster, spec, name, "fp32", allow_whole=allow_whole)
    assert plan is not None
    return plan


def every_kind(plan: planner.Plan) -> planner.Plan:
    """``plan`` (the GPT's) with its layers split each way at shares that divide unevenly."""
    layers = (
        LayerSplit("blocks.0.attn.c_attn", "column", (70, 61, 40, 21)),  # 192 output features
        LayerSplit("blocks.0.attn.c_proj", "batch", (3, 2, 2, 1)),        # 8 rows of the batch
        LayerSplit("blocks.0.mlp.c_fc", "row", (30, 20, 10, 4)),          # 64 input features
        LayerSplit("blocks.0.mlp.c_proj", "row", (100, 90, 50, 16)),      # 256 input features
        LayerSplit("lm_head", "batch", (1, 1, 5, 1)),                     # no bias
        # Fused: c_fc's 256 output features stay split through the gelu into c_proj.
        LayerSplit("blocks.1.mlp.c_fc", "column", (100, 90, 50, 16), fused=True),
        LayerSplit("blocks.1.mlp.c_proj", "row", (100, 90, 50, 16), fused=True),
    )
    return dataclasses.replace(plan, sections={"uneven-tp": UnevenTpSection(layers)})


def llama_split() -> planner.Plan:
    """The tiny Llama on the mixed cluster, its MLPs fused (gate and up columns, silu and mul
    on the slices, down a row) at shares that divide its 128 features unevenly, and its
    attention projections split each way (no projection has a bias)."""
    graph, spec, name, cluster = prepare_model(LLAMA, Cluster.load(MIXED))
    plan = uneven_tp_plan(graph, cluster, spec, name, "fp32", allow_whole=False)
    layers = [LayerSplit(f"model.layers.{i}.mlp.{m}", "row" if m == "down_proj" else "column", (50, 40, 30, 8),
                         fused=True) for i in (0, 1) for m in ("gate_proj", "up_proj", "down_proj")]
    layers += [LayerSplit("model.layers.0.self_attn.q_proj", "column", (7, 29, 20, 8)),   # 64 output features
               LayerSplit("model.layers.0.self_attn.o_proj", "row", (30, 20, 10, 4)),     # 64 input features
               LayerSplit("model.layers.1.self_attn.v_proj", "batch", (3, 2, 2, 1))]      # 8 rows
    return dataclasses.replace(plan, sections={"uneven-tp": UnevenTpSection(tuple(layers))})


def vgg_second_group() -> planner.Plan:
    """A tiny VGG on the mixed cluster: classifier.1 a row split (16 inputs), then its second
    fusable group fused (classifier.3 column, the relu, classifier.5 row: 32 features) at
    shares that divide unevenly; classifier.3 is also the row of the first group, not fused."""
    spec = ModelSpec(str(Path(__file__).resolve().parents[1] / "examples/vgg.py"),
                     {"width": 2, "hidden": 32, "image_size": 32, "batch_size": 4, "num_classes": 8})
    graph, spec, name, cluster = prepare_model(spec, Cluster.load(MIXED))
    plan = uneven_tp_plan(graph, cluster, spec, name, "fp32", allow_whole=False)
    shares = (13, 11, 5, 3)
    layers = (LayerSplit("classifier.1", "row", (7, 5, 3, 1)), LayerSplit("classifier.3", "column", shares, fused=True),
              LayerSplit("classifier.5", "row", shares, fused=True))
    return dataclasses.replace(plan, sections={"uneven-tp": UnevenTpSection(layers)})


@pytest.mark.distributed
def test_uneven_tp_programs_match_one_device(tmp_path) -> None:
    gpt = accpar_plan(GPT)
    folders = [planner.compile(plan, tmp_path / name) for name, plan in (
        ("gpt", gpt), ("gpt-every-kind", every_kind(gpt)), ("cnn", accpar_plan(CNN, allow_whole=False)),
        ("llama", llama_split()), ("vgg", vgg_second_group()),
    )]
    # The program lists each layer's kind and shares; plan strings enter it through repr() only.
    source = (folders[1] / "model_spmd.py").read_text()
    assert "#   blocks.0.attn.c_attn: column split, rank shares 70/61/40/21" in source
    assert "('blocks.0.attn.c_proj', 'batch', (3, 2, 2, 1))" in source
    assert "('blocks.1.mlp.c_fc', 'column', (100, 90, 50, 16), True)" in source
    # The plan the search chose fuses the MLPs (no gather between c_fc and c_proj).
    assert any(layer.fused for layer in gpt.sections["uneven-tp"].layers)
    launch = check_many(4, folders, tmp_path)
    for folder in folders:
        assert result_of(launch, folder).startswith("ok parity ok"), (folder.name, result_of(launch, folder))


@pytest.mark.distributed
def test_uneven_tp_checkpoints_resume_on_the_even_plan_and_back(tmp_path) -> None:
    accpar = every_kind(accpar_plan(GPT))
    uneven = planner.compile(accpar, tmp_path / "uneven")
    graph, spec, name, _ = prepare_model(GPT, Cluster.load(MIXED))
    even_plan = data_parallel_plan(graph, Cluster.parse("cpu:1x4"), spec, name, "ddp")  # no search: the DDP plan
    even = planner.compile(even_plan, tmp_path / "even")
    resume_there_and_back(uneven, even, tmp_path, 1)
