"""Tests of calibration: the α/β fit, the derived numbers, calibration fields in cluster files,
one real (quick) profile of this machine, and the ``planner profile`` command."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cost_model import profile as profile_module
from cost_model.profile import (MachineProfile, MatmulSample, ProfileError, StreamSample,
                                fit_alpha_beta, matmul_calibration, profile_machine,
                                stream_calibration)
from planner.cli import main
from planner.cluster import Cluster, DeviceSpec, LinkSpec, NodeSpec
from planner.errors import ClusterError

SIZES = [2**k for k in range(2, 27, 4)]  # 4 B .. 64 MiB, as the default profile


def _ring_time(size: float, nproc: int, alpha: float, beta: float) -> float:
    """t = 2(n−1)·α + 2(n−1)/n · S/β, worked out directly."""
    return 2 * (nproc - 1) * alpha + 2 * (nproc - 1) / nproc * size / beta


def _calibrated_device(**calibration) -> DeviceSpec:
    return DeviceSpec("cpu-process (1 thread)", {"float32": 80e9, "bfloat16": 1.3e9},
                      12 * 2**30, 16e9, **calibration)


def _cluster(device: DeviceSpec) -> Cluster:
    link = LinkSpec(bandwidth=1.1e9, latency=2e-4)
    return Cluster("profiled-test", (NodeSpec(device, 2, link),), link, "gloo")


# ---- the α/β fit ----

@pytest.mark.parametrize("nproc, alpha, beta", [(2, 2e-4, 1.1e9), (4, 25e-6, 3e9),
                                                (8, 3e-6, 450e9)])
def test_fit_recovers_alpha_beta(nproc, alpha, beta):
    times = [_ring_time(size, nproc, alpha, beta) for size in SIZES]
    fitted_alpha, fitted_beta = fit_alpha_beta(SIZES, times, nproc)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-9)
    assert fitted_beta == pytest.approx(beta, rel=1e-9)


def test_fit_weights_relative_error():
    # 10% noise on the 4-byte point alone must move α by about 10%, not be drowned out by
    # the 64 MiB point (an unweighted fit would fit the large sizes and get α badly wrong).
    times = [_ring_time(size, 2, 1e-4, 1e9) for size in SIZES]
    times[0] *= 1.1
    alpha, beta = fit_alpha_beta(SIZES, times, 2)
    assert 1.0 < alpha / 1e-4 < 1.1 and beta == pytest.approx(1e9, rel=0.01)


def test_fit_clamps_to_positive():
    # Exact data from t = S/β − 100 µs: the fit says α = −50 µs; α becomes t(smallest)/(2(n−1)).
    sizes = [1e6, 2e6, 4e6]
    alpha, beta = fit_alpha_beta(sizes, [size / 1e9 - 1e-4 for size in sizes], 2)
    assert alpha == pytest.approx(9e-4 / 2) and beta == pytest.approx(1e9)
    # Larger messages faster than smaller ones: 1/β < 0; β becomes S/t of the largest.
    alpha, beta = fit_alpha_beta([4, 1e6], [2e-3, 1e-3], 2)
    assert alpha > 0 and beta == pytest.approx(1e6 / 1e-3)


def test_fit_rejects_unusable_data():
    with pytest.raises(ProfileError, match="at least two sizes"):
        fit_alpha_beta([1024, 1024], [1e-3, 1e-3], 2)
    with pytest.raises(ProfileError, match="positive and finite"):
        fit_alpha_beta([4, 1024], [1e-3, 0.0], 2)


# ---- measurements -> cluster numbers ----

def test_matmul_calibration_by_hand():
    overhead = 1e-6
    # float32: one point is the three layouts of a linear layer's step (x @ W.T, g @ W,
    # g.T @ x), 3 · 2n³ FLOP, at 50, 80, 100, 90 GFLOP/s once the overhead is taken off.
    rates = {256: 50e9, 512: 80e9, 1024: 100e9, 2048: 90e9}
    samples = [MatmulSample("float32", n, 3 * 2 * n**3 / rate + overhead) for n, rate in rates.items()]
    samples.append(MatmulSample("bfloat16", 256, 3 * 2 * 256**3 / 1e9 + overhead))  # one size only
    peaks, efficiency = matmul_calibration(samples, overhead)
    assert peaks == pytest.approx({"float32": 100e9, "bfloat16": 1e9})
    # Reference dtype: float32 (most sizes); median of 0.5, 0.8, 1.0, 0.9 = 0.85.
    assert efficiency == pytest.approx(0.85)
    with pytest.raises(ProfileError, match="no matmul"):
        matmul_calibration([], overhead)


def test_stream_calibration_by_hand():
    samples = [StreamSample("add", 2**22, 3 * 4 * 2**22, 3 * 4 * 2**22 / 20e9),
               StreamSample("copy", 2**22, 2 * 4 * 2**22, 2 * 4 * 2**22 / 16e9),
               StreamSample("add", 2**23, 3 * 4 * 2**23, 3 * 4 * 2**23 / 10e9)]
    bandwidth, efficiency = stream_calibration(samples, overhead_s=0.0)
    assert bandwidth == pytest.approx(20e9) and efficiency == pytest.approx(0.8)


# ---- calibration fields on DeviceSpec and in cluster files ----

def test_calibration_fields_default_and_validate():
    plain = DeviceSpec("x", {"float32": 1e12}, 8, 1e12)
    assert (plain.matmul_efficiency, plain.memory_efficiency, plain.kernel_overhead_s) \
        == (None, None, None) and plain.calibration == {}
    device = _calibrated_device(matmul_efficiency=1, memory_efficiency=0.5, kernel_overhead_s=0)
    assert device.matmul_efficiency == 1.0 and isinstance(device.matmul_efficiency, float)
    assert device.calibration == {"matmul_efficiency": 1.0, "memory_efficiency": 0.5,
                                  "kernel_overhead_s": 0.0}
    for bad in (0, 1.5, -0.1, float("nan"), True, "0.9"):
        with pytest.raises(ClusterError, match=r"DeviceSpec.matmul_efficiency must be a "
                                               r"fraction in \(0, 1\]"):
            _calibrated_device(matmul_efficiency=bad)
    with pytest.raises(ClusterError, match=r"DeviceSpec.memory_efficiency must be a fraction"):
        _calibrated_device(memory_efficiency=2.0)
    for bad in (-1e-6, float("inf"), False):
        with pytest.raises(ClusterError, match=r"DeviceSpec.kernel_overhead_s must be a finite "
                                               r"number of seconds >= 0"):
            _calibrated_device(kernel_overhead_s=bad)
    # Hashable (a cache key), and calibration is part of equality.
    assert hash(_cluster(device)) == hash(_cluster(device))
    assert _cluster(device) != _cluster(_calibrated_device())


@pytest.mark.parametrize("suffix", [".toml", ".json"])
@pytest.mark.parametrize("calibration", [
    {"matmul_efficiency": 0.93, "memory_efficiency": 0.71, "kernel_overhead_s": 2.2e-6},
    {"kernel_overhead_s": 5e-6},  # partly calibrated: the others stay None
    {},
])
def test_calibration_round_trip(tmp_path, suffix, calibration):
    cluster = _cluster(_calibrated_device(**calibration))
    path = tmp_path / f"c{suffix}"
    cluster.save(path, comment="measured by a test\nsecond line")
    assert Cluster.load(path) == cluster
    assert Cluster.parse(str(path)) == cluster
    assert Cluster.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster
    text = path.read_text()
    if suffix == ".toml":
        assert ("[nodes.device.calibration]" in text) == bool(calibration)
        assert "# measured by a test\n# second line\n" in text
    else:
        assert ("calibration" in text) == bool(calibration)


def test_calibration_in_files(tmp_path):
    base = ('name = "lab"\n[[nodes]]\npreset = "cpu"\n'
            '[nodes.device.calibration]\nmatmul_efficiency = 0.9\n')
    path = tmp_path / "lab.toml"
    path.write_text(base)
    device = Cluster.load(path).device_of(0)
    assert device.matmul_efficiency == 0.9 and device.memory_efficiency is None
    assert device.peak_flops == Cluster.preset("cpu").device_of(0).peak_flops  # preset kept
    for text, match in [
        (base.replace("0.9", "1.5"), r"lab.toml: nodes\[0\].device.calibration.matmul_efficiency "
                                     r"must be a fraction in \(0, 1\], got 1.5"),
        (base.replace("matmul_efficiency", "matmul_eficiency"),
         r"unknown key nodes\[0\].device.calibration.matmul_eficiency; did you mean "
         r"'matmul_efficiency'"),
        (base.replace("matmul_efficiency = 0.9", "kernel_overhead_s = -1"),
         r"nodes\[0\].device.calibration.kernel_overhead_s must be a finite number of seconds"),
    ]:
        path.write_text(text)
        with pytest.raises(ClusterError, match=match):
            Cluster.load(path)


# ---- a real profile of this machine ----

def test_profile_machine_quick(tmp_path):
    cluster = profile_machine(nproc=2, quick=True)
    device, link = cluster.device_of(0), cluster.nodes[0].intra_link
    assert cluster.world_size == 2 and cluster.num_nodes == 1
    assert cluster.name.startswith("profiled-")
    assert cluster.backend == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    assert "float32" in device.peak_flops
    numbers = [*device.peak_flops.values(), device.memory_bandwidth, device.memory_bytes,
               device.kernel_overhead_s, link.bandwidth, link.latency]
    assert all(math.isfinite(value) and value > 0 for value in numbers), numbers
    assert 0 < device.matmul_efficiency <= 1 and 0 < device.memory_efficiency <= 1
    assert cluster.inter_link == link  # the single-host stand-in
    path = tmp_path / "cluster.toml"
    cluster.save(path)
    assert Cluster.load(path) == cluster and Cluster.parse(str(path)) == cluster


def test_profile_arguments_checked_before_spawning():
    with pytest.raises(ProfileError, match="nproc must be an integer >= 2"):
        profile_machine(nproc=1)
    with pytest.raises(ProfileError, match='device must be "cpu" or "cuda", got \'tpu\''):
        profile_machine(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ProfileError, match="no CUDA GPU"):
            profile_machine(device="cuda")


# ---- the command ----

def _canned_profile(nproc: int, device: str | None, quick: bool) -> MachineProfile:
    """What measure_machine would return, without the seconds of measuring."""
    cluster = _cluster(_calibrated_device(matmul_efficiency=0.96, memory_efficiency=0.94,
                                          kernel_overhead_s=1.7e-6))
    return MachineProfile(
        cluster=cluster, kind="cpu", nproc=nproc, threads=1, overhead_s=1.7e-6,
        matmuls=(MatmulSample("float32", 256, 2 * 256**3 / 80e9),
                 MatmulSample("bfloat16", 256, 2 * 256**3 / 1.3e9)),
        streams=(StreamSample("add", 2**22, 3 * 4 * 2**22, 3 * 4 * 2**22 / 16e9),),
        allreduce=((4, 4e-4), (2**24, 3e-2)), quick=quick, wall_s=4.0)


def test_cli_profile(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(profile_module, "measure_machine",
                        lambda *args: calls.append(args) or _canned_profile(*args))
    path = tmp_path / "cluster.toml"
    assert main(["profile", "--quick", "--nproc", "2", "-o", str(path)]) == 0
    assert calls == [(2, None, True)]
    out = capsys.readouterr().out
    for expected in ("peak float32", "80 GFLOP/s", "matmul efficiency", "0.960",
                     "memory bandwidth", "16 GB/s", "all-reduce α (latency)", "200.0 µs",
                     "all-reduce β (bandwidth)", "1.1 GB/s",
                     f"next: planner plan examples/gpt.py --cluster {path}"):
        assert expected in out, expected
    assert Cluster.parse(str(path)) == _canned_profile(2, None, True).cluster
    assert "# Measured by `planner profile --nproc 2 --quick`" in path.read_text()


def test_cli_profile_errors_before_measuring(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(profile_module, "measure_machine",
                        lambda *args: pytest.fail("measured despite a bad output path"))
    for output, match in [(tmp_path / "missing" / "c.toml", "missing does not exist"),
                          (tmp_path / "c.yaml", "must end in .toml or .json"),
                          (tmp_path, "must end in .toml or .json")]:
        assert main(["profile", "-o", str(output)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: cluster file") or err.startswith("error: cannot write")
        assert match in err and err.count("\n") == 1


def test_cli_profile_bad_nproc(tmp_path, capsys):
    assert main(["profile", "--nproc", "1", "-o", str(tmp_path / "c.toml")]) == 2
    assert "argument --nproc: must be an integer >= 2, got '1'" in capsys.readouterr().err


def test_cli_profile_one_group_of_a_mixed_cluster(tmp_path, monkeypatch, capsys):
    # Measured on a node of the "cpu-slow" group of examples/clusters/mixed.toml (2 devices a
    # node, so --nproc 2 measures its intra-node link too): that group's devices take the
    # measured figures under their own name; cpu-fast and the network between nodes stay.
    mixed = Path(__file__).resolve().parents[1] / "examples/clusters/mixed.toml"
    monkeypatch.setattr(profile_module, "measure_machine", lambda *args: _canned_profile(*args))
    path = tmp_path / "mixed-profiled.toml"
    assert main(["profile", "--nproc", "2", "--cluster", str(mixed), "--group", "cpu-slow", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert "cpu-slow (measured here); groups cpu-fast keep the file's figures" in out
    written, before = Cluster.load(path), Cluster.load(mixed)
    measured = _canned_profile(2, None, False).cluster.nodes[0]
    slow, fast = written.device_of(2), written.device_of(0)
    assert slow.name == "cpu-slow" and slow.peak_flops == measured.device.peak_flops
    assert slow.kernel_overhead_s == 1.7e-6 and written.nodes[1].intra_link == measured.intra_link
    assert fast == before.device_of(0) and written.inter_link == before.inter_link
    assert "device group 'cpu-slow' measured on this host" in path.read_text()


def test_cli_profile_group_errors_before_measuring(tmp_path, monkeypatch, capsys):
    mixed = str(Path(__file__).resolve().parents[1] / "examples/clusters/mixed.toml")
    monkeypatch.setattr(profile_module, "measure_machine", lambda *args: pytest.fail("measured despite a bad group"))
    for arguments, match in ((["--cluster", mixed, "--group", "h100"], "has no device group 'h100'"),
                             (["--group", "cpu-slow"], "--cluster and --group go together")):
        assert main(["profile", *arguments, "-o", str(tmp_path / "c.toml")]) == 2
        err = capsys.readouterr().err
        assert match in err and err.count("\n") == 1, err
