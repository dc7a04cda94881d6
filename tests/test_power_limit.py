"""A board power limit lowers a GPU's peak as its clock (planner.power_limit, with_power_limit).

Worked by hand from the NVIDIA H100 datasheet: H100 SXM 700 W, 989.4 dense BF16 TFLOP/s; H100
NVL 400 W, 835.5. Exponent ln(989.4 / 835.5) / ln(700 / 400) = 0.16907 / 0.55962 = 0.30211.
At 500 W: (500 / 700) ** 0.30211 = exp(0.30211 x -0.33647) = exp(-0.101652) = 0.90335, so
989.4 x 0.90335 = 893.77 TFLOP/s.
"""

from __future__ import annotations

import pytest

from cost_model.gpu_kernels import generation_of, matmul_time
from cost_model.nccl import nccl_profile
from planner.cluster import Cluster
from planner.cluster_edits import link_scales, preset_changes, provenance, with_memory, with_power_limit
from planner.errors import ClusterError
from planner.power_limit import H100_POWER_POINTS, clock_exponent, peak_scale_at_power_limit


def test_the_two_datasheet_points_give_the_clock_exponent():
    assert clock_exponent() == pytest.approx(0.30211, abs=5e-5)
    # The law goes through both points: at the NVL's 400 W it gives the NVL's peak.
    assert 989.4e12 * peak_scale_at_power_limit(400.0) == pytest.approx(H100_POWER_POINTS[0][1], rel=1e-12)
    assert peak_scale_at_power_limit(700.0) == 1.0


def test_500_watts_is_90_percent_of_the_sxm_peak_and_inside_the_sources_bounds():
    scale = peak_scale_at_power_limit(500.0)
    assert scale == pytest.approx(0.90335, abs=5e-5)
    assert 989.4 * scale == pytest.approx(893.77, abs=0.01)
    assert 835.5 < 989.4 * scale < 989.4  # torchtitan: "between SXM and NVL"


def test_a_limit_above_the_datasheets_buys_no_clock():
    assert peak_scale_at_power_limit(1000.0) == 1.0


def test_with_power_limit_scales_every_peak_and_keeps_the_measured_collectives():
    h100 = with_memory(Cluster.preset("dgx-h100", nodes=2), memory_bytes=96_000_000_000)
    capped = with_power_limit(h100, 500.0)
    device, before = capped.device_of(0), h100.device_of(0)
    for dtype in ("float32", "bfloat16", "float8"):
        assert device.flops_for(dtype) == pytest.approx(0.90335 * before.flops_for(dtype), rel=1e-4)
    assert device.memory_bandwidth == before.memory_bandwidth  # HBM has its own clock
    assert nccl_profile(capped) == nccl_profile(h100)  # collectives and contention as measured
    assert link_scales(capped) == link_scales(h100)
    peak_change = next(change for change in preset_changes(capped) if change.startswith("peak FLOP/s"))
    assert "bfloat16 989 TFLOP/s" in peak_change and "bfloat16 894 TFLOP/s" in peak_change
    assert "collectives: NCCL as measured on dgx-h100" in provenance(capped)


def test_a_compute_bound_gemm_slows_by_the_clock_ratio():
    h100 = Cluster.preset("dgx-h100")
    capped = with_power_limit(h100, 500.0)
    # The MAMF shape is compute-bound: its time less the 5 us launch scales as 1 / 0.90335.
    launch = 5e-6
    full = matmul_time(1, 6144, 17920, 2816, h100.device_of(0), "bfloat16", 2, generation_of(h100.device_of(0)))
    slow = matmul_time(1, 6144, 17920, 2816, capped.device_of(0), "bfloat16", 2, generation_of(capped.device_of(0)))
    assert (slow - launch) / (full - launch) == pytest.approx(1 / 0.90335, rel=1e-4)


def test_bad_limits_and_other_gpus_get_one_clear_error():
    with pytest.raises(ClusterError, match="power limit must be positive watts"):
        with_power_limit(Cluster.preset("dgx-h100"), 0)
    with pytest.raises(ClusterError, match="only be applied to H100 devices.*A100-SXM4-80GB.*set the device's peak_flops"):
        with_power_limit(Cluster.preset("dgx-a100-80g"), 300)
