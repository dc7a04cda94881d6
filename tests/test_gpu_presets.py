"""GPUs and cloud instance types by name (``planner.gpu_presets``): ``--cluster h100:16``,
``a100-40g:8x4``, ``p5:2``... with their datasheet and network figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_model.nccl import nccl_profile
from planner import baselines
from planner.cli import main
from planner.cluster import Cluster, preset_names
from planner.model_spec import ModelSpec

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
NAMED = ("h100", "h200", "a100", "a100-40g", "v100", "l40s", "mi300x", "p4d", "p5", "a3", "nd-h100-v5")


def test_every_named_preset_is_listed_on_one_line(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in lines]
    assert listed == preset_names()
    assert set(NAMED) <= set(listed)


@pytest.mark.parametrize("name", NAMED)
def test_each_parses_with_node_and_gpu_counts(name):
    cluster = Cluster.parse(f"{name}:2x4")
    assert cluster.world_size == 8 and cluster.num_nodes == 2
    assert cluster.derived_from == name


def test_network_figures_per_gpu_worked_by_hand():
    """Stated node rates shared by 8 GPUs: Gb/s x 1e9 / 8 bits / 8 GPUs."""
    per_gpu = {name: Cluster.parse(f"{name}:2").inter_link.bandwidth for name in ("p5", "p4d", "a3", "v100", "nd-h100-v5")}
    assert per_gpu["p5"] == pytest.approx(3200e9 / 8 / 8)  # 50 GB/s
    assert per_gpu["p4d"] == pytest.approx(400e9 / 8 / 8)  # 6.25 GB/s
    assert per_gpu["a3"] == pytest.approx(1000e9 / 8 / 8)  # 15.625 GB/s
    assert per_gpu["v100"] == pytest.approx(4 * 100e9 / 8 / 8)  # DGX-1: 4 x EDR
    assert per_gpu["nd-h100-v5"] == pytest.approx(8 * 400e9 / 8 / 8)  # one 400 Gb/s NDR per GPU


def test_device_figures():
    device = {name: Cluster.parse(name).nodes[0].device for name in ("h200", "a100-40g", "mi300x", "v100")}
    assert device["h200"].memory_bytes == 141e9 and device["h200"].memory_bandwidth == 4.8e12
    assert device["a100-40g"].memory_bytes == 40e9
    assert device["mi300x"].peak_flops["bfloat16"] == 1307.4e12
    assert "bfloat16" not in device["v100"].peak_flops  # Volta has no bf16 tensor cores


def test_80gb_gpus_hold_what_nvidia_smi_reports_less_the_cited_reserve():
    """An H100 80GB reports 81,559 MiB and an A100 80GB 81,920 MiB (nvidia-smi); a training
    process has those less 300 MiB of CUDA context and 688 MiB of one NCCL communicator:
    H100 (81,559 - 300 - 688) x 1,048,576 = 80,571 x 1,048,576 = 84,484,816,896 B (78.68 GiB),
    A100 80,932 x 1,048,576 = 84,863,352,832 B (79.04 GiB); not the datasheets' 80e9 (74.5 GiB).
    Every preset of the same board holds the same (the H800 is the H100's 80 GB HBM3 board)."""
    def memory(name: str) -> int:
        return Cluster.parse(f"{name}:1").nodes[0].device.memory_bytes

    h100 = {name: memory(name) for name in ("h100", "dgx-h100", "p5", "a3", "hgx-h800")}
    a100 = {name: memory(name) for name in ("a100", "dgx-a100-80g")}
    assert set(h100.values()) == {84_484_816_896}
    assert set(a100.values()) == {84_863_352_832}


def test_h100_by_name_is_priced_as_the_dgx_preset():
    """Same hardware, same measured NCCL curves: the same plan predicts the same step."""
    assert nccl_profile(Cluster.parse("h100:2")) is not None
    assert nccl_profile(Cluster.parse("p5:2")) is None  # EFA: no published nccl-tests figures here
    spec = ModelSpec(GPT, {"n_layer": 2, "batch_size": 32})
    by_name = baselines.ddp(spec, "h100:2", precision="bf16")
    dgx = baselines.ddp(spec, "dgx-h100:2", precision="bf16")
    assert by_name.estimate.step_time_s == pytest.approx(dgx.estimate.step_time_s, rel=1e-12)
    slower_network = baselines.ddp(spec, "a3:2", precision="bf16")
    assert slower_network.estimate.step_time_s > dgx.estimate.step_time_s
