"""The measuring processes of ``planner profile`` (``cost_model.profile``): every rank measures
the same points at the same time, after a barrier, so ranks contend for cores, caches and memory
as they do in training; rank 0 reports the slowest rank's time of each point. What is measured,
and how each figure becomes a cluster number, is in ``cost_model.profile``'s docstring."""

from __future__ import annotations

import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from planner.cluster import format_si
from planner.errors import PlannerError

__all__ = ["PROFILE_TIMEOUT_S", "ProfileError", "ProfileSettings", "print_progress", "run_workers"]

# Seconds the workers may take in all, before they are stopped and the profile fails.
PROFILE_TIMEOUT_S = 600.0
# Seconds a rank waits for the others in the rendezvous and in each collective.
_COLLECTIVE_TIMEOUT = timedelta(seconds=120)
# Most calls in one timed repetition (a tiny op at ~1 µs reaches target_s long before).
_MAX_CALLS = 2000
_TINY_CALLS = 200  # calls per repetition of the 1-element op: long enough for perf_counter


class ProfileError(PlannerError):
    """The machine could not be profiled (bad arguments, or the worker processes failed)."""


@dataclass(frozen=True)
class ProfileSettings:
    """What to measure and how long to spend on each point."""

    matmul_sizes: tuple[int, ...]  # n of the n×n @ n×n matmuls, ascending
    matmul_dtypes: tuple[str, ...]  # DTYPE_KEYS names; "tf32" is float32 with TF32 allowed
    stream_numels: tuple[int, ...]  # float32 elements per tensor of the streaming ops
    allreduce_bytes: tuple[int, ...]  # bytes per all-reduce, ascending
    target_s: float  # seconds of work in one timed repetition
    reps: int  # timed repetitions per point (median taken)
    slow_op_s: float  # skip a dtype's next size when one call would take longer (seconds)

    @classmethod
    def for_device(cls, kind: str, quick: bool) -> ProfileSettings:
        """Defaults for ``kind`` ("cpu" or "cuda"); ``quick`` trades accuracy for ~3× speed."""
        # Streaming tensors: three of >= 16 MiB per rank on CPU (48 MiB, more than the L3 share
        # of a rank on common servers), >= 64 MiB on GPU (more than an H100's 50 MB L2), so
        # that memory, not cache, is measured. All-reduce sizes: 4 B .. 64 MiB, every 16×.
        allreduce = (2**2, 2**10, 2**18, 2**24) if quick else tuple(2**k for k in range(2, 27, 4))
        if kind == "cuda":
            return cls(matmul_sizes=(1024, 2048, 4096) if quick else (1024, 2048, 4096, 8192),
                       matmul_dtypes=("float32", "tf32", "bfloat16", "float16"),
                       stream_numels=(2**24, 2**26) if quick else (2**24, 2**26, 2**28),
                       allreduce_bytes=allreduce, target_s=0.01 if quick else 0.05,
                       reps=3 if quick else 7, slow_op_s=0.05 if quick else 0.25)
        return cls(matmul_sizes=(256, 512, 1024) if quick else (256, 512, 1024, 2048),
                   matmul_dtypes=("float32", "bfloat16", "float16"),
                   stream_numels=(2**22, 2**23) if quick else (2**22, 2**23, 2**24),
                   allreduce_bytes=allreduce, target_s=0.01 if quick else 0.05,
                   reps=3 if quick else 7, slow_op_s=0.1 if quick else 0.5)


# ---- the workers: every rank measures the same points at the same time ----

def run_workers(nproc: int, kind: str, backend: str, threads: int | None,
                 settings: ProfileSettings) -> dict:
    """Spawn ``nproc`` ranks, return rank 0's raw measurements; ProfileError when they fail."""
    context = torch_mp.get_context("spawn")
    results = context.SimpleQueue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    try:
        workers = torch_mp.start_processes(
            _worker, args=(nproc, kind, backend, threads, settings, init_method, results),
            nprocs=nproc, join=False, start_method="spawn")
    except OSError as err:
        raise ProfileError(f"cannot start {nproc} worker processes ({err})") from None
    deadline = time.monotonic() + PROFILE_TIMEOUT_S
    try:
        while not workers.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise ProfileError(f"profiling did not finish within {PROFILE_TIMEOUT_S:.0f} s; "
                                   f"try --quick or fewer processes (--nproc)")
    except (torch_mp.ProcessRaisedException, torch_mp.ProcessExitedException) as err:
        last = [line for line in str(err).strip().splitlines() if line.strip()][-1:]
        raise ProfileError(f"a profiling process failed (rank {err.error_index}): "
                           f"{last[0].strip() if last else err}; rerun with fewer processes "
                           f"or --device cpu") from None
    finally:
        for process in workers.processes:  # only ours, and only if still running
            if process.is_alive():
                process.terminate()
    if results.empty():
        raise ProfileError("the profiling processes exited without a result")
    return results.get()


def _worker(rank: int, nproc: int, kind: str, backend: str, threads: int | None,
            settings: ProfileSettings, init_method: str, results) -> None:
    """One rank: join the group, measure every point with the others, rank 0 reports."""
    if threads is not None:
        torch.set_num_threads(threads)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback only
    device = torch.device("cpu")
    if kind == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=nproc,
                            timeout=_COLLECTIVE_TIMEOUT)
    try:
        # Control messages (barriers, the slowest rank's time) go over gloo on CPU tensors.
        control = dist.new_group(backend="gloo") if backend == "nccl" else None
        comm_device = device if backend == "nccl" else torch.device("cpu")
        bench = _Bench(device, control, settings, log=print_progress if rank == 0 else None)
        raw = bench.run(comm_device)
        if kind == "cuda":
            raw["device_name"] = torch.cuda.get_device_name(device)
            raw["device_memory"] = torch.cuda.get_device_properties(device).total_memory
        if rank == 0:
            results.put(raw)
    finally:
        dist.destroy_process_group()


class _Bench:
    """The measurements of one rank; every method is called on every rank in the same order."""

    def __init__(self, device: torch.device, control, settings: ProfileSettings,
                 log: Callable[[str], None] | None) -> None:
        self.device = device
        self.control = control
        self.settings = settings
        self.log = log or (lambda line: None)

    def run(self, comm_device: torch.device) -> dict:
        overhead = self.kernel_overhead()
        return {"overhead_s": overhead, "matmul": self.matmuls(), "stream": self.streams(),
                "allreduce": self.allreduce(comm_device)}

    def kernel_overhead(self) -> float:
        a, b, out = (torch.ones(1, device=self.device) for _ in range(3))
        seconds = self.point(lambda: torch.add(a, b, out=out), self.device, calls=_TINY_CALLS)
        self.log(f"kernel overhead (1-element add): {seconds * 1e6:.2f} µs")
        return seconds

    def matmuls(self) -> list[tuple[str, int, float]]:
        rows = []
        sizes = self.settings.matmul_sizes
        for dtype in self.settings.matmul_dtypes:
            torch_dtype = torch.float32 if dtype == "tf32" else getattr(torch, dtype)
            precision = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
            try:
                for index, size in enumerate(sizes):
                    a, b, out = self.tensors(3, (size, size), torch_dtype)
                    if a is None:
                        self.log(f"matmul {dtype}: not supported here, skipped")
                        break
                    # The three layouts of a linear layer's training step: forward x @ W.T,
                    # input gradient g @ W, weight gradient g.T @ x. Transposed operands run
                    # far slower than contiguous ones on some BLAS (2x on this CPU's), and the
                    # simulator prices every training matmul with one rate.
                    seconds = self.point(
                        lambda: (torch.mm(a, b.t(), out=out), torch.mm(a, b, out=out), torch.mm(a.t(), b, out=out)),
                        self.device,
                    )
                    rows.append((dtype, size, seconds))
                    self.log(f"matmul {dtype} {size}x{size}x{size}: "
                             f"{format_si(6 * size**3 / seconds, 'FLOP/s')}")
                    following = sizes[index + 1] if index + 1 < len(sizes) else None
                    if following and seconds / 3 * (following / size) ** 3 > self.settings.slow_op_s:
                        self.log(f"matmul {dtype}: larger sizes skipped (one call would take "
                                 f"~{seconds * (following / size) ** 3:.1f} s)")
                        break
            finally:
                torch.set_float32_matmul_precision(precision)
        return rows

    def streams(self) -> list[tuple[str, int, int, float]]:
        rows = []
        for numel in self.settings.stream_numels:
            a, b, out = self.tensors(3, (numel,), torch.float32)
            for op, moved, fn in (("add", 3 * 4 * numel, lambda: torch.add(a, b, out=out)),
                                  ("copy", 2 * 4 * numel, lambda: out.copy_(a))):
                seconds = self.point(fn, self.device)
                rows.append((op, numel, moved, seconds))
                self.log(f"{op} of {format_si(4 * numel, 'B')} tensors: "
                         f"{format_si(moved / seconds, 'B/s')}")
            del a, b, out
        return rows

    def allreduce(self, comm_device: torch.device) -> list[tuple[int, float]]:
        rows = []
        for size in self.settings.allreduce_bytes:
            # Zeros: repeated sums stay 0 (ones would overflow to inf in long loops).
            tensor = torch.zeros(max(1, size // 4), dtype=torch.float32, device=comm_device)
            seconds = self.point(lambda: dist.all_reduce(tensor), comm_device)
            rows.append((size, seconds))
            self.log(f"all_reduce {format_si(size, 'B')}: {seconds * 1e6:.1f} µs")
        return rows

    def tensors(self, count: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple:
        """``count`` random tensors, or Nones (on every rank) when the dtype cannot matmul here."""
        try:
            tensors = tuple(torch.randn(shape, device=self.device).to(dtype) for _ in range(count))
            if len(shape) == 2:
                torch.mm(tensors[0][:2, :2], tensors[1][:2, :2])
            supported = 1.0
        except (RuntimeError, TypeError, NotImplementedError):
            supported = 0.0
        if self.all_ranks_min(supported) < 1:
            return (None,) * count
        return tensors

    def point(self, fn: Callable[[], object], device: torch.device, calls: int | None = None
              ) -> float:
        """Seconds per call of ``fn``: median over repetitions, slowest rank (module docstring)."""
        fn()  # warm-up: allocation, kernel selection, first-touch of pages
        if calls is None:
            self.barrier()
            once = self.all_ranks_max(_elapsed(fn, 1, device))
            calls = max(1, min(_MAX_CALLS, math.ceil(self.settings.target_s / max(once, 1e-9))))
        samples = []
        for _ in range(self.settings.reps):
            self.barrier()
            samples.append(_elapsed(fn, calls, device) / calls)
        return self.all_ranks_max(statistics.median(samples))

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def all_ranks_max(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.control)
        return float(tensor.item())

    def all_ranks_min(self, value: float) -> float:
        return -self.all_ranks_max(-value)


def _elapsed(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Seconds for ``calls`` calls of ``fn`` (CUDA: events on the current stream)."""
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3  # elapsed_time is in milliseconds
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - begin


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]



def print_progress(line: str) -> None:
    print(f"profile: {line}", file=sys.stderr, flush=True)
