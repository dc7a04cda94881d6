"""The whole-model walks' choice rule (``search.rules.choice.follow``) and the program
conventions it may take (``search.rules.conventions``).

Each convention is wrong for the plain op (the brute-force checker says so), is never among
the registry's candidates, and is taken by a walk only when asked; each clause of the choice
rule is checked on an op where it decides.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from planner.graph import OpNode, TensorMeta
from search.rules import axis_candidates, check_rule
from search.rules.choice import ALL_REDUCE, GATHER, REDUCE_SCATTER, SLICE, follow, move_cost
from search.rules.conventions import convention_candidates

F32, I64 = torch.float32, torch.int64
R, P = Replicate(), Partial()


def _node(op: str, inputs, outputs, attrs=None, dtypes=None, params=()) -> OpNode:
    dtypes = dtypes or [F32] * len(inputs)
    return OpNode(
        name=op.split(".")[1], op=op, inputs=tuple(f"in{i}" for i in range(len(inputs))),
        input_meta=tuple(TensorMeta(tuple(s), d) for s, d in zip(inputs, dtypes)),
        output_meta=tuple(TensorMeta(tuple(s), F32) for s in outputs),
        params=params, attrs=tuple(attrs) if attrs is not None else tuple(None for _ in inputs),
    )


EMBEDDING = _node("aten.embedding.default", [(10, 4), (3, 5)], [(3, 5, 4)], dtypes=[F32, I64])
CROSS_ENTROPY = _node("aten.cross_entropy_loss.default", [(6, 10), (6,)], [()], dtypes=[F32, I64])
QKV_SPLIT = _node("aten.split.Tensor", [(2, 12)], [(2, 4), (2, 4), (2, 4)], [None, 4, 1])
ROW_PARALLEL = _node("aten.linear.default", [(5, 8), (6, 8), (6,)], [(5, 6)])
ROW_PARALLEL_ADDMM = _node("aten.addmm.default", [(6,), (5, 8), (8, 6)], [(5, 6)])
CONVENTIONS = {
    "vocabulary-parallel embedding": (EMBEDDING, (Shard(0), R), (P,)),
    "vocabulary-parallel cross entropy": (CROSS_ENTROPY, (Shard(1), R), (R,)),
    "fused projection split": (QKV_SPLIT, (Shard(1),), (Shard(1),) * 3),
    "row-parallel bias (linear)": (ROW_PARALLEL, (Shard(1), Shard(1), R), (P,)),
    "row-parallel bias (addmm)": (ROW_PARALLEL_ADDMM, (R, Shard(1), Shard(0)), (P,)),
}


@pytest.mark.parametrize("name", CONVENTIONS)
def test_a_convention_is_offered_apart_and_is_wrong_for_the_plain_op(name: str) -> None:
    node, inputs, outputs = CONVENTIONS[name]
    (convention,) = convention_candidates(node, 2)
    assert (convention.inputs, convention.outputs) == (inputs, outputs)
    assert convention not in axis_candidates(node, 2)
    assert check_rule(node, convention, 2) is not None  # the plain op on local pieces differs


@pytest.mark.parametrize("name", CONVENTIONS)
def test_a_walk_takes_a_convention_only_when_its_program_implements_it(name: str) -> None:
    node, inputs, outputs = CONVENTIONS[name]
    weights = {i for i, p in enumerate(inputs) if isinstance(p, Shard) and node.input_meta[i].shape == (10, 4)}
    assert follow(node, inputs, 2, weights, conventions=True) == (inputs, outputs)
    wanted, produced = follow(node, inputs, 2, weights, conventions=False)
    assert (wanted, produced) != (inputs, outputs)


def test_cross_entropy_with_label_smoothing_has_no_vocabulary_parallel_convention() -> None:
    smoothed = _node("aten.cross_entropy_loss.default", [(6, 10), (6,)], [()], [None, None, None, 1, -100, 0.1], [F32, I64])
    assert convention_candidates(smoothed, 2) == []
    assert follow(smoothed, (Shard(1), R), 2, conventions=True) == ((R, R), (R,))


def test_move_costs_in_the_stated_order() -> None:
    # (split, whole) -> both split alike: a slice; (split, partial) -> a reduce-scatter.
    assert move_cost((Shard(0), R), (Shard(0), Shard(0))) == SLICE
    assert move_cost((Shard(0), P), (Shard(0), Shard(0))) == REDUCE_SCATTER
    assert move_cost((P,), (R,)) == ALL_REDUCE
    assert move_cost((Shard(0),), (R,)) == GATHER
    assert SLICE < REDUCE_SCATTER < ALL_REDUCE < GATHER


def test_a_walk_introduces_no_split_an_input_did_not_bring() -> None:
    """add(partial, whole) with nothing split: the partial sums are all-reduced, not
    reduce-scattered into a split no input had."""
    add = _node("aten.add.Tensor", [(4, 6), (4, 6)], [(4, 6)])
    assert move_cost((P, R), (Shard(0), Shard(0))) is None
    assert follow(add, (P, R), 2) == ((R, R), (R,))


def test_partial_sums_meet_a_split_by_reduce_scatter() -> None:
    """The sequence-parallel residual add: the block's partial output is reduce-scattered to
    the residual's split."""
    add = _node("aten.add.Tensor", [(2, 8, 6), (2, 8, 6)], [(2, 8, 6)])
    assert follow(add, (Shard(1), P), 2) == ((Shard(1), Shard(1)), (Shard(1),))


def test_partial_sums_are_not_carried_past_a_scaling_by_a_whole_value() -> None:
    """mul(P, R) is right for the plain op (linear in the partial factor), but the walk
    reduces first, as Megatron-LM does before a norm."""
    mul = _node("aten.mul.Tensor", [(4, 6), (4, 1)], [(4, 6)])
    assert any(c.inputs == (P, R) and c.outputs == (P,) for c in axis_candidates(mul, 2))
    assert follow(mul, (P, R), 2) == ((R, R), (R,))


def test_partial_sums_flow_through_sums_of_partials() -> None:
    add = _node("aten.add.Tensor", [(4, 6), (4, 6)], [(4, 6)])
    assert follow(add, (P, P), 2) == ((P, P), (P,))


def test_weights_the_layout_placed_are_kept_and_the_activation_gathered() -> None:
    """A column-parallel linear reached by a sequence-split activation: the weight stays split
    on its output features, the activation is gathered (not the weight)."""
    linear = _node("aten.linear.default", [(2, 8, 6), (4, 6)], [(2, 8, 4)])
    assert follow(linear, (Shard(1), Shard(0)), 2, fixed={1}) == ((R, Shard(0)), (Shard(2),))
    # Unplaced, the weight would be the cheaper thing to move.
    assert follow(linear, (Shard(1), Shard(0)), 2) == ((Shard(1), R), (Shard(1),))


def test_a_whole_input_is_sliced_to_follow_a_split_one() -> None:
    """Rotary: the activation arrives split on heads; the whole cos table is sliced alike."""
    mul = _node("aten.mul.Tensor", [(2, 4, 8, 6), (2, 4, 8, 6)], [(2, 4, 8, 6)])
    assert follow(mul, (Shard(1), R), 2) == ((Shard(1), Shard(1)), (Shard(1),))
