"""Reductions and losses: ops that fold dims away.

A dim that is not reduced may stay split. A split reduced dim leaves each rank a piece of
the result that combines across ranks: ``sum`` -> ``Partial()``, ``mean`` -> ``Partial("avg")``.
(``amax`` -> ``Partial("max")`` is right too, but not offered: DTensor's backward of a
max-partial value hands the gradient to every rank's local maximum, and fails outright when
it arrives as partial sums, "Redistribution from one partial type (P(sum)) to another
(P(max)) is unsupported"; so the reduced dim is gathered first.) The average of per-rank means is the mean only when every
rank holds the same number of elements, so ``mean`` over a split dim needs the axis to
divide it (8 rows over 3 ranks average 3, 3 and 2 rows with equal weights).

Losses are reductions too. Cross entropy / NLL reduce over rows (and spatial positions):
rows split in the logits and the targets alike; a split of the class dim needs a log-sum-exp
across ranks (Megatron's vocabulary-parallel cross entropy), which the plain op cannot do, so
it is not offered here (it is a program convention: ``search.rules.conventions``). A mean reduction
over split rows is exact only when every rank has the same number of counted targets: rows
must divide evenly, no class weights, and (data-dependent, not checkable here) the same
number of ``ignore_index`` targets on every rank.
"""

from __future__ import annotations

from torch.distributed.tensor import Shard

from planner.graph import OpNode
from search.rules.common import AVG, SUM, R, aligned_shard, attr, divides, is_float, norm_dim, shardable_dims
from search.rules.registry import AxisCandidate, register_rule

_REDUCTION_NONE, _REDUCTION_MEAN, _REDUCTION_SUM = 0, 1, 2


def _reduced_dims(node: OpNode) -> list[int]:
    rank = len(node.input_meta[0].shape)
    if node.op in ("aten.sum.default", "aten.mean.default", "aten.max.default", "aten.min.default"):
        return list(range(rank))
    dims = attr(node, 1, [])
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return sorted({norm_dim(d, rank) for d in dims}) if dims else list(range(rank))


_COMBINE = {
    "aten.sum.default": SUM,
    "aten.sum.dim_IntList": SUM,
    "aten.mean.default": AVG,
    "aten.mean.dim": AVG,
    # Max/min partials (MAX, MIN) are right forward, but DTensor cannot run their backward
    # (module docstring): the reduced dim is gathered first.
    "aten.amax.default": None,
    "aten.max.default": None,
    "aten.amin.default": None,
    "aten.min.default": None,
    "aten.max.dim": None,  # the indices of a per-rank maximum are not the global indices
    "aten.min.dim": None,
}


@register_rule(*_COMBINE)
def reduction_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """Kept dims stay split; a split reduced dim gives a partial result (see module)."""
    x = node.input_meta[0]
    rank = len(x.shape)
    reduced = _reduced_dims(node)
    keepdim = bool(node.output_meta) and len(node.output_meta[0].shape) == rank and rank > 0
    combine = _COMBINE[node.op]
    found = []
    for dim in shardable_dims(x.shape, axis_size):
        if dim not in reduced:
            out_dim = dim if keepdim else dim - sum(d < dim for d in reduced)
            found.append(AxisCandidate((Shard(dim),), tuple(Shard(out_dim) for _ in node.output_meta)))
        elif combine is not None and (combine != AVG or divides(axis_size, x.shape[dim])):
            found.append(AxisCandidate((Shard(dim),), (combine,)))
    if combine in (SUM, AVG) and is_float(x):  # sums and means are linear
        found += [AxisCandidate((flavour,), (flavour,)) for flavour in (SUM, AVG)]
    return found


@register_rule("aten.cumsum.default")
def cumsum_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """A running sum along ``dim``: other dims may be split; linear."""
    x = node.input_meta[0]
    along = norm_dim(attr(node, 1, 0), len(x.shape))
    found = [AxisCandidate((Shard(d),), (Shard(d),)) for d in shardable_dims(x.shape, axis_size) if d != along]
    if is_float(x) and is_float(node.output_meta[0]):
        found += [AxisCandidate((flavour,), (flavour,)) for flavour in (SUM, AVG)]
    return found


# ------------------------------------------------------------------------------ losses


@register_rule("aten.cross_entropy_loss.default", "aten.nll_loss.default", "aten.nll_loss_nd.default")
def row_loss_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """Logits (N, C, *d) and targets (N, *d): split rows or a position dim alike in both."""
    metas = node.input_meta
    if len(metas) < 2 or len(metas[0].shape) < 2:
        return []
    logits, target = metas[:2]
    weighted = len(metas) > 2  # class weights make the mean a weighted mean
    reduction = attr(node, 3, _REDUCTION_MEAN)
    found = []
    for target_dim in shardable_dims(target.shape, axis_size):
        logits_dim = 0 if target_dim == 0 else target_dim + 1
        if reduction == _REDUCTION_NONE:
            output = Shard(target_dim)
        elif reduction == _REDUCTION_SUM:
            output = SUM
        elif not weighted and divides(axis_size, target.shape[target_dim]):
            output = AVG
        else:
            continue
        rest = tuple(R for _ in metas[2:])  # class weights: whole
        found.append(AxisCandidate((Shard(logits_dim), Shard(target_dim)) + rest, (output,)))
    return found


# loss op -> attrs position of its reduction argument
_POINTWISE_LOSSES = {
    "aten.mse_loss.default": 2,
    "aten.l1_loss.default": 2,
    "aten.smooth_l1_loss.default": 2,
    "aten.huber_loss.default": 2,
    "aten.kl_div.default": 2,
    "aten.soft_margin_loss.default": 2,
    "aten.binary_cross_entropy.default": 3,
    "aten.binary_cross_entropy_with_logits.default": 4,
}


@register_rule(*_POINTWISE_LOSSES)
def pointwise_loss_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """Elementwise losses: split any dim in every input alike (weights where they have it);
    ``mean`` needs the axis to divide that dim, ``sum`` does not, ``none`` stays split."""
    metas = node.input_meta
    x = metas[0]
    rank = len(x.shape)
    reduction = attr(node, _POINTWISE_LOSSES[node.op], _REDUCTION_MEAN)
    found = []
    for dim in shardable_dims(x.shape, axis_size):
        if reduction == _REDUCTION_NONE:
            output = Shard(dim)
        elif reduction == _REDUCTION_SUM:
            output = SUM
        elif divides(axis_size, x.shape[dim]):
            output = AVG
        else:
            continue
        try:
            inputs = tuple(aligned_shard(meta, rank, dim, x.shape[dim]) for meta in metas)
        except ValueError:
            continue
        found.append(AxisCandidate(inputs, (output,)))
    return found
