"""Hand-worked bytes and times of one expert-parallel dispatch across nodes
(``cost_model.all_to_all``): flat, Tutel's two-level, DeepEP's deduplicated, and the
deduplicated one under DeepSeek-V3's node-limited routing.

The case: 2 H800 nodes of 4 GPUs (``hgx-h800``: NVLink 200e9 B/s a direction, 3 us a hop;
InfiniBand 50e9 B/s per GPU, 8 us), an 8-way expert-parallel group, 8 experts round-robin
(expert e on device e, so node 0 holds experts 0-3 and node 1 experts 4-7), top-2 routing.
Each device holds T = 1000 tokens of hidden 1024 in bf16: a row is 2048 bytes, it sends
C = 2000 copies, S = 4,096,000 bytes.
"""

from __future__ import annotations

import pytest

from cost_model.all_to_all import RoutingGroups, dispatch_traffic, node_fanout
from cost_model.collectives import group_shape
from planner.cluster import Cluster
from planner.strategy import ExpertPlacement

CLUSTER = Cluster.preset("hgx-h800", nodes=2, devices_per_node=4)
RANKS = list(range(8))
SHAPE = group_shape(CLUSTER, RANKS)
ROW, TOKENS, COPIES = 1024 * 2, 1000, 2000
S = COPIES * ROW


def test_fanout_of_uniform_top2_over_two_nodes():
    # A node holding 4 of the 8 experts is missed when both picks fall on the other 4:
    # C(4,2)/C(8,2) = 6/28, so reached with 22/28 = 11/14. Two nodes: 22/14 reached in all,
    # the token's own node among them, so 11/14 remote.
    fanout = node_fanout(ExpertPlacement.round_robin(8, 8), CLUSTER, RANKS, top_k=2)
    assert fanout.nodes == 2
    assert fanout.reached == pytest.approx(22 / 14)
    assert fanout.remote == pytest.approx(11 / 14)


def test_node_limited_routing_bounds_the_nodes_only_when_groups_lie_on_nodes():
    # Groups {0-3} and {4-7}, one per token: the token's group is node 0's with chance 1/2,
    # and then both its experts are there. Each node is reached with 1/2; 1/2 remote.
    limited = node_fanout(ExpertPlacement.round_robin(8, 8), CLUSTER, RANKS, top_k=2, groups=RoutingGroups(2, 1))
    assert (limited.reached, limited.remote) == (pytest.approx(1.0), pytest.approx(0.5))
    # Node 0 holding experts {0, 1, 4, 5} instead: each group has 2 experts on each node, the
    # two picks among the group's 4 miss node 0 with C(2,2)/C(4,2) = 1/6, so 5/6 remote:
    # more than unlimited routing's 11/14, since the limit now concentrates picks on 4 experts.
    scattered = ExpertPlacement(8, tuple(((device, 1.0),) for device in (0, 1, 4, 5, 2, 3, 6, 7)))
    spread = node_fanout(scattered, CLUSTER, RANKS, top_k=2, groups=RoutingGroups(2, 1))
    assert spread.remote == pytest.approx(5 / 6)


def test_deepseek_v3_node_limit_on_eight_nodes():
    # 256 experts in 8 groups of 32, 4 groups per token, top-8, EP64 over 8 nodes with one
    # group per node (32 experts on each node's 8 GPUs). A chosen group's node is missed
    # when all 8 picks fall in the other 3 chosen groups (96 of 128 eligible experts):
    # C(96,8)/C(128,8); a node is chosen with 4/8. Unlimited: missed with C(224,8)/C(256,8).
    from math import comb
    cluster = Cluster.preset("hgx-h800", nodes=8)
    ranks = list(range(64))
    contiguous = ExpertPlacement(64, tuple(((e // 4, 1.0),) for e in range(256)))
    limited = node_fanout(contiguous, cluster, ranks, top_k=8, groups=RoutingGroups(8, 4))
    per_node = 0.5 * (1 - comb(96, 8) / comb(128, 8))
    assert limited.reached == pytest.approx(8 * per_node)
    assert limited.remote == pytest.approx(7 * per_node)
    assert limited.reached <= 4
    free = node_fanout(contiguous, cluster, ranks, top_k=8)
    assert free.remote == pytest.approx(7 * (1 - comb(224, 8) / comb(256, 8)))
    assert (round(free.remote, 2), round(limited.remote, 2)) == (4.63, 3.18)  # the limit saves 31% of IB bytes


# Flat: (n - m)/n = 4/8 of S crosses InfiniBand, (p - 1)/n = 3/8 stays on NVLink, the links
# overlap. IB: 2,048,000 / 50e9 + 4 x 8 us = 72.96 us; NVLink: 1,536,000 / 200e9 + 3 x 3 us =
# 16.68 us. Two-level: phase 1 inside the node moves 3/4 of S = 3,072,000 B over NVLink,
# 15.36 + 9 = 24.36 us; phase 2 across nodes 1/2 of S = 2,048,000 B over IB in one message,
# 40.96 + 8 = 48.96 us; one after the other: 73.32 us (as many IB bytes as flat).
@pytest.mark.parametrize("algorithm, network_bytes, nvlink_bytes, network_s, nvlink_s, time_s", [
    ("flat", 2_048_000, 1_536_000, 72.96e-6, 16.68e-6, 72.96e-6),
    ("hierarchical", 2_048_000, 3_072_000, 48.96e-6, 24.36e-6, 73.32e-6),
])
def test_flat_and_two_level_dispatch(algorithm, network_bytes, nvlink_bytes, network_s, nvlink_s, time_s):
    traffic = dispatch_traffic(algorithm, COPIES, TOKENS, ROW, SHAPE)
    assert (traffic.network_bytes, traffic.nvlink_bytes) == (pytest.approx(network_bytes), pytest.approx(nvlink_bytes))
    assert (traffic.network_s, traffic.nvlink_s) == (pytest.approx(network_s), pytest.approx(nvlink_s))
    assert traffic.time_s == pytest.approx(time_s)


def test_deduplicated_dispatch_crosses_ib_once_per_node():
    # Unlimited routing: T x 11/14 rows cross IB = 1,609,142.86 B: 32.18 + 8 = 40.18 us; the
    # NVLink leg forwards 3/4 of the copies: 24.36 us; overlapped: 40.18 us, against flat's 72.96.
    fanout = node_fanout(ExpertPlacement.round_robin(8, 8), CLUSTER, RANKS, top_k=2)
    dedup = dispatch_traffic("deduplicated", COPIES, TOKENS, ROW, SHAPE, fanout)
    assert dedup.network_bytes == pytest.approx(1000 * 11 / 14 * 2048)
    assert dedup.network_s == pytest.approx(1000 * 11 / 14 * 2048 / 50e9 + 8e-6)
    assert dedup.nvlink_s == pytest.approx(24.36e-6)
    assert dedup.time_s == pytest.approx(40.1829e-6, rel=1e-5)
    # Node-limited (one group per token, groups on nodes): T x 1/2 rows, 1,024,000 B: 28.48 us.
    limited = node_fanout(ExpertPlacement.round_robin(8, 8), CLUSTER, RANKS, top_k=2, groups=RoutingGroups(2, 1))
    capped = dispatch_traffic("deduplicated", COPIES, TOKENS, ROW, SHAPE, limited)
    assert capped.network_bytes == pytest.approx(1_024_000)
    assert capped.time_s == pytest.approx(28.48e-6)


def test_one_node_sends_nothing_over_the_network():
    shape = group_shape(CLUSTER, [0, 1, 2, 3])
    for algorithm in ("flat", "hierarchical", "deduplicated"):
        # 3/4 of S over NVLink in one pairwise all-to-all: 3,072,000 / 200e9 + 3 x 3 us.
        traffic = dispatch_traffic(algorithm, COPIES, TOKENS, ROW, shape)
        assert traffic.network_bytes == 0
        assert traffic.time_s == pytest.approx(24.36e-6)


def test_bad_inputs_are_one_line():
    with pytest.raises(ValueError, match="dispatch algorithm must be one of"):
        dispatch_traffic("ring", COPIES, TOKENS, ROW, SHAPE)
    with pytest.raises(ValueError, match="needs the tokens' node fan-out"):
        dispatch_traffic("deduplicated", COPIES, TOKENS, ROW, SHAPE)
    with pytest.raises(ValueError, match="do not divide 8 experts"):
        node_fanout(ExpertPlacement.round_robin(8, 8), CLUSTER, RANKS, 2, RoutingGroups(3, 1))
    with pytest.raises(ValueError, match="too few"):
        node_fanout(ExpertPlacement.round_robin(8, 8), CLUSTER, RANKS, 6, RoutingGroups(2, 1))
    with pytest.raises(ValueError, match="groups per token"):
        RoutingGroups(2, 3)


def test_a_layers_all_to_all_is_priced_by_its_algorithm():
    """``moe_layer_cost`` of the case above as a layer: 8,000 tokens over 8 devices, top-2 of 8
    experts round-robin, capacity factor 1 (so no chance excess: every expert computes and
    receives its even share): each device sends and receives 2,000 copies, S bytes. Forward runs
    a dispatch and a combine: twice one dispatch. On this NCCL cluster the layer's all-to-alls
    exchange with every peer at once (``peers_in_flight``: 256), so each leg pays one latency,
    not one per peer as in the cases above: flat IB 40.96 + 8 = 48.96 us (NVLink 7.68 + 3 us);
    two-level 15.36 + 3 then 40.96 + 8 = 67.32 us; deduplicated 40.18 us and 28.48 us with one
    of two groups per token (one remote node: one latency either way)."""
    from cost_model.moe import MoELayer, moe_layer_cost
    layer = MoELayer(tokens=8000, hidden=1024, ffn=512, experts=8, top_k=2)

    def forward_comm(algorithm, groups=()):
        return moe_layer_cost(layer, "expert_parallel", CLUSTER, RANKS, algorithm=algorithm, capacity_factor=1.0,
                              routing_groups=groups).forward_comm_s

    assert forward_comm("flat") == pytest.approx(2 * 48.96e-6)
    assert forward_comm("hierarchical") == pytest.approx(2 * 67.32e-6)
    assert forward_comm("deduplicated") == pytest.approx(2 * 40.1829e-6, rel=1e-5)
    assert forward_comm("deduplicated", (2, 1)) == pytest.approx(2 * 28.48e-6)
    assert forward_comm("flat", (2, 1)) == pytest.approx(2 * 48.96e-6)  # no merging: the limit saves nothing
    # Bytes a device sends a step (4 dispatches): IB 1,024,000 + NVLink 3,072,000 each.
    cost = moe_layer_cost(layer, "expert_parallel", CLUSTER, RANKS, algorithm="deduplicated", capacity_factor=1.0,
                          routing_groups=(2, 1))
    assert cost.sent_bytes == pytest.approx(4 * (1_024_000 + 3_072_000))
