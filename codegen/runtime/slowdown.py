"""``launch.py --slowdown-from-cluster``: make a heterogeneous cluster real on one CPU host.

A cluster file may declare devices of different speeds (``examples/clusters/mixed.toml``:
two devices twice as fast as the other two), but the processes torchrun starts on one host
all run on the same cores. With this flag each rank computes as slowly as its device is
declared to be, relative to the fastest: rank r's factor is ``k_r = peak_fastest / peak_r``
(peak FLOP/s for the plan's precision, from the plan's cluster), times ``base`` (default 1)
to emulate devices slower than one core of this host.

Where the time goes: op by op, as the simulator prices it. ``paced(K)`` is a
``TorchDispatchMode`` that sees every ATen op the rank's thread runs (forward, backward, the
optimizer: the autograd engine runs CPU backward on the calling thread, with its modes). It
times each op in CPU seconds of the thread (``time.thread_time``: what the op computed,
however many other processes shared the cores meanwhile) and owes the rank ``K`` times that,
less the wall time the op already took; the debt is slept off once it passes ``FLUSH_S``,
and in full before every collective (a ``c10d`` or functional-collective op), so a rank
reaches each collective as late as a device ``K`` times slower would, and its waits for the
other ranks (not ops of this thread) are never stretched. A program whose ranks meet at every
split layer (uneven tensor parallelism) or every micro-batch (pipelines) is thus slowed where
it computes, not as one block at the end of the forward.

Why sleeping, not fewer threads or repeated work: a rank that repeats its work, or spins,
holds a core the other ranks on the same host need (our CI hosts have 2 cores for 4 ranks),
so the fast ranks would slow down too and the experiment would measure contention, not
heterogeneity; a sleeping rank holds none, and a ``base`` of a few makes the sleeps, not the
shared cores, fill the step. Thread counts do not give a chosen ratio (one thread is already
the torchrun default). Limits: Python between ops (and DTensor's dispatch, which runs inside
the op the mode sees) is not device time and is stretched only where it runs inside an op;
an op's time waiting inside the op for another process (none on CPU but collectives) would
be stretched, and collectives are excluded by name.
"""

from __future__ import annotations

import time
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from planner.device_groups import rank_devices

__all__ = ["FLUSH_S", "Pacer", "paced", "slowdown_factor"]

# The debt a rank carries before it sleeps: time.sleep overshoots by about 0.05-0.1 ms on
# Linux, so sleeping once per millisecond of debt or more keeps that overshoot (returned as
# credit below) a small part of each sleep.
FLUSH_S = 1e-3
# The namespaces of torch.distributed's collective ops (c10d: dist.all_reduce and friends,
# DDP's reducer, pipelining's send/recv; _c10d_functional: functional collectives, DTensor).
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")


def slowdown_factor(plan, rank: int, base: float = 1.0) -> float:
    """How many times slower than one core ``rank`` computes: ``base`` times how many times
    slower its device is than the plan cluster's fastest, by peak FLOP/s for the plan's
    precision (``base`` on the fastest devices)."""
    dtype = "float32" if plan.precision == "fp32" else "bfloat16"
    devices = rank_devices(plan.cluster)
    return base * max(device.flops_for(dtype) for device in devices) / devices[rank].flops_for(dtype)


class Pacer(TorchDispatchMode):
    """Every op of this thread lasts ``factor`` times its CPU seconds (module docstring).

    Attributes:
        factor: the stretch, at least 1.
        owed_s: seconds still to sleep (negative: the ops already took longer, as when the
            host's cores were busy with other ranks).
        slept_s: the seconds slept so far (for tests and reports).
        ops, op_cpu_s, collectives: the ops timed and their CPU seconds, and the collectives
            met, so far (``summary``).
    """

    def __init__(self, factor: float, cpu_clock=time.thread_time, wall_clock=time.perf_counter,
                 sleep=time.sleep) -> None:
        super().__init__()
        self.factor = max(1.0, float(factor))
        self.owed_s = 0.0
        self.slept_s = 0.0
        self.ops, self.op_cpu_s, self.collectives = 0, 0.0, 0
        # The clocks are parameters so a test can check the arithmetic with its own.
        self._cpu, self._wall, self._sleep = cpu_clock, wall_clock, sleep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES:
            self.settle()  # arrive as late as the slow device would; the wait itself is not compute
            self.collectives += 1
            return func(*args, **kwargs)
        wall, cpu = self._wall(), self._cpu()
        out = func(*args, **kwargs)
        cpu = self._cpu() - cpu
        self.ops += 1
        self.op_cpu_s += cpu
        self.owed_s += self.factor * cpu - (self._wall() - wall)
        if self.owed_s > FLUSH_S:
            self._sleep_debt()
        return out

    def settle(self) -> None:
        """Sleep off the whole debt now; a credit does not carry past a meeting point (the
        rank waited there anyway)."""
        if self.owed_s > 0:
            self._sleep_debt()
        self.owed_s = 0.0

    def summary(self, rank: int, steps: int) -> str:
        """One line: per step, this rank's ops, their CPU seconds, the seconds slept to
        stretch them and the collectives met (where a measured step's time went)."""
        per = max(1, steps)
        return (f"rank {rank} slowed {self.factor:g}x: per step {self.ops / per:.0f} ops, "
                f"{self.op_cpu_s / per * 1e3:.1f} ms of op CPU, {self.slept_s / per * 1e3:.1f} ms slept, "
                f"{self.collectives / per:.0f} collectives")

    def _sleep_debt(self) -> None:
        start = self._wall()
        self._sleep(self.owed_s)
        slept = self._wall() - start
        self.slept_s += slept
        self.owed_s -= slept  # an overshoot becomes credit


def paced(factor: float) -> Pacer:
    """A ``Pacer`` to enter (``with paced(k): ...``) around what the rank computes."""
    return Pacer(factor)
