"""``launch.py --slowdown-from-cluster``: make a heterogeneous cluster real on one CPU host.

A cluster file may declare devices of different speeds (``examples/clusters/mixed.toml``:
two devices twice as fast as the other two), but the processes torchrun starts on one host
all run on the same cores. With this flag each rank computes as slowly as its device is
declared to be, relative to the fastest: rank r's factor is ``k_r = peak_fastest / peak_r``
(peak FLOP/s for the plan's precision, from the plan's cluster), times ``base`` (default 1)
to emulate devices slower than one core of this host. ``slow_down`` measures each forward of
the rank's module in CPU seconds of its thread (``time.thread_time``: what the forward
computed, however many other processes shared the cores meanwhile) and sleeps until the
forward has lasted ``K = base * k_r`` times that; the module's output carries a pass-through
autograd step whose backward, the first of the backward pass, sleeps ``(K - 1)`` times twice
the forward's CPU seconds (a backward does twice a forward's FLOPs, the cost model's
``BACKWARD_TO_FORWARD``). So the rank's forward and backward last about ``K`` times its own
compute, and its gradients reach the all-reduce as late as on a device ``K`` times slower
than a core; only its own compute is stretched, never its waits for other ranks.

Why sleeping, not fewer threads or repeated work: a rank that repeats its work, or spins,
holds a core the other ranks on the same host need (our CI hosts have 2 cores for 4 ranks),
so the fast ranks would slow down too and the experiment would measure contention, not
heterogeneity; a sleeping rank holds none, and a ``base`` of a few makes the sleeps, not the
shared cores, fill the step. Thread counts do not give a chosen ratio (one
thread is already the torchrun default). Limits: the forward is timed whole, so a program
whose forward runs collectives (FSDP's all-gathers) stretches those too; the measurement is
meant for DDP programs. The optimizer step is not stretched (it is the same on every rank).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from planner.device_groups import rank_devices

__all__ = ["slow_down", "slowdown_factor"]

# A backward does about twice a forward's FLOPs (cost_model/defaults.py BACKWARD_TO_FORWARD,
# from Kaplan et al. 2020 section 2.1: one matmul for the input gradient, one for the weight's).
BACKWARD_TO_FORWARD = 2.0


def slowdown_factor(plan, rank: int, base: float = 1.0) -> float:
    """How many times slower than one core ``rank`` computes: ``base`` times how many times
    slower its device is than the plan cluster's fastest, by peak FLOP/s for the plan's
    precision (``base`` on the fastest devices)."""
    dtype = "float32" if plan.precision == "fp32" else "bfloat16"
    devices = rank_devices(plan.cluster)
    return base * max(device.flops_for(dtype) for device in devices) / devices[rank].flops_for(dtype)


class _SleepInBackward(torch.autograd.Function):
    """The identity; its backward sleeps ``seconds`` first."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


def slow_down(module: torch.nn.Module, factor: float) -> None:
    """Stretch ``module``'s forward and backward to ``factor`` times their CPU seconds (module
    docstring); nothing when ``factor`` is 1 or less."""
    if factor <= 1.0:
        return
    started: list[tuple[float, float]] = []

    def before(_module, _args) -> None:
        started.append((time.perf_counter(), time.thread_time()))

    def after(_module, _args, output: Any) -> Any:
        wall, cpu = started.pop()
        forward_cpu_s = time.thread_time() - cpu
        time.sleep(max(0.0, factor * forward_cpu_s - (time.perf_counter() - wall)))
        leaves, spec = tree_flatten(output)
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:  # the loss: backward starts there
                leaves[index] = _SleepInBackward.apply(leaf, (factor - 1.0) * BACKWARD_TO_FORWARD * forward_cpu_s)
                break
        return tree_unflatten(leaves, spec)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)
