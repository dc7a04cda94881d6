"""Transformer Engine's overlap of the sequence-parallel collectives with GEMMs
(``Plan.tp_comm_overlap``, ``cost_model.tp_comm_overlap``): the exposed time of each method
worked by hand, one layer of a Megatron plan priced by it, a plan without it priced as
before, and the field refused where it does not apply."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cost_model.simulator import Simulator, simulated
from cost_model.tp_comm_overlap import (
    bulk_exposed, gemm_share, pipelined_exposed, ring_exchange_exposed, TE_PIPELINE_SPLITS,
)
from planner.api import prepare_model
from planner.errors import PlanningError
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan
from tests.simulation_only_fields import check_simulation_only_field

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
H100_SHARE = (132 - 16) / 132  # an H100's 132 SMs, 16 of them held by the userbuffers kernel


def test_ring_exchange_hides_the_gather_while_each_chunk_outlasts_its_transfer() -> None:
    """tp = 8: the GEMM in 8 chunks of G/8, the all-gather in 7 transfers of C/7, each beside
    a chunk. G = 8 ms, C = 7 ms: chunks of 1 ms, transfers of 1 ms: nothing exposed.
    G = 4 ms, C = 7 ms: chunks of 0.5 ms, each of the 7 transfers 0.5 ms longer: 3.5 ms."""
    assert ring_exchange_exposed(8e-3, 7e-3, 8) == pytest.approx(0.0, abs=1e-15)
    assert ring_exchange_exposed(4e-3, 7e-3, 8) == pytest.approx(3.5e-3)
    assert ring_exchange_exposed(4e-3, 7e-3, 1) == 0.0  # no tensor parallelism, nothing to gather


def test_pipelined_reduce_scatter_exposes_its_last_chunk_and_the_sms_it_takes() -> None:
    """4 chunks. G = 4 ms (1 ms a chunk), each chunk's reduce-scatter c = 0.5 ms: chunks 2-4
    run beside the previous chunk's reduce-scatter on 116/132 of the SMs, 0.5 x 16/132 =
    0.0606 ms longer each; the last reduce-scatter runs alone: 0.5 + 3 x 0.0606 = 0.6818 ms.
    G = 1 ms (0.25 ms a chunk), c = 0.5 ms: the reduce-scatters pace it, 0.25 ms each beyond
    the chunk: 0.5 + 3 x 0.25 = 1.25 ms."""
    assert TE_PIPELINE_SPLITS == 4
    assert pipelined_exposed(4e-3, 0.5e-3, 4, H100_SHARE) == pytest.approx(0.5e-3 + 3 * 0.5e-3 * 16 / 132)
    assert pipelined_exposed(4e-3, 0.5e-3, 4, H100_SHARE) == pytest.approx(0.6818e-3, rel=1e-4)
    assert pipelined_exposed(1e-3, 0.5e-3, 4, H100_SHARE) == pytest.approx(1.25e-3)


def test_bulk_overlap_costs_the_sms_it_takes_or_what_outlasts_the_gemm() -> None:
    """G = 2 ms beside C = 1 ms: the GEMM loses 16/132 of its SMs for 1 ms: 0.1212 ms.
    G = 0.5 ms beside C = 1 ms: the collective outlasts it by 0.5 ms."""
    assert bulk_exposed(2e-3, 1e-3, H100_SHARE) == pytest.approx(1e-3 * 16 / 132)
    assert bulk_exposed(0.5e-3, 1e-3, H100_SHARE) == pytest.approx(0.5e-3)


def _layer_plans(overlap_too: bool = True):
    """examples/gpt.py (width 1024, 16 heads, 2 layers, 512 positions, batch 8) on one
    DGX-H100 (8 GPUs), Megatron's layout on tp = 8 with sequence parallelism, bf16, with
    Megatron-Core's 16-bit weights (``Plan.half_precision_weights``: no autocast casts) both
    without and with Transformer Engine's overlap."""
    graph, spec, name, cluster = prepare_model(
        ModelSpec(GPT, {"batch_size": 8, "n_layer": 2, "n_embd": 1024, "n_head": 16, "seq_len": 512}), "dgx-h100:1")
    plans = [simulated(dataclasses.replace(megatron_plan(graph, cluster, spec, name, tp=8, sequence_parallel=True,
                                                         precision="bf16", tp_comm_overlap=overlap),
                                           half_precision_weights=True), graph)
             for overlap in ((False, True) if overlap_too else (False,))]
    return graph, plans


def _first_block(graph, simulator):
    """The first block's linears and the readers of its row-parallel projections (the
    dropouts, on whose input edges Megatron's reduce-scatters sit), in order, with their
    costs."""
    block = next(node.block for node in graph.nodes if node.block is not None)
    nodes = [node for node in graph.nodes if node.block == block]
    linears = [node for node in nodes if node.op.startswith("aten.linear.")]
    readers = [node for node in nodes if node.op.startswith("aten.dropout.")
               and simulator.costs[node.name].forward_comm_s]
    return linears, readers


def test_without_the_overlap_a_layer_pays_four_gathers_and_four_reduce_scatters_alone() -> None:
    """Korthikanti et al. (2022), section 4.2.2: per layer, forward and backward, 4
    all-gathers and 4 reduce-scatters of s b h elements. Here s b h = 512 x 8 x 1024 bf16 =
    8 MiB each: the all-gathers before c_attn and c_fc (their gradients' reduce-scatters in
    backward), the reduce-scatters of c_proj's and the MLP projection's partial sums at the
    dropouts that read them, before the residual adds (their gradients' all-gathers in
    backward). Nothing is overlapped: each
    costs the collective alone, as before the setting existed, and off is the default."""
    graph, (plan,) = _layer_plans(overlap_too=False)
    default = megatron_plan(graph, plan.cluster, plan.model, plan.summary.name, tp=8, sequence_parallel=True,
                            precision="bf16")
    default = simulated(dataclasses.replace(default, half_precision_weights=True), graph)
    assert not default.tp_comm_overlap and default.estimate == plan.estimate
    simulator = Simulator(plan, graph)
    context = simulator.context
    size = 512 * 8 * 1024 * 2
    gather, scatter = context.collective("all_gather", size, "tp"), context.collective("reduce_scatter", size, "tp")
    linears, readers = _first_block(graph, simulator)
    qkv, fc = linears[0], linears[2]
    for column in (qkv, fc):
        cost = simulator.costs[column.name]
        assert (cost.forward_comm_s, cost.backward_comm_s) == pytest.approx((gather, scatter))
        assert cost.axis_bytes["tp"] == pytest.approx(2 * size * 7 / 8)
    assert len(readers) == 2
    for reader in readers:
        cost = simulator.costs[reader.name]
        assert (cost.forward_comm_s, cost.backward_comm_s) == pytest.approx((scatter, gather))


def test_one_overlapped_layer_exposes_what_transformer_engine_leaves() -> None:
    """The same layer with ``tp_comm_overlap``: G the GEMM each collective hides behind
    (a linear's backward: half data gradient, half weight gradient), C the collective alone.

    * c_attn, c_fc (column parallel): the forward all-gather by ring exchange with the GEMM,
      ``7 max(0, C/7 - G/8)``; backward, the gradient's reduce-scatter beside the weight
      gradient and the input gathered again beside the data gradient, each
      ``max(C - G, 16/132 C)``; the re-gather's bytes are counted.
    * the dropouts after c_proj and the MLP projection (row parallel): the reduce-scatter in 4
      chunks after the GEMM, ``c + 3 max(c - G/4, 16/132 c)``; the gradient's all-gather by
      ring exchange with the projection's data gradient.
    Every other op costs what it costs without the overlap. (GEMMs this small hide little:
    the chunked reduce-scatters and the re-gathers make this layer slower than without.)"""
    graph, (off, on) = _layer_plans()
    before, after = Simulator(off, graph), Simulator(on, graph)
    context = after.context
    size = 512 * 8 * 1024 * 2
    gather, scatter = context.collective("all_gather", size, "tp"), context.collective("reduce_scatter", size, "tp")
    chunk = context.collective("reduce_scatter", size / 4, "tp")
    assert gemm_share(context.device) == pytest.approx(H100_SHARE)
    linears, readers = _first_block(graph, after)
    qkv, proj, fc, fc_proj = linears
    for column in (qkv, fc):
        cost = after.costs[column.name]
        half = cost.backward_s / 2
        assert cost.forward_comm_s == pytest.approx(7 * max(0.0, gather / 7 - cost.forward_s / 8), abs=1e-12)
        assert cost.backward_comm_s == pytest.approx(
            max(scatter - half, 16 / 132 * scatter) + max(gather - half, 16 / 132 * gather))
        assert cost.axis_bytes["tp"] == pytest.approx(3 * size * 7 / 8)
    for reader, row in zip(readers, (proj, fc_proj)):
        cost, gemm = after.costs[reader.name], before.costs[row.name]
        assert cost.forward_comm_s == pytest.approx(
            chunk + 3 * max(chunk - gemm.forward_s / 4, 16 / 132 * chunk))
        assert cost.backward_comm_s == pytest.approx(7 * max(0.0, gather / 7 - gemm.backward_s / 2 / 8), abs=1e-12)
    overlapped = {qkv.name, fc.name, *(reader.name for reader in readers)}
    for node in graph.nodes:
        if node.block == qkv.block and node.name not in overlapped:
            assert after.costs[node.name] == before.costs[node.name], node.name
    # One device per stage, no dp and no pipeline: the tensor-parallel collectives run on the
    # compute stream between the passes, so the step moves by exactly what the ops' do.
    moved = sum(after.costs[n.name].forward_comm_s + after.costs[n.name].backward_comm_s
                - before.costs[n.name].forward_comm_s - before.costs[n.name].backward_comm_s for n in graph.nodes)
    assert on.estimate.step_time_s - off.estimate.step_time_s == pytest.approx(moved)


def test_the_setting_needs_sequence_parallelism_round_trips_and_is_not_compiled(tmp_path) -> None:
    """Transformer Engine overlaps the sequence-parallel collectives only: a plan without
    sequence parallelism is refused in one line. The field round-trips through the plan file
    (a file written before it reads as off), and ``compile`` refuses it in one line: compiled
    programs do not overlap."""
    graph, (off, on) = _layer_plans()
    with pytest.raises(PlanningError, match="tp_comm_overlap .* needs tp > 1 and sequence_parallel"):
        megatron_plan(graph, on.cluster, on.model, "gpt", tp=8, precision="bf16", tp_comm_overlap=True)
    plain = megatron_plan(graph, on.cluster, on.model, "gpt", tp=8, precision="bf16")
    with pytest.raises(ValueError, match="field 'tp_comm_overlap' is true but the plan has no sequence parallelism") as error:
        dataclasses.replace(plain, tp_comm_overlap=True)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="field 'tp_comm_overlap' must be true or false"):
        dataclasses.replace(on, tp_comm_overlap="yes")
    assert "tp collectives overlapped as Transformer Engine does" in on.name and "overlapped" not in off.name
    check_simulation_only_field(on, "tp_comm_overlap", tmp_path)
