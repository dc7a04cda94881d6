"""The per-op rule registry: ATen op name -> pure function giving one mesh axis's candidates.

A rule answers one question: on a mesh axis of ``axis_size`` ranks, in which placements may
this op's tensor inputs arrive and what placements do its outputs then have, when every rank
runs the *same op* on its local pieces? Each answer is an :class:`AxisCandidate`. A rule
knows nothing about costs, search or codegen.

Placement semantics are DTensor's: ``Shard(d)`` splits dim ``d`` with ``torch.chunk``
(ranks past the last chunk hold empty pieces), ``Partial(op)`` holds pieces that reduce with
``op`` to the value, ``Replicate`` holds the whole value. A candidate is correct when, for
any input values, the local results combine into the op's result on the whole inputs *and*
each ``Shard`` output piece is exactly the piece ``torch.chunk`` would give (so the next op
sees a standard layout). ``search.rules.check.check_rule`` verifies that by brute force.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from planner.graph import OpGraph, OpNode
from planner.strategy import placements_str

R = Replicate()


@dataclass(frozen=True)
class AxisCandidate:
    """Placements of one op's tensor inputs and outputs on ONE mesh axis.

    Attributes:
        inputs: one placement per tensor input, aligned with ``OpNode.inputs``.
        outputs: one placement per tensor output, aligned with ``OpNode.output_meta``.
    """

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]

    def __post_init__(self) -> None:
        for where, placements in (("inputs", self.inputs), ("outputs", self.outputs)):
            if not isinstance(placements, tuple) or not all(isinstance(p, Placement) for p in placements):
                raise TypeError(
                    f"AxisCandidate.{where} must be a tuple of Shard/Replicate/Partial, got {placements!r}; "
                    f"build it as e.g. (Shard(0), Replicate())"
                )
            for placement in placements:
                if isinstance(placement, Shard) and placement.dim < 0:
                    raise ValueError(
                        f"AxisCandidate.{where} has {placement!r}; normalise negative dims to dim % rank first"
                    )

    @property
    def is_replicated(self) -> bool:
        """Whether every input and output is ``Replicate`` (every rank does all the work)."""
        return all(isinstance(p, Replicate) for p in self.inputs + self.outputs)

    @property
    def shards_work(self) -> bool:
        """Whether each rank does only part of the op's work: some input or output is split.
        (Partial inputs alone leave every rank a whole-size computation.)"""
        return any(isinstance(p, Shard) for p in self.inputs + self.outputs)

    def __str__(self) -> str:
        return f"{placements_str(self.inputs)} -> {placements_str(self.outputs)}"


def replicated(node: OpNode) -> AxisCandidate:
    """The all-replicate candidate of ``node``: always correct, never cheaper."""
    return AxisCandidate(tuple(R for _ in node.inputs), tuple(R for _ in node.output_meta))


Rule = Callable[[OpNode, int], list[AxisCandidate]]

_RULES: dict[str, Rule] = {}
_FALLBACKS: list[tuple[int, Callable[[str], bool], Rule]] = []
# axis_candidates' answers by ``rule_inputs`` key: a whole-model walk meets the same op on
# the same shapes once per repeated block, and the defaults enumerate thousands of incoming
# combinations per op. Registering a rule empties it (an op's rule may change).
_ANSWERS: dict[tuple, tuple[AxisCandidate, ...]] = {}


def register_rule(*ops: str) -> Callable[[Rule], Rule]:
    """Register ``rule(node, axis_size) -> list[AxisCandidate]`` for the ATen ops ``ops``
    (``"aten.mm.default"``; ``"getitem"`` for tuple unpacking). An explicit rule replaces the
    family default for that op; registering the same op twice is an error."""
    if not ops or not all(isinstance(op, str) and op for op in ops):
        raise ValueError(f"register_rule needs one or more op names like 'aten.mm.default', got {ops!r}")

    def decorate(rule: Rule) -> Rule:
        for op in ops:
            if op in _RULES and _RULES[op] is not rule:
                raise ValueError(
                    f"op '{op}' already has rule {_RULES[op].__module__}.{_RULES[op].__qualname__}; "
                    f"refine that rule instead of registering {rule.__qualname__} too"
                )
            _RULES[op] = rule
        _ANSWERS.clear()
        return rule

    return decorate


def register_family(matches: Callable[[str], bool], rule: Rule, priority: int = 0) -> None:
    """A rule for every op ``matches(op)`` accepts that has no explicit rule (op families).
    Of several families that accept an op, the highest ``priority`` wins (the defaults of
    ``search.rules.defaults`` sit lowest)."""
    _FALLBACKS.append((priority, matches, rule))
    _FALLBACKS.sort(key=lambda entry: -entry[0])
    _ANSWERS.clear()


def rule_for(op: str) -> Rule | None:
    """The rule of ``op``: its explicit registration, else its family's default, else None."""
    if op in _RULES:
        return _RULES[op]
    for _, matches, rule in _FALLBACKS:
        if matches(op):
            return rule
    return None


def registered_ops() -> tuple[str, ...]:
    """Ops with an explicit rule, sorted."""
    return tuple(sorted(_RULES))


def axis_candidates(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """Candidates of ``node`` on one mesh axis of ``axis_size`` ranks, all-replicate first.

    An op with no rule gets only the all-replicate candidate: planning never stops on an
    unknown op. ``unknown_ops(graph)`` lists them; ``planner.plan`` puts them in the plan's
    warnings, so a user sees them in the report (not as Python warnings on stderr).

    Answers are remembered by ``rule_inputs(node, axis_size)``: rules are pure functions of
    those fields, so two nodes that agree on them get the same candidates.
    """
    if axis_size < 1:
        raise ValueError(f"axis_size must be a positive number of ranks, got {axis_size}")
    key = rule_inputs(node, axis_size)
    known = _ANSWERS.get(key) if key is not None else None
    if known is None:
        known = tuple(_computed_candidates(node, axis_size))
        if key is not None:
            _ANSWERS[key] = known
    return list(known)


def rule_inputs(node: OpNode, axis_size: int) -> tuple | None:
    """Everything a rule may read: the op, its non-tensor arguments, the shapes and dtypes of
    its tensors, its attention mask's kind, and the axis size; ``None`` when an argument
    cannot be hashed (the answer is then not remembered). Names, parameters and modules are
    left out: a rule must not read them (``tests/test_rule_answers_cache.py`` checks that two
    nodes differing only there get the same answer)."""
    key = (node.op, _frozen(node.attrs), node.input_meta, node.output_meta, node.attention_mask_kind, axis_size)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _frozen(value):
    """``value`` made hashable, each part tagged by its type: a list and a tuple, or ``1``,
    ``1.0`` and ``True`` (equal as keys), may mean different things to a rule."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(item) for item in value))
    return (type(value).__name__, value)


def _computed_candidates(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    first = replicated(node)
    rule = rule_for(node.op)
    if rule is None or axis_size == 1:
        return [first]
    found = [first]
    for candidate in rule(node, axis_size):
        _check_arity(node, candidate, rule)
        if candidate not in found:
            found.append(candidate)
    return found


def unknown_ops(graph: OpGraph) -> dict[str, int]:
    """Ops of ``graph`` with no rule (they run replicated) -> how many nodes use each."""
    counts: dict[str, int] = {}
    for node in graph.nodes:
        if rule_for(node.op) is None:
            counts[node.op] = counts.get(node.op, 0) + 1
    return counts


def _check_arity(node: OpNode, candidate: AxisCandidate, rule: Rule) -> None:
    if len(candidate.inputs) != len(node.inputs) or len(candidate.outputs) != len(node.output_meta):
        raise ValueError(
            f"rule {rule.__qualname__} for '{node.op}' gave {candidate} with {len(candidate.inputs)} inputs and "
            f"{len(candidate.outputs)} outputs, but node '{node.name}' has {len(node.inputs)} and "
            f"{len(node.output_meta)}; give one placement per tensor input and output"
        )
    for placement, meta in zip(candidate.inputs + candidate.outputs, node.input_meta + node.output_meta):
        if isinstance(placement, Shard) and placement.dim >= len(meta.shape):
            raise ValueError(
                f"rule {rule.__qualname__} for '{node.op}' gave {candidate}: {placement} of a tensor of rank "
                f"{len(meta.shape)} ({meta}); shard a dim in 0..{len(meta.shape) - 1}"
            )


__all__ = [
    "AxisCandidate",
    "axis_candidates",
    "register_family",
    "register_rule",
    "registered_ops",
    "replicated",
    "rule_for",
    "rule_inputs",
    "unknown_ops",
]
