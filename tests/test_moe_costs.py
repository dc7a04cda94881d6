"""Costs of one MoE layer (``cost_model.moe``) against values worked out by hand.

The device is made for arithmetic: 1 TFLOP/s at full efficiency, memory traffic free, no
kernel overhead; links of 1 GB/s with (next to) no latency. Then a kernel costs FLOPs / 1e12 s and an
all-to-all in which each of n devices sends S bytes costs (n - 1) / n x S / 1e9 s.

The layer: 1024 tokens, hidden 256, expert FFN 512, 4 experts, top-2, 2 matmuls per expert
(a GELU MLP): one routed copy costs 2 x 2 x 256 x 512 = 524,288 FLOPs forward; 2048 copies.
"""

from __future__ import annotations

import pytest

from cost_model.moe import MoELayer, moe_layer_cost
from planner.cluster import Cluster, DeviceSpec, LinkSpec, NodeSpec
from planner.strategy import ExpertPlacement
from search.expert_placement import eplb

DEVICE = DeviceSpec(
    name="arith", peak_flops={"float32": 1e12}, memory_bytes=10**12, memory_bandwidth=1e30,
    matmul_efficiency=1.0, memory_efficiency=1.0, kernel_overhead_s=0.0,
)
LINK = LinkSpec(bandwidth=1e9, latency=1e-15)  # latency must be positive; this one is negligible
LAYER = MoELayer(tokens=1024, hidden=256, ffn=512, experts=4, top_k=2, matmuls=2)
COPY_FLOPS = 524_288
SKEWED = [0.4, 0.3, 0.2, 0.1]
Z4 = 1.049131  # Blom's expected largest of 4 standard normals: Phi^-1((4 - 0.375) / (4 + 0.25))


def cluster(nodes: int = 1, per_node: int = 4) -> Cluster:
    return Cluster(name="arith", nodes=tuple(NodeSpec(DEVICE, per_node, LINK) for _ in range(nodes)),
                   inter_link=LINK, backend="gloo")


def cost(mode: str, **options):
    return moe_layer_cost(LAYER, mode, cluster(), range(4), precision="fp32", **options)


def test_expert_parallel_waits_for_the_busiest_device():
    # Round-robin, skewed routing: expert 0 expects 0.4 x 2048 = 819.2 copies on device 0,
    # and one micro-batch's routing sends it more by chance (cost_model.expert_load): its
    # count is Binomial(2048, 0.4), sigma = sqrt(819.2 x 0.6) = 22.17, and the busiest of 4
    # devices is z_4 = Phi^-1(3.625 / 4.25) = 1.0491 sigmas above: 819.2 + 23.26 = 842.46.
    busiest = 819.2 + Z4 * (819.2 * 0.6) ** 0.5
    assert busiest == pytest.approx(842.46, abs=0.01)
    result = cost("expert_parallel", token_share=SKEWED)
    assert result.busiest_copies == pytest.approx(busiest)
    assert result.forward_compute_s == pytest.approx(busiest * COPY_FLOPS / 1e12)
    assert result.backward_compute_s == pytest.approx(2 * busiest * COPY_FLOPS / 1e12)
    assert result.max_over_mean == pytest.approx(busiest / 512)
    # Each device sends 512 copies x 256 x 4 bytes = 524,288 B; device 0 receives 842.46 x
    # 1024 B, which bounds the exchange: 3/4 x 862,679 / 1e9 per all-to-all, two in forward
    # (dispatch, combine) and two in backward.
    one = 0.75 * busiest * 1024 / 1e9
    assert result.forward_comm_s == pytest.approx(2 * one) and result.backward_comm_s == pytest.approx(2 * one)
    assert result.weight_bytes == 2 * 256 * 512 * 4  # one expert per device
    assert result.dropped_fraction == 0.0


def test_capacity_drops_the_overflow_and_pads_every_expert():
    # Capacity 1.0 x 2048 / 4 = 512 copies per expert: experts 0 and 1 drop 307.2 and 102.4
    # of their 819.2 and 614.4 (0.2 of all copies); every buffer is padded to 512.
    result = cost("expert_parallel", token_share=SKEWED, capacity_factor=1.0)
    assert result.dropped_fraction == pytest.approx(0.2)
    assert result.busiest_copies == pytest.approx(512)
    assert result.max_over_mean == pytest.approx(1.0)
    # Device 0 receives its 512 kept copies, as much as each device sends.
    assert result.forward_comm_s == pytest.approx(2 * 0.75 * 512 * 1024 / 1e9)


def test_data_parallel_moves_no_tokens_and_holds_every_expert():
    result = cost("data_parallel", token_share=SKEWED)
    assert result.busiest_copies == pytest.approx(512)  # its own 256 tokens x top-2
    assert result.forward_comm_s == 0.0 and result.backward_comm_s == 0.0
    assert result.weight_bytes == 4 * 2 * 256 * 512 * 4


def test_expert_sliced_balances_any_routing_by_moving_every_token():
    result = cost("expert_sliced", token_share=SKEWED)
    assert result.busiest_copies == pytest.approx(512)  # a quarter of every copy's FLOPs
    assert result.forward_compute_s == pytest.approx(512 * COPY_FLOPS / 1e12)
    # All-gather of the 2048 kept copies x 256 x 4 B (each token once per chosen expert, as
    # the compiled program sends them) and reduce-scatter of the outputs: each a ring of
    # 3/4 x 2 MiB / 1e9.
    ring = 0.75 * 2048 * 256 * 4 / 1e9
    assert result.forward_comm_s == pytest.approx(2 * ring)
    assert result.weight_bytes == 4 * 2 * 256 * 512 * 4 / 4


def test_a_copied_hot_expert_shares_its_load():
    # EPLB with 2 slots per device gives the hot experts copies; the busiest device then
    # computes what the placement loads it with (plus the chance excess of one batch, z_4
    # sigmas of its fullest device), less than round-robin's 842.46 copies.
    placement = eplb(SKEWED, devices=4, slots_per_device=2)
    result = cost("expert_parallel", token_share=SKEWED, placement=placement)
    loads = placement.device_loads([s * 2048 for s in SKEWED])
    spread = max((load * (1 - load / 2048)) ** 0.5 for load in loads)
    assert result.busiest_copies == pytest.approx(max(loads) + Z4 * spread)
    assert result.busiest_copies < 819.2


def test_hierarchical_all_to_all_is_priced_across_nodes():
    two_nodes = cluster(nodes=2, per_node=2)
    flat = moe_layer_cost(LAYER, "expert_parallel", two_nodes, range(4), precision="fp32")
    hierarchical = moe_layer_cost(LAYER, "expert_parallel", two_nodes, range(4), precision="fp32", algorithm="hierarchical")
    assert flat.forward_compute_s == hierarchical.forward_compute_s
    # Uniform routing: each device sends 512 copies and the busiest receives, by chance,
    # 512 + z_4 x sqrt(512 x 3/4) = 532.56 (cost_model.expert_load): S = 532.56 x 1 KiB bounds
    # the exchange. Flat, 2 nodes of 2: a quarter of S stays on the node's link, half crosses
    # the network, at once: max(1/4, 1/2) x S / 1e9. Two-level: the node's half exchanged
    # inside it, then across: 1/2 x S / 1e9 + 1/2 x S / 1e9. Here flat is cheaper (the network
    # is no slower than NVLink).
    size = (512 + Z4 * (512 * 0.75) ** 0.5) * 1024
    assert flat.forward_comm_s == pytest.approx(2 * 0.5 * size / 1e9)
    assert hierarchical.forward_comm_s == pytest.approx(2 * size / 1e9)


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="MoE mode must be one of"):
        cost("tensor")
    with pytest.raises(ValueError, match="token_share has 3 entries for 4 experts"):
        cost("expert_parallel", token_share=[0.5, 0.25, 0.25])
    with pytest.raises(ValueError, match="placement is for 4 experts on 2 devices"):
        cost("expert_parallel", placement=ExpertPlacement(2, tuple(((e % 2, 1.0),) for e in range(4))))


def test_dispatch_buffers_hold_the_sent_and_the_received_copies():
    """One device's dispatch buffers (``cost_model.moe_layers.dispatch_buffer_bytes``) for the
    skewed layer with capacity 1.0: it sends its 1024 / 4 x 2 = 512 copies less the 0.2
    dropped, 409.6 rows, and receives the busiest device's buffer padded to the capacity, 512
    rows; rows of 256 x 4 B: (409.6 + 512) x 1024 = 943,718.4 B. Expert-sliced holds only the
    gathered copies; data parallel none."""
    from cost_model.moe_layers import dispatch_buffer_bytes
    from planner.moe_blocks import MoEBlock
    from planner.strategy import ExpertLayout

    block = MoEBlock("moe", 4, 2, 1.0, 256, 512, 2, "router.weight", ("experts.w_in", "experts.w_out"), "test")
    parallel = cost("expert_parallel", token_share=SKEWED, capacity_factor=1.0)
    layout = ExpertLayout("moe", "expert_parallel", 4, 2, 1.0, placement=ExpertPlacement.round_robin(4, 4))
    assert dispatch_buffer_bytes(block, layout, parallel, 1024, 4, "fp32") == pytest.approx((409.6 + 512) * 1024)
    sliced = cost("expert_sliced", token_share=SKEWED, capacity_factor=1.0)
    sliced_layout = ExpertLayout("moe", "expert_sliced", 4, 2, 1.0)
    assert dispatch_buffer_bytes(block, sliced_layout, sliced, 1024, 4, "fp32") == sliced.buffer_bytes
    replicated = ExpertLayout("moe", "data_parallel", 4, 2, 1.0)
    assert dispatch_buffer_bytes(block, replicated, cost("data_parallel"), 1024, 4, "fp32") == 0.0


def test_a_memory_bound_layer_reads_the_weights_of_every_expert_the_device_holds():
    # The arithmetic device with memory at 1 GB/s: data parallel, each device holds all 4
    # experts (4 x 2 x 256 x 512 x 4 B = 4,194,304 B, read once by the grouped GEMM) and
    # computes its 512 copies, whose activations move 512 x (256 + 512) x 4 B x 2 matmuls =
    # 3,145,728 B: 7,340,032 B / 1e9 = 7.34 ms forward, against 512 x 524,288 FLOPs / 1e12 =
    # 0.27 ms of compute; backward twice both. Reading one expert's weights (1,048,576 B)
    # would price 4.19 ms.
    slow_memory = DeviceSpec(
        name="arith", peak_flops={"float32": 1e12}, memory_bytes=10**12, memory_bandwidth=1e9,
        matmul_efficiency=1.0, memory_efficiency=1.0, kernel_overhead_s=0.0,
    )
    slow = Cluster(name="arith", nodes=(NodeSpec(slow_memory, 4, LINK),), inter_link=LINK, backend="gloo")
    result = moe_layer_cost(LAYER, "data_parallel", slow, range(4), precision="fp32")
    assert result.forward_compute_s == pytest.approx((4_194_304 + 3_145_728) / 1e9)
    assert result.backward_compute_s == pytest.approx(2 * (4_194_304 + 3_145_728) / 1e9)
    # Expert parallel, one expert per device: 1,048,576 B of weights, its 512 copies' 3,145,728.
    result = moe_layer_cost(LAYER, "expert_parallel", slow, range(4), precision="fp32",
                            token_share=[0.25] * 4, capacity_factor=1.0)
    assert result.forward_compute_s == pytest.approx((1_048_576 + 3_145_728) / 1e9)
