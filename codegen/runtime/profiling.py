"""``launch.py --profile measured.json``: what one training run measured, for
``planner compare`` and ``planner calibrate``.

The loop's steps fall in three parts (``torch.profiler.schedule``): the first ``wait``
steps run without the profiler, and their times (the first step, which includes one-off
set-up, left out) are the measured step times; one warm-up step; then ``active`` steps
recorded by ``torch.profiler`` (which slows them a little), from which come the per-op
times (self CPU time of each ATen op, with its FLOPs for matmul-like ops) and the
per-collective times (gloo's record of each collective, with its tensor sizes). Figures
are rank 0's, per step.

The file (JSON, ``format: soap-planner-measured``, ``version: 1``) holds the plan itself, so
it can be compared and calibrated on without its program folder::

    {"format": "soap-planner-measured", "version": 1, "plan": {...plan.json...},
     "plan_fingerprint": "<planner.plan_identity>", "world_size": 2, "backend": "gloo", "device": "cpu",
     "step_times_s": [...], "step_time_s": <median>, "profiled_steps": 3,
     "ops": {"aten::mm": {"count": 36, "time_s": 0.0123, "flops": 1.2e9}, ...,
             "optimizer.step": {"count": 1, "time_s": 0.002, "flops": 0}},
     "collectives": [{"kind": "all_reduce", "bytes": 4096, "count": 2, "time_s": 0.0004}, ...]}

(``count``, ``time_s`` and ``flops`` per step; ``optimizer.step`` is the whole optimizer step,
total time, whose ops are also among the ``aten::`` ones.)
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from planner.errors import LaunchError
from planner.json_files import peek_json
from planner.outputs import write_text_atomically
from planner.plan_identity import plan_fingerprint

MEASURED_FORMAT = "soap-planner-measured"
MEASURED_VERSION = 1
MIN_PROFILE_STEPS = 5  # >= 2 clean steps after the first, one warm-up step, one profiled step
# Collective names as the gloo and NCCL process groups record them ("gloo:all_reduce").
_COLLECTIVE_KINDS = {
    "all_reduce": "all_reduce", "allreduce": "all_reduce", "all_gather": "all_gather", "allgather": "all_gather",
    "all_gather_into_tensor": "all_gather", "_allgather_base": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reducescatter": "reduce_scatter", "broadcast": "broadcast", "all_to_all": "all_to_all", "alltoall": "all_to_all",
    "alltoall_base": "all_to_all", "send": "send_recv", "recv": "send_recv",
}
_BYTES = {torch.float32: 4, torch.float64: 8, torch.bfloat16: 2, torch.float16: 2, torch.int64: 8, torch.int32: 4}


def profile_split(steps: int) -> tuple[int, int, int]:
    """(wait, warmup, active) steps of a profiled run of ``steps`` steps: about a third of
    them (1 to 5) profiled, one warm-up, the rest clean. LaunchError when too few."""
    if steps < MIN_PROFILE_STEPS:
        raise LaunchError(f"--profile needs --steps {MIN_PROFILE_STEPS} or more (clean steps, then profiled ones), got {steps}")
    active = max(1, min(5, steps // 3))
    return steps - active - 1, 1, active


def start_profiler(steps: int):
    """A started ``torch.profiler.profile`` over the last steps of the run (``profile_split``)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    wait, warmup, active = profile_split(steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(
        activities=activities, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        record_shapes=True, with_flops=True,
    )
    profiler.start()
    return profiler


def collective_kind(name: str) -> str | None:
    """``all_reduce`` for ``gloo:all_reduce`` / ``nccl:all_reduce`` ..., None for other events."""
    backend, _, operation = name.partition(":")
    if backend not in ("gloo", "nccl") or not operation:
        return None
    return _COLLECTIVE_KINDS.get(operation.lower())


def summarize(profiler, active: int) -> tuple[dict[str, dict[str, float]], list[dict[str, Any]]]:
    """Per-step op times (self time of each ``aten::`` op, its FLOPs) and collectives (by kind
    and message bytes) from a finished profiler that recorded ``active`` steps."""
    ops: dict[str, dict[str, float]] = {}
    for event in profiler.key_averages():
        if event.key.startswith("Optimizer.step#") and event.count:
            # torch.optim's own annotation around step(): on CPU AdamW runs single-tensor
            # ops (add_, mul_, lerp_) that cannot be told from the model's by name.
            ops["optimizer.step"] = {"count": event.count / active, "time_s": event.cpu_time_total / 1e6 / active, "flops": 0.0}
            continue
        if not event.key.startswith("aten::") or event.count == 0:
            continue
        self_us = event.self_cpu_time_total + getattr(event, "self_device_time_total", 0.0)
        ops[event.key] = {"count": event.count / active, "time_s": self_us / 1e6 / active, "flops": (event.flops or 0) / active}
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    for event in profiler.events():
        kind = collective_kind(event.name)
        if kind is None:
            continue
        elements = sum(math_prod(shape) for shape in (event.input_shapes or []) if isinstance(shape, (list, tuple)))
        size = elements * _element_bytes(event)
        groups[(kind, int(size))].append(event.time_range.elapsed_us() / 1e6)
    collectives = [
        {"kind": kind, "bytes": size, "count": len(times) / active, "time_s": sum(times) / active}
        for (kind, size), times in sorted(groups.items())
    ]
    return ops, collectives


def math_prod(shape) -> int:
    total = 1
    for extent in shape:
        total *= int(extent)
    return total


def _element_bytes(event) -> int:
    """Bytes per element of a collective's tensors: gloo records no dtype, and every
    gradient and activation collective of a program runs in the plan's floating dtype, so
    fp32 unless the event says otherwise."""
    types = [text for text in (getattr(event, "input_types", None) or []) if text]
    for text in types:
        for dtype, size in _BYTES.items():
            if str(dtype).removeprefix("torch.") in text.lower():
                return size
    return 4


def is_measured_file(path: Path) -> bool:
    """Whether ``path`` holds a measured file written by ``write_measured`` (of any version):
    the files ``--profile`` may replace without ``--force``."""
    data = peek_json(path)
    return isinstance(data, dict) and data.get("format") == MEASURED_FORMAT


def write_measured(path: str | Path, plan_path: Path, step_times: list[float], profiler, active: int) -> dict[str, Any]:
    """Write ``measured.json`` (rank 0 only, through a temporary file renamed into place;
    the others return what it would hold). ``path`` was checked before the run
    (``codegen.runtime.run_outputs``)."""
    ops, collectives = summarize(profiler, active)
    clean = step_times[1:] or step_times
    plan = json.loads(Path(plan_path).read_text())
    record = {
        "format": MEASURED_FORMAT, "version": MEASURED_VERSION,
        "plan": plan, "plan_fingerprint": plan_fingerprint(plan),
        "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "step_times_s": clean, "step_time_s": statistics.median(clean), "profiled_steps": active,
        "ops": ops, "collectives": collectives,
    }
    if dist.get_rank() == 0:
        write_text_atomically(Path(path), json.dumps(record, indent=1) + "\n")
    return record
