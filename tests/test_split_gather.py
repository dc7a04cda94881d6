"""The fused q|k|v projection's ``split`` under Megatron's layout: what the simulator charges
for the gathers the program runs there (``cost_model.split_gather``), worked by hand.

The program's bytes are counted by ``tests/test_comm_audit.py`` (GPT, Megatron's tp=2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.tensor import Shard

from cost_model.collectives import collective_time
from cost_model.simulator import Simulator
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan
from tests.simulation_only_fields import check_simulation_only_field

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")


@pytest.mark.parametrize("dp", [1, 2])
def test_fused_projection_split_gathers_its_input_and_its_pieces_gradients(dp: int) -> None:
    """examples/gpt.py (width 64, 32 positions), global batch 8, Megatron's layout on tp=2,
    fp32. Each block's c_attn makes (8, 32, 192) = 196608 B (over dp ranks: 196608/dp B on
    this rank), split over tp on the features and cut into q, k, v along them. Forward
    all-gathers it: (2-1)/2 x 196608/dp; backward all-gathers each piece's gradient
    (3 x 65536/dp B): (2-1)/2 x 196608/dp again. So 196608/dp B on tp per block."""
    graph, spec, name, cluster = prepare_model(ModelSpec(GPT, {"batch_size": 8, "n_layer": 2}), f"cpu:1x{2 * dp}")
    plan = megatron_plan(graph, cluster, spec, name, tp=2, precision="fp32")
    simulator = Simulator(plan, graph)
    splits = [node for node in graph.nodes if node.op == "aten.split.Tensor"]
    assert len(splits) == 2  # one per block
    tp = plan.mesh.names.index("tp")
    ranks, concurrent, _ = simulator.context.groups["tp"]
    overhead = simulator.context.redistribute_overhead_s
    for split in splits:
        strategy = simulator.context.strategies[split.name]
        assert strategy.inputs[0][tp] == Shard(2) and all(p[tp] == Shard(2) for p in strategy.outputs)
        cost = simulator.costs[split.name]
        assert cost.axis_bytes == {"tp": pytest.approx(196608 / dp)}
        gather = collective_time("all_gather", 196608 / dp, simulator.context.cluster, ranks, concurrent)
        piece = collective_time("all_gather", 65536 / dp, simulator.context.cluster, ranks, concurrent)
        assert cost.forward_comm_s == pytest.approx(gather + overhead)
        assert cost.backward_comm_s == pytest.approx(3 * (piece + overhead))


def test_a_plan_with_fused_weights_laid_out_per_rank_splits_locally(tmp_path) -> None:
    """Megatron-LM lays the fused weight out per rank, so the split sends nothing: a plan that
    says so (``fused_splits_local``, for simulating Megatron-LM's own runs) is charged no
    bytes there and one fewer forward and three fewer backward collectives per block; it
    round-trips through the plan file, and compiling it is refused in one line."""
    graph, spec, name, cluster = prepare_model(ModelSpec(GPT, {"batch_size": 8, "n_layer": 2}), "cpu:1x2")
    gathering = megatron_plan(graph, cluster, spec, name, tp=2, precision="fp32")
    local = megatron_plan(graph, cluster, spec, name, tp=2, precision="fp32", fused_splits_local=True)
    assert local.fused_splits_local and not gathering.fused_splits_local
    assert local.estimate.bytes_per_axis["tp"] == pytest.approx(gathering.estimate.bytes_per_axis["tp"] - 2 * 196608)
    simulator = Simulator(local, graph)
    for split in (node for node in graph.nodes if node.op == "aten.split.Tensor"):
        cost = simulator.costs[split.name]
        assert not cost.axis_bytes and cost.forward_comm_s == cost.backward_comm_s == 0.0
    check_simulation_only_field(local, "fused_splits_local", tmp_path)
