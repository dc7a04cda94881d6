"""Family defaults: candidates derived from ``op_rule`` (``search.rules.op_families``).

For every op family ``op_rule`` understands, the default rule enumerates plausible incoming
placements of each tensor input on the axis (``Replicate``; ``Shard(d)`` for every dim at
least as long as the axis, divisible or not; ``Partial()`` and ``Partial("avg")`` for
floating tensors), asks ``op_rule`` what the op does with them, and keeps the distinct
``(wanted inputs, outputs)`` answers.

Explicit registrations and family rules (the other modules of ``search.rules``) take
precedence. The defaults end up serving the families ``op_rule`` gets right according to the
brute-force check (``tests/test_rules.py``): ``getitem``, transposes/permutes, (un)squeeze,
select/slice, expand, copies and aliases, layer/RMS norm, softmax, group norm, upsampling. The
families it gets wrong (splits, losses, reductions, matmuls) are never defaulted: their
common ops have explicit rules and any other op of theirs is reported as unknown.
"""

from __future__ import annotations

import itertools
import math

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from planner.graph import OpNode, TensorMeta
from search.rules.op_families import LINEARS, LOSSES, REDUCTIONS, SPLITS, known_family, op_rule
from search.rules.registry import AxisCandidate, register_family

R = Replicate()

# More incoming combinations than this and only those with at most two non-replicated
# inputs are tried (op_rule reads at most the first sharded input and the weight).
_MAX_COMBINATIONS = 4096

# Families whose op_rule answers the brute-force check found wrong (see the docstrings of
# shapes.py, reductions.py, matmul.py): an op of theirs without an explicit rule is reported
# as unknown rather than given op_rule's answers. (``stack`` was never checked against
# op_rule: its explicit rule in pointwise.py serves it.)
_UNTRUSTED_PREFIXES: tuple[str, ...] = SPLITS + LOSSES + REDUCTIONS + LINEARS + ("aten.stack.",)


def _default_applies(op: str) -> bool:
    return known_family(op) and not op.startswith(_UNTRUSTED_PREFIXES)


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


def propagation_candidates(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """The distinct answers of ``op_rule`` over ``incoming_combinations``."""
    found: dict[AxisCandidate, None] = {}
    for incoming in incoming_combinations(node, axis_size):
        wanted, outputs = op_rule(node, incoming)
        if len(wanted) != len(node.input_meta) or len(outputs) != len(node.output_meta):
            continue  # op_rule answers one output for some multi-output ops (max.dim): unusable
        candidate = AxisCandidate(
            _normalised(tuple(wanted), node.input_meta), _normalised(tuple(outputs), node.output_meta)
        )
        found.setdefault(candidate, None)
    return list(found)


register_family(_default_applies, propagation_candidates, priority=-100)
