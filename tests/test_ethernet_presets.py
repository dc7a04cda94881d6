"""The commodity-Ethernet presets: each instance's network figure through NCCL's socket
transport (planner.ethernet_presets), worked by hand, and collectives priced on them."""

import pytest

from cost_model.collectives import collective_time
from planner.cluster import Cluster, preset_table
from planner.ethernet_presets import SOCKET_LATENCY, socket_bandwidth, socket_efficiency


@pytest.mark.parametrize("name, gpus, gbps, per_gpu", [
    # line rate / 8 bits x socket efficiency / GPUs sharing the machine's network
    ("p3.2xlarge", 1, 10, 10e9 / 8 * 0.6 / 1),       # 0.75 GB/s
    ("a2-highgpu-1g", 1, 24, 24e9 / 8 * 0.6 / 1),    # 1.8 GB/s
    ("g4dn.8xlarge", 1, 50, 50e9 / 8 * 0.6 / 1),     # 3.75 GB/s
    ("a2-highgpu-4g", 4, 50, 50e9 / 8 * 0.6 / 4),    # 0.9375 GB/s per GPU
    ("a2-highgpu-8g", 8, 100, 100e9 / 8 * 0.4 / 8),  # 0.625 GB/s per GPU
    ("p3dn.24xlarge", 8, 100, 100e9 / 8 * 0.4 / 8),
])
def test_each_instance_gets_its_network_through_sockets(name, gpus, gbps, per_gpu):
    cluster = Cluster.preset(name, nodes=2)
    assert cluster.devices_per_node == gpus
    assert cluster.inter_link.bandwidth == pytest.approx(per_gpu)
    assert cluster.inter_link.latency == SOCKET_LATENCY == 40e-6
    assert f"{gbps:g} Gb/s Ethernet, NCCL sockets" in dict(preset_table())[name]


def test_socket_efficiency_follows_the_two_measurements():
    assert socket_efficiency(32) == 0.6  # NVIDIA/nccl#209: 60% of 32 Gb/s
    assert socket_efficiency(100) == 0.4  # NVIDIA/nccl#450: 5 of 12.5 GB/s
    assert socket_bandwidth(100, 1) == pytest.approx(5e9)


def test_an_all_reduce_between_single_gpu_machines_is_a_ring_over_sockets():
    # 4 x p3.2xlarge, 100 MB all-reduce: each machine has one GPU, so the ring's every hop
    # crosses Ethernet at 0.75 GB/s with 40 µs latency: 2(n-1)/n S/β + 2(n-1)α
    # = 1.5 * 1e8 / 0.75e9 + 6 * 40e-6 = 0.2 + 0.00024 s (the tree, 2 S/β + ..., is slower).
    cluster = Cluster.preset("p3.2xlarge", nodes=4)
    seconds = collective_time("all_reduce", 1e8, cluster, [0, 1, 2, 3])
    assert seconds == pytest.approx(1.5 * 1e8 / 0.75e9 + 6 * 40e-6)
