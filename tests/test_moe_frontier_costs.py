"""The costs that decide DeepSeek-V3's plan on 256 H100s (1,024 sequences of 4,096), worked by
hand: the expert-parallel all-to-all a device moves per step, DeepEP's published internode
bandwidth against the deduplicated dispatch's price, and FSDP's gather of the dense weights
across 32 nodes.

DeepSeek-V3 (HF config): hidden 7168, 256 routed experts of ffn 2048, top-8, 8 groups of which
each token picks 4 (node-limited routing), 58 MoE layers. A step has 1024 x 4096 = 4,194,304
tokens: 16,384 per device at dp = 256. A bf16 row is 7168 x 2 = 14,336 bytes.
"""

from __future__ import annotations

import pytest

from cost_model.all_to_all import RoutingGroups, dispatch_traffic, node_fanout
from cost_model.collectives import collective_time, group_shape, peers_in_flight
from cost_model.moe import MoELayer, moe_layer_cost
from planner.cluster import Cluster
from planner.strategy import ExpertPlacement

HIDDEN, FFN, EXPERTS, TOP_K, ROW = 7168, 2048, 256, 8, 7168 * 2
TOKENS_PER_DEVICE = 1024 * 4096 // 256  # 16,384


def test_ep256_moves_7_5_gb_per_layer_per_device_and_takes_73_ms_a_direction():
    # EP256 over 32 DGX-H100 nodes, one expert per device, capacity factor 1 (every device
    # receives exactly its share, no chance excess). One dispatch: each device sends its
    # 16,384 x 8 = 131,072 copies, S = 131,072 x 14,336 = 1,879,048,192 B; 255/256 of it leaves
    # the device. Four all-to-alls a layer (dispatch and combine, forward and backward):
    # 4 x S x 255/256 = 7,486,832,640 B, x 58 layers = 434 GB per device per step.
    cluster = Cluster.preset("dgx-h100", 32)
    layer = MoELayer(tokens=TOKENS_PER_DEVICE * 256, hidden=HIDDEN, ffn=FFN, experts=EXPERTS, top_k=TOP_K)
    cost = moe_layer_cost(layer, "expert_parallel", cluster, list(range(256)), capacity_factor=1.0)
    size = TOKENS_PER_DEVICE * TOP_K * ROW
    assert size == 1_879_048_192
    assert cost.sent_bytes == pytest.approx(4 * size * 255 / 256)
    # Flat: the copies bound for the 31 other nodes, 248/256 of S, cross the device's own
    # 50e9 B/s InfiniBand NIC (DGX H100: one 400 Gb/s ConnectX-7 per GPU): 36.41 ms, plus one
    # 8 us latency: NCCL progresses 256 peers at once (cost_model.collectives.NCCL_PEERS_IN_FLIGHT),
    # so the 248 remote peers are one round, not 248 x 8 us = 1.98 ms in turn: 36.42 ms a
    # dispatch; forward = dispatch + combine.
    one = size * 248 / 256 / 50e9 + 8e-6
    assert cost.forward_comm_s == pytest.approx(2 * one) == pytest.approx(72.83e-3, rel=1e-4)
    # The whole step's all-to-all if nothing hides it: 58 layers x 4 x 36.42 ms = 8.45 s,
    # more than the experts' own compute on the device: the expert FLOPs of 131,072 copies
    # (2 x 3 x 7168 x 2048 each) are 1.154e13 a forward, 34.99e12 forward and backward, 35.4 ms
    # at the H100's 989.4e12 bf16 peak: 58 x 35.4 ms = 2.05 s at best.
    step_all_to_all = 58 * 4 * one
    assert step_all_to_all == pytest.approx(8.448, rel=1e-3)
    assert cost.forward_compute_s + cost.backward_compute_s > 3 * 131_072 * 2 * 3 * HIDDEN * FFN / 989.4e12


def test_deepseek_ep64_dispatch_runs_at_deepeps_measured_internode_bandwidth():
    # DeepSeek-V3's own setting on its own cluster: EP64 over 8 H800 nodes, one routing group
    # (32 experts) per node, each token to at most 4 nodes. DeepEP's README measures its normal
    # internode kernels at EP64 with 4,096 tokens, hidden 7168, top-4 groups, top-8: dispatch
    # 51 GB/s, combine 50 GB/s RDMA bottleneck bandwidth (deepseek-ai/DeepEP README,
    # "Normal kernels with NVLink and RDMA forwarding"). Priced here: each token crosses IB
    # once per remote node it reaches (3.175 on average, tests/test_all_to_all.py):
    # 4096 x 3.1754 x 14,336 = 186.46 MB at 50e9 B/s + 8 us (the 7 remote nodes' latencies
    # overlap: one round of NCCL_PEERS_IN_FLIGHT) = 3.737 ms; the NVLink leg
    # forwards 7/8 of the 32,768 copies, 411 MB at 200e9 B/s = 2.08 ms, hidden under it.
    cluster = Cluster.preset("hgx-h800", nodes=8)
    ranks = list(range(64))
    one_group_per_node = ExpertPlacement(64, tuple(((e // 4, 1.0),) for e in range(EXPERTS)))
    fanout = node_fanout(one_group_per_node, cluster, ranks, TOP_K, RoutingGroups(8, 4))
    traffic = dispatch_traffic("deduplicated", 4096 * TOP_K, 4096, ROW, group_shape(cluster, ranks), fanout,
                               in_flight=peers_in_flight(cluster))
    assert traffic.network_bytes == pytest.approx(4096 * 3.17538 * ROW, rel=1e-5)
    assert traffic.time_s == pytest.approx(traffic.network_bytes / 50e9 + 8e-6)
    assert traffic.nvlink_s < traffic.network_s
    # The bandwidth the price implies, RDMA bytes over time: 49.9 GB/s, within 4% of DeepEP's 50-51.
    implied = traffic.network_bytes / traffic.time_s
    assert implied == pytest.approx(49.89e9, rel=1e-3)
    assert 0.96 * 51e9 < implied < 1.04 * 50e9


def test_fsdp_gathers_dense_weights_over_eight_nics_per_node():
    # All-gathering 34 GB (17B dense weights in bf16) over dp = 256 ranks on 32 nodes: NCCL's
    # ring runs one ring per NIC, so a node's 8 NICs carry the inter-node traffic together:
    # bus bandwidth min(NVLink ring 370e9, 8 x 47e9 NIC busbw = 376e9) = 370e9 B/s
    # (planner/presets.py, cost_model.nccl); (255/256) x 34e9 / 370e9 = 91.5 ms, plus latency.
    # Not 34e9 / 50e9 = 0.68 s: the gather is not bound by one GPU's NIC.
    cluster = Cluster.preset("dgx-h100", 32)
    gather = collective_time("all_gather", 34e9, cluster, list(range(256)))
    assert gather == pytest.approx(34e9 * 255 / 256 / 370e9, rel=0.02)


def test_a_pipeline_hop_of_one_sequence_costs_a_millisecond_and_a_quarter():
    # Between stages on different nodes, one micro-batch of one sequence: 4096 x 7168 x 2 B =
    # 58,720,256 B through one NIC at NCCL's measured 47e9 B/s (NVIDIA/nccl-tests#290, presets):
    # 1.249 ms plus latency. The 1F1B grid charges 2 (pp - 1) hops on the critical path: 7.5 ms at
    # pp = 4, nothing beside the 30 s steps of this model's plans.
    cluster = Cluster.preset("dgx-h100", 32)
    hop = collective_time("send_recv", 4096 * ROW, cluster, [0, 64])
    assert hop == pytest.approx(4096 * ROW / 47e9, rel=0.02)


def test_all_to_all_latency_overlaps_over_peers_as_nccl_runs_it():
    # NCCL posts every peer's send and receive at once and progresses 32 channels x 8 peers a
    # batch = 256 peers together (cost_model.collectives, NVIDIA/nccl src/enqueue.cc); DeepEP's
    # measured dispatch is 192 us at EP128 and 194 us at EP256, not 1 ms more. The latency term
    # of the flat all-to-all of S = 256 MB over EP256 on 32 DGX-H100 nodes (alpha-beta model):
    # 248/256 x S / 50e9 + 1 x 8 us on NCCL; 248 x 8 us in turn when one peer at a time.
    shape = group_shape(Cluster.preset("dgx-h100", 32), list(range(256)))
    size = 256e6
    bandwidth = size * 248 / 256 / 50e9  # 4.96 ms
    concurrent = dispatch_traffic("flat", size / ROW, size / ROW / TOP_K, ROW, shape, in_flight=256)
    one_by_one = dispatch_traffic("flat", size / ROW, size / ROW / TOP_K, ROW, shape, in_flight=1)
    assert concurrent.network_s == pytest.approx(bandwidth + 8e-6)
    assert one_by_one.network_s == pytest.approx(bandwidth + 248 * 8e-6)
    # 64 nodes (EP512, 504 remote peers): two rounds of 256, 2 x 8 us.
    wide = group_shape(Cluster.preset("dgx-h100", 64), list(range(512)))
    assert dispatch_traffic("flat", size / ROW, 1.0, ROW, wide, in_flight=256).network_s == \
        pytest.approx(size * 504 / 512 / 50e9 + 2 * 8e-6)
    # The backend decides: NCCL clusters 256 peers at once, gloo one (as before).
    assert peers_in_flight(Cluster.preset("dgx-h100", 32)) == 256
    assert peers_in_flight(Cluster.preset("cpu", 1, 8)) == 1
