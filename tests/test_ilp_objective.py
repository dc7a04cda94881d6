"""CP-SAT's objective equals the cost worked out by hand.

``tests/test_search.py`` checks CP-SAT against exhaustive enumeration of the search's own
objective; these tests check the objective itself. Tiny models run on a two-device cluster
with round numbers, and every expected number below is written out from the formulas
(roofline compute in ``cost_model.compute``, alpha-beta ring collectives in
``cost_model.collectives``, the resharding table in ``cost_model.resharding``, the objective
of ``search.ilp``), not copied from a run.

The candidate lists are restricted to the strategies under test, so the solver's choice
is forced (or is a choice between strategies whose hand costs are known).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from planner.cluster import Cluster, DeviceSpec, LinkSpec, NodeSpec
from planner.strategy import Mesh
from planner.trace import trace
from search.node_candidates import node_strategies
from search.cost_tables import build_cost_tables
from search.ilp import solve
from search.layouts import combine
from search.plan_builder import unsimulated_plan

# ---------------------------------------------------------------- the toy cluster

PEAK = 1e12  # float32 FLOP/s
MATMUL_EFF = 0.5  # calibrated fraction of PEAK: matmuls run at 5e11 FLOP/s
HBM = 1e11  # memory bandwidth, bytes/s
MEMORY_EFF = 0.5  # calibrated fraction of HBM: streaming ops run at 5e10 B/s
OVERHEAD = 1e-6  # seconds per kernel (one forward and one backward kernel per op)
BETA = 1e10  # intra-node link, bytes/s per direction
ALPHA = 1e-5  # intra-node link latency, seconds
F32 = 4  # bytes per float32 element; fp32 precision keeps activations at 4 bytes

R, S0, S1, PSUM = Replicate(), Shard(0), Shard(1), Partial("sum")

# CP-SAT minimises integer nanoseconds (search.ilp.SCALE = 1e9): every objective
# coefficient (one per node choice, per costed resharding pair, per gradient reduction) is
# rounded to the nearest nanosecond, so the reported objective is exact to 0.5 ns per term.
# The unrounded objective (CostTables.objective, floats) must match to 1e-9 relative.
NS_PER_TERM = 0.5e-9


def _cluster() -> Cluster:
    device = DeviceSpec(
        name="toy",
        peak_flops={"float32": PEAK},
        memory_bytes=10**9,
        memory_bandwidth=HBM,
        matmul_efficiency=MATMUL_EFF,
        memory_efficiency=MEMORY_EFF,
        kernel_overhead_s=OVERHEAD,
        # No DTensor dispatch (calibrated at 0; uncalibrated a graph program pays the measured
        # default, cost_model.host_dispatch): each op costs its roofline plus OVERHEAD.
        dtensor_op_overhead_s=0.0,
    )
    # Two devices on one node; the inter-node link is never used.
    node = NodeSpec(device=device, devices=2, intra_link=LinkSpec(bandwidth=BETA, latency=ALPHA))
    return Cluster(name="toy", nodes=(node,), inter_link=LinkSpec(bandwidth=1e9, latency=1e-4), backend="gloo")


MESH = Mesh((("tp", 2),))


def _tables(graph, choices: dict[str, list[dict]]):
    """Cost tables of ``graph`` on ``MESH`` with each node's candidates limited to the
    strategies described in ``choices`` (node -> [{"inputs": ..., "output": ...}, ...])."""
    strategies, inputs = combine(graph, MESH, {})
    plan = unsimulated_plan(graph, _cluster(), None, "toy", MESH, strategies, inputs)
    assert plan.precision == "fp32" and plan.pipeline is None  # one micro-batch, 4-byte activations
    every = node_strategies(graph, MESH)
    picked = {}
    for name, wanted in choices.items():
        picked[name] = []
        for want in wanted:
            matches = [
                s for s in every[name]
                if s.inputs == tuple((p,) for p in want["inputs"]) and s.outputs[0] == (want["output"],)
            ]
            assert len(matches) == 1, (name, want, [(s.inputs, s.outputs) for s in every[name]])
            picked[name].append(matches[0])
    assert set(picked) == {node.name for node in graph.nodes}
    return build_cost_tables(plan, graph, picked)


def _trace(model: nn.Module, batch: int, features: int):
    with torch.device("meta"):
        model, x = model.to("meta"), torch.randn(batch, features)
    return trace(model, (x,))


class TwoLinears(nn.Module):
    """x (64, 256) -> fc1 (256 -> 128) -> fc2 (128 -> 64) -> sum."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(256, 128, bias=False)
        self.fc2 = nn.Linear(128, 64, bias=False)

    def forward(self, x):
        return self.fc2(self.fc1(x)).sum()


class OneLinear(nn.Module):
    """x (batch, 256) -> fc (256 -> 128) -> sum."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(256, 128, bias=False)

    def forward(self, x):
        return self.fc(x).sum()


# ------------------------------------------------------------------------- the tests


def test_forced_plan_objective_equals_the_hand_computed_cost():
    """fc1 replicated, fc2 column-parallel, the loss read replicated: every objective term
    (node compute, a resharding edge, an input-gradient all-reduce z) appears once."""
    graph = _trace(TwoLinears(), 64, 256)
    assert [n.op for n in graph.nodes] == ["aten.linear.default", "aten.linear.default", "aten.sum.default"]
    fc1, fc2, loss_op = (n.name for n in graph.nodes)  # op names are digests (planner.node_names)
    tables = _tables(graph, {
        fc1: [{"inputs": (R, R), "output": R}],  # x R, weight R -> R
        fc2: [{"inputs": (R, S0), "output": S1}],  # weight rows split: column-parallel
        loss_op: [{"inputs": (R,), "output": R}],
    })

    # fc1, whole work: forward max(FLOPs / (peak x eff), bytes / (bandwidth x eff)) + overhead,
    # backward twice the FLOPs and bytes. Bytes = x + weight + output.
    fc1_flops = 2 * 64 * 256 * 128  # 4,194,304 FLOPs
    fc1_bytes = (64 * 256 + 128 * 256 + 64 * 128) * F32  # 229,376 bytes
    fc1_fwd = max(fc1_flops / (PEAK * MATMUL_EFF), fc1_bytes / (HBM * MEMORY_EFF)) + OVERHEAD  # 8.388608e-6 + 1e-6
    fc1_bwd = max(2 * fc1_flops / (PEAK * MATMUL_EFF), 2 * fc1_bytes / (HBM * MEMORY_EFF)) + OVERHEAD
    # compute-bound: 8.39 us of FLOPs > 4.59 us of bytes

    # fc2, half the work on each rank (its output is split on tp); weight split -> no weight
    # gradient all-reduce.
    fc2_flops = 2 * 64 * 128 * 64 / 2  # 524,288 FLOPs per rank
    fc2_bytes = (64 * 128 + 64 * 128 + 64 * 64) * F32 / 2  # 40,960 bytes per rank
    fc2_fwd = max(fc2_flops / (PEAK * MATMUL_EFF), fc2_bytes / (HBM * MEMORY_EFF)) + OVERHEAD  # 1.048576e-6 + 1e-6
    fc2_bwd = max(2 * fc2_flops / (PEAK * MATMUL_EFF), 2 * fc2_bytes / (HBM * MEMORY_EFF)) + OVERHEAD

    # Megatron's f: fc2 reads fc1's replicated output with split weights, so fc1's output
    # gradient is partial on tp and is all-reduced in backward: S = 64 x 128 x 4 bytes.
    # Ring on n = 2: 2(n-1)/n S/beta + 2(n-1) alpha; the tree (2 S/beta + 2 log2(2) alpha) is slower.
    grad_all_reduce = 2 * (2 - 1) / 2 * (64 * 128 * F32) / BETA + 2 * (2 - 1) * ALPHA  # 3.2768e-6 + 2e-5

    # Edge fc2 -> sum: S(1) -> R is an all-gather of the full 64 x 64 output in forward and
    # its dual, a reduce-scatter of the gradient, in backward: (n-1)/n S/beta + (n-1) alpha each.
    all_gather = (2 - 1) / 2 * (64 * 64 * F32) / BETA + (2 - 1) * ALPHA  # 8.192e-7 + 1e-5
    reduce_scatter = all_gather

    # The sum, whole work, memory-bound (no FLOPs counted): bytes = input + the scalar output.
    sum_bytes = 64 * 64 * F32 + F32  # 16,388 bytes
    sum_fwd = sum_bytes / (HBM * MEMORY_EFF) + OVERHEAD
    sum_bwd = 2 * sum_bytes / (HBM * MEMORY_EFF) + OVERHEAD

    hand = fc1_fwd + fc1_bwd + fc2_fwd + fc2_bwd + grad_all_reduce + all_gather + reduce_scatter + sum_fwd + sum_bwd
    # fc1 27.165824 + fc2 5.145728 + f 23.2768 + gather/scatter 21.6384 + sum 2.98328 = 80.210032 us

    result = solve(tables, memory_bytes=None, work=10)
    assert result.optimal and result.choice == {fc1: 0, fc2: 0, loss_op: 0}
    assert tables.objective(result.choice) == pytest.approx(hand, rel=1e-9)
    # Terms: 3 node choices + 1 costed edge pair + 1 gradient reduction, each rounded to 1 ns.
    assert result.objective_s == pytest.approx(hand, abs=5 * NS_PER_TERM)


@pytest.mark.parametrize("batch", [64, 512])
def test_cp_sat_picks_the_hand_computed_optimum(batch):
    """Replicated, batch-sharded or column-parallel linear before a loss that reads its input
    replicated: the hand costs say which wins (replicated for a small batch, where the gathers'
    latency outweighs half the FLOPs; column-parallel for a large one), and CP-SAT agrees."""
    graph = _trace(OneLinear(), batch, 256)
    assert [n.op for n in graph.nodes] == ["aten.linear.default", "aten.sum.default"]
    fc, loss_op = (n.name for n in graph.nodes)
    strategies = [
        {"inputs": (R, R), "output": R},  # 0: replicated
        {"inputs": (S0, R), "output": S0},  # 1: batch-sharded, weight replicated
        {"inputs": (R, S0), "output": S1},  # 2: column-parallel
    ]
    tables = _tables(graph, {fc: strategies, loss_op: [{"inputs": (R,), "output": R}]})

    flops = 2 * batch * 256 * 128
    nbytes = (batch * 256 + 128 * 256 + batch * 128) * F32

    def linear_time(fraction: float) -> float:
        forward = max(fraction * flops / (PEAK * MATMUL_EFF), fraction * nbytes / (HBM * MEMORY_EFF)) + OVERHEAD
        backward = max(2 * fraction * flops / (PEAK * MATMUL_EFF), 2 * fraction * nbytes / (HBM * MEMORY_EFF)) + OVERHEAD
        return forward + backward

    # The loss reads the whole (batch, 128) output: sum's bytes = input + scalar, fwd + 2x bwd.
    sum_bytes = batch * 128 * F32 + F32
    loss = sum_bytes / (HBM * MEMORY_EFF) + OVERHEAD + 2 * sum_bytes / (HBM * MEMORY_EFF) + OVERHEAD
    # A split output gathered for the loss: all-gather forward + reduce-scatter backward of
    # the full (batch, 128) tensor, each (n-1)/n S/beta + (n-1) alpha on n = 2.
    gather_both_ways = 2 * ((2 - 1) / 2 * (batch * 128 * F32) / BETA + (2 - 1) * ALPHA)
    # Batch-sharded: the replicated weight's gradient is all-reduced over tp (data-parallel
    # sync): ring 2(n-1)/n S/beta + 2(n-1) alpha with S = 128 x 256 x 4 = 131,072 bytes.
    weight_sync = 2 * (2 - 1) / 2 * (128 * 256 * F32) / BETA + 2 * (2 - 1) * ALPHA  # 1.31072e-5 + 2e-5

    hand = [
        linear_time(1.0) + loss,  # replicated: whole work, no communication
        linear_time(0.5) + weight_sync + gather_both_ways + loss,  # batch-sharded
        linear_time(0.5) + gather_both_ways + loss,  # column-parallel
    ]
    for index, expected in enumerate(hand):
        assert tables.objective({fc: index, loss_op: 0}) == pytest.approx(expected, rel=1e-9), index
    best = min(range(3), key=hand.__getitem__)
    # The scenario: at batch 64, halving the linear saves 12.58 us of matmul time but the
    # gather and scatter cost 23.28 us (replicated is best); at batch 512 it saves 100.66 us
    # for 46.21 us (column-parallel is best).

    result = solve(tables, memory_bytes=None, work=10)
    assert result.optimal and result.choice == {fc: best, loss_op: 0}
    # Terms: 2 node choices + at most 1 costed edge pair, each rounded to 1 ns.
    assert result.objective_s == pytest.approx(hand[best], abs=3 * NS_PER_TERM)


def test_an_op_reading_a_partial_input_does_its_whole_work():
    """Row-parallel linear (contraction split: half the FLOPs) followed by a sum of its
    Partial(sum) output: every rank sums its whole (64, 128) partial tensor.

    The simulator once divided an op's work by the ranks on which its *output* was not
    Replicate, so this sum was charged half its work; it now splits work only over axes
    where some operand is Shard (``search.rules.registry.AxisCandidate.shards_work``).
    """
    graph = _trace(OneLinear(), 64, 256)
    fc, loss_op = (n.name for n in graph.nodes)
    tables = _tables(graph, {
        fc: [{"inputs": (S1, S1), "output": PSUM}],  # x and weight split on the contraction dim
        loss_op: [{"inputs": (PSUM,), "output": PSUM}],  # sum of partial sums stays partial
    })
    flops = 2 * 64 * 256 * 128 / 2  # half the contraction per rank
    nbytes = (64 * 256 + 128 * 256 + 64 * 128) * F32 / 2
    linear = (max(flops / (PEAK * MATMUL_EFF), nbytes / (HBM * MEMORY_EFF)) + OVERHEAD
              + max(2 * flops / (PEAK * MATMUL_EFF), 2 * nbytes / (HBM * MEMORY_EFF)) + OVERHEAD)
    # The linear itself is priced right: half the work, no communication.
    assert tables.candidates[fc][0].compute_s == pytest.approx(linear, rel=1e-9)
    assert tables.candidates[fc][0].communication_s == 0
    sum_bytes = 64 * 128 * F32 + F32  # the whole local partial tensor is read on each rank
    loss = sum_bytes / (HBM * MEMORY_EFF) + OVERHEAD + 2 * sum_bytes / (HBM * MEMORY_EFF) + OVERHEAD
    result = solve(tables, memory_bytes=None, work=10)
    assert result.optimal
    assert tables.candidates[loss_op][0].compute_s == pytest.approx(loss, rel=1e-9)
    assert result.objective_s == pytest.approx(linear + loss, abs=2 * NS_PER_TERM)
