"""Edited clusters keep what was measured (planner.cluster_edits, cost_model.nccl).

A cluster derived from a GPU preset (an edit, a file naming the preset, a calibration) keeps the
preset's NCCL measurements and overlap contention for every link class it did not change, and
scales the curves of a link class it did by the ratio of its link to the preset's. Worked by
hand from the DGX A100 figures (planner/presets.py): ring busbw 232.5e9 B/s inside a node,
24e9 B/s per NIC, 8 NICs per node; NCCL latencies (µs): ring base Simple 8.4, LL 6.6; NVLink
hop Simple 3.4, LL 0.6; network hop ring Simple 14.0, LL 2.7.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cost_model.calibration import calibration_values, with_calibration
from cost_model.collectives import COLLECTIVES, algorithm_times, collective_time, group_shape
from cost_model.nccl import OVERLAP_COMPUTE_SLOWDOWN, nccl_algorithm_times, nccl_profile
from planner.cluster import Cluster
from planner.cluster_edits import (link_scales, preset_changes, provenance, with_attention_kernel, with_inter_node,
                                   with_intra_node, with_memory)
from planner.errors import ClusterError

GIB = 2**30
KIB = 2**10
# Groups on 2 DGX nodes: inside one node, across both (8 per node), one rank per node.
GROUPS = {"intra": list(range(8)), "across": list(range(16)), "one per node": [0, 8]}


def all_times(cluster: Cluster) -> list[float]:
    """Every collective of 1 KiB and 1 GiB over every group of ``GROUPS``, alone and with 4
    groups at once: the times the simulator would read."""
    found = []
    for kind in COLLECTIVES:
        for ranks in GROUPS.values():
            ranks = ranks[:2] if kind == "send_recv" else ranks
            found += [collective_time(kind, size, cluster, ranks, concurrent) for size in (KIB, GIB) for concurrent in (1, 4)]
    return found


@pytest.fixture(scope="module")
def dgx2() -> Cluster:
    return Cluster.preset("dgx-a100-80g", nodes=2)


def test_memory_and_attention_kernel_keep_every_collective_bit_for_bit(dgx2):
    edited = with_memory(with_attention_kernel(dgx2, "flash-attention-triton"), memory_bytes=40_000_000_000,
                         memory_bandwidth=1.555e12)
    assert edited != dgx2 and edited.derived_from == "dgx-a100-80g"
    assert all_times(edited) == all_times(dgx2)  # ==, not approx: the same figures, the same arithmetic
    assert nccl_profile(edited) == nccl_profile(dgx2)
    assert nccl_profile(edited).overlap_slowdown == OVERLAP_COMPUTE_SLOWDOWN == 0.189  # contention kept
    assert preset_changes(edited) == ["memory 84.9 GB -> 40 GB", "memory bandwidth 2.04 TB/s -> 1.55 TB/s",
                                      "attention kernel flash-attention-2 -> flash-attention-triton"]


def test_halved_inter_node_bandwidth_scales_the_measured_network_curve(dgx2):
    slow = with_inter_node(dgx2, bandwidth=12.5e9)
    assert link_scales(slow).inter_bandwidth == 0.5 and link_scales(slow).intra_bandwidth == 1.0
    assert nccl_profile(slow).nic_busbw == 12e9  # 24e9 measured per NIC x 12.5 / 25
    # 1 GiB all-gather over 16 ranks on 2 nodes: each node's 8 members share 8 NICs of 12e9:
    # 96e9 B/s, below NVLink's 232.5e9, so the ring runs at 96e9. ring/Simple: 15 steps, 1 of
    # them across nodes: 8.4 + 14 · 3.4 + 14.0 = 70.0 µs; 15/16 · 2^30 B / 96e9 B/s.
    expected = 70.0e-6 + 15 / 16 * GIB / 96e9
    assert collective_time("all_gather", GIB, slow, range(16)) == pytest.approx(expected, rel=1e-12)
    # the preset: the same latency, the bytes at 192e9 B/s: the bandwidth term doubled, no more
    assert collective_time("all_gather", GIB, dgx2, range(16)) == pytest.approx(70.0e-6 + 15 / 16 * GIB / 192e9, rel=1e-12)
    # inside a node nothing changed: bit for bit
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        for size in (KIB, GIB):
            assert collective_time(kind, size, slow, range(8)) == collective_time(kind, size, dgx2, range(8))
    assert nccl_profile(slow).overlap_slowdown == 0.189


def test_doubled_inter_node_latency_scales_only_the_network_hops(dgx2):
    laggy = with_inter_node(dgx2, latency=16e-6)  # the preset's 8 µs x 2
    shape = group_shape(laggy, list(range(16)))
    table = nccl_algorithm_times("all_gather", KIB, shape, nccl_profile(laggy))
    # ring/LL: base 6.6 + 14 NVLink hops · 0.6 + 1 network hop · 2.7 · 2 = 20.4 µs; LL runs at
    # half the 192e9 B/s network share: 15/16 KiB / 96e9.
    assert table["ring/LL"] == pytest.approx(20.4e-6 + 15 / 16 * KIB / 96e9, rel=1e-12)
    before = nccl_algorithm_times("all_gather", KIB, shape, nccl_profile(dgx2))
    assert table["ring/LL"] - before["ring/LL"] == pytest.approx(2.7e-6, rel=1e-9)
    assert all_times(with_inter_node(dgx2, latency=8e-6)) == all_times(dgx2)  # the preset's own value: unchanged


def test_intra_node_edit_scales_nvlink_and_leaves_the_network(dgx2):
    half = with_intra_node(dgx2, bandwidth=150e9)
    # 1 GiB ring all-reduce in one node: 8.4 + 2 · 7 · 3.4 = 56 µs; 2 · 7/8 · 2^30 B at 232.5e9 / 2.
    assert collective_time("all_reduce", GIB, half, range(8)) == pytest.approx(56e-6 + 2 * 7 / 8 * GIB / 116.25e9, rel=1e-12)
    # one rank per node uses no NVLink: the same as the preset, bit for bit
    assert collective_time("all_reduce", GIB, half, [0, 8]) == collective_time("all_reduce", GIB, dgx2, [0, 8])


def test_a_file_naming_the_preset_with_one_override_is_the_edit(tmp_path, dgx2):
    network = tmp_path / "lab.toml"
    network.write_text('name = "lab"\n[inter_node]\nbandwidth = 12.5e9\n[[nodes]]\ncount = 2\npreset = "dgx-a100-80g"\n')
    from_file = Cluster.load(network)
    assert from_file == dataclasses.replace(with_inter_node(dgx2, bandwidth=12.5e9), name="lab")
    assert all_times(from_file) == all_times(with_inter_node(dgx2, bandwidth=12.5e9))
    memory = tmp_path / "small.json"
    memory.write_text(json.dumps({"name": "small", "nodes": [
        {"count": 2, "preset": "dgx-a100-80g", "device": {"memory_bytes": 40e9}}]}))
    assert Cluster.load(memory) == dataclasses.replace(with_memory(dgx2, memory_bytes=40_000_000_000), name="small")
    assert all_times(Cluster.load(memory)) == all_times(dgx2)


def test_a_cluster_not_derived_from_a_preset_keeps_alpha_beta(tmp_path, dgx2):
    scratch = dataclasses.replace(dgx2, name="scratch", derived_from=None)  # the same hardware, described from scratch
    assert nccl_profile(scratch) is None and link_scales(scratch) is None
    shape = group_shape(scratch, list(range(16)))
    assert collective_time("all_gather", GIB, scratch, range(16)) == min(algorithm_times("all_gather", GIB, shape).values())
    # a file with every table written out and no preset key: from scratch too
    table = scratch.to_dict()
    assert "preset" not in table["nodes"][0]
    (tmp_path / "scratch.json").write_text(json.dumps(table))
    assert Cluster.load(tmp_path / "scratch.json") == scratch
    # node groups naming different presets: no one preset's measurements describe it
    mixed = Cluster.from_dict({"name": "mixed", "inter_node": {"bandwidth": 25e9, "latency": 8e-6},
                               "nodes": [{"preset": "dgx-a100-80g"}, {"preset": "dgx-h100"}]})
    assert mixed.derived_from is None and nccl_profile(mixed) is None


def test_derived_clusters_without_the_measured_node_shape_say_why_they_use_alpha_beta(dgx2):
    four = Cluster.preset("dgx-h100", nodes=2, devices_per_node=4)
    assert four.derived_from == "dgx-h100" and nccl_profile(four) is None  # the measurements are of 8-GPU nodes
    assert provenance(four) == ("derived from preset dgx-h100; collectives: alpha-beta on its own links "
                                "(nodes of 4 devices, the measurements are of 8)")
    gloo = dataclasses.replace(dgx2, backend="gloo")
    assert nccl_profile(gloo) is None and "backend nccl -> gloo" in provenance(gloo)
    assert provenance(Cluster.preset("cpu", 1, 4)) == ""  # no measurements to lose: nothing to say
    one_slow_node = dataclasses.replace(dgx2, nodes=(dgx2.nodes[0], with_intra_node(dgx2, bandwidth=150e9).nodes[1]))
    assert nccl_profile(one_slow_node) is None  # one measured NVLink curve cannot describe both nodes
    assert provenance(one_slow_node).endswith("(nodes with different intra-node links)")


def test_provenance_tells_the_user_which_measured_curves_are_in_use(dgx2):
    assert provenance(dgx2) == ""  # the preset as built: its name says it
    assert provenance(with_inter_node(dgx2, bandwidth=12.5e9)) == (
        "derived from preset dgx-a100-80g (inter-node bandwidth 25 GB/s -> 12.5 GB/s); "
        "collectives: NCCL as measured on dgx-a100-80g, inter-node bandwidth x0.5")
    assert provenance(dataclasses.replace(dgx2, name="lab")) == (
        "derived from preset dgx-a100-80g; collectives: NCCL as measured on dgx-a100-80g")


def test_derived_from_survives_files_and_plans(tmp_path, dgx2):
    edited = with_intra_node(with_attention_kernel(dgx2, "flash-attention-triton"), latency=4e-6)
    assert edited.to_dict()["nodes"][0]["preset"] == "dgx-a100-80g"
    assert Cluster.from_dict(json.loads(json.dumps(edited.to_dict()))) == edited
    for suffix in (".toml", ".json"):
        edited.save(tmp_path / f"edited{suffix}")
        assert Cluster.load(tmp_path / f"edited{suffix}") == edited
    assert Cluster.from_dict(Cluster.preset("cpu", 1, 3).to_dict()) == Cluster.preset("cpu", 1, 3)


def test_a_plan_written_before_derived_from_keeps_the_measured_curves(dgx2):
    legacy = dgx2.to_dict()
    for group in legacy["nodes"]:
        del group["preset"]  # the layout plans and files had before
    assert Cluster.from_dict(legacy) == dgx2 and nccl_profile(Cluster.from_dict(legacy)) is not None
    legacy["inter_node"]["bandwidth"] = 20e9  # edited by hand, under the preset's name: as before, α–β
    assert Cluster.from_dict(legacy).derived_from is None


def test_calibration_keeps_the_preset_and_scales_the_calibrated_link(dgx2):
    values = {**calibration_values(dgx2), "matmul_efficiency": 0.7, "link_bandwidth": 150e9}
    calibrated = with_calibration(dgx2, values)
    assert calibrated.derived_from == "dgx-a100-80g"
    assert "matmul efficiency default -> 0.7" in preset_changes(calibrated)
    assert "intra-node bandwidth 300 GB/s -> 150 GB/s" in preset_changes(calibrated)
    assert link_scales(calibrated).intra_bandwidth == 0.5 and link_scales(calibrated).inter_bandwidth == 1.0
    assert nccl_profile(calibrated).ring_busbw == 232.5e9 / 2
    assert collective_time("all_reduce", GIB, calibrated, [0, 8]) == collective_time("all_reduce", GIB, dgx2, [0, 8])


def test_edits_refuse_bad_values(dgx2):
    with pytest.raises(ClusterError, match="attention kernel must be one of"):
        with_attention_kernel(dgx2, "flash-attention-9")
    with pytest.raises(ClusterError, match="LinkSpec.bandwidth must be a positive"):
        with_inter_node(dgx2, bandwidth=0)
    with pytest.raises(ClusterError, match="derived_from must be None or a preset"):
        dataclasses.replace(dgx2, derived_from="dgx-b200")


@pytest.fixture(scope="module")
def gpt_ddp_plans():
    """examples/gpt.py (batch 16) under DDP on 2 DGX A100 nodes: the preset, a memory edit and
    a network ten times slower."""
    from planner import baselines
    from planner.model_spec import ModelSpec

    spec = ModelSpec(str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py"), {"batch_size": 16})
    dgx2 = Cluster.preset("dgx-a100-80g", nodes=2)
    return {name: baselines.ddp(spec, cluster) for name, cluster in (
        ("preset", dgx2), ("memory", with_memory(dgx2, memory_bytes=40_000_000_000)),
        ("slow network", with_inter_node(dgx2, bandwidth=2.5e9)))}


def test_the_simulated_step_keeps_the_measured_collectives_and_contention(gpt_ddp_plans):
    preset, memory, slow = (gpt_ddp_plans[name].estimate for name in ("preset", "memory", "slow network"))
    # fields the memory size does not enter: the same step, figure for figure
    assert (memory.step_time_s, memory.compute_s, memory.communication_s) == (
        preset.step_time_s, preset.compute_s, preset.communication_s)
    assert slow.communication_s > preset.communication_s and slow.step_time_s > preset.step_time_s


def test_the_report_and_a_saved_plan_keep_the_provenance(gpt_ddp_plans, tmp_path):
    from planner.api import simulate
    from planner.plans import load_plan

    plan = gpt_ddp_plans["slow network"]
    report = " ".join(plan.report().split())  # unwrapped
    assert ("nccl; derived from preset dgx-a100-80g (inter-node bandwidth 25 GB/s -> 2.5 GB/s); collectives: NCCL "
            "as measured on dgx-a100-80g, inter-node bandwidth x0.1") in report
    assert "derived from" not in " ".join(gpt_ddp_plans["preset"].report().split())
    plan.save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded.cluster == plan.cluster and loaded.cluster.derived_from == "dgx-a100-80g"
    assert simulate(loaded).step_time_s == plan.estimate.step_time_s
