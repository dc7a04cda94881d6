"""Calibration: measure the machine we run on and describe it as a ``Cluster`` (as in Daydream).

``python -m planner profile --nproc N -o cluster.toml`` starts N worker processes on this
host, exactly as ``torchrun --nproc_per_node N`` would, and measures, on every rank at the same
time (so ranks contend for cores, caches and memory as they do in training):

  compute   ``torch.mm`` of square n×n matrices, several n, per dtype (float32 always; on
            CUDA also tf32, bfloat16, float16; on CPU also bfloat16 and float16, whose larger
            shapes are skipped once one call would take longer than ``slow_op_s``);
  memory    streaming ops on tensors larger than the caches: ``torch.add(a, b, out=c)`` moves
            3 × size bytes, ``c.copy_(a)`` moves 2 × size bytes;
  overhead  ``torch.add`` on 1-element tensors, which does no work but dispatch (and launch);
  network   ``dist.all_reduce`` of float32 tensors of 4 B .. 64 MiB over the process backend
            (gloo on CPU; nccl when every rank has a GPU of its own).

Timing. Every point is warmed up once; then one timed call sets how many calls make one timed
repetition (about ``target_s`` of work); the point's time is the median over ``reps``
repetitions of the per-call time, and of the ranks the slowest (a synchronous step waits for
it). All ranks start each repetition together after a barrier. CPU: ``time.perf_counter``;
CUDA: CUDA events on the current stream. On CPU each rank runs with
``threads = max(1, cores // nproc)`` intra-op threads, cores being the CPUs this process may
use (``os.sched_getaffinity``, else ``os.cpu_count()``); the file's comment records it.
(torchrun sets OMP_NUM_THREADS=1 per process when nproc > 1; give the training processes the
same thread count as the profile, or the numbers do not apply.)

How each number of the cluster file is derived (``t`` is a point's time in seconds):

  kernel_overhead_s  = t(tiny add).
  achieved(d, n)     = 3·2n³ / (t − kernel_overhead_s), for dtype d and size n, where t times
                       the three matmul layouts of a linear layer's training step (x @ W.T,
                       g @ W, g.T @ x), so the rate is what training matmuls reach, transposed
                       operands included.
  peak_flops[d]      = max over n of achieved(d, n): the best rate seen, not a datasheet peak.
  matmul_efficiency  = median over n of achieved(r, n) / peak_flops[r], for the reference
                       dtype r: the one measured at the most sizes, ties broken by the higher
                       peak (float32 on a CPU, bfloat16 on a recent GPU). The simulator's
                       ``peak × efficiency`` then equals r's typical (median-size) matmul rate.
                       One efficiency serves every dtype, so for the others it is approximate.
  streamed(op, s)    = bytes(op, s) / (t − kernel_overhead_s).
  memory_bandwidth   = max over (op, s) of streamed(op, s).
  memory_efficiency  = median over (op, s) of streamed(op, s) / memory_bandwidth.
  α, β (latency, bandwidth of the intra-node link) = the least-squares fit of the ring model
                       t(S) = 2(n−1)·α + 2(n−1)/n · S/β  (n = nproc, S = bytes all-reduced;
                       ``cost_model.collectives.ring_all_reduce_time``) to the all-reduce
                       times, each residual divided by its t: the times span four orders of
                       magnitude and an unweighted fit would ignore α. A non-positive α or
                       1/β (noise) is replaced by the smallest message's time / (2(n−1)), resp.
                       the largest message's bandwidth term alone (see ``fit_alpha_beta``).
  inter_link         = the intra-node link: one host has no inter-node network, so this is a
                       stand-in that lets "profile:2" style clusters load; edit it for a real
                       multi-host cluster.
  memory_bytes       = CPU: physical RAM (or the cgroup limit, if lower) / nproc;
                       CUDA: the GPU's memory / the ranks sharing it.

Layering: imports torch, numpy and ``planner.cluster``/``planner.errors``; imported by the CLI
only when ``planner profile`` runs (torch is slow to import).
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import torch

from cost_model.profile_workers import ProfileError, ProfileSettings, print_progress, run_workers
from planner.cluster import Cluster, DeviceSpec, LinkSpec, NodeSpec, format_si


@dataclass(frozen=True)
class MatmulSample:
    """One matmul point: the three n×n @ n×n layouts of a linear layer's training step
    (``a @ b.T``, ``a @ b``, ``a.T @ b``) in ``dtype`` took ``seconds`` together."""

    dtype: str
    size: int
    seconds: float

    @property
    def flops(self) -> float:
        return 3 * 2.0 * self.size**3


@dataclass(frozen=True)
class StreamSample:
    """One streaming point: ``op`` on float32 tensors of ``numel`` elements moved ``bytes``."""

    op: str
    numel: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class MachineProfile:
    """Everything measured, and the Cluster derived from it (see the module docstring)."""

    cluster: Cluster
    kind: str  # "cpu" or "cuda"
    nproc: int
    threads: int | None  # intra-op threads per process on CPU; None on CUDA
    overhead_s: float
    matmuls: tuple[MatmulSample, ...]
    streams: tuple[StreamSample, ...]
    allreduce: tuple[tuple[int, float], ...]  # (bytes, seconds)
    quick: bool
    wall_s: float

    @property
    def device(self) -> DeviceSpec:
        return self.cluster.nodes[0].device

    @property
    def link(self) -> LinkSpec:
        return self.cluster.nodes[0].intra_link

    def table(self) -> list[tuple[str, str]]:
        """(quantity, value) rows for the CLI: what was measured, in readable units."""
        device, link = self.device, self.link
        rows = [("device", f"{device.name} x {self.nproc} ({self.cluster.backend})")]
        for dtype, flops in device.peak_flops.items():
            sizes = [s.size for s in self.matmuls if s.dtype == dtype]
            rows.append((f"peak {dtype}", f"{format_si(flops, 'FLOP/s')} "
                                          f"(best of n = {', '.join(map(str, sizes))})"))
        rows += [("matmul efficiency", f"{device.matmul_efficiency:.3f}"),
                 ("memory bandwidth", format_si(device.memory_bandwidth, "B/s")),
                 ("memory efficiency", f"{device.memory_efficiency:.3f}"),
                 ("kernel overhead", f"{device.kernel_overhead_s * 1e6:.2f} µs"),
                 ("memory per process" if self.kind == "cpu" else "memory per device",
                  format_si(device.memory_bytes, "B")),
                 ("all-reduce α (latency)", f"{link.latency * 1e6:.1f} µs"),
                 ("all-reduce β (bandwidth)", format_si(link.bandwidth, "B/s")),
                 ("profiling time", f"{self.wall_s:.1f} s")]
        return rows

    def notes(self) -> str:
        """How the profile was taken, for the comment at the top of the cluster file."""
        threads = (f"{self.threads} intra-op thread{'s' if self.threads != 1 else ''} per "
                   f"process (torch.set_num_threads; cores // nproc)" if self.threads else
                   "one GPU per process" if self.cluster.backend == "nccl" else
                   "processes sharing GPUs, collectives on CPU tensors")
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        rates = [f"  {dtype}: " + ", ".join(
            f"n={s.size} {format_si(s.flops / s.seconds, 'FLOP/s')}"
            for s in self.matmuls if s.dtype == dtype) for dtype in self.device.peak_flops]
        return "\n".join([
            f"Measured by `planner profile --nproc {self.nproc}{' --quick' if self.quick else ''}`"
            f" on {_host_label()}, {when}, torch {torch.__version__}:",
            f"{self.nproc} {self.kind.upper()} processes over {self.cluster.backend}, {threads}.",
            "Matmul rates (n×n @ n×n, slowest rank):", *rates,
            "peak_flops = best rate per dtype; calibration = measured efficiencies and per-op "
            "overhead;",
            "intra_node = all-reduce α/β fit; inter_node is a stand-in (= intra_node): one host "
            "has no inter-node network.",
        ])


# ---- the entry points ----

def profile_machine(nproc: int = 2, device: str | None = None, quick: bool = False) -> Cluster:
    """Measure this machine and return it as a one-node Cluster (see the module docstring).

    Args:
        nproc: worker processes (ranks) on this host, as ``torchrun --nproc_per_node``; >= 2,
            since collectives need two ranks.
        device: "cpu" or "cuda"; None picks CUDA when available.
        quick: fewer sizes and repetitions (on a 2-core CPU: ~5-10 s against ~20-30 s, of
            which ~4 s start the processes).
    Returns:
        ``Cluster(name="profiled-<hostname>")`` with measured peak FLOP/s, bandwidth,
        calibration and links. Raises ProfileError when it cannot measure.

    The workers are started with the "spawn" method, which imports the caller's main module
    again: a script that calls this needs the usual ``if __name__ == "__main__":`` guard.
    """
    return measure_machine(nproc, device, quick).cluster


def measure_machine(nproc: int = 2, device: str | None = None, quick: bool = False,
                    log: Callable[[str], None] | None = None) -> MachineProfile:
    """``profile_machine`` with the raw measurements kept (for the CLI's table and file notes).

    Args:
        nproc, device, quick: as ``profile_machine``.
        log: receives one progress line per step; default: printed to stderr.
    Returns:
        The MachineProfile; ``.cluster`` is what ``profile_machine`` returns.
    """
    log = log or print_progress
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 2:
        raise ProfileError(f"nproc must be an integer >= 2 (collectives need two ranks), "
                           f"got {nproc!r}; pass --nproc 2 or more")
    kind = _device_kind(device)
    gpus = torch.cuda.device_count() if kind == "cuda" else 0
    backend = "nccl" if kind == "cuda" and nproc <= gpus else "gloo"
    cores = _usable_cores()
    threads = max(1, cores // nproc) if kind == "cpu" else None
    settings = ProfileSettings.for_device(kind, quick)
    how = f"{threads} thread{'s' if threads != 1 else ''} each" if threads else f"{gpus} GPUs"
    log(f"profiling {nproc} {kind} processes over {backend} ({how}; {cores} cores)"
        f"{', quick' if quick else ''}")
    start = time.perf_counter()
    raw = run_workers(nproc, kind, backend, threads, settings)
    wall = time.perf_counter() - start

    overhead = raw["overhead_s"]
    matmuls = tuple(MatmulSample(*row) for row in raw["matmul"])
    streams = tuple(StreamSample(*row) for row in raw["stream"])
    allreduce = tuple((int(size), float(seconds)) for size, seconds in raw["allreduce"])
    peak_flops, matmul_efficiency = matmul_calibration(matmuls, overhead)
    bandwidth, memory_efficiency = stream_calibration(streams, overhead)
    alpha, beta = fit_alpha_beta([s for s, _ in allreduce], [t for _, t in allreduce], nproc)
    if kind == "cpu":
        name = f"cpu-process ({threads} thread{'s' if threads != 1 else ''})"
        memory = _host_memory_bytes() // nproc
    else:
        name = raw["device_name"]
        memory = raw["device_memory"] // math.ceil(nproc / gpus)  # ranks sharing one GPU
    spec = DeviceSpec(name=name, peak_flops=peak_flops, memory_bytes=memory,
                      memory_bandwidth=bandwidth, matmul_efficiency=matmul_efficiency,
                      memory_efficiency=memory_efficiency, kernel_overhead_s=overhead)
    link = LinkSpec(bandwidth=beta, latency=alpha)
    cluster = Cluster(name=f"profiled-{_host_label()}", nodes=(NodeSpec(spec, nproc, link),),
                      inter_link=link, backend=backend)
    log(f"done in {wall:.1f} s")
    return MachineProfile(cluster=cluster, kind=kind, nproc=nproc, threads=threads,
                          overhead_s=overhead, matmuls=matmuls, streams=streams,
                          allreduce=allreduce, quick=quick, wall_s=wall)


# ---- from measurements to cluster numbers (pure; the formulas of the module docstring) ----

def matmul_calibration(samples: Sequence[MatmulSample], overhead_s: float
                       ) -> tuple[dict[str, float], float]:
    """peak_flops per dtype and matmul_efficiency, as defined in the module docstring."""
    if not samples:
        raise ProfileError("no matmul could be timed on this device; check that torch.mm "
                           "works for float32 here")
    rates: dict[str, list[float]] = {}
    for sample in samples:
        rates.setdefault(sample.dtype, []).append(sample.flops / _net(sample.seconds, overhead_s))
    peaks = {dtype: max(values) for dtype, values in rates.items()}
    reference = max(rates, key=lambda dtype: (len(rates[dtype]), peaks[dtype]))
    efficiency = statistics.median(rate / peaks[reference] for rate in rates[reference])
    return peaks, efficiency


def stream_calibration(samples: Sequence[StreamSample], overhead_s: float) -> tuple[float, float]:
    """(memory_bandwidth, memory_efficiency), as defined in the module docstring."""
    if not samples:
        raise ProfileError("no streaming op could be timed on this device")
    rates = [sample.bytes / _net(sample.seconds, overhead_s) for sample in samples]
    best = max(rates)
    return best, statistics.median(rate / best for rate in rates)


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], nproc: int
                   ) -> tuple[float, float]:
    """Fit the ring all-reduce model t = 2(n−1)·α + 2(n−1)/n · S/β to measured times.

    Least squares on the relative error (each row divided by its t), with unknowns α and 1/β.

    Args:
        sizes: bytes all-reduced per call (at least two distinct sizes).
        times: seconds per call, same order.
        nproc: ranks taking part (n), >= 2.
    Returns:
        (α seconds, β bytes/s), both positive: a non-positive α becomes the smallest message's
        time / (2(n−1)); a non-positive 1/β becomes the largest message's bandwidth
        2(n−1)/n · S / (t − 2(n−1)·α) (or / t when α eats all of t).
    """
    sizes_arr = np.asarray(sizes, dtype=np.float64)
    times_arr = np.asarray(times, dtype=np.float64)
    if sizes_arr.shape != times_arr.shape or len(set(sizes_arr.tolist())) < 2 or nproc < 2:
        raise ProfileError(f"need all-reduce times of at least two sizes on >= 2 ranks to fit "
                           f"α and β, got sizes {list(sizes)} on {nproc} ranks")
    if not np.all(np.isfinite(times_arr)) or np.any(times_arr <= 0):
        raise ProfileError(f"all-reduce times must be positive and finite, got {list(times)}")
    hops = 2.0 * (nproc - 1)
    design = np.column_stack([np.full_like(sizes_arr, hops), hops / nproc * sizes_arr])
    weights = 1.0 / times_arr
    (alpha, inverse_beta), *_ = np.linalg.lstsq(design * weights[:, None], times_arr * weights,
                                                rcond=None)
    if not alpha > 0:
        alpha = float(times_arr[np.argmin(sizes_arr)]) / hops
    if not inverse_beta > 0:
        largest = int(np.argmax(sizes_arr))
        wire = times_arr[largest] - hops * alpha
        wire = wire if wire > 0 else times_arr[largest]
        inverse_beta = wire / (hops / nproc * sizes_arr[largest])
    return float(alpha), float(1.0 / inverse_beta)


def _net(seconds: float, overhead_s: float) -> float:
    """A call's time less the per-op overhead, never below half of it (noise guard)."""
    return max(seconds - overhead_s, seconds / 2)


# ---- the host ----

def _device_kind(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = str(device).lower().split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ProfileError(f"device must be \"cpu\" or \"cuda\", got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ProfileError("device \"cuda\" asked for, but torch sees no CUDA GPU here; "
                           "profile the CPU instead (leave the device out)")
    return kind


def _usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _host_memory_bytes() -> int:
    """Physical RAM in bytes, or the cgroup (v2 or v1) memory limit when that is lower."""
    total = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024  # the file says kB, meaning KiB
                    break
    except (OSError, ValueError):
        pass
    if not total and hasattr(os, "sysconf"):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (OSError, ValueError):
            total = 0
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file, encoding="ascii") as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < (total or float("inf")):
            total = int(text)
    if not total:
        raise ProfileError("cannot read this machine's memory size (/proc/meminfo, sysconf)")
    return total


def _host_label() -> str:
    """The host name, reduced to printable characters for the cluster's name."""
    label = "".join(ch for ch in socket.gethostname() if ch.isprintable() and not ch.isspace())
    return label or "localhost"
