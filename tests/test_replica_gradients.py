"""Gradients of parameters replicated over a non-``dp`` axis whose ranks saw other rows
(``cost_model.replica_gradients``): charged on every mesh, once per step.

A plan that splits the batch over ``tp`` with the weights whole there is data parallelism
under another axis name: each rank's weight gradient covers its own rows only, and the
program all-reduces it over ``tp``. The simulator must charge that all-reduce, or such a plan
looks cheaper than the same split on ``dp``. Hand formula for one linear W (N x K), fp32
gradients (e = 4 bytes), ring all-reduce over n ranks: 2 (n-1)/n N K e bytes per device.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from cost_model.simulator import Simulator
from planner.api import prepare_model
from planner.cluster import Cluster
from planner.strategy import Mesh
from search.node_candidates import node_strategies
from search.layouts import combine
from search.plan_builder import unsimulated_plan

K, N, BATCH = 64, 32, 8
E = 4


class OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N, bias=False)

    def forward(self, x):
        return self.proj(x).sum()


@pytest.fixture(scope="module")
def setup():
    cluster = Cluster.preset("cpu", 1, 2)
    graph, *_ = prepare_model(OneLinear(), cluster, (torch.randn(BATCH, K),))
    return graph, cluster


def _linear_cost(graph, cluster, mesh: Mesh, wanted_weight, wanted_output):
    node = next(n for n in graph.nodes if n.op == "aten.linear.default")
    options = node_strategies(graph, mesh, only={node.name})[node.name]
    strategy = next(s for s in options
                    if s.params["proj.weight"] == wanted_weight and s.outputs[0] == wanted_output)
    seed, inputs = combine(graph, mesh, {})
    simulator = Simulator(unsimulated_plan(graph, cluster, None, "M", mesh, seed, inputs), graph)
    return simulator, simulator.node_costs.compute(node, strategy, edges=[])


def test_batch_split_over_tp_with_whole_weights_pays_the_gradient_all_reduce(setup):
    graph, cluster = setup
    mesh = Mesh((("tp", 2),))
    simulator, cost = _linear_cost(graph, cluster, mesh, (Replicate(),), (Shard(0),))
    assert cost.axis_bytes["tp"] == pytest.approx(2 * (2 - 1) / 2 * N * K * E)
    assert cost.axis_sync_s == pytest.approx(simulator.context.collective("all_reduce", N * K * E, "tp"))
    assert cost.axis_sync_s > 0


def test_split_weights_or_the_dp_axis_pay_nothing_here(setup):
    graph, cluster = setup
    # Column-parallel: W split over tp, each rank's gradient is its own shard's whole gradient.
    _, column = _linear_cost(graph, cluster, Mesh((("tp", 2),)), (Shard(0),), (Shard(1),))
    assert column.axis_sync_s == 0
    # The batch over dp: the data-parallel sync (the simulator's own, per flavour) covers it.
    _, data_parallel = _linear_cost(graph, cluster, Mesh((("dp", 2),)), (Replicate(),), (Shard(0),))
    assert data_parallel.axis_sync_s == 0 and "dp" not in data_parallel.axis_bytes
