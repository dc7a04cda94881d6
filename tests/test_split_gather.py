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
    ranks, concurrent, _ = simulator._groups["tp"]
    overhead = simulator.redistribute_overhead_s
    for split in splits:
        strategy = simulator.strategies[split.name]
        assert strategy.inputs[0][tp] == Shard(2) and all(p[tp] == Shard(2) for p in strategy.outputs)
        cost = simulator.costs[split.name]
        assert cost.axis_bytes == {"tp": pytest.approx(196608 / dp)}
        gather = collective_time("all_gather", 196608 / dp, simulator.cluster, ranks, concurrent)
        piece = collective_time("all_gather", 65536 / dp, simulator.cluster, ranks, concurrent)
        assert cost.forward_comm_s == pytest.approx(gather + overhead)
        assert cost.backward_comm_s == pytest.approx(3 * (piece + overhead))
