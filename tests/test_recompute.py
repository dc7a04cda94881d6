"""Activation recomputation: what the simulator charges, and what compiled programs do.

``recompute="full"`` checkpoints every repeated block (a transformer layer): the block keeps
only its inputs for backward and runs its forward again there. The simulator prices exactly
that (ops around the blocks keep their activations); the two codegen paths compile it
(``codegen.runtime.recompute`` for DDP/ZeRO/FSDP programs, a checkpointed nested function per
block in graph programs). Parity of recomputed programs is in ``test_parity.py`` and
``test_spmd_parity.py``; here, that the memory really goes away. ``recompute="selective"``
checkpoints each block's attention core only (``codegen.attention_core``); its parity is in
``test_schedule_parity.py``. ``recompute="full_keep_a2a"`` recomputes the block but not its
MoE layers' collectives, which hand back what forward kept (``codegen.runtime.kept_exchanges``);
its compiled programs' parity is in ``test_moe_parity.py`` and ``test_pipeline_parity.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
import torch.nn as nn

from codegen.runtime.kept_exchanges import kept_exchange
from codegen.runtime.moe import recompute_in_backward_counting_once
from codegen.runtime.recompute import recompute_in_backward
from cost_model.simulator import Simulator
from planner.api import prepare_model
from planner.graph import BlockRun
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan
from fake_group import graph_program_on_rank0
from test_parity import REPO


def _saved_bytes(run) -> tuple[int, object]:
    """Bytes autograd saves for backward outside checkpointed regions while ``run()`` runs
    forward (checkpointing installs its own hooks inside its regions, which take precedence),
    and what ``run()`` returned."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = run()
    return total, output


@pytest.fixture(scope="module")
def gpt():
    spec = ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8})
    return prepare_model(spec, "cpu:1x2")


def test_simulator_recomputes_blocks_only(gpt):
    """Peak activations under full recompute = what the ops around the blocks save + each
    block's input + one block's saved activations (the one being recomputed), worked out
    from the simulator's own per-segment table."""
    graph, spec, name, cluster = gpt
    plan = megatron_plan(graph, cluster, spec, name, tp=2, precision="fp32")
    full = Simulator(dataclasses.replace(plan, recompute="full"), graph)
    segments = full.segments()
    blocks = [s for s in segments if s.block]
    around = [s for s in segments if not s.block]
    assert len(blocks) == sum(graph.blocks.values()) and around
    expected = sum(s.saved_bytes for s in around) + sum(s.checkpoint_bytes for s in blocks) + max(s.saved_bytes for s in blocks)
    assert full.run().memory.activations == pytest.approx(expected, rel=1e-9)
    none = Simulator(plan, graph).run()
    assert none.memory.activations == pytest.approx(sum(s.saved_bytes for s in segments), rel=1e-9)
    # ... and recomputing costs one more forward of every block, never of the rest.
    assert full.run().step_time_s > none.step_time_s


def test_recompute_in_backward_keeps_gradients_and_drops_activations():
    torch.manual_seed(0)
    blocks = nn.Sequential(*(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(3)))
    checkpointed = nn.Sequential(*(recompute_in_backward(copy.deepcopy(b)) for b in blocks))
    x = torch.randn(16, 32)
    plain_saved, plain_out = _saved_bytes(lambda: blocks(x).square().mean())
    ckpt_saved, ckpt_out = _saved_bytes(lambda: checkpointed(x).square().mean())
    plain_out.backward()
    ckpt_out.backward()
    assert torch.equal(plain_out, ckpt_out)
    for (name, p), q in zip(blocks.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    # Each plain block saves its input, the hidden pre- and post-GELU activations and its
    # output's input; a checkpointed block saves nothing outside its region.
    assert plain_saved > 16 * 128 * 4 * 3
    assert ckpt_saved < plain_saved / 4


def _graph_program_saved_bytes(plan) -> int:
    """Run the compiled graph program of ``plan`` forward as rank 0 of a fake process group
    on meta tensors; the bytes it saves for backward outside checkpointed regions."""
    with graph_program_on_rank0(plan) as (spmd, local_args, local_kwargs):
        saved, _ = _saved_bytes(lambda: spmd(*local_args, **local_kwargs))
        return saved


def test_graph_program_checkpoints_every_block(gpt):
    """The compiled Megatron GPT program with recomputation checkpoints each of its blocks,
    and saves far fewer bytes for backward than the same program without."""
    from codegen.spmd_emit import render_graph_program

    graph, spec, name, cluster = gpt
    plan = megatron_plan(graph, cluster, spec, name, tp=2, precision="fp32")
    recomputed = dataclasses.replace(plan, recompute="full")
    source = render_graph_program(recomputed)
    blocks = [f"{group}.{index}." for group, count in graph.blocks.items() for index in range(count)]
    for block in blocks:  # each block (both alike: one function written once) called under checkpoint
        assert re.search(rf"= checkpoint\(blocks_block, self, {re.escape(repr(block))}, .*use_reentrant=False\)", source), source
    assert "checkpoint(" not in render_graph_program(plan)
    plain, checkpointed = _graph_program_saved_bytes(plan), _graph_program_saved_bytes(recomputed)
    assert checkpointed < plain / 2, (checkpointed, plain)


# ------------------------------------------------------------------ selective recomputation


@pytest.fixture(scope="module")
def gpt_by_attention():
    """GPT with its attention core written out (``attention="eager"``: (seq, seq) scores) and
    with one fused SDPA op (the default)."""
    return {
        attention: prepare_model(ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8, "attention": attention}), "cpu:1x2")
        for attention in ("eager", "sdpa")
    }


def test_attention_cores_are_found_from_scores_to_scores_times_v(gpt_by_attention):
    from codegen.attention_core import attention_cores, core_module

    graph = gpt_by_attention["eager"][0]
    cores = attention_cores(graph, 32)
    assert [core.block for core in cores] == [("blocks", 0), ("blocks", 1)]
    ops = [graph.node(name).op.split(".")[1] for name in cores[0].nodes]
    assert ops[0] == "matmul" and ops[-1] == "matmul" and "softmax" in ops and "dropout" in ops
    assert "linear" not in ops and "transpose" not in ops  # the projections and head split are kept
    assert [core_module(graph, core) for core in cores] == ["blocks.0.attn.core", "blocks.1.attn.core"]
    assert attention_cores(gpt_by_attention["sdpa"][0], 32) == []  # one fused op: no core


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_selective_recompute_drops_the_scores_in_graph_programs_and_in_the_simulator(gpt_by_attention, attention):
    """Compiled with tp=2: selective saves fewer bytes for backward than none by at least every
    block's softmax output (B, heads/tp, S, S) fp32, and more than full. With fused SDPA there
    is nothing to drop: the program and the simulator both keep exactly what none keeps."""
    from codegen.spmd_emit import render_graph_program

    graph, spec, name, cluster = gpt_by_attention[attention]
    plan = megatron_plan(graph, cluster, spec, name, tp=2, precision="fp32")
    plans = {mode: dataclasses.replace(plan, recompute=mode) for mode in ("none", "selective", "full")}
    saved = {mode: _graph_program_saved_bytes(p) for mode, p in plans.items()}
    simulated = {mode: Simulator(p, graph).run().memory.activations for mode, p in plans.items()}
    scores = [segment.score_bytes for segment in Simulator(plan, graph).segments() if segment.block]
    source = render_graph_program(plans["selective"])
    if attention == "eager":
        softmax_bytes = 8 * (4 // 2) * 32 * 32 * 4
        assert saved["none"] - saved["selective"] >= 2 * softmax_bytes, saved
        assert saved["full"] < saved["selective"], saved
        assert all(s >= softmax_bytes for s in scores) and simulated["full"] < simulated["selective"] < simulated["none"]
        assert source.count("checkpoint(_blocks_") == 2 and "def _blocks_0_attention():" in source
    else:
        assert saved["selective"] == saved["none"] and simulated["selective"] == simulated["none"] and scores == [0.0, 0.0]
        assert "checkpoint(_blocks_" not in source and "attention is one fused op, e.g. scaled_dot_product_attention" in source


def test_selective_recompute_in_data_parallel_programs_checkpoints_the_core_module(gpt_by_attention):
    """A DDP program checkpoints each AttentionCore module (no weights inside), which saves
    fewer bytes for backward; with fused SDPA its table is empty and says why."""
    from codegen.attention_core import selective_table

    graph, spec, name, cluster = gpt_by_attention["eager"]
    plan = dataclasses.replace(megatron_plan(graph, cluster, spec, name, precision="fp32"), recompute="selective")
    table = selective_table(plan)
    assert "RECOMPUTED_BLOCKS = (\n    'blocks.0.attn.core',\n    'blocks.1.attn.core',\n)" in table
    torch.manual_seed(0)
    model, args, _ = spec.build("cpu")
    plain_saved, plain_loss = _saved_bytes(lambda: model(*args))
    selective = copy.deepcopy(model)
    for path in ("blocks.0.attn.core", "blocks.1.attn.core"):
        recompute_in_backward(selective.get_submodule(path))
    selective_saved, selective_loss = _saved_bytes(lambda: selective(*args))
    assert torch.equal(plain_loss, selective_loss)
    assert plain_saved - selective_saved >= 2 * 8 * 4 * 32 * 32 * 4  # at least each block's softmax output
    graph, spec, name, cluster = gpt_by_attention["sdpa"]
    fused = selective_table(dataclasses.replace(megatron_plan(graph, cluster, spec, name, precision="fp32"), recompute="selective"))
    assert "RECOMPUTED_BLOCKS = ()" in fused and "attention is one fused op, e.g. scaled_dot_product_attention" in fused


def test_selective_recompute_of_an_inline_core_is_refused_in_data_parallel_programs():
    """HF GPT-2's eager attention computes its core inside GPT2Attention, next to the
    projections: no module holds it alone, so a DDP program refuses it in one line."""
    pytest.importorskip("transformers")
    from codegen.attention_core import selective_table
    from test_parity import HF_GPT2_TINY

    spec = ModelSpec("hf:gpt2", {**HF_GPT2_TINY, "seq_len": 32, "attn_implementation": "eager"})
    graph, spec, name, cluster = prepare_model(spec, "cpu:1x2")
    plan = dataclasses.replace(megatron_plan(graph, cluster, spec, name, precision="fp32"), recompute="selective")
    with pytest.raises(NotImplementedError) as error:
        selective_table(plan)
    assert "transformer.h.0" in str(error.value) and "\n" not in str(error.value)


def test_dense_blocks_before_moe_ones_are_recomputed_too():
    """DeepSeek-V3's dense first layers are a run of blocks of their own (before its MoE
    ones), so full recomputation keeps only their inputs as well: the same sum as above, over
    a stack of 2 dense + 2 MoE blocks, with the dense ones among the recomputed."""
    from moe_plans import HF_MOE
    from search.data_parallel import data_parallel_plan

    spec = ModelSpec("hf:deepseek_v3", {**HF_MOE["deepseek_v3"], "num_hidden_layers": 4, "first_k_dense_replace": 2})
    graph, spec, name, cluster = prepare_model(spec, "cpu:1x2")
    assert graph.block_runs == (BlockRun("model.layers", 0, 2, kind=0), BlockRun("model.layers", 2, 2, kind=1))
    plan = data_parallel_plan(graph, cluster, spec, name, "ddp")
    full = Simulator(dataclasses.replace(plan, recompute="full"), graph)
    segments = full.segments()
    blocks = [s for s in segments if s.block]
    assert [s.name for s in blocks] == [f"model.layers.{index}" for index in range(4)]
    assert all(s.checkpoint_bytes < s.saved_bytes for s in blocks[:2])  # the dense ones drop activations
    around = [s for s in segments if not s.block]
    expected = sum(s.saved_bytes for s in around) + sum(s.checkpoint_bytes for s in blocks) + max(s.saved_bytes for s in blocks)
    assert full.run().memory.activations == pytest.approx(expected, rel=1e-9)


class _CountedExchange(torch.autograd.Function):
    """A stand-in for an MoE layer's all-to-all (``codegen.runtime.moe.all_to_all_rows``):
    forward "communicates" through ``kept_exchange`` (here: doubles its rows and counts the
    call), backward sends the gradient back (doubled)."""

    calls = 0

    @staticmethod
    def forward(ctx, rows):
        def communicate():
            _CountedExchange.calls += 1
            return rows * 2

        return kept_exchange(communicate)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _ExchangingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.before, self.after = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.after(torch.tanh(_CountedExchange.apply(torch.tanh(self.before(x))))))


@pytest.mark.parametrize("keep, calls", [(False, 2), (True, 1)])
def test_recomputation_keeping_exchanges_runs_each_collective_once(keep, calls):
    """``recompute_in_backward_counting_once(block, keep_exchanges=True)``
    (``recompute="full_keep_a2a"``): backward recomputes the block, but its exchange hands
    back what forward kept instead of communicating again; plain full recomputation
    communicates twice. Gradients equal the block's without recomputation either way."""
    torch.manual_seed(0)
    reference, x = _ExchangingBlock(), torch.randn(4, 8)
    block = recompute_in_backward_counting_once(copy.deepcopy(reference), keep_exchanges=keep)
    reference(x).square().sum().backward()
    _CountedExchange.calls = 0
    block(x).square().sum().backward()
    assert _CountedExchange.calls == calls
    for (name, expected), got in zip(reference.named_parameters(), block.parameters()):
        torch.testing.assert_close(got.grad, expected.grad, rtol=0, atol=0, msg=name)
