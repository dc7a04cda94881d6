"""Per-op sharding rules: which placements each op may take on each mesh axis.

Public API:

* ``@register_rule("aten.mm.default", ...)`` registers a pure function
  ``rule(node, axis_size) -> list[AxisCandidate]`` for those ATen ops;
* ``axis_candidates(node, axis_size)``: the op's candidates on one axis, all-replicate first;
* ``candidates(node, mesh)``: one ``AxisCandidate`` per mesh axis, combined over the axes
  and capped at ``MAX_CANDIDATES`` (see there);
* ``unknown_ops(graph)``: ops that have no rule (they run replicated, with a warning);
* ``check_rule(node, candidate, axis_size)`` (``search.rules.check``): brute-force check of a
  candidate on tiny tensors with uneven sizes.

Where rules come from, by precedence: explicit registrations (``matmul``, ``shapes``,
``nn``, ``reductions``, ``indexing``), family rules (``pointwise``), and last the
defaults (``defaults``: views, norms, softmax, getitem, the rest of the batch-wise ops).
Program conventions (``conventions``: Megatron-LM's vocabulary-parallel embedding and cross
entropy, fused projection splits, the row-parallel bias added once) are kept apart and asked
for only by walks whose program implements them; ``choice.follow`` is the walks' one choice
rule over all of them. This registry is the planner's one sharding-rule engine: the per-op
search and every whole-model layout read it.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

from torch.distributed.tensor import Shard

from planner.graph import OpNode
from planner.strategy import Mesh
from search.rules import defaults as _defaults  # noqa: F401 - registers the family defaults
from search.rules import indexing as _indexing  # noqa: F401 - registers rules
from search.rules import matmul as _matmul  # noqa: F401
from search.rules import nn as _nn  # noqa: F401
from search.rules import pointwise as _pointwise  # noqa: F401
from search.rules import reductions as _reductions  # noqa: F401
from search.rules import shapes as _shapes  # noqa: F401
from search.rules.check import check_rule
from search.rules.registry import (
    AxisCandidate,
    axis_candidates,
    register_family,
    register_rule,
    registered_ops,
    replicated,
    rule_for,
    unknown_ops,
)

# At most this many combinations per node are kept by ``candidates``: the all-replicate one,
# then those that divide the op's work by the most ranks (the product of the sizes of the
# axes whose candidate splits the work), fewer partial outputs first (they cost a reduction
# later), then in rule order. 32 keeps a 2-axis mesh's useful combinations of the ~6-10
# candidates per axis of a matmul and bounds a CP-SAT model at 32 Booleans per node.
MAX_CANDIDATES = 32
# Combinations enumerated before ranking; beyond it each axis keeps fewer candidates.
_MAX_COMBINATIONS = 4096


def candidates(
    node: OpNode,
    mesh: Mesh | Sequence[int],
    keep: Callable[[tuple[AxisCandidate, ...]], bool] | None = None,
) -> list[tuple[AxisCandidate, ...]]:
    """Candidates of ``node`` on the whole mesh: one ``AxisCandidate`` per mesh axis.

    Per-axis candidates combine independently (the product over axes), except that a dim
    split by several axes must be divisible by the product of their sizes (per-axis rules
    are checked on whole sizes; a second split of an uneven piece is not). The result
    starts with the all-replicate combination and has at most ``MAX_CANDIDATES`` entries.

    Args:
        node: the op.
        mesh: a ``Mesh`` or the sizes of its axes, outermost first.
        keep: a filter applied *before* the cap (e.g. "no weight split on the dp axis"),
            so that filtering does not eat into the ``MAX_CANDIDATES`` kept.

    Returns:
        Tuples aligned with the mesh axes.
    """
    sizes = tuple(mesh.shape) if isinstance(mesh, Mesh) else tuple(mesh)
    per_axis = [axis_candidates(node, size) for size in sizes]
    if math.prod(len(options) for options in per_axis) > _MAX_COMBINATIONS:
        # Many axes: keep each axis's all-replicate candidate and its work-splitting ones first.
        per_axis_kept = max(2, int(_MAX_COMBINATIONS ** (1 / len(per_axis))))
        per_axis = [
            options[:1] + sorted(options[1:], key=lambda c: not c.shards_work)[: per_axis_kept - 1]
            for options in per_axis
        ]
    first = tuple(options[0] for options in per_axis)
    scored = []
    for order, combination in enumerate(itertools.product(*per_axis)):
        if combination == first or not _fits(node, combination, sizes):
            continue
        if keep is not None and not keep(combination):
            continue
        divisor = math.prod(size for size, c in zip(sizes, combination) if c.shards_work)
        partial_outputs = sum(1 for c in combination for p in c.outputs if p.is_partial())
        scored.append((-divisor, partial_outputs, order, combination))
    scored.sort(key=lambda entry: entry[:3])
    return [first] + [entry[3] for entry in scored[: MAX_CANDIDATES - 1]]


def _fits(node: OpNode, combination: tuple[AxisCandidate, ...], sizes: tuple[int, ...]) -> bool:
    metas = node.input_meta + node.output_meta
    for index, meta in enumerate(metas):
        splits: dict[int, list[int]] = {}
        for size, candidate in zip(sizes, combination):
            placement = (candidate.inputs + candidate.outputs)[index]
            if isinstance(placement, Shard):
                splits.setdefault(placement.dim, []).append(size)
        for dim, axis_sizes in splits.items():
            if len(axis_sizes) > 1 and meta.shape[dim] % math.prod(axis_sizes) != 0:
                return False
    return True


__all__ = [
    "MAX_CANDIDATES",
    "AxisCandidate",
    "axis_candidates",
    "candidates",
    "check_rule",
    "register_family",
    "register_rule",
    "registered_ops",
    "replicated",
    "rule_for",
    "unknown_ops",
]
