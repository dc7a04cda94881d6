"""SUMMA layouts in the search: candidates in the vocabulary's placements, their costs in the
simulator against formulas derived here by hand, CP-SAT against exhaustive enumeration on a
SUMMA mesh, and the ``--tp-layouts`` choices end to end.

Bytes per device of one linear ``y = x W^T`` (T rows, K in, N out, e bytes per element),
derived from the block algorithms (``cost_model/summa.py``'s docstring):

* 2-D / 2.5-D, q x q (x d): an x block is T K / (d q^2), a W block K N / q^2. Forward
  broadcasts one x block along ``col`` and one W block along ``row`` in each of q rounds;
  backward broadcasts them again (q rounds each) and reduces dX along ``col``, dW along
  ``row`` (q rounds each). A broadcast or reduction of S bytes costs a device S. So per
  device: ``col`` 3 q T K / (d q^2) e = 3 T K e / (d q), ``row`` 3 K N e / q.
  2.5-D adds the once-per-step all-reduce of the W block's gradient over ``dep``.
* 3-D, q x q x q (non-swapped: x gathered over ``row``, W over ``dep``, y reduce-scattered
  over ``col``): the gathered blocks are T K / q^2, K N / q^2 and T N / q^2, and a ring
  all-gather or reduce-scatter of S bytes over q devices costs (q-1)/q S. x is gathered in
  forward and again in backward, and dX reduce-scattered: 3 (q-1)/q T K / q^2 e on ``row``;
  W likewise on ``dep``; y reduce-scattered in forward and dY gathered in backward:
  2 (q-1)/q T N / q^2 e on ``col``. Swapped exchanges ``row`` and ``col``.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import planner
from cost_model.simulator import Simulator
from planner.api import prepare_model
from planner.cluster import Cluster
from planner.errors import ArgumentError, PlanningError
from planner.plans import load_plan
from planner.strategy import Mesh, SummaLayout
from search.node_candidates import node_strategies
from search.cost_tables import build_cost_tables
from search.ilp import solve
from search.layouts import combine
from search.plan_builder import unsimulated_plan
from search.rules.summa import summa_candidates
from search.summa_meshes import summa_grids

R = Replicate()
E = 4  # fp32 bytes per element
BATCH, SEQ, K, N = 8, 4, 64, 32
MESH_2D = Mesh((("dp", 2), ("row", 2), ("col", 2)))
MESH_25D = Mesh((("dep", 2), ("row", 2), ("col", 2)))
MESH_3D = Mesh((("row", 2), ("col", 2), ("dep", 2)))


class OneLinear(nn.Module):
    def __init__(self, bias: bool = False):
        super().__init__()
        self.proj = nn.Linear(K, N, bias=bias)

    def forward(self, x):
        return self.proj(x).sum()


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(K, K, bias=False)
        self.down = nn.Linear(K, K, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x))).sum()


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(K)
        self.up = nn.Linear(K, K)
        self.down = nn.Linear(K, K)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(self.norm(x)))).sum()


def _graph(model: nn.Module):
    graph, *_ = prepare_model(model, Cluster.preset("cpu", 1, 8), (torch.randn(BATCH, SEQ, K),))
    return graph


@pytest.fixture(scope="module")
def linear_graph():
    return _graph(OneLinear())


@pytest.fixture(scope="module")
def biased_graph():
    return _graph(OneLinear(bias=True))


@pytest.fixture(scope="module")
def mlp_graph():
    return _graph(Mlp())


def _node(graph, op):
    return next(node for node in graph.nodes if node.op == op)


def _by_axis(mesh: Mesh, placements) -> dict:
    return dict(zip(mesh.names, placements))


# ------------------------------------------------------------------ candidates


def test_2d_and_25d_linear_placements_are_the_vocabulary(biased_graph):
    linear = _node(biased_graph, "aten.linear.default")
    for mesh, layout in ((MESH_2D, SummaLayout(2, 1, "2d")), (MESH_25D, SummaLayout(2, 2, "2.5d"))):
        (strategy,) = summa_candidates(linear, mesh)
        assert strategy.layout == layout
        x, w, b = (_by_axis(mesh, p) for p in strategy.inputs)
        y = _by_axis(mesh, strategy.outputs[0])
        block = {"row": Shard(0), "col": Shard(2), **({"dep": Shard(0)} if "dep" in mesh.names else {}), **({"dp": Shard(0)} if "dp" in mesh.names else {})}
        assert x == block and y == block
        assert w == {"row": Shard(1), "col": Shard(0), **({"dep": R} if "dep" in mesh.names else {}), **({"dp": R} if "dp" in mesh.names else {})}
        assert b == {name: Shard(0) if name == "col" else R for name in mesh.names}


def test_3d_linear_placements_are_the_vocabulary_and_alternate(biased_graph):
    linear = _node(biased_graph, "aten.linear.default")
    plain, swapped, plain_kept, swapped_kept = summa_candidates(linear, MESH_3D)
    assert (plain.layout, swapped.layout) == (SummaLayout(2, 2, "3d", False), SummaLayout(2, 2, "3d", True))
    # Keeping the gathered operands changes what the backward sends, not the placements.
    assert (plain_kept.layout, swapped_kept.layout) == (SummaLayout(2, 2, "3d", False, True),
                                                        SummaLayout(2, 2, "3d", True, True))
    assert (plain_kept.inputs, plain_kept.outputs) == (plain.inputs, plain.outputs)
    assert (swapped_kept.inputs, swapped_kept.outputs) == (swapped.inputs, swapped.outputs)
    for strategy, b, c in ((plain, "row", "col"), (swapped, "col", "row")):
        x, w, bias = (_by_axis(MESH_3D, p) for p in strategy.inputs)
        assert x == {b: Shard(0), "dep": Shard(0), c: Shard(2)}
        assert w == {c: Shard(1), "dep": Shard(1), b: Shard(0)}
        assert bias == {b: Shard(0), "dep": R, c: R}
        assert _by_axis(MESH_3D, strategy.outputs[0]) == {c: Shard(0), "dep": Shard(0), b: Shard(2)}
    # A non-swapped matmul's output is what the swapped one reads: an MLP needs no resharding.
    assert plain.outputs[0] == swapped.inputs[0] and swapped.outputs[0] == plain.inputs[0]


def test_block_norm_and_pointwise_keep_the_block_layout(mlp_graph):
    norm, gelu = _node(mlp_graph, "aten.layer_norm.default"), _node(mlp_graph, "aten.gelu.default")
    (strategy,) = summa_candidates(norm, MESH_25D)
    assert strategy.layout == SummaLayout(2, 2, "2.5d")
    block = (Shard(0), Shard(0), Shard(2))
    assert strategy.inputs[0] == block and strategy.outputs[0] == block
    assert all(p == (R, R, Shard(0)) for p in strategy.params.values())  # split on the hidden axis, col
    # 3-D: one block-layout norm per hidden axis, each naming it through its layout.
    hidden = {s.layout.hidden_axis: _by_axis(MESH_3D, s.inputs[0]) for s in summa_candidates(norm, MESH_3D)}
    assert hidden == {"col": {"row": Shard(0), "col": Shard(2), "dep": Shard(0)},
                      "row": {"row": Shard(2), "col": Shard(0), "dep": Shard(0)}}
    outputs = {_by_axis(MESH_3D, s.outputs[0])["row"] for s in summa_candidates(gelu, MESH_3D)}
    assert outputs == {Shard(0), Shard(2)}


def test_no_summa_candidates_on_a_1d_mesh_or_for_uneven_sizes(linear_graph):
    linear = _node(linear_graph, "aten.linear.default")
    assert summa_candidates(linear, Mesh((("dp", 2), ("tp", 4)))) == []
    # q = 4 needs K and N divisible by 4 (they are) and the rows by dep x row = 2 x 4 = 8,
    # the batch of 8 (it is); q = 3 does not divide K = 64.
    assert summa_candidates(linear, Mesh((("dep", 2), ("row", 4), ("col", 4))))
    assert summa_candidates(linear, Mesh((("row", 3), ("col", 3)))) == []


# ------------------------------------------------------------------ costs


def _node_cost(graph, mesh, strategy):
    cluster = Cluster.preset("cpu", 1, mesh.size)
    seed, inputs = combine(graph, mesh, {})
    simulator = Simulator(unsimulated_plan(graph, cluster, None, "M", mesh, seed, inputs), graph)
    node = graph.node(strategy.node)
    return simulator, simulator.node_costs.compute(node, strategy, edges=[])


@pytest.mark.parametrize("mesh", [MESH_2D, MESH_25D], ids=["2d-dp2", "2.5d"])
def test_2d_and_25d_bytes_per_device_match_the_hand_formula(linear_graph, mesh):
    (strategy,) = summa_candidates(_node(linear_graph, "aten.linear.default"), mesh)
    simulator, cost = _node_cost(linear_graph, mesh, strategy)
    q, d = 2, strategy.layout.d
    rows = BATCH * SEQ // (mesh.axis_size("dp") if "dp" in mesh.names else 1)
    assert cost.axis_bytes["col"] == pytest.approx(3 * rows * K * E / (d * q))
    assert cost.axis_bytes["row"] == pytest.approx(3 * K * N * E / q)
    if d > 1:  # the weight gradient's all-reduce over depth: ring, 2 (d-1)/d of the block
        block = K * N / q**2 * E
        assert cost.axis_bytes["dep"] == pytest.approx(2 * (d - 1) / d * block)
        assert cost.axis_sync_s == pytest.approx(simulator.context.collective("all_reduce", block, "dep"))
    else:
        assert "dep" not in cost.axis_bytes and cost.axis_sync_s == 0


def test_3d_bytes_per_device_match_the_hand_formula(linear_graph):
    plain, swapped, plain_kept, swapped_kept = summa_candidates(_node(linear_graph, "aten.linear.default"), MESH_3D)
    q, rows, ring = 2, BATCH * SEQ, (2 - 1) / 2
    # x: gathered in forward, again in backward, dX reduce-scattered (kept: no second gather);
    # W over dep likewise; y: scattered in forward, dY gathered in backward.
    for strategy, gather_x, scatter_y, x_and_w_moves in (
            (plain, "row", "col", 3), (swapped, "col", "row", 3), (plain_kept, "row", "col", 2),
            (swapped_kept, "col", "row", 2)):
        _, cost = _node_cost(linear_graph, MESH_3D, strategy)
        assert cost.axis_bytes[gather_x] == pytest.approx(x_and_w_moves * ring * rows * K / q**2 * E)
        assert cost.axis_bytes["dep"] == pytest.approx(x_and_w_moves * ring * K * N / q**2 * E)
        assert cost.axis_bytes[scatter_y] == pytest.approx(2 * ring * rows * N / q**2 * E)
        assert cost.axis_sync_s == 0  # W is split on every axis: nothing to sum
    # Kept, the node saves the gathered x [T/q, K/q] and W [K/q, N/q] beside x's shard.
    _, without = _node_cost(linear_graph, MESH_3D, plain)
    _, kept = _node_cost(linear_graph, MESH_3D, plain_kept)
    assert kept.saved_bytes - without.saved_bytes == pytest.approx((rows * K / q**2 - rows * K / q**3 + K * N / q**2) * E)


def test_summa_compute_is_the_local_block_products(linear_graph):
    """Forward: q rounds of [T/(dq), K/q] x [K/q, N/q]; total FLOPs 2 T K N / (d q^2) on a
    2.5-D grid, the same share of the work as any split over 8 devices."""
    (strategy,) = summa_candidates(_node(linear_graph, "aten.linear.default"), MESH_25D)
    simulator, cost = _node_cost(linear_graph, MESH_25D, strategy)
    from cost_model.compute import roofline_time
    rows = BATCH * SEQ
    one_round = roofline_time(2 * (rows / 4) * (K / 2) * (N / 2), E * ((rows / 4) * (K / 2) + (K / 2) * (N / 2) + (rows / 4) * (N / 2)),
                              simulator.context.cluster.device_of(0), torch.float32)
    assert cost.forward_s == pytest.approx(2 * one_round)
    assert cost.backward_s == pytest.approx(4 * one_round)


def test_norm_in_block_layout_reduces_its_statistics_over_the_hidden_axis(mlp_graph):
    (strategy,) = summa_candidates(_node(mlp_graph, "aten.layer_norm.default"), MESH_25D)
    simulator, cost = _node_cost(mlp_graph, MESH_25D, strategy)
    rows = BATCH * SEQ / 4  # split over dep and row
    stats = 2 * rows * 4  # mean and variance per row, fp32
    # forward and backward each all-reduce 2 numbers per row over col (ring: 2 (n-1)/n)
    assert cost.axis_bytes["col"] == pytest.approx(2 * 2 * (1 / 2) * stats)
    # the norm's weight and bias are split on col, replicated on dep and row where the rows
    # are split: their gradients are summed over both, once per step
    local = K / 2 * E
    expected = 2 * (simulator.context.collective("all_reduce", local, "dep") + simulator.context.collective("all_reduce", local, "row"))
    assert cost.axis_sync_s == pytest.approx(expected)


# ------------------------------------------------------------------ search


def test_cp_sat_finds_the_exhaustive_optimum_on_a_3d_mesh():
    mlp_graph = _graph(TwoLinears())
    cluster = Cluster.preset("cpu", 1, 8)
    seed, inputs = combine(mlp_graph, MESH_3D, {})
    skeleton = unsimulated_plan(mlp_graph, cluster, None, "M", MESH_3D, seed, inputs)
    tables = build_cost_tables(skeleton, mlp_graph, node_strategies(mlp_graph, MESH_3D, tp_layouts="summa"))
    sizes = {name: len(options) for name, options in tables.candidates.items()}
    assert math.prod(sizes.values()) <= 300_000, sizes
    names = list(sizes)
    best = min(tables.objective(dict(zip(names, combo))) for combo in itertools.product(*(range(sizes[n]) for n in names)))
    result = solve(tables, memory_bytes=None, work=20)
    assert result.optimal
    assert tables.objective(result.choice) == pytest.approx(best, abs=1e-8)
    # with --tp-layouts summa the linears have SUMMA candidates only
    linears = [node.name for node in mlp_graph.nodes if node.op == "aten.linear.default"]
    assert len(linears) == 2
    for name in linears:
        assert all(c.strategy.layout is not None for c in tables.candidates[name])


def test_summa_meshes_factor_the_devices_and_split_the_batch():
    grids = {(g.family, g.q, g.d, dp) for g, dp in summa_grids(Cluster.preset("cpu", 1, 8), 8)}
    assert grids == {("2d", 2, 1, 2), ("2.5d", 2, 2, 1), ("3d", 2, 2, 1)}
    # 64 devices, batch 64: 2-D 8x8, 2.5-D 4x4x4 and 3-D 4x4x4 among them
    grids = {(g.family, g.q, g.d, dp) for g, dp in summa_grids(Cluster.preset("dgx-a100-80g", 8), 64)}
    assert {("2d", 8, 1, 1), ("2.5d", 4, 4, 1), ("3d", 4, 4, 1)} <= grids
    # a batch of 2 splits over no grid's rows on 8 devices (2-D q=2 with dp=2 needs 4)
    assert summa_grids(Cluster.preset("cpu", 1, 8), 2) == []


@pytest.fixture(scope="module")
def summa_plan():
    return planner.plan("examples/gpt.py", "cpu:1x8", tp_layouts="summa", effort=0.25, progress=False)


def test_tp_layouts_summa_plans_every_linear_in_a_summa_layout(summa_plan, tmp_path_factory):
    linears = [s for s in summa_plan.strategies if s.op == "aten.linear.default"]
    assert linears and all(isinstance(s.layout, SummaLayout) for s in linears)
    assert any(name in summa_plan.mesh.names for name in ("row", "col"))
    path = tmp_path_factory.mktemp("summa") / "plan.json"
    summa_plan.save(path)
    loaded = load_plan(path)
    assert [s.layout for s in loaded.strategies] == [s.layout for s in summa_plan.strategies]
    assert json.loads(path.read_text())["strategies"][0]["node"] == summa_plan.strategies[0].node
    report = summa_plan.report()
    assert "Tensor-parallel layout by layer" in report
    family = next(s.layout for s in linears).describe().replace(" (swapped)", "")
    assert family in report
    # what the SUMMA linears save (or lose) against 1-D on the same devices, per layer group
    assert f"SUMMA linears against 1-D tensor parallelism on the same {summa_plan.world_size} devices" in summa_plan.search_summary
    assert "blocks.*.mlp.c_fc (2x" in summa_plan.search_summary


def test_tp_layouts_1d_has_no_summa_mesh_and_bad_values_are_refused():
    plan = planner.plan("examples/gpt.py", "cpu:1x4", tp_layouts="1d", effort=0.25, progress=False)
    assert all(s.layout is None for s in plan.strategies)
    assert not {"row", "col", "dep"} & set(plan.mesh.names)
    with pytest.raises(ArgumentError, match="tp_layouts must be one of"):
        planner.plan("examples/gpt.py", "cpu:1x4", tp_layouts="2d", progress=False)
    with pytest.raises(PlanningError, match="no 2-D/2.5-D/3-D tensor-parallel mesh"):
        planner.plan("examples/gpt.py", "cpu:1x2", tp_layouts="summa", progress=False)


def test_auto_keeps_summa_meshes_only_where_they_can_matter():
    """A tiny GPT on 8 CPU processes: 1-D beats every grid for its linears, so ``auto`` adds
    no mesh (planning as before). Many tokens through narrow layers on one DGX node (65536
    tokens of width 1024: 1-D all-reduces T h per matmul pair, 2.5-D [2,2,2] moves about
    3 T h / 4 per matmul and its small weight blocks): the 2.5-D grid is kept."""
    from search.summa_meshes import MAX_AUTO_MESHES, summa_meshes

    tiny, *_ = prepare_model("examples/gpt.py", "cpu:1x8")
    assert summa_meshes(tiny, Cluster.preset("cpu", 1, 8), "fp32", "auto") == []
    assert len(summa_meshes(tiny, Cluster.preset("cpu", 1, 8), "fp32", "summa")) == 3
    from planner.model_spec import ModelSpec
    spec = ModelSpec("examples/gpt.py", {"n_layer": 1, "n_embd": 1024, "n_head": 16, "seq_len": 1024, "batch_size": 64})
    dgx = Cluster.preset("dgx-a100-80g", 1)
    narrow, *_ = prepare_model(spec, dgx)
    kept = summa_meshes(narrow, dgx, "bf16", "auto")
    assert MESH_25D in kept and len(kept) <= MAX_AUTO_MESHES
    assert summa_meshes(narrow, dgx, "bf16", "1d") == []


def test_tp_layouts_1d_on_a_summa_mesh_plans_plain_shardings():
    """``plan_on_mesh(..., tp_layouts="1d")`` on a grid mesh: per-axis shardings only, no op
    in a SUMMA layout (what a SUMMA plan is compared with on its own mesh)."""
    from search.mesh_search import plan_on_mesh

    graph = _graph(Mlp())
    with_summa = node_strategies(graph, MESH_3D)
    plain_only = node_strategies(graph, MESH_3D, tp_layouts="1d")
    assert any(s.layout for options in with_summa.values() for s in options)
    assert not any(s.layout for options in plain_only.values() for s in options)
    plan = plan_on_mesh(graph, Cluster.preset("cpu", 1, 8), MESH_3D, tp_layouts="1d", effort=0.1)
    assert plan.mesh == MESH_3D and all(s.layout is None for s in plan.strategies)


def test_auto_picks_3d_with_kept_gathers_for_a_wide_model_on_single_gpu_nodes():
    """Golden plan (``benchmarks/summa_whole_model.py``'s ``one-gpu-nodes-short``): a GPT of
    width 16384 with 16384 tokens a step on 64 single-A100 nodes over HDR InfiniBand. 1-D
    tensor parallelism stays inside a node, so the 1-D search can only replicate or pipeline
    the 3.2 G-parameter layers and all-reduce their gradients over InfiniBand; 3-D [4,4,4]
    moves about (TK + KN + TN)/16 elements per device per matmul, and keeping the gathered
    operands saves two of its eight collectives. ``auto`` runs every linear that way, faster
    than the 1-D search's plan and than plain shardings on the same grid."""
    from planner.model_spec import ModelSpec
    from search.mesh_search import plan_on_mesh

    spec = ModelSpec("examples/gpt.py", {"n_layer": 4, "n_embd": 16384, "n_head": 128, "seq_len": 256,
                                         "vocab_size": 32000, "batch_size": 64})
    cluster = Cluster.preset("dgx-a100-80g", nodes=64, devices_per_node=1)
    auto = planner.plan(spec, cluster, effort=0.5, progress=False)
    linears = [s for s in auto.strategies if s.op == "aten.linear.default"]
    assert auto.mesh == Mesh((("row", 4), ("col", 4), ("dep", 4))) and auto.estimate.fits
    assert all(s.layout == SummaLayout(4, 4, "3d", s.layout.swapped, keep_gathered=True) for s in linears)
    one_d = planner.plan(spec, cluster, tp_layouts="1d", effort=0.5, progress=False)
    graph, *_ = prepare_model(spec, cluster)
    plain = plan_on_mesh(graph, cluster, auto.mesh, tp_layouts="1d", effort=0.5)
    assert auto.estimate.step_time_s < 0.5 * one_d.estimate.step_time_s
    assert auto.estimate.step_time_s < plain.estimate.step_time_s
    from planner.summa_report import layer_family
    assert {layer_family(s) for s in linears} == {"3-D q=4, gathers kept"}
    assert "gathers kept" in auto.search_summary


def test_summa_buffers_count_in_the_step_memory():
    """The largest transient block set of the plan's SUMMA linears (3-D: gathered x and W and
    the partial y, ``cost_model.summa``'s ``buffer_bytes``) is part of the communication
    buffers: [T/q, K/q] + [K/q, N/q] + [T/q, N/q] elements for the two K x K linears here."""
    from search.summa_layout import summa_layout

    graph = _graph(TwoLinears())
    cluster = Cluster.preset("cpu", 1, 8)
    strategies, inputs = summa_layout(graph, MESH_3D, "3d")
    plan = unsimulated_plan(graph, cluster, None, "M", MESH_3D, strategies, inputs)
    memory = Simulator(plan, graph).run(trace=False).memory
    seed, seed_inputs = combine(graph, MESH_3D, {})
    plain = Simulator(unsimulated_plan(graph, cluster, None, "M", MESH_3D, seed, seed_inputs), graph).run(trace=False).memory
    q, rows = 2, BATCH * SEQ
    assert memory.communication_buffers - plain.communication_buffers == pytest.approx(
        (rows * K + K * K + rows * K) / q**2 * E, abs=1)
