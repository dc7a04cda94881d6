"""The words of a generated graph program: placements, per-rank shapes and why each
collective is there (STYLE.md item 11: a comment on each collective saying why).
"""

from __future__ import annotations

import math
import re
from typing import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from planner.strategy import placement_to_str

Placements = tuple[Placement, ...]

# Op families, by the short op name (``aten.layer_norm.default`` -> ``layer_norm``), used to
# say why an op reads its input whole.
_NORMS = ("layer_norm", "native_layer_norm", "rms_norm", "group_norm", "batch_norm")
_SOFTMAXES = ("softmax", "_softmax", "log_softmax", "_log_softmax", "cross_entropy_loss", "nll_loss", "nll_loss_forward")
_MATMULS = ("linear", "addmm", "mm", "matmul", "bmm", "baddbmm")
_VIEWS = ("view", "reshape", "_unsafe_view", "flatten", "unflatten", "expand")
_SPLITS = ("split", "split_with_sizes", "chunk", "unbind")


def placement_text(placement: Placement) -> str:
    """``S(0)``, ``R``, ``P``; DTensor's internal strided shard (a split of a split dim,
    after a view merges dims) reads ``S(2) strided x4``."""
    if type(placement).__name__ == "_StridedShard":
        return f"S({placement.dim}) strided x{placement.split_factor}"
    try:
        return placement_to_str(placement)
    except ValueError:
        return str(placement)


def short_op(op: str) -> str:
    """``"aten.layer_norm.default"`` -> ``"layer_norm"``."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else parts[-1]


def constant_name(placements: Placements, axes: Sequence[str]) -> str:
    """A Python name for a placements tuple: ``(Shard(0), Replicate())`` on ``(dp, tp)`` ->
    ``DP_S0_TP_R``; ``Partial("avg")`` reads ``PAVG``."""
    parts = []
    for axis, placement in zip(axes, placements):
        text = re.sub(r"\W", "", placement_text(placement).replace("strided", "X")).upper()
        parts.append(f"{axis.upper()}_{text}")
    return "_".join(parts)


def describe(placements: Placements, axes: Sequence[str]) -> str:
    """``S(0) on dp, P on tp``."""
    return ", ".join(f"{placement_text(p)} on {axis}" for axis, p in zip(axes, placements))


def local_shape(shape: Sequence[int], placements: Placements, sizes: Sequence[int]) -> tuple[int, ...]:
    """This rank's shape of a tensor of global ``shape`` (DTensor splits like ``torch.chunk``)."""
    local = list(shape)
    for placement, size in zip(placements, sizes):
        if isinstance(placement, Shard) and local:
            dim = placement.dim % len(local)
            local[dim] = math.ceil(local[dim] / size)
    return tuple(local)


def shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def value_note(shape: Sequence[int] | None, placements: Placements | None, axes: Sequence[str], sizes: Sequence[int]) -> str:
    """``(8, 32, 256) -> (4, 32, 128) per rank: S(0) on dp, S(2) on tp`` for a DTensor;
    ``(4, 1, 16, 16) on every rank`` for a tensor computed locally."""
    if shape is None:
        return ""
    if placements is None:
        return f"{shape_text(shape)} on every rank"
    local = local_shape(shape, placements, sizes)
    if local == tuple(shape):
        return f"{shape_text(shape)}: {describe(placements, axes)}"
    return f"{shape_text(shape)} -> {shape_text(local)} per rank: {describe(placements, axes)}"


def reshard_note(
    value: str,
    source: Placements | None,
    target: Placements,
    consumer: str,
    consumer_op: str,
    module: str,
    axes: Sequence[str],
) -> str:
    """One comment line (without ``#``) saying which collective turns ``value`` from
    ``source`` into ``target`` placements on each mesh axis, and why the consumer needs it.
    ``source`` is ``None`` for a tensor computed locally (the same on every rank)."""
    op = short_op(consumer_op)
    if source is None:
        split = [f"dim {p.dim} on {axis}" for axis, p in zip(axes, target) if isinstance(p, Shard)]
        kept = f", each rank keeping its part of {' and '.join(split)}" if split else ""
        return f"no communication: {value} is computed locally, the same on every rank; {op} takes it as a DTensor{kept}"
    steps, reasons = [], []
    for axis, src, dst in zip(axes, source, target):
        if _same(src, dst):
            continue
        if isinstance(src, Partial) and isinstance(dst, Replicate):
            steps.append(f"all-reduce over {axis}")
            reasons.append(f"{value} holds partial sums on {axis}; {op} needs the summed value")
        elif isinstance(src, Partial) and isinstance(dst, Shard):
            steps.append(f"reduce-scatter over {axis}")
            reasons.append(f"sum {value}'s partial sums and keep this rank's part of dim {dst.dim} (sequence parallel)")
        elif isinstance(src, Shard) and isinstance(dst, Replicate):
            steps.append(f"all-gather over {axis}")
            reasons.append(f"{op} needs the whole of dim {src.dim}{_why_whole(op, module)}")
        elif isinstance(src, Shard) and isinstance(dst, Shard):
            steps.append(f"all-to-all over {axis}")
            reasons.append(f"{op} reads {value} split on dim {dst.dim} instead of dim {src.dim}")
        elif isinstance(src, Replicate) and isinstance(dst, Shard):
            steps.append(f"no communication on {axis}")
            reasons.append(f"each rank keeps its part of dim {dst.dim} for {op}")
        elif isinstance(dst, Partial):
            steps.append(f"no communication on {axis}")
            reasons.append(f"{op} adds {value} to partial sums, so it is counted once over {axis} (zeros elsewhere)")
        else:
            steps.append(f"{placement_text(src)} -> {placement_text(dst)} over {axis}")
            reasons.append(f"{op} reads it so")
    if not steps:
        return ""
    return f"{'; '.join(steps)}: {'; '.join(reasons)}"


def _why_whole(op: str, module: str) -> str:
    where = f" ({module})" if module else ""
    if op in _NORMS:
        return f": it normalises over the hidden features{where}"
    if op in _SOFTMAXES:
        return f": it normalises over the classes{where}"
    if op in _MATMULS:
        return f": a column-parallel layer multiplies the whole input by this rank's output features{where}"
    if op in _VIEWS:
        return ": its new shape cuts across the split dim"
    if op in _SPLITS:
        return ": it cuts the split dim into pieces"
    return f" under the plan{where}"


def _same(a: Placement, b: Placement) -> bool:
    if isinstance(a, Partial) and isinstance(b, Partial):
        return a.reduce_op == b.reduce_op
    return a == b
