"""Tests of the cluster model: presets, the CLI form, TOML/JSON files and every user error."""

from __future__ import annotations

import json
import pickle
import sys

import pytest

from planner.cluster import (Cluster, DeviceSpec, LinkSpec, NodeSpec, preset_names,
                             preset_table)
from planner.errors import ClusterError, OutputError

# Two groups: one node taken from a preset with one override, then two hand-written nodes.
HETERO_TOML = """
name = "mixed"
backend = "nccl"

[inter_node]
bandwidth = 12.5e9
latency = 1e-5

[[nodes]]
preset = "dgx-a100-80g"
devices = 4
[nodes.device.peak_flops]
float8 = 600e12

[[nodes]]
count = 2
devices = 2
[nodes.device]
name = "L4"
memory_bytes = 24e9
memory_bandwidth = 300e9
[nodes.device.peak_flops]
float32 = 30.3e12
bfloat16 = 121e12
[nodes.intra_node]
bandwidth = 32e9
latency = 1e-5
"""


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def _raises(match: str):
    return pytest.raises(ClusterError, match=match)


# ---- presets ----

# The 80 GB GPUs hold what nvidia-smi reports less 300 MiB of CUDA context and 688 MiB of one
# NCCL communicator (planner.gpu_presets.usable_memory_bytes): A100 (81,920 - 988) x 2**20 =
# 80,932 x 1,048,576 = 84,863,352,832 B; H100 (81,559 - 988) x 2**20 = 84,484,816,896 B.
@pytest.mark.parametrize("name, world, device, bf16, memory, intra, inter", [
    ("dgx-a100-80g", 8, "A100-SXM4-80GB", 312e12, 84_863_352_832, 300e9, 25e9),
    ("dgx-h100", 8, "H100-SXM5-80GB", 989.4e12, 84_484_816_896, 450e9, 50e9),
    ("p3.16xlarge", 8, "V100-SXM2-16GB", 15.7e12, 16e9, 150e9, 25e9 / 8 / 8),
    ("cpu", 2, "cpu-process", 50e9, 8 * 2**30, 2e9, 1e9),
])
def test_preset_numbers(name, world, device, bf16, memory, intra, inter):
    cluster = Cluster.preset(name)
    assert cluster.name == name and cluster.world_size == world and cluster.num_nodes == 1
    assert cluster.devices_per_node == world and cluster.is_homogeneous
    spec = cluster.device_of(0)
    assert spec.name == device
    assert spec.flops_for("bfloat16") == pytest.approx(bf16)  # V100: no bf16 -> float32
    assert spec.memory_bytes == memory == cluster.min_device_memory
    assert cluster.nodes[0].intra_link.bandwidth == pytest.approx(intra)
    assert cluster.inter_link.bandwidth == pytest.approx(inter)
    assert cluster.backend == ("gloo" if name == "cpu" else "nccl")
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    hash(cluster)  # usable as a cache key


def test_preset_details_and_dtype_names():
    h100 = Cluster.preset("dgx-h100").device_of(0)
    assert h100.flops_for("float8_e4m3fn") == h100.flops_for("fp8") == pytest.approx(1978.9e12)
    assert h100.flops_for("torch.float32") == pytest.approx(67e12)
    assert h100.flops_for("tf32") == pytest.approx(494.7e12)
    assert h100.memory_bandwidth == pytest.approx(3.35e12)
    a100 = Cluster.preset("dgx-a100-80g").device_of(0)
    assert a100.flops_for("half") == a100.flops_for("bf16") == pytest.approx(312e12)
    assert a100.flops_for("int64") == pytest.approx(19.5e12)  # unknown dtype -> float32
    v100 = Cluster.preset("p3.16xlarge").device_of(0)
    assert v100.flops_for("float16") == pytest.approx(125e12)
    assert dict(a100.peak_flops) == {"float32": 19.5e12, "tf32": 156e12,
                                     "bfloat16": 312e12, "float16": 312e12}


def test_hgx_h800_is_an_h100_with_deepseek_v3s_links():
    """DeepSeek-V3's cluster (2,048 H800s, 8 per node): H100 SXM compute and memory, NVLink
    400 GB/s bidirectional (200e9 B/s a direction, not the H100's 450e9) and one 400 Gb/s
    InfiniBand NIC per GPU (400e9 / 8 = 50e9 B/s)."""
    cluster = Cluster.preset("hgx-h800", nodes=256)
    h800, h100 = cluster.device_of(0), Cluster.preset("dgx-h100").device_of(0)
    assert (cluster.world_size, cluster.devices_per_node, cluster.backend) == (2048, 8, "nccl")
    assert h800.flops_for("bf16") == h100.flops_for("bf16") == pytest.approx(989.4e12)
    assert h800.flops_for("fp8") == pytest.approx(1978.9e12)
    assert (h800.memory_bytes, h800.memory_bandwidth) == (h100.memory_bytes, h100.memory_bandwidth)
    assert cluster.nodes[0].intra_link.bandwidth == pytest.approx(400e9 / 2)
    assert cluster.inter_link.bandwidth == pytest.approx(400e9 / 8)
    assert Cluster.preset("HGX-H800") == Cluster.preset("hgx-h800")


def test_preset_overrides_and_listing():
    cluster = Cluster.preset("dgx-h100", nodes=2, devices_per_node=4)
    assert (cluster.world_size, cluster.num_nodes, cluster.devices_per_node) == (8, 2, 4)
    assert Cluster.preset("DGX-H100") == Cluster.preset("dgx-h100")
    assert preset_names()[:5] == ["dgx-a100-80g", "dgx-h100", "hgx-h800", "p3.16xlarge", "cpu"]
    assert "h100" in preset_names() and "nd-h100-v5" in preset_names()  # by GPU and instance name (test_gpu_presets)
    assert {"p3.2xlarge", "a2-highgpu-8g", "p3dn.24xlarge"} <= set(preset_names())  # Ethernet (test_ethernet_presets)
    assert [name for name, _ in preset_table()] == preset_names()
    assert all(description for _, description in preset_table())
    with _raises("nodes must be a positive integer, got 0"):
        Cluster.preset("cpu", nodes=0)


def test_describe():
    text = Cluster.preset("dgx-a100-80g", nodes=2).describe()
    assert text == ("dgx-a100-80g: 2 nodes x 8 A100-SXM4-80GB (84.9 GB, 312 TFLOP/s bf16, "
                    "intra-node 300 GB/s); inter-node 25 GB/s per device; nccl")
    assert "1 node x 2 cpu-process" in Cluster.preset("cpu").describe()
    assert "125 TFLOP/s fp16" in Cluster.preset("p3.16xlarge").describe()


# ---- the CLI form ----

@pytest.mark.parametrize("text, nodes, per_node", [
    ("cpu", 1, 2), ("cpu:3", 3, 2), ("cpu:1x4", 1, 4), ("cpu:2X3", 2, 3),
    ("dgx-h100:16", 16, 8), (" p3.16xlarge:2x8 ", 2, 8),
])
def test_parse_cli_forms(text, nodes, per_node):
    cluster = Cluster.parse(text)
    assert (cluster.num_nodes, cluster.devices_per_node) == (nodes, per_node)
    assert cluster.world_size == nodes * per_node


@pytest.mark.parametrize("text", ["cpu:x", "cpu:0x4", "cpu:1x0", "cpu:1x4x2", "cpu:", ":2", "",
                                  "cpu:-1", "dir/cpu"])
def test_parse_malformed(text):
    with _raises("PRESET:NODESxDEVICES"):
        Cluster.parse(text)


def test_unknown_preset_lists_presets():
    for call in (lambda: Cluster.parse("tpu-v5:2"), lambda: Cluster.preset("b200")):
        with pytest.raises(ClusterError) as info:
            call()
        assert "unknown cluster preset" in str(info.value)
        assert all(name in str(info.value) for name in preset_names())


def test_parse_file_path(tmp_path):
    path = _write(tmp_path, "mixed.toml", HETERO_TOML)
    assert Cluster.parse(str(path)) == Cluster.parse(path) == Cluster.load(path)
    assert pickle.loads(pickle.dumps(Cluster.load(path))).node_of(5) == 1


# ---- files ----

def test_heterogeneous_file(tmp_path):
    cluster = Cluster.load(_write(tmp_path, "mixed.toml", HETERO_TOML))
    assert cluster.name == "mixed" and cluster.world_size == 8 and cluster.num_nodes == 3
    assert not cluster.is_homogeneous
    a100, l4 = cluster.nodes[0].device, cluster.nodes[1].device
    assert a100.name == "A100-SXM4-80GB" and a100.flops_for("float8") == 600e12  # merged
    assert a100.flops_for("bfloat16") == 312e12  # kept from the preset
    assert cluster.nodes[0].intra_link == Cluster.preset("dgx-a100-80g").nodes[0].intra_link
    assert l4.memory_bytes == 24_000_000_000 and isinstance(l4.memory_bytes, int)
    assert cluster.inter_link == LinkSpec(12.5e9, 1e-5)
    assert [cluster.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert [cluster.device_of(r).name for r in (3, 4, 7)] == ["A100-SXM4-80GB", "L4", "L4"]
    assert cluster.min_device_memory == 24_000_000_000
    with _raises("different|nodes\\[i\\].devices"):
        cluster.devices_per_node
    for rank in (-1, 8, 1.0):
        with _raises("outside cluster 'mixed'; ranks are 0..7"):
            cluster.node_of(rank)


@pytest.mark.parametrize("suffix", [".toml", ".json", ".TOML"])
def test_round_trip(tmp_path, suffix):
    cluster = Cluster.load(_write(tmp_path, "mixed.toml", HETERO_TOML))
    path = tmp_path / f"saved{suffix}"
    cluster.save(path)
    assert Cluster.load(path) == cluster
    assert Cluster.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster
    assert [group["count"] for group in cluster.to_dict()["nodes"]] == [1, 2]


def test_file_defaults_from_preset(tmp_path):
    path = _write(tmp_path, "lab.json", json.dumps({"nodes": [{"preset": "cpu", "count": 3}]}))
    cluster = Cluster.load(path)
    assert cluster.name == "lab" and cluster.backend == "gloo"  # name from the file stem
    assert cluster == Cluster("lab", Cluster.preset("cpu", nodes=3).nodes,
                              Cluster.preset("cpu").inter_link, "gloo", derived_from="cpu")


# ---- user errors: each message names the offending thing ----

@pytest.mark.parametrize("text, match", [
    (HETERO_TOML.replace('memory_bytes = 24e9', 'memory_bytes = -3'),
     r"cluster file .*bad.toml: nodes\[1\].device.memory_bytes must be a positive integer, got -3"),
    (HETERO_TOML.replace('memory_bytes', 'memmory_bytes'),
     r"unknown key nodes\[1\].device.memmory_bytes; did you mean 'memory_bytes'"),
    (HETERO_TOML.replace('backend = "nccl"', 'backend = "mpi"'),
     r"backend must be \"nccl\" \(GPUs\) or \"gloo\" \(CPU\), got 'mpi'"),
    (HETERO_TOML.replace('float8 = 600e12', 'bfloat61 = 600e12'),
     r"unknown key nodes\[0\].device.peak_flops.bfloat61; did you mean 'bfloat16'"),
    (HETERO_TOML.replace('float32 = 30.3e12', 'float32 = 0'),
     r"nodes\[1\].device.peak_flops.float32 must be a positive finite number, got 0"),
    (HETERO_TOML.replace('latency = 1e-5', 'latency = "fast"', 1),
     r"inter_node.latency must be a positive finite number, got 'fast'"),
    (HETERO_TOML.replace('count = 2', 'count = 0'), r"nodes\[1\].count must be a positive integer"),
    (HETERO_TOML.replace('devices = 2', 'devices = 1.5'), r"nodes\[1\].devices must be a positive"),
    (HETERO_TOML.replace('preset = "dgx-a100-80g"', 'preset = "dgx-a100"'),
     r"nodes\[0\].preset: unknown cluster preset 'dgx-a100'; choose one of dgx-a100-80g"),
    (HETERO_TOML.replace('name = "L4"\n', ''), r"nodes\[1\].device.name is missing"),
    (HETERO_TOML.replace('name = "mixed"', 'name = ""'), r"name must be a non-empty"),
    (HETERO_TOML.replace('name = "mixed"', 'nmae = "x"'), r"unknown key nmae; did you mean 'name'"),
    ('name = "x"\nbackend = "gloo"\n', r"nodes must be a non-empty list"),
    ('name = "x"\n[[nodes]]\ndevices = 2\n',
     r"nodes\[0\].device is missing; add a \[nodes.device\] table or a preset key"),
    ('name = "x"\n[[nodes]]\npreset = "cpu"\n[[nodes]]\npreset = "dgx-h100"\n',
     r"backend is missing; add backend"),
    ('name = "x"\nbackend = "nccl"\n[[nodes]]\npreset = "cpu"\n[[nodes]]\npreset = "dgx-h100"\n',
     r"inter_node is missing; add an \[inter_node\] table"),
    ('name = "x"\nnodes = [1]\n', r"nodes\[0\] must be a table, got 1"),
])
def test_bad_file_fields(tmp_path, text, match):
    with _raises(match):
        Cluster.load(_write(tmp_path, "bad.toml", text))


def test_bad_syntax_and_paths(tmp_path):
    with _raises(r"cluster file .*missing.toml not found; check the path.*dgx-h100"):
        Cluster.load(tmp_path / "missing.toml")
    with _raises(r"not found"):
        Cluster.parse(str(tmp_path / "missing.json"))
    with _raises(r"bad.toml is not valid TOML: .*line 3"):
        Cluster.load(_write(tmp_path, "bad.toml", 'name = "x"\n\nbackend = \n'))
    with _raises(r"bad.json is not valid JSON: .*line 2"):
        Cluster.load(_write(tmp_path, "bad.json", '{"name": "x",\n oops}'))
    with _raises(r"list.json: cluster must be a table, got \[1\]"):
        Cluster.load(_write(tmp_path, "list.json", "[1]"))
    with _raises(r"must end in .toml or .json, got '.yaml'"):
        Cluster.load(_write(tmp_path, "c.yaml", ""))
    with _raises(r"must end in .toml or .json"):
        Cluster.preset("cpu").save(tmp_path / "c.txt")
    with pytest.raises(OutputError, match=r"no-such-dir does not exist; create it first"):
        Cluster.preset("cpu").save(tmp_path / "no-such-dir" / "c.toml")


# ---- direct construction: one canonical form, checked in __post_init__ ----

def test_construction_validates():
    cpu = Cluster.preset("cpu")
    device, link = cpu.device_of(0), cpu.inter_link
    with _raises(r"DeviceSpec.memory_bytes must be a positive integer, got -3"):
        DeviceSpec("x", {"float32": 1e12}, -3, 1e12)
    with _raises(r"DeviceSpec.memory_bytes must be a positive integer, got 8.0"):
        DeviceSpec("x", {"float32": 1e12}, 8.0, 1e12)  # files may say 8e9; code says an int
    with _raises(r"DeviceSpec.peak_flops is empty"):
        DeviceSpec("x", {}, 8, 1e12)
    with _raises(r"unknown key DeviceSpec.peak_flops.int8"):
        DeviceSpec("x", {"int8": 1e12}, 8, 1e12)
    with _raises(r"LinkSpec.bandwidth must be a positive finite number, got inf"):
        LinkSpec(float("inf"), 1e-6)
    with _raises(r"LinkSpec.latency must be a positive finite number, got True"):
        LinkSpec(1e9, True)
    with _raises(r"NodeSpec.devices must be a positive integer, got 0"):
        NodeSpec(device, 0, link)
    with _raises(r"Cluster.nodes is empty"):
        Cluster("x", (), link, "gloo")
    with _raises(r"Cluster.backend must be .*got 'mpi'"):
        Cluster("x", cpu.nodes, link, "mpi")
    with _raises(r"Cluster.nodes\[0\] must be a NodeSpec"):
        Cluster("x", [device], link, "gloo")
    no_fp32 = DeviceSpec("fp16-only", {"float16": 1e12}, 8, 1e12)
    with _raises(r"'fp16-only' has no peak_flops for 'bfloat16' nor float32"):
        no_fp32.flops_for("bfloat16")
    assert Cluster("x", list(cpu.nodes), link, "gloo").nodes == cpu.nodes  # list -> tuple
    with pytest.raises(TypeError):
        device.peak_flops["float32"] = 1.0  # read-only


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is 3.11+")
def test_saved_toml_is_readable(tmp_path):
    import tomllib

    path = tmp_path / "c.toml"
    Cluster.preset("dgx-h100", nodes=2).save(path)
    text = path.read_text()
    assert "bandwidth = 4.5e+11" in text and "memory_bytes = 84484816896" in text
    assert tomllib.loads(text)["nodes"][0]["count"] == 2
