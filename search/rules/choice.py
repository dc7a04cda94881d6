"""The choice rule of a whole-model walk: which of an op's registry candidates it takes.

The registry (``search.rules.axis_candidates``) says which placements are *correct* for an
op on one mesh axis; the per-op search weighs them all with the cost model. A whole-model
layout (data parallel, Megatron-LM, the SUMMA layouts' other ops) is instead a walk through
the graph in which each op *follows* the placements its inputs arrive in. ``follow`` is that
walk's one choice, stated so it can be argued with:

1. Inputs the layout has placed (``fixed``: parameters whose placement it decided, such as
   Megatron's column- and row-parallel weights) are taken as they are: the op adapts its
   activations, never the weights.
2. Each other input arrives in some placement and a candidate wants it in another; the move
   costs, in this order: kept as it comes (0); a whole input sliced to the split another
   input arrives in (1: no communication); partial sums reduce-scattered to that split
   (10); partial sums all-reduced (50); anything gathered whole (100). A candidate that
   needs another move (a split moved to another dim, a split or partial sums made where no
   input arrives split) is out: the walk introduces no split an input did not bring.
3. Partial sums flow on only through an op that takes every input as partial sums (sums of
   partials, views, copies): the walk does not carry them past a scaling by a whole value,
   so the reduction happens before the next normalisation, as Megatron-LM places it.
4. The cheapest candidate wins; ties go to the registry's order, then the program
   conventions (``search.rules.conventions``) when the walk's program implements them. When
   none keeps the placed inputs, the op runs on whole inputs (all-replicate), so there is
   always an answer.

This rule replaced a second set of hand-written rules (``op_rule``) the walks used to read.
Building every layout both ways (data parallel, Megatron-LM with and without sequence
parallelism, dp x tp; GPT, Llama, MLP and CNN examples, HF Llama, Mistral, Qwen2, GPT-2,
BERT, T5, ViT, GPT-NeoX and Falcon, at 4 ranks) placed every node alike but for three
corrections, where ``op_rule`` was wrong for the op: an attention mask is now sliced
with the batch or heads it belongs to (it was left whole, which does not broadcast against
the local queries); a mean loss over evenly split columns is a partial average (it was
gathered); a vocabulary-parallel cross entropy takes its targets whole (a 3-D SUMMA layout
kept them split on an axis where the logits' rows were not); and at a batch smaller than the
axis, the uneven merges of ``shapes`` apply. SUMMA layouts (2-D, 2.5-D, 3-D) were compared
too.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from planner.graph import OpNode, TensorMeta
from search.rules.conventions import convention_candidates
from search.rules.registry import AxisCandidate, axis_candidates, replicated, rule_inputs

SLICE, REDUCE_SCATTER, ALL_REDUCE, GATHER = 1, 10, 50, 100

# follow's answers: a walk meets the same op on the same shapes and placements once per
# repeated block, and a search builds several layouts per mesh. Keyed by everything a rule
# may read (``rule_inputs``) and the walk's own arguments.
_ANSWERS: dict[tuple, tuple[tuple[Placement, ...], tuple[Placement, ...]]] = {}


def follow(
    node: OpNode,
    incoming: tuple[Placement, ...],
    axis_size: int,
    fixed: frozenset[int] | set[int] = frozenset(),
    conventions: bool = False,
) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """(the placements ``node`` takes its inputs in, its outputs' placements) when its inputs
    arrive in ``incoming`` on an axis of ``axis_size`` ranks (the choice rule of the module).

    Args:
        fixed: positions of the inputs whose placement the layout decided (kept as they come).
        conventions: also consider Megatron-LM's program conventions.
    """
    incoming = normalised(incoming, node.input_meta)
    if all(isinstance(p, Replicate) for p in incoming):
        return incoming, tuple(Replicate() for _ in node.output_meta)
    inputs = rule_inputs(node, axis_size)
    key = None if inputs is None else (inputs, incoming, frozenset(fixed), conventions)
    if key is not None and key in _ANSWERS:
        return _ANSWERS[key]
    answer = _cheapest(node, incoming, axis_size, fixed, conventions)
    if key is not None:
        _ANSWERS[key] = answer
    return answer


def _cheapest(node: OpNode, incoming, axis_size: int, fixed, conventions: bool):
    options = axis_candidates(node, axis_size)
    if conventions:
        options += convention_candidates(node, axis_size)
    best: tuple[tuple[int, int], AxisCandidate] | None = None
    for order, candidate in enumerate(options):
        cost = move_cost(incoming, candidate.inputs, fixed)
        if cost is not None and (best is None or (cost, order) < best[0]):
            best = ((cost, order), candidate)
    chosen = best[1] if best is not None else replicated(node)
    return chosen.inputs, chosen.outputs


def move_cost(incoming: tuple[Placement, ...], wanted: tuple[Placement, ...], fixed=frozenset()) -> int | None:
    """What bringing ``incoming`` to ``wanted`` costs in the choice rule; ``None``: out."""
    follows = any(isinstance(have, Shard) and have == want for have, want in zip(incoming, wanted))
    keeps_partial = any(isinstance(have, Partial) and have == want for have, want in zip(incoming, wanted))
    if keeps_partial and not all(isinstance(want, Partial) for want in wanted):
        return None
    total = 0
    for index, (have, want) in enumerate(zip(incoming, wanted)):
        if have == want:
            continue
        if index in fixed:
            return None
        if isinstance(want, Replicate):
            total += ALL_REDUCE if isinstance(have, Partial) else GATHER
        elif isinstance(want, Shard) and follows and isinstance(have, Replicate):
            total += SLICE
        elif isinstance(want, Shard) and follows and isinstance(have, Partial):
            total += REDUCE_SCATTER
        else:
            return None
    return total


def normalised(placements: tuple[Placement, ...], metas: tuple[TensorMeta, ...]) -> tuple[Placement, ...]:
    """``placements`` with negative ``Shard`` dims counted from the front."""
    return tuple(Shard(p.dim % len(m.shape)) if isinstance(p, Shard) and m.shape else p for p, m in zip(placements, metas))


__all__ = ["follow", "move_cost", "normalised"]
