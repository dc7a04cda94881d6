"""The NCCL model (cost_model.nccl) against cases worked out by hand.

Figures used (cost_model/nccl.py cites each): DGX A100 ring busbw 232.5e9 B/s, 24e9 B/s per NIC,
8 NICs per node; DGX H100 ring busbw 370e9 B/s, NVLS algbw 275e9 B/s, 47e9 B/s per NIC.
NCCL latencies (µs): ring base LL 6.6, LL128 14, Simple 8.4; NVLink hop LL 0.6, LL128 1.9,
Simple 3.4; network hop ring Simple 14, tree Simple 14; tree base Simple 8.4, NVLink hop 4.0;
NVLS 25; multi-node Simple ring all-reduce latency × 1.4.
"""

from __future__ import annotations

import dataclasses

import pytest

from cost_model.collectives import collective_time, group_shape
from cost_model.nccl import bus_bytes, nccl_algorithm_times, nccl_profile
from planner.cluster import Cluster, LinkSpec

GIB = 2**30
MIB = 2**20


def times(cluster: Cluster, kind: str, size: float, ranks, concurrent: int = 1) -> dict[str, float]:
    return nccl_algorithm_times(kind, size, group_shape(cluster, list(ranks)), nccl_profile(cluster),
                                concurrent)


def best(table: dict[str, float]) -> str:
    return min(table, key=table.get)


def test_only_the_measured_presets_and_clusters_derived_from_them_get_nccl_figures():
    assert nccl_profile(Cluster.preset("dgx-a100-80g", nodes=4)).ring_busbw == 232.5e9
    assert nccl_profile(Cluster.preset("dgx-h100")).nvls_algbw == 275e9
    assert nccl_profile(Cluster.preset("cpu")) is None  # gloo: α–β
    assert nccl_profile(Cluster.preset("p3.16xlarge")) is None  # no published figures used
    renamed = dataclasses.replace(Cluster.preset("dgx-a100-80g"), name="my-cluster")
    assert nccl_profile(renamed) == nccl_profile(Cluster.preset("dgx-a100-80g"))  # still the preset's hardware
    edited = dataclasses.replace(Cluster.preset("dgx-a100-80g"), inter_link=LinkSpec(20e9, 9e-6))
    assert nccl_profile(edited).nic_busbw == 24e9 * 20 / 25  # the changed link scales (tests/test_cluster_edits.py)
    scratch = dataclasses.replace(Cluster.preset("dgx-a100-80g"), name="my-cluster", derived_from=None)
    assert nccl_profile(scratch) is None  # described from scratch (planner profile, a file without a preset): α–β
    assert nccl_profile(Cluster.preset("dgx-a100-80g", devices_per_node=4)) is None  # not a DGX


def test_large_all_reduce_in_one_a100_node_reaches_the_measured_busbw():
    dgx = Cluster.preset("dgx-a100-80g")
    table = times(dgx, "all_reduce", GIB, range(8))
    # ring/Simple: latency 8.4 + 2·7 hops · 3.4 = 56 µs; bytes 2·7/8 · 2^30 = 1879048192 at
    # 232.5e9 B/s = 8.081928e-3 s; total 8.137928e-3 s.
    assert table["ring/Simple"] == pytest.approx(56e-6 + 2 * 7 / 8 * GIB / 232.5e9)
    assert table["ring/Simple"] == pytest.approx(8.137928e-3, rel=1e-6)
    assert best(table) == "ring/Simple"
    assert "nvls/Simple" not in table  # A100's NVSwitch does not reduce
    assert collective_time("all_reduce", GIB, dgx, range(8)) == table["ring/Simple"]
    # busbw as nccl-tests reports it: 1879048192 / 8.137928e-3 = 230.9e9 B/s (published 232.5)
    assert bus_bytes("all_reduce", GIB, 8) / table["ring/Simple"] == pytest.approx(230.9e9, rel=1e-3)


def test_small_messages_run_on_low_latency_protocols_at_lower_busbw():
    dgx = Cluster.preset("dgx-a100-80g")
    table = times(dgx, "all_reduce", MIB, range(8))
    # ring/LL: 6.6 + 14 · 0.6 = 15 µs; 1835008 bytes at 232.5e9 / 2 = 15.7850e-6 s -> 30.785 µs
    assert table["ring/LL"] == pytest.approx(15e-6 + 2 * 7 / 8 * MIB / (232.5e9 / 2))
    # ring/LL128: 14 + 14 · 1.9 = 40.6 µs + 1835008 / (0.92 · 232.5e9) = 8.579 µs -> 49.18 µs
    assert table["ring/LL128"] == pytest.approx(40.6e-6 + 2 * 7 / 8 * MIB / (0.92 * 232.5e9))
    # ring/Simple: 56 µs + 7.893 µs = 63.89 µs
    assert best(table) == "ring/LL"
    # The achieved busbw rises with the message and levels off at the measured plateau.
    achieved = [bus_bytes("all_reduce", size, 8) / collective_time("all_reduce", size, dgx, range(8))
                for size in (4 * 2**10, MIB, 16 * MIB, 256 * MIB, 4 * GIB)]
    assert achieved == sorted(achieved)
    assert achieved[0] < 0.1 * 232.5e9 and achieved[-1] > 0.99 * 232.5e9


def test_h100_switches_from_ring_ll_to_nvls_between_1_and_2_mib():
    """NVIDIA/nccl-tests#309 observes RING/LL up to 1 MB and NVLS/Simple from 2 MB on 8 H100s."""
    h100 = Cluster.preset("dgx-h100")
    one = times(h100, "all_reduce", MIB, range(8))
    # ring/LL: 15 µs + 1835008 / (370e9 / 2) = 9.919 µs -> 24.92 µs; NVLS: 25 + 2^20/275e9 µs
    assert one["ring/LL"] == pytest.approx(15e-6 + 2 * 7 / 8 * MIB / 185e9)
    assert one["nvls/Simple"] == pytest.approx(25e-6 + MIB / 275e9)
    assert best(one) == "ring/LL"
    two = times(h100, "all_reduce", 2 * MIB, range(8))
    # ring/LL: 15 + 19.84 = 34.84 µs; NVLS: 25 + 7.626 = 32.63 µs
    assert best(two) == "nvls/Simple"
    # At 8 GiB NVLS gives the published busbw of ~480 GB/s: 1.75 · 275e9 = 481e9 less latency.
    big = collective_time("all_reduce", 8 * GIB, h100, range(8))
    assert bus_bytes("all_reduce", 8 * GIB, 8) / big == pytest.approx(481e9, rel=2e-3)
    # NVLS is not used below 5 GPUs (NVIDIA/nccl#1455).
    assert "nvls/Simple" not in times(h100, "all_reduce", GIB, range(4))


def test_group_across_nodes_is_bounded_by_the_node_nics():
    cluster = Cluster.preset("dgx-a100-80g", nodes=4)
    table = times(cluster, "all_reduce", 4 * GIB, range(32))
    # ring bus bandwidth: min(NVLink 232.5e9, 8 NICs · 24e9 = 192e9) = 192e9.
    # latency: 8.4 + (62 − 6) NVLink hops · 3.4 + 2·3 network hops · 14 = 282.8 µs, · 1.4 (plateau)
    latency = (8.4 + 56 * 3.4 + 6 * 14) * 1.4e-6
    assert table["ring/Simple"] == pytest.approx(latency + 2 * 31 / 32 * 4 * GIB / 192e9)
    assert best(table) == "ring/Simple"
    # busbw = 8321499136 / (395.92e-6 + 43.3411e-3) = 190.3e9 (NVIDIA measures 192e9, nccl#812)
    assert bus_bytes("all_reduce", 4 * GIB, 32) / table["ring/Simple"] == pytest.approx(190.26e9, rel=1e-3)


def test_concurrent_groups_share_the_nics():
    cluster = Cluster.preset("dgx-a100-80g", nodes=4)
    data_parallel = range(0, 32, 8)  # one member per node: the dp group of a tp=8 mesh
    # 8 such groups at once: each member keeps its own NIC, 24e9 B/s; latency with one rank per
    # node uses network hops at the tree latency: 8.4 + 6 · 14 = 92.4 µs, · 1.4.
    alone = times(cluster, "all_reduce", GIB, data_parallel, concurrent=8)
    assert alone["ring/Simple"] == pytest.approx(92.4e-6 * 1.4 + 2 * 3 / 4 * GIB / 24e9)
    # 16 groups (two members per NIC): 24e9 · 8 / 16 = 12e9 B/s each.
    halved = times(cluster, "all_reduce", GIB, data_parallel, concurrent=16)
    assert halved["ring/Simple"] == pytest.approx(92.4e-6 * 1.4 + 2 * 3 / 4 * GIB / 12e9)


def test_tree_beats_ring_on_two_nodes():
    """Each node sends S across the network in the tree, 2(n−1)/n · S in the ring (nccl#812)."""
    cluster = Cluster.preset("dgx-a100-80g", nodes=2)
    table = times(cluster, "all_reduce", GIB, range(16))
    # tree/Simple: max(chain 2S/232.5e9 = 9.2365e-3, network S/192e9 = 5.5924e-3) / 0.92
    # = 10.0397e-3 s, latency 8.4 + 2 · (7 · 4.0 + 1 · 14) = 92.4 µs
    assert table["tree/Simple"] == pytest.approx(92.4e-6 + 2 * GIB / 232.5e9 / 0.92)
    # ring/Simple: (8.4 + 28 · 3.4 + 2 · 14) · 1.4 = 184.24 µs + 2·15/16 · S / 192e9 = 10.486e-3
    assert table["ring/Simple"] == pytest.approx(184.24e-6 + 2 * 15 / 16 * GIB / 192e9)
    assert best(table) == "tree/Simple"


def test_send_recv_and_all_to_all():
    cluster = Cluster.preset("dgx-a100-80g", nodes=2)
    # Inside a node: 1e9 / 232.5e9 + one ring Simple step 8.4 + 3.4 µs.
    assert collective_time("send_recv", 1e9, cluster, [0, 1]) == pytest.approx(1e9 / 232.5e9 + 11.8e-6)
    # Across nodes, one NIC: 1e9 / 24e9 + 8.4 + 14 (network hop, tree latency with one rank per node)
    assert collective_time("send_recv", 1e9, cluster, [0, 8]) == pytest.approx(1e9 / 24e9 + 22.4e-6)
    # all_to_all of 16 ranks on 2 nodes, S = 1 GiB per rank: 7/16 · S over NVLink at 232.5e9
    # (2.0205e-3 s) while 8/16 · S leaves the node on the member's NIC at 24e9 (22.370e-3 s).
    table = times(cluster, "all_to_all", GIB, range(16))
    assert table["p2p/Simple"] == pytest.approx(22.4e-6 + 8 / 16 * GIB / 24e9)


def test_empty_and_single_rank_are_free():
    dgx = Cluster.preset("dgx-h100")
    assert set(times(dgx, "all_reduce", 0, range(8)).values()) == {0.0}
    assert collective_time("all_gather", GIB, dgx, [3]) == 0.0
    assert collective_time("send_recv", GIB, dgx, [2, 2]) == 0.0
