"""Family defaults: the rules of the op families that follow their input's split.

Views and copies (the split moves with the dim it was on, or the input is gathered when the
op cuts across it), ``getitem``, layer/RMS norm and softmax (any dim but the normalised
ones stays split), and the batch-wise ops (samples independent along dim 0: group norm,
upsampling, and the convolution, pooling and padding ops that have explicit rules too).
``follow_input`` answers, for the placements an op's inputs arrive in, the placements it
takes them in and its outputs'; the default rule enumerates plausible incoming placements of
each tensor input on the axis (``Replicate``; ``Shard(d)`` for every dim at least as long as
the axis, divisible or not; ``Partial()`` and ``Partial("avg")`` for floating tensors) and
keeps the distinct answers as the op's candidates.

Explicit registrations and family rules (the other modules of ``search.rules``) take
precedence: reshapes (``shapes``) correct the uneven merges ``follow_input`` would keep, for
instance. Every candidate is checked by brute force in ``tests/test_rules.py``.
"""

from __future__ import annotations

import itertools
import math

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from planner.graph import VIEW_OPS, OpNode, TensorMeta
from search.rules.registry import AxisCandidate, register_family

R = Replicate()

# More incoming combinations than this and only those with at most two non-replicated
# inputs are tried (the family rules read at most the first sharded input).
_MAX_COMBINATIONS = 4096

SAME_LAYOUT = ("aten.clone.", "aten.contiguous.", "aten.alias.", "aten.detach.", "aten._assert", "aten.lift")
NORMS = ("aten.layer_norm.", "aten.rms_norm.")
SOFTMAXES = ("aten.softmax.", "aten._softmax.", "aten.log_softmax.", "aten._log_softmax.")
BATCHWISE = (
    "aten.conv1d.", "aten.conv2d.", "aten.conv3d.", "aten.convolution.", "aten.max_pool", "aten.avg_pool",
    "aten.adaptive_avg_pool", "aten.adaptive_max_pool", "aten.group_norm.", "aten.upsample", "aten.pad.",
    "aten.constant_pad_nd.",
)


def has_default(op: str) -> bool:
    """Whether ``op`` belongs to a family ``follow_input`` answers."""
    return op == "getitem" or op in VIEW_OPS or op.startswith(
        (*SAME_LAYOUT, "aten.flatten.", "aten.unflatten.", *NORMS, *SOFTMAXES, *BATCHWISE)
    )


def follow_input(node: OpNode, incoming: tuple[Placement, ...]) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """(the placements the op takes its inputs in, the placements of its outputs), for an op
    of the families of ``has_default``; anything else is run on whole inputs."""
    outs = node.output_meta
    if all(isinstance(p, Replicate) for p in incoming):
        return incoming, tuple(R for _ in outs)
    op = node.op
    if op == "getitem":
        return incoming, tuple(incoming[0] for _ in outs)
    if node.is_view or op.startswith(SAME_LAYOUT) or op.startswith(("aten.flatten.", "aten.unflatten.")):
        return _view_rule(node, incoming)
    if op.startswith(NORMS) or op.startswith(SOFTMAXES):
        return _normalisation_rule(node, incoming)
    if op.startswith(BATCHWISE):
        return _batchwise_rule(node, incoming)
    return _gather_all(node, incoming)


def input_options(meta: TensorMeta, axis_size: int, partial: bool = True) -> list[Placement]:
    """Placements one tensor may plausibly arrive in on an axis of ``axis_size`` ranks:
    ``Replicate``, ``Shard(d)`` of every dim with at least ``axis_size`` elements (uneven
    too), and ``Partial()``/``Partial("avg")`` for floating tensors."""
    options: list[Placement] = [R]
    options += [Shard(dim) for dim, size in enumerate(meta.shape) if size >= axis_size and size > 1]
    if partial and meta.dtype.is_floating_point:
        options += [Partial(), Partial("avg")]
    return options


def incoming_combinations(node: OpNode, axis_size: int) -> list[tuple[Placement, ...]]:
    """Every combination of ``input_options`` of the node's inputs (capped, see module)."""
    options = [input_options(meta, axis_size) for meta in node.input_meta]
    if math.prod(len(o) for o in options) <= _MAX_COMBINATIONS:
        return list(itertools.product(*options))
    combos: list[tuple[Placement, ...]] = [tuple(R for _ in options)]
    for first, second in itertools.combinations_with_replacement(range(len(options)), 2):
        for a in options[first][1:]:
            for b in options[second][1:] if second != first else [None]:
                combo = [R] * len(options)
                combo[first] = a
                if b is not None:
                    combo[second] = b
                combos.append(tuple(combo))
    return combos


def _normalised(placements: tuple[Placement, ...], metas: tuple[TensorMeta, ...]) -> tuple[Placement, ...]:
    return tuple(
        Shard(p.dim % len(m.shape)) if isinstance(p, Shard) and m.shape else p for p, m in zip(placements, metas)
    )


def default_candidates(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """The distinct answers of ``follow_input`` over ``incoming_combinations``."""
    found: dict[AxisCandidate, None] = {}
    for incoming in incoming_combinations(node, axis_size):
        wanted, outputs = follow_input(node, incoming)
        if len(wanted) != len(node.input_meta) or len(outputs) != len(node.output_meta):
            continue
        candidate = AxisCandidate(
            _normalised(tuple(wanted), node.input_meta), _normalised(tuple(outputs), node.output_meta)
        )
        found.setdefault(candidate, None)
    return list(found)


# ----------------------------------------------------------------------------- family rules


def _gather_all(node: OpNode, incoming):
    return tuple(R for _ in incoming), tuple(R for _ in node.output_meta)


def _each(node: OpNode, placement: Placement) -> tuple[Placement, ...]:
    """``placement`` for every output of ``node`` (``max.dim`` gives values and indices)."""
    return tuple(placement for _ in node.output_meta)


def _first_sharded(node: OpNode, incoming) -> tuple[TensorMeta, Shard] | None:
    for meta, placement in zip(node.input_meta, incoming):
        if isinstance(placement, Shard) and meta.shape:
            return meta, Shard(placement.dim % len(meta.shape))
    return None


def _norm_dim(dim: int, rank: int) -> int:
    return dim % rank if rank else 0


def _map_reshape_dim(src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> int | None:
    """Where ``dim`` of ``src`` lands after a reshape to ``dst``: the dst dim that starts at
    the same flat offset, when the sharded dim is its outermost factor or splits evenly."""
    before = math.prod(src[:dim])
    running = 1
    for index, size in enumerate(dst):
        if running == before and size > 1:
            return index if (size % src[dim] == 0 or src[dim] % size == 0) else None
        running *= size
        if running > before:
            return None
    return None


def _moved_dim(node: OpNode, meta: TensorMeta, dim: int) -> int | None:
    """Where sharded dimension ``dim`` of the input lands in the output of a view-like op,
    or ``None`` when the op cuts across it (the input must then be gathered)."""
    op, attrs, rank = node.op, node.attrs, len(meta.shape)
    out = node.output_meta[0]
    if op.startswith("aten.transpose."):
        first, second = _norm_dim(attrs[1], rank), _norm_dim(attrs[2], rank)
        return second if dim == first else first if dim == second else dim
    if op.startswith("aten.t."):
        return rank - 1 - dim
    if op.startswith("aten.permute."):
        return [_norm_dim(d, rank) for d in attrs[1]].index(dim)
    if op.startswith("aten.unsqueeze."):
        return dim + 1 if dim >= _norm_dim(attrs[1], rank + 1) else dim
    if op.startswith("aten.squeeze."):
        if len(attrs) > 1:
            given = attrs[1] if isinstance(attrs[1], (list, tuple)) else [attrs[1]]
            removed = sorted({_norm_dim(d, rank) for d in given if meta.shape[_norm_dim(d, rank)] == 1})
        else:
            removed = [i for i, size in enumerate(meta.shape) if size == 1]
        return None if dim in removed else dim - sum(d < dim for d in removed)
    if op.startswith(("aten.slice.", "aten.narrow.")):
        along = _norm_dim(attrs[1], rank) if len(attrs) > 1 else 0
        return None if along == dim and out.shape[dim] != meta.shape[dim] else dim
    if op.startswith("aten.select."):
        along = _norm_dim(attrs[1], rank)
        return None if along == dim else dim - (along < dim)
    if op.startswith(("aten.expand.", "aten.expand_as.")):
        return dim + len(out.shape) - rank
    if op.startswith(SAME_LAYOUT):
        return dim
    return _map_reshape_dim(meta.shape, out.shape, dim)


def _view_rule(node: OpNode, incoming):
    found = _first_sharded(node, incoming)
    if found is None or not node.output_meta:
        partial = next((p for p in incoming if isinstance(p, Partial)), R)
        return incoming, tuple(partial for _ in node.output_meta)  # views keep partial sums
    meta, placement = found
    new_dim = _moved_dim(node, meta, placement.dim)
    if new_dim is None:
        return _gather_all(node, incoming)
    return incoming, tuple(Shard(new_dim) for _ in node.output_meta)


def _normalisation_rule(node: OpNode, incoming):
    """Layer/RMS norm over the trailing dims, softmax over ``dim``: other dims may stay sharded."""
    found = _first_sharded(node, incoming[:1])
    if found is None:
        return _gather_all(node, incoming)
    meta, placement = found
    rank = len(meta.shape)
    if node.op.startswith(NORMS):
        normalized = len(node.attrs[1]) if len(node.attrs) > 1 and isinstance(node.attrs[1], (list, tuple)) else 1
        blocked = set(range(rank - normalized, rank))
    else:
        blocked = {_norm_dim(node.attrs[1], rank) if len(node.attrs) > 1 else rank - 1}
    if placement.dim in blocked:
        return _gather_all(node, incoming)
    wanted = (placement,) + tuple(R for _ in incoming[1:])
    return wanted, tuple(placement if len(o.shape) == rank else R for o in node.output_meta)


def _batchwise_rule(node: OpNode, incoming):
    """Convolutions, pooling, group norm, padding: samples are independent along dim 0."""
    found = _first_sharded(node, incoming[:1])
    if found and found[1].dim == 0:
        return (found[1],) + tuple(R for _ in incoming[1:]), tuple(Shard(0) for _ in node.output_meta)
    return _gather_all(node, incoming)


register_family(has_default, default_candidates, priority=-100)
