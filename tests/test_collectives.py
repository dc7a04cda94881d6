"""Collective costs of the α–β model (cost_model.collectives) against numbers worked out by hand.

Links used (planner/presets.py): dgx-a100-80g intra 300e9 B/s, 3e-6 s; inter 25e9 B/s per
device, 8e-6 s; 8 GPUs per node. dgx-h100 intra 450e9 B/s, 3e-6 s.

The presets themselves are priced from NCCL measurements (cost_model.nccl, tests/test_nccl.py);
the α–β model prices every other cluster, so these tests use ``alpha_beta(preset)``: the
preset's hardware under another name, as a cluster file describing it would be.
"""

from __future__ import annotations

import dataclasses

import pytest

from cost_model.collectives import (COLLECTIVES, GroupShape, algorithm_times, all_gather_time,
                                    collective_time, group_link, group_shape, member_bandwidth,
                                    ring_all_reduce_time)
from planner.cluster import Cluster, LinkSpec, NodeSpec
from planner.errors import ClusterError

GIB = 2**30  # bytes
A100_INTRA = LinkSpec(300e9, 3e-6)
A100_INTER = LinkSpec(25e9, 8e-6)


def alpha_beta(name: str, nodes: int = 1, devices_per_node: int | None = None) -> Cluster:
    """The preset's hardware described from scratch (not derived from the preset, so without
    its NCCL measurements): priced by the α–β model."""
    return dataclasses.replace(Cluster.preset(name, nodes, devices_per_node), name=f"{name}-file", derived_from=None)


@pytest.fixture
def dgx() -> Cluster:
    return alpha_beta("dgx-a100-80g")


@pytest.fixture
def dgx2() -> Cluster:
    return alpha_beta("dgx-a100-80g", nodes=2)


def mixed() -> Cluster:
    """Node 0: 8 A100 on NVLink (300e9, 3e-6); node 1: 4 A100 on a slower (100e9, 5e-6) link."""
    device = Cluster.preset("dgx-a100-80g").nodes[0].device
    return Cluster(name="mixed", backend="nccl", inter_link=A100_INTER,
                   nodes=(NodeSpec(device, 8, A100_INTRA),
                          NodeSpec(device, 4, LinkSpec(100e9, 5e-6))))


# ---- group shapes ----

def test_group_shape_one_node_and_two_nodes(dgx2):
    assert group_shape(dgx2, range(8)) == GroupShape(size=8, nodes=1, per_node=8,
                                                     intra=A100_INTRA, inter=None, node_devices=8)
    shape = group_shape(dgx2, [9, 0, 8, 1])  # order does not matter
    assert (shape.size, shape.nodes, shape.per_node, shape.inter, shape.is_even) == \
        (4, 2, 2, A100_INTER, True)
    uneven = group_shape(dgx2, [*range(8), 8])
    assert (uneven.nodes, uneven.per_node, uneven.is_even) == (2, 8, False)


def test_group_shape_rejects_bad_groups(dgx2):
    with pytest.raises(ValueError, match="empty"):
        group_shape(dgx2, [])
    with pytest.raises(ValueError, match=r"repeat \[3\]"):
        group_shape(dgx2, [3, 4, 3])
    with pytest.raises(ClusterError, match="outside"):
        group_shape(dgx2, [0, 16])
    with pytest.raises(ValueError, match="inter must be None"):
        GroupShape(size=2, nodes=1, per_node=2, intra=A100_INTRA, inter=A100_INTER,
                   node_devices=8)


# ---- inside one node ----

def test_ring_all_reduce_intra_node_dgx_a100_1gib(dgx):
    times = algorithm_times("all_reduce", GIB, group_shape(dgx, range(8)))
    # ring: 2·7/8 · 2^30 / 300e9 + 2·7 · 3e-6 = 6.2634940e-3 + 42e-6 = 6.3054940e-3 s
    assert times["ring"] == pytest.approx(2 * 7 / 8 * GIB / 300e9 + 14 * 3e-6)
    assert times["ring"] == pytest.approx(6.305494e-3)
    # tree: 2 · 2^30 / 300e9 + 2·⌈log2 8⌉ · 3e-6 = 7.1582788e-3 + 18e-6 = 7.1762788e-3 s
    assert times["tree"] == pytest.approx(7.1762788e-3)
    assert collective_time("all_reduce", GIB, dgx, range(8)) == pytest.approx(times["ring"])
    # The old single-link ring helper agrees inside a node.
    assert times["ring"] == pytest.approx(ring_all_reduce_time(GIB, 8, group_link(dgx, [*range(8)])))


def test_tree_wins_small_messages_at_large_n_ring_wins_large():
    big = alpha_beta("dgx-a100-80g", devices_per_node=32)  # a hypothetical 32-GPU NVLink node
    ranks = range(32)
    small = algorithm_times("all_reduce", 1024, group_shape(big, ranks))
    # ring: 2·31/32 · 1024 / 3e11 + 62 · 3e-6 = 6.6e-9 + 186e-6 = 1.8600661e-4 s
    # tree: 2 · 1024 / 3e11 + 2·⌈log2 32⌉ · 3e-6 = 6.8e-9 + 30e-6 = 3.0006827e-5 s
    assert small["ring"] == pytest.approx(1.8600661e-4)
    assert small["tree"] == pytest.approx(3.0006827e-5)
    assert collective_time("all_reduce", 1024, big, ranks) == pytest.approx(small["tree"])
    large = algorithm_times("all_reduce", GIB, group_shape(big, ranks))
    # ring: 2·31/32 · 2^30 / 3e11 + 186e-6 = 7.1205826e-3 s
    # tree: 2 · 2^30 / 3e11 + 30e-6 = 7.1882788e-3 s
    assert large["ring"] == pytest.approx(7.1205826e-3)
    assert large["tree"] == pytest.approx(7.1882788e-3)
    assert collective_time("all_reduce", GIB, big, ranks) == pytest.approx(large["ring"])


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_all_gather_reduce_scatter_intra_node(kind):
    h100 = alpha_beta("dgx-h100")
    size = 2**28  # 256 MiB, the full tensor
    # 7/8 · 2^28 / 450e9 + 7 · 3e-6 = 5.2195783e-4 + 21e-6 = 5.4295783e-4 s
    assert collective_time(kind, size, h100, range(8)) == pytest.approx(5.4295783e-4)
    assert collective_time(kind, size, h100, range(8)) == \
        pytest.approx(all_gather_time(size, 8, LinkSpec(450e9, 3e-6)))


def test_broadcast(dgx, dgx2):
    # one node: 1e8 / 3e11 + ⌈log2 8⌉ · 3e-6 = 3.3333e-4 + 9e-6 = 3.4233333e-4 s
    assert collective_time("broadcast", 1e8, dgx, range(8)) == pytest.approx(3.4233333e-4)
    # two nodes, 16 ranks: 1e8 / min(3e11, 25e9) + ⌈log2 2⌉ · 8e-6 + ⌈log2 8⌉ · 3e-6
    #   = 4e-3 + 8e-6 + 9e-6 = 4.017e-3 s
    assert collective_time("broadcast", 1e8, dgx2, range(16)) == pytest.approx(4.017e-3)


def test_all_to_all_intra_node(dgx):
    size = 2**26  # 64 MiB sent by each rank, 8 MiB to each of the 8 ranks
    # One peer at a time: 7/8 · 2^26 / 3e11 + 7 · 3e-6 = 1.9573419e-4 + 21e-6 = 2.1673419e-4 s
    assert algorithm_times("all_to_all", size, group_shape(dgx, range(8)))["pairwise"] == \
        pytest.approx(2.1673419e-4)
    # As NCCL runs it (the 7 peers in one round, peers_in_flight = 256): 1.9573419e-4 + 3e-6
    assert collective_time("all_to_all", size, dgx, range(8)) == pytest.approx(1.9873419e-4)


def test_send_recv_intra_vs_inter(dgx2):
    # same node: 1e9 / 3e11 + 3e-6 = 3.3363333e-3 s
    assert collective_time("send_recv", 1e9, dgx2, [0, 1]) == pytest.approx(1e9 / 3e11 + 3e-6)
    # across nodes: 1e9 / 25e9 + 8e-6 = 0.040008 s
    assert collective_time("send_recv", 1e9, dgx2, [0, 8]) == pytest.approx(0.040008)
    # 16 concurrent pairs, one member per node each, on 8-NIC nodes: 25e9 · 8 / 16 = 12.5e9 B/s
    #   -> 1e9 / 12.5e9 + 8e-6 = 0.080008 s
    assert collective_time("send_recv", 1e9, dgx2, [0, 8], concurrent_groups=16) == \
        pytest.approx(0.080008)
    assert collective_time("send_recv", 1e9, dgx2, [5, 5]) == 0.0


# ---- across nodes ----

def test_hierarchical_all_reduce_two_dgx_nodes(dgx2):
    times = algorithm_times("all_reduce", GIB, group_shape(dgx2, range(16)))
    # n = 16, k = 2 nodes, p = 8 per node, β_m = 25e9 · 8 / max(8, 8·1) = 25e9
    # phase 1, intra reduce-scatter over 8: 7/8 · 2^30 / 300e9 + 7 · 3e-6 = 3.1527470e-3 s
    reduce_scatter = 7 / 8 * GIB / 300e9 + 7 * 3e-6
    # phase 2, inter all-reduce of 2^30/8 over 2 nodes, ring: 2·1/2 · 2^27 / 25e9 + 2 · 8e-6
    #   = 5.3687091e-3 + 16e-6 = 5.3847091e-3 s  (tree: 2 · 2^27 / 25e9 + 2·1·8e-6, slower)
    inter = 2 * 1 / 2 * (GIB / 8) / 25e9 + 2 * 8e-6
    # phase 3, intra all-gather: same as phase 1
    assert times["hierarchical"] == pytest.approx(reduce_scatter + inter + reduce_scatter)
    assert times["hierarchical"] == pytest.approx(0.011690203)
    # flat ring bound by the NIC: 2·15/16 · 2^30 / 25e9 + 30 · max(3e-6, 8e-6) = 0.0807706 s
    assert times["ring"] == pytest.approx(0.0807706368)
    # tree: 2 · 2^30 / 25e9 + 2 · (⌈log2 2⌉ · 8e-6 + ⌈log2 8⌉ · 3e-6) = 0.0859333 s
    assert times["tree"] == pytest.approx(0.08593334592)
    assert times["hierarchical"] < times["ring"]
    assert collective_time("all_reduce", GIB, dgx2, range(16)) == \
        pytest.approx(times["hierarchical"])


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_all_gather_reduce_scatter_across_two_nodes(dgx2, kind):
    times = algorithm_times(kind, GIB, group_shape(dgx2, range(16)))
    # flat ring: 15/16 · 2^30 / 25e9 + 15 · 8e-6 = 0.040385318 s
    assert times["ring"] == pytest.approx(0.0403853184)
    # two-level: inter over 2 nodes of 2^30/8: 1/2 · 2^27 / 25e9 + 8e-6 = 2.6923546e-3 s
    #          + intra over 8 of 2^30: 7/8 · 2^30 / 3e11 + 21e-6     = 3.1527470e-3 s
    assert times["hierarchical"] == pytest.approx(
        1 / 2 * (GIB / 8) / 25e9 + 8e-6 + 7 / 8 * GIB / 3e11 + 7 * 3e-6)
    assert times["hierarchical"] == pytest.approx(5.8451015e-3)
    assert collective_time(kind, GIB, dgx2, range(16)) == pytest.approx(times["hierarchical"])


def test_all_to_all_across_two_nodes(dgx2):
    shape = group_shape(dgx2, range(16))
    large = algorithm_times("all_to_all", GIB, shape)
    # pairwise: max(intra 7/16 · 2^30 / 3e11 + 7 · 3e-6, inter 1/2 · 2^30 / 25e9 + 8 · 8e-6)
    #         = max(1.5868735e-3, 0.021538836) = 0.021538836 s (half the data crosses nodes)
    assert large["pairwise"] == pytest.approx(0.02153883648)
    # hierarchical: 7/8 · 2^30 / 3e11 + 7 · 3e-6 + 1/2 · 2^30 / 25e9 + 1 · 8e-6 = 0.024635583 s
    assert large["hierarchical"] == pytest.approx(0.0246355835)
    # As NCCL runs it, every peer at once (peers_in_flight = 256): one 8 us latency, not 8:
    # 1/2 · 2^30 / 25e9 + 8e-6 = 0.021482836 s
    assert collective_time("all_to_all", GIB, dgx2, range(16)) == pytest.approx(0.02148283648)
    # Small messages, one peer at a time: the hierarchical exchange sends 1 inter-node message
    # instead of 8.
    small = algorithm_times("all_to_all", 16384, shape)
    # pairwise inter: 1/2 · 16384 / 25e9 + 64e-6 = 6.432768e-5 s
    # hierarchical:   7/8 · 16384 / 3e11 + 21e-6 + 1/2 · 16384 / 25e9 + 8e-6 = 2.9375467e-5 s
    assert small["pairwise"] == pytest.approx(6.432768e-5)
    assert small["hierarchical"] == pytest.approx(2.9375467e-5)
    # With NCCL's peers overlapping, the flat exchange pays one latency too and wins:
    # pairwise 1/2 · 16384 / 25e9 + 8e-6 = 8.32768e-6 s; hierarchical 7/8 · 16384 / 3e11 + 3e-6
    # + 3.2768e-7 + 8e-6 = 1.1375467e-5 s.
    assert collective_time("all_to_all", 16384, dgx2, range(16)) == pytest.approx(8.32768e-6)


def test_uneven_group_has_no_two_level_algorithm(dgx2):
    # 8 ranks on node 0, 1 on node 1: rank 8 alone sends 8/9 of its data across nodes.
    times = algorithm_times("all_to_all", 9e6, group_shape(dgx2, [*range(8), 8]))
    assert set(times) == {"pairwise"}
    # inter: (9 − 1)/9 · 9e6 / 25e9 + 8 · 8e-6 = 3.2e-4 + 64e-6 = 3.84e-4 s
    # intra: (8 − 1)/9 · 9e6 / 3e11 + 7 · 3e-6 = 2.333e-5 + 21e-6 = 4.433e-5 s
    assert times["pairwise"] == pytest.approx(3.84e-4)
    assert set(algorithm_times("all_reduce", 9e6, group_shape(dgx2, [*range(8), 8]))) == \
        {"ring", "tree"}


def test_concurrent_groups_share_the_nic():
    cluster = alpha_beta("dgx-a100-80g", nodes=4)
    ranks = [0, 8, 16, 24]  # one data-parallel group of a tp=8 x dp=4 mesh: 1 member per node
    shape = group_shape(cluster, ranks)
    # 25e9 · 8 / max(8, 1 · c): c = 1 or 8 -> 25e9 (the NIC is not oversubscribed); c = 16 -> half
    assert member_bandwidth(shape, 1) == pytest.approx(25e9)
    assert member_bandwidth(shape, 8) == pytest.approx(25e9)
    assert member_bandwidth(shape, 16) == pytest.approx(12.5e9)
    alone = collective_time("all_reduce", GIB, cluster, ranks)
    # ring over 4 ranks, no intra hop: 2·3/4 · 2^30 / 25e9 + 6 · 8e-6 = 0.064472509 s
    assert alone == pytest.approx(0.06447250944)
    assert collective_time("all_reduce", GIB, cluster, ranks, concurrent_groups=8) == \
        pytest.approx(alone)
    # c = 16: 2·3/4 · 2^30 / 12.5e9 + 6 · 8e-6 = 0.128897019 s
    assert collective_time("all_reduce", GIB, cluster, ranks, concurrent_groups=16) == \
        pytest.approx(0.12889701888)
    # Two members per node and 8 groups: 16 members on 8 NICs -> 12.5e9 each.
    assert member_bandwidth(group_shape(cluster, [0, 1, 8, 9]), 8) == pytest.approx(12.5e9)


def test_heterogeneous_cluster_uses_the_slower_intra_link():
    cluster = mixed()
    # A group inside node 1 uses node 1's link: 3/4 · 2^30 / 100e9 + 3 · 5e-6 = 8.0680638e-3 s
    assert collective_time("all_gather", GIB, cluster, [8, 9, 10, 11]) == \
        pytest.approx(3 / 4 * GIB / 100e9 + 3 * 5e-6)
    # A group over both nodes takes the slower intra link and the smaller node's NIC count.
    shape = group_shape(cluster, [0, 1, 2, 3, 8, 9, 10, 11])
    assert (shape.intra, shape.node_devices, shape.per_node) == (LinkSpec(100e9, 5e-6), 4, 4)
    times = algorithm_times("all_gather", GIB, shape)
    # two-level: 1/2 · (2^30/4) / 25e9 + 8e-6 + 3/4 · 2^30 / 100e9 + 3 · 5e-6
    #          = 5.3687091e-3 + 8e-6 + 8.0530637e-3 + 15e-6 = 0.013444773 s
    assert times["hierarchical"] == pytest.approx(
        1 / 2 * (GIB / 4) / 25e9 + 8e-6 + 3 / 4 * GIB / 100e9 + 3 * 5e-6)
    assert times["hierarchical"] == pytest.approx(0.0134447728)
    # Two such groups at once put 8 members on node 1's 4 NICs: 25e9 · 4 / 8 = 12.5e9 B/s.
    assert member_bandwidth(shape, 2) == pytest.approx(12.5e9)


# ---- degenerate cases and errors ----

@pytest.mark.parametrize("kind", COLLECTIVES)
def test_zero_bytes_and_single_rank_cost_nothing(dgx2, kind):
    ranks = [0, 8] if kind == "send_recv" else range(16)
    assert collective_time(kind, 0, dgx2, ranks) == 0.0
    if kind != "send_recv":
        assert collective_time(kind, GIB, dgx2, [3]) == 0.0
    assert collective_time(kind, GIB, dgx2, ranks) > 0.0


def test_bad_arguments(dgx2):
    with pytest.raises(ValueError, match="all_reduce, all_gather, reduce_scatter, all_to_all, "
                                         "broadcast, send_recv"):
        collective_time("allreduce", 1.0, dgx2, range(16))
    with pytest.raises(ValueError, match=r"\[src, dst\]"):
        collective_time("send_recv", 1.0, dgx2, [0, 1, 2])
    with pytest.raises(ValueError, match="size_bytes"):
        collective_time("all_reduce", -1.0, dgx2, range(16))
    with pytest.raises(ValueError, match="concurrent_groups"):
        collective_time("all_reduce", 1.0, dgx2, range(16), concurrent_groups=0)
    with pytest.raises(ValueError, match="one node"):
        member_bandwidth(group_shape(dgx2, range(8)))
