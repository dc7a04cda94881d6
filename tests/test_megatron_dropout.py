"""Megatron's order after a row-parallel matmul: reduce first, then bias-dropout-add.

Megatron-Core's ``RowParallelLinear`` all-reduces its partial sums (reduce-scatters them to
the sequence split under ``--sequence-parallel``) inside its forward, and ``TransformerLayer``
runs ``self_attn_bda`` / ``mlp_bda`` (bias, dropout, residual add) on that reduced tensor
(megatron/core/tensor_parallel/layers.py and megatron/core/transformer/transformer_layer.py,
core_v0.8.0). The layout used to carry the partial sums through the dropout and reduce at the
residual add: every tp rank then ran the dropout on the whole tensor and kept its whole mask.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from cost_model.compute import efficiencies
from cost_model.resharding import forward_collective
from cost_model.simulator import Simulator
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan
from search.rules import axis_candidates

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
# examples/gpt.py's defaults: batch 8, sequence 32, width 64, 2 blocks; dropout 0.1 here.
BATCH, SEQ, WIDTH = 8, 32, 64


@pytest.fixture(scope="module")
def gpt_with_dropout():
    return prepare_model(ModelSpec(GPT, {"dropout": 0.1}), "cpu:1x2")


def _block_dropouts(graph):
    # The residual dropouts: resid_dropout after attn.c_proj, dropout after mlp.c_proj.
    return [n for n in graph.nodes if n.op.startswith("aten.dropout.") and n.block is not None]


@pytest.mark.parametrize("sequence_parallel, reduced", [(False, Replicate()), (True, Shard(1))])
def test_dropout_reads_the_reduced_row_parallel_output(gpt_with_dropout, sequence_parallel, reduced):
    graph, spec, name, cluster = gpt_with_dropout
    plan = megatron_plan(graph, cluster, spec, name, tp=2, sequence_parallel=sequence_parallel, precision="fp32")
    strategy_of = {s.node: s for s in plan.strategies}
    nodes = {n.name: n for n in graph.nodes}
    dropouts = _block_dropouts(graph)
    assert len(dropouts) == 4  # 2 blocks x (attention, MLP)
    for dropout in dropouts:
        projection = nodes[dropout.inputs[0]]
        assert projection.module.endswith("c_proj")  # the row-parallel matmul it reads
        # The projection makes partial sums (weight split on its input features)...
        assert strategy_of[projection.name].outputs[0] == (Partial(),)
        # ...reduced on the edge into the dropout: all-reduced to whole tensors, or
        # reduce-scattered to the sequence split (dim 1 of (B, T, C)).
        assert strategy_of[dropout.name].inputs[0] == (reduced,)
        assert strategy_of[dropout.name].outputs[0] == (reduced,)
        kind = forward_collective(Partial(), reduced)
        assert kind == ("reduce_scatter" if sequence_parallel else "all_reduce")
        # The residual add reads the dropout as it comes: no second collective.
        add = next(n for n in graph.nodes if dropout.name in n.inputs)
        assert add.op == "aten.add.Tensor"
        assert strategy_of[add.name].inputs[add.inputs.index(dropout.name)] == (reduced,)


def test_dropout_under_sequence_parallelism_prices_a_tp_share(gpt_with_dropout):
    graph, spec, name, cluster = gpt_with_dropout
    plain = Simulator(megatron_plan(graph, cluster, spec, name, tp=2, precision="fp32"), graph)
    split = Simulator(megatron_plan(graph, cluster, spec, name, tp=2, sequence_parallel=True, precision="fp32"), graph)
    device = cluster.nodes[0].device
    _, memory_efficiency, _ = efficiencies(device, "fp32")
    elements = BATCH * SEQ * WIDTH  # 16,384 per dropout
    for dropout in _block_dropouts(graph):
        # The kernel reads x and writes y, fp32: 16,384 x (4 + 4) = 131,072 bytes whole; under
        # sequence parallelism each of the 2 ranks moves half, 65,536 bytes. Dropout does no
        # FLOPs, so the roofline prices bytes only: the forwards differ by 65,536 bytes at the
        # device's memory bandwidth x efficiency (the per-kernel overhead is in both).
        assert dropout.bytes_moved == elements * (4 + 4)
        saved_bytes_s = elements * (4 + 4) / 2 / (device.memory_bandwidth * memory_efficiency)
        assert plain.costs[dropout.name].forward_s - split.costs[dropout.name].forward_s == pytest.approx(saved_bytes_s)
        # Its mask, a byte per element kept for backward: 16,384 bytes whole, 8,192 on each
        # rank under sequence parallelism (it was 16,384 on every rank, the mask of the
        # partial sums).
        assert plain.costs[dropout.name].saved_bytes == pytest.approx(elements)
        assert split.costs[dropout.name].saved_bytes == pytest.approx(elements / 2)


def test_dropout_takes_no_partial_sums(gpt_with_dropout):
    # Each rank would draw its own mask: the sum of differently masked partial sums is not
    # the dropout of the sum, so the registry offers dropout no Partial candidate.
    graph = gpt_with_dropout[0]
    for dropout in _block_dropouts(graph):
        candidates = axis_candidates(dropout, 2)
        assert candidates  # the sequence and feature splits stay
        assert not any(isinstance(p, Partial) for c in candidates for p in (*c.inputs, *c.outputs))


def test_the_compiled_program_reduce_scatters_before_each_dropout_as_planned(gpt_with_dropout, tmp_path):
    # The program runs on DTensors, which never draw a mask for partial sums; it used to
    # rewrite the plan's partial dropout on its own (codegen.spmd_placements
    # .dropout_without_partials, with a comment saying so). Now the plan already reads the
    # reduce-scattered tensor, and the program does what the plan priced.
    from planner.api import compile as compile_plan

    graph, spec, name, cluster = gpt_with_dropout
    plan = megatron_plan(graph, cluster, spec, name, tp=2, sequence_parallel=True, precision="fp32")
    program = (compile_plan(plan, tmp_path / "out") / "model_spmd.py").read_text()
    assert "DTensor cannot draw one for partial sums" not in program
    # The repeated blocks share one emitted function: block 0's two dropouts are written out.
    first_block = _block_dropouts(graph)[0].block
    for dropout in [d for d in _block_dropouts(graph) if d.block == first_block]:
        call = next(line for line in program.splitlines() if line.strip().startswith(f"{dropout.name} = "))
        # its input: the projection's output reduce-scattered to the sequence split (a
        # ``_tp_s1`` value), 1/2 of (8, 32, 64) on each rank
        assert re.search(r"aten\.dropout\.default\(\w+_tp_s1, ", call), call
        assert "(8, 32, 64) -> (8, 16, 64) per rank: S(1) on tp" in call
