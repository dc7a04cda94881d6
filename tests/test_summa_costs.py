"""``cost_model.summa`` against closed forms derived here by hand.

Notation: one matmul [T, K] x [K, N] (T = batch x m rows), e bytes per element, q x q x d grid.

Bytes one device moves (bandwidth terms of the collectives: broadcast and reduce S, ring
all-reduce 2(n-1)/n S, all-gather and reduce-scatter (n-1)/n S):

  1-D column, p devices   forward 0                 backward 2(p-1)/p T K e   (all-reduce dX)
  1-D row                 forward 2(p-1)/p T N e    backward 0                (all-reduce Y)
  2-D  forward  q rounds x (X block T K/q^2 + W block K N/q^2) e = (T K + K N) e / q
       backward twice that (the dX pass re-broadcasts W and reduces dX blocks, the dW pass
                re-broadcasts X and reduces dW blocks) = 2 (T K + K N) e / q
  2.5-D forward  q (T K/(d q^2) + K N/q^2) e = (T K/d + K N) e / q
        backward 2 (T K/d + K N) e / q + 2(d-1)/d K N e / q^2   (depth all-reduce of dW)
  3-D  forward  (q-1)/q (T K + K N + T N) e / q^2       (gather X, gather W, scatter Y)
       backward (q-1)/q (T N + 2 T K + 2 K N) e / q^2   (gather dY, X, W; scatter dX, dW)
       kept gathers: backward (q-1)/q (T N + T K + K N) e / q^2 (gather dY; scatter dX, dW),
                saving the gathered X [T/q, K/q] and W [K/q, N/q] instead of X's shard [T/q^2, K/q]

The cluster of the timing tests: nodes of 4 devices, intra link (beta_i, alpha_i), inter link
(beta_e, alpha_e), a device doing exactly ``PEAK`` FLOP/s on matmuls with no launch overhead
and a memory so fast that every matmul is compute-bound.
"""

from __future__ import annotations

import pytest

from cost_model.summa import (
    Grid,
    MatmulShape,
    ThreeDAxes,
    matmul_cost,
    pipelined_rounds,
)
from planner.cluster import Cluster, DeviceSpec, LinkSpec, NodeSpec

PEAK = 100e12
BETA_I, ALPHA_I = 100e9, 1e-6
BETA_E, ALPHA_E = 10e9, 1e-5
E = 2  # bf16
SHAPE = MatmulShape(batch=4, m=512, k=1024, n=4096)
T, K, N = 2048, 1024, 4096


def cluster(nodes: int, per_node: int = 4) -> Cluster:
    device = DeviceSpec("ideal", {"bfloat16": PEAK, "float32": PEAK}, memory_bytes=10**11,
                        memory_bandwidth=1e18, matmul_efficiency=1.0, memory_efficiency=1.0,
                        kernel_overhead_s=0.0)
    node = NodeSpec(device, per_node, LinkSpec(BETA_I, ALPHA_I))
    return Cluster("test", tuple([node] * nodes), LinkSpec(BETA_E, ALPHA_E), "nccl")


def cost(family: str, q: int, d: int = 1, nodes: int = 2, per_node: int = 4, shape=SHAPE, **kwargs):
    grid = Grid(family, q, d)
    return matmul_cost(shape, grid, cluster(nodes, per_node), list(range(grid.devices)), **kwargs)


@pytest.mark.parametrize("family,q,d,forward,backward", [
    ("1d_column", 4, 1, 0.0, 2 * 3 / 4 * T * K * E),
    ("1d_row", 4, 1, 2 * 3 / 4 * T * N * E, 0.0),
    ("1d_column", 8, 1, 0.0, 2 * 7 / 8 * T * K * E),
    ("2d", 2, 1, (T * K + K * N) * E / 2, 2 * (T * K + K * N) * E / 2),
    ("2.5d", 2, 2, (T * K / 2 + K * N) * E / 2, 2 * (T * K / 2 + K * N) * E / 2 + 2 * 1 / 2 * K * N * E / 4),
    ("3d", 2, 2, 1 / 2 * (T * K + K * N + T * N) * E / 4, 1 / 2 * (T * N + 2 * T * K + 2 * K * N) * E / 4),
])
def test_bytes_per_device_match_the_closed_forms(family, q, d, forward, backward):
    result = cost(family, q, d)
    assert result.bytes_per_device("forward") == pytest.approx(forward)
    assert result.bytes_per_device("backward") == pytest.approx(backward)


def test_memory_per_device_shrinks_as_the_layout_promises():
    weights = {"1d_column": K * N / 8 * E, "2d": K * N / 4 * E, "2.5d": K * N / 4 * E, "3d": K * N / 8 * E}
    saved_input = {"1d_column": T * K * E, "2d": T * K / 4 * E, "2.5d": T * K / 8 * E, "3d": T * K / 8 * E}
    grids = {"1d_column": (8, 1), "2d": (2, 1), "2.5d": (2, 2), "3d": (2, 2)}
    for family, (q, d) in grids.items():
        result = cost(family, q, d)
        assert result.weight_bytes == pytest.approx(weights[family]), family
        assert result.activation_bytes == pytest.approx(saved_input[family]), family
    # 3-D's transient buffers are the gathered operands and the partial output, 1/q^2 each.
    assert cost("3d", 2, 2).buffer_bytes == pytest.approx((T * K + K * N + T * N) / 4 * E)


def test_pipelined_rounds_hides_the_smaller_of_compute_and_communication():
    # q = 3, compute 5, broadcast 2, reduce 1: 2 + max(5, 2) + max(5, 2 + 1) + max(5, 1) + 1.
    assert pipelined_rounds(3, 5.0, 2.0, 1.0) == pytest.approx(2 + 5 + 5 + 5 + 1)
    # Communication-bound, q = 2: round 0 overlaps only the next broadcast, round 1 only the
    # previous reduce: 4 + max(1, 4) + max(1, 3) + 3.
    assert pipelined_rounds(2, 1.0, 4.0, 3.0) == pytest.approx(4 + 4 + 3 + 3)
    assert pipelined_rounds(1, 5.0, 0.0, 0.0) == pytest.approx(5.0)


def test_2d_times_inside_one_node():
    # q = 2 on ranks 0..3 of one node: every broadcast is intra-node, S/beta_i + log2(2) alpha_i.
    result = cost("2d", 2, nodes=1)
    per_round = 2 * (T / 2) * (K / 2) * (N / 2) / PEAK
    x_bcast = T * K / 4 * E / BETA_I + ALPHA_I
    w_bcast = K * N / 4 * E / BETA_I + ALPHA_I
    forward = (x_bcast + w_bcast) + max(per_round, x_bcast + w_bcast) + per_round
    # dX pass: prefetch W, drain the dX reduce (priced as a broadcast of an X block); dW pass
    # the other way round.
    dx_pass = w_bcast + max(per_round, w_bcast) + max(per_round, x_bcast) + x_bcast
    dw_pass = x_bcast + max(per_round, x_bcast) + max(per_round, w_bcast) + w_bcast
    assert result.forward_compute_s == pytest.approx(2 * per_round)
    assert result.forward_s == pytest.approx(forward)
    assert result.backward_s == pytest.approx(dx_pass + dw_pass)


def test_2d_columns_across_nodes_pay_the_inter_node_link():
    # Nodes of 2 devices: rows (ranks 0,1 and 2,3) stay inside a node, columns (0,2 and 1,3)
    # cross; two column groups share each node's 2-device network: beta_e * 2 / max(2, 1 * 2).
    result = cost("2d", 2, nodes=2, per_node=2)
    w_bcast = K * N / 4 * E / BETA_E + ALPHA_E
    x_bcast = T * K / 4 * E / BETA_I + ALPHA_I
    per_round = 2 * (T / 2) * (K / 2) * (N / 2) / PEAK
    assert result.forward_s == pytest.approx((x_bcast + w_bcast) + max(per_round, x_bcast + w_bcast) + per_round)
    by_group = {(t.phase, t.kind, t.group): t.seconds for t in result.transfers}
    assert by_group[("forward", "broadcast", "col")] == pytest.approx(w_bcast)
    assert by_group[("forward", "broadcast", "row")] == pytest.approx(x_bcast)


def test_2_5d_adds_the_depth_all_reduce_of_the_weight_gradients():
    # q = 2, d = 2 on two nodes of 4: depth pairs (r, r + 4) cross nodes, one member per node,
    # four groups on each 4-device node: beta_e. Ring all-reduce of n = 2: S/beta_e + 2 alpha_e
    # (cheaper than the tree, 2 S/beta_e + 2 alpha_e).
    result = cost("2.5d", 2, 2)
    per_round = 2 * (T / 4) * (K / 2) * (N / 2) / PEAK
    x_bcast = T * K / 8 * E / BETA_I + ALPHA_I
    w_bcast = K * N / 4 * E / BETA_I + ALPHA_I
    depth = K * N / 4 * E / BETA_E + 2 * ALPHA_E
    dx_pass = w_bcast + max(per_round, w_bcast) + max(per_round, x_bcast) + x_bcast
    dw_pass = x_bcast + max(per_round, x_bcast) + max(per_round, w_bcast) + w_bcast
    assert result.backward_s == pytest.approx(dx_pass + dw_pass + depth)
    assert result.forward_compute_s == pytest.approx(2 * T * K * N / 8 / PEAK)


def test_3d_times_gather_multiply_scatter():
    # q = 2 on two nodes of 4: row groups (stride 1) and col groups (stride 2) are intra-node,
    # depth groups (stride 4) cross nodes. Ring all-gather / reduce-scatter of n = 2:
    # S/(2 beta) + alpha.
    result = cost("3d", 2, 2)
    compute = 2 * (T / 2) * (K / 2) * (N / 2) / PEAK

    def intra(size):
        return size * E / 2 / BETA_I + ALPHA_I

    def inter(size):
        return size * E / 2 / BETA_E + ALPHA_E
    x, w, y = T * K / 4, K * N / 4, T * N / 4
    assert result.forward_s == pytest.approx(compute + intra(x) + intra(w) + inter(y))
    # Gather dY, X and W; dX's product, then dW's while dX is reduce-scattered; dW's scatter.
    assert result.backward_s == pytest.approx(inter(y) + intra(x) + intra(w) + compute + max(compute, intra(x))
                                              + intra(w))
    # Kept gathers: the backward gathers dY only, and the forward's X and W blocks stay.
    kept = cost("3d", 2, 2, keep_gathered=True)
    assert kept.forward_s == pytest.approx(result.forward_s)
    assert kept.backward_s == pytest.approx(inter(y) + compute + max(compute, intra(x)) + intra(w))
    assert kept.activation_bytes == pytest.approx((x + w) * E)
    assert result.activation_bytes == pytest.approx(x / 2 * E)
    assert kept.kept_bytes == pytest.approx((x + w - x / 2) * E) and result.kept_bytes == 0.0
    assert kept.bytes_per_device("backward") == pytest.approx(1 / 2 * (T * N + T * K + K * N) * E / 4)
    # The next matmul of a chain gathers its input over depth and scatters over rows.
    swapped = cost("3d", 2, 2, axes=ThreeDAxes().swapped())
    assert swapped.forward_s == pytest.approx(compute + inter(x) + intra(w) + intra(y))


def test_1d_times_all_reduce_y_in_forward_and_dx_beside_the_weight_gradient():
    # p = 4 inside one node: ring 2(3/4) S/beta_i + 6 alpha_i against tree 2 S/beta_i + 4 alpha_i.
    column = cost("1d_column", 4, nodes=1)
    size = T * K * E
    all_reduce = min(1.5 * size / BETA_I + 6 * ALPHA_I, 2 * size / BETA_I + 4 * ALPHA_I)
    compute = 2 * T * K * N / 4 / PEAK
    assert column.forward_s == pytest.approx(compute)
    # dX first, then dW while dX is all-reduced.
    assert column.backward_s == pytest.approx(compute + max(compute, all_reduce))
    assert all_reduce > compute  # this shape is communication-bound: the overlap is partial
    row = cost("1d_row", 4, nodes=1)
    out = T * N * E
    y_all_reduce = min(1.5 * out / BETA_I + 6 * ALPHA_I, 2 * out / BETA_I + 4 * ALPHA_I)
    assert row.forward_s == pytest.approx(compute + y_all_reduce)  # the next op needs Y whole
    assert row.backward_s == pytest.approx(2 * compute)


@pytest.mark.parametrize("make, message", [
    (lambda: Grid("2d", 2, 2), "has no depth"),
    (lambda: Grid("3d", 2, 1), "q x q x q"),
    (lambda: Grid("4d", 2), "family must be one of"),
    (lambda: MatmulShape(0, 1, 1, 1), "MatmulShape.batch"),
    (lambda: cost("2d", 2, nodes=1, per_node=4, precision="fp64"), "precision must be one of"),
    (lambda: matmul_cost(SHAPE, Grid("2d", 2), cluster(1), [0, 1, 2]), "needs 4 ranks"),
    (lambda: ThreeDAxes("row", "row", "depth"), "once each"),
    (lambda: cost("2d", 2, nodes=1, per_node=4, keep_gathered=True), "only 3-D matmuls keep"),
])
def test_bad_arguments_say_what_is_wrong(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_only_groups_on_the_same_node_share_its_network():
    # 2.5-D q = 2, d = 2 on four nodes of 2: depth pairs (r, r + 4) are {0,4}, {1,5} on nodes
    # 0 and 2 and {2,6}, {3,7} on nodes 1 and 3. Each node's 2-device network carries 2 of the
    # 4 pairs, one member each: beta_e * 2 / max(2, 1 * 2) = beta_e, not beta_e / 2.
    result = cost("2.5d", 2, 2, nodes=4, per_node=2)
    depth = next(t for t in result.transfers if t.group == "depth")
    assert depth.seconds == pytest.approx(K * N / 4 * E / BETA_E + 2 * ALPHA_E)


@pytest.mark.parametrize("family,q,d", [("1d", 64, 1), ("2d", 8, 1), ("2.5d", 4, 4), ("3d", 4, 4)])
def test_gpt_layer_bytes_of_the_benchmark_match_its_closed_forms(family, q, d):
    # benchmarks/summa_bytes.py sums the four matmuls of a GPT layer (3-D with alternating
    # roles) on the 64-GPU preset; its closed forms are derived in its docstring.
    from benchmarks.summa_bytes import closed_form_bytes, layer_cost
    on = Cluster.preset("dgx-a100-80g", nodes=8)
    hidden, tokens = 1024, 8192
    assert layer_cost(family, q, d, hidden, tokens, on)["bytes"] == pytest.approx(
        closed_form_bytes(family, q, d, hidden, tokens))


def test_candidate_grids_factor_the_devices():
    from cost_model.summa import candidate_grids
    as_tuples = lambda devices: sorted((g.family, g.q, g.d) for g in candidate_grids(devices))
    # 64 = 8 x 8 = 4 x 4 x 4 (2.5-D and 3-D); 2 x 2 x 16 has d > q.
    assert as_tuples(64) == [("2.5d", 4, 4), ("2d", 8, 1), ("3d", 4, 4)]
    assert as_tuples(8) == [("2.5d", 2, 2), ("3d", 2, 2)]
    assert as_tuples(32) == [("2.5d", 4, 2)]  # 2 x 2 x 8 has d > q
    assert as_tuples(4) == [("2d", 2, 1)]
    assert as_tuples(6) == [] and as_tuples(1) == []
    with pytest.raises(ValueError, match="positive integer"):
        candidate_grids(0)


def test_simulator_shares_a_node_network_only_between_groups_on_that_node():
    """The simulator's gradient all-reduce over a SUMMA grid's ``dep`` axis (2.5-D's weight
    gradients): on single-GPU nodes each node holds one rank of one of the 16 depth groups, so
    a group gets its devices' whole link: ring all-reduce of S over n = 4 ranks,
    2(n-1)/n S / beta_e + 2(n-1) alpha_e. On nodes of 4 devices (``dep`` stride 16, so the
    4 ranks of a node belong to 4 different depth groups) the 4 groups on a node share its
    4 links: still one link each. It used to divide the link by all 16 groups."""
    from planner.api import prepare_model
    from planner.model_spec import ModelSpec
    from planner.strategy import Mesh
    from search.plan_builder import unsimulated_plan
    from search.summa_layout import summa_layout
    from cost_model.simulator import Simulator

    config = {"n_layer": 1, "n_head": 4, "n_embd": 32, "vocab_size": 64, "seq_len": 8, "batch_size": 16}
    mesh = Mesh((("dep", 4), ("row", 4), ("col", 4)))
    size = 1e8
    for per_node in (1, 4):
        cluster = Cluster.preset("dgx-a100-80g", nodes=64 // per_node, devices_per_node=per_node)
        graph, spec, name, _ = prepare_model(ModelSpec("examples/gpt.py", config), cluster)
        strategies, inputs = summa_layout(graph, mesh, "2.5d")
        simulator = Simulator(unsimulated_plan(graph, cluster, spec, name, mesh, strategies, inputs, label="t"), graph)
        assert simulator.context.groups["dep"][1] == per_node
        beta, alpha = cluster.inter_link.bandwidth, cluster.inter_link.latency
        expected = 2 * 3 / 4 * size / beta + 2 * 3 * alpha
        assert simulator.context.collective("all_reduce", size, "dep") == pytest.approx(expected, rel=1e-9)


def test_simulator_prices_a_two_axis_reduce_scatter_on_the_whole_partial_tensor_first():
    """A [B, S, H] tensor partial over both axes of a row=8 x col=8 mesh on 64 single-GPU
    nodes, read split (Shard(0), Shard(2)): the first reduce-scatter (row) runs on the whole
    tensor X (every rank holds a full partial sum), the second (col) on the 1/8 it left:
    7/8 X / beta_e + 7/8 (X / 8) / beta_e plus latencies, not twice 7/8 (X / 8) / beta_e (each
    axis priced as if the other had already split the tensor)."""
    import torch
    from torch.distributed.tensor import Partial, Shard

    from cost_model.simulator import NodeCost, Simulator
    from planner.api import prepare_model
    from planner.model_spec import ModelSpec
    from planner.strategy import Mesh
    from search.plan_builder import unsimulated_plan
    from search.summa_layout import summa_layout

    config = {"n_layer": 1, "n_head": 4, "n_embd": 64, "vocab_size": 64, "seq_len": 8, "batch_size": 64}
    mesh = Mesh((("row", 8), ("col", 8)))
    cluster = Cluster.preset("dgx-a100-80g", nodes=64, devices_per_node=1)
    graph, spec, name, _ = prepare_model(ModelSpec("examples/gpt.py", config), cluster)
    strategies, inputs = summa_layout(graph, mesh, "2d")
    simulator = Simulator(unsimulated_plan(graph, cluster, spec, name, mesh, strategies, inputs, label="t"), graph)
    meta = next(m for node in graph.nodes for m in node.input_meta
                if m is not None and tuple(m.shape) == (64, 8, 64) and m.dtype.is_floating_point)
    cost = NodeCost()
    simulator.node_costs.charge_edge(cost, meta, (Partial(), Partial()), (Shard(0), Shard(2)))
    whole = meta.nbytes * simulator.context.activation_scale
    first = simulator.context.collective("reduce_scatter", whole, "row")
    second = simulator.context.collective("reduce_scatter", whole / 8, "col")
    assert cost.forward_comm_s == pytest.approx(first + second, rel=1e-9)
    # At least the bandwidth term of the first, whole-tensor ring reduce-scatter.
    assert cost.forward_comm_s >= 7 / 8 * whole / cluster.inter_link.bandwidth
