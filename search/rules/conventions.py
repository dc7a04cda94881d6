"""Program conventions: candidates that are right only in a program that implements them.

The per-op rules (``register_rule``) answer for the *plain* op: every rank runs the same op
on its local pieces. Megatron-LM's tensor parallelism also runs four ops in ways the plain
op does not, each made right by what the program does around the op:

* **vocabulary-parallel embedding**: the table split on its rows (the vocabulary); each rank
  looks up the ids in its rows and writes zeros for the others, so the outputs are partial
  sums (the plain op would index out of range). The program masks the ids
  (``codegen.runtime.spmd``'s embedding handling; Megatron's ``VocabParallelEmbedding``).
* **vocabulary-parallel cross entropy**: logits split on the classes; the ranks all-reduce
  each row's max, sum of exponentials and target logit, and every rank holds the whole loss
  (``codegen.runtime.loss_parallel`` runs it, ``cost_model.loss_parallel`` prices it). Only
  for a cross entropy without class weights or label smoothing (what PyTorch's
  ``loss_parallel`` takes).
* **fused projection split**: ``q|k|v`` (or ``gate|up``) produced by one column-parallel
  matmul and split on its sharded feature dim stays split, each piece on the same dim: the
  program lays the weight's rows out so each rank holds its part of every piece (Megatron
  permutes them; DTensor's ``_StridedShard``).
* **row-parallel bias counted once**: ``linear``/``addmm`` with the activation split on the
  contracted dim and the weight on its input features give partial sums; the replicated
  bias is added once, after the reduction (the plain op would add it on every rank).

A walk that builds a Megatron-LM layout asks for them (``search.rules.choice.follow`` with
``conventions=True``); the per-op search does not: its programs run each op plainly.
``tests/test_rules.py`` shows each is wrong for the plain op; ``tests/test_rule_conventions.py``
that each is offered exactly where the convention applies.
"""

from __future__ import annotations

from typing import Callable

from torch.distributed.tensor import Partial, Shard

from planner.graph import OpNode
from search.rules.common import R
from search.rules.registry import AxisCandidate

ConventionRule = Callable[[OpNode, int], list[AxisCandidate]]

_CONVENTIONS: dict[str, list[ConventionRule]] = {}


def register_convention(*ops: str) -> Callable[[ConventionRule], ConventionRule]:
    """Register ``rule(node, axis_size) -> list[AxisCandidate]``: candidates of ``ops`` that are
    right only in a program implementing the convention (say which, in the rule's docstring)."""
    if not ops or not all(isinstance(op, str) and op for op in ops):
        raise ValueError(f"register_convention needs one or more op names like 'aten.mm.default', got {ops!r}")

    def decorate(rule: ConventionRule) -> ConventionRule:
        for op in ops:
            _CONVENTIONS.setdefault(op, []).append(rule)
        return rule

    return decorate


def convention_candidates(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """The program-convention candidates of ``node`` on an axis of ``axis_size`` ranks."""
    if axis_size < 2:
        return []
    return [candidate for rule in _CONVENTIONS.get(node.op, ()) for candidate in rule(node, axis_size)]


@register_convention("aten.embedding.default")
def vocabulary_parallel_embedding(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """Table split on its rows, ids whole: partial sums (see the module)."""
    if len(node.input_meta) < 2 or len(node.input_meta[0].shape) != 2:
        return []
    return [AxisCandidate((Shard(0), R) + tuple(R for _ in node.input_meta[2:]), (Partial(),))]


@register_convention("aten.cross_entropy_loss.default")
def vocabulary_parallel_cross_entropy(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """Logits split on the classes (dim 1), targets whole: every rank holds the loss."""
    logits = node.input_meta[0]
    if len(logits.shape) < 2 or not vocabulary_parallel_loss(node):
        return []
    return [AxisCandidate((Shard(1),) + tuple(R for _ in node.input_meta[1:]), tuple(R for _ in node.output_meta))]


def vocabulary_parallel_loss(node: OpNode) -> bool:
    """Whether a loss can run on logits split over the classes: a cross entropy without class
    weights or label smoothing (what PyTorch's ``loss_parallel`` takes)."""
    attrs = node.attrs
    weighted = len(node.inputs) > 2
    smoothing = attrs[5] if len(attrs) > 5 and attrs[5] is not None else 0.0
    return node.op == "aten.cross_entropy_loss.default" and not weighted and smoothing == 0.0


@register_convention("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default")
def fused_projection_split(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """A cut along the last dim of a tensor split on that dim: every piece split alike."""
    source = node.input_meta[0]
    if not source.shape:
        return []
    last = len(source.shape) - 1
    along = node.attrs[2] if len(node.attrs) > 2 and node.attrs[2] is not None else 0
    if along % len(source.shape) != last:
        return []
    return [AxisCandidate((Shard(last),) + tuple(R for _ in node.input_meta[1:]), tuple(Shard(last) for _ in node.output_meta))]


@register_convention("aten.linear.default", "aten.addmm.default")
def row_parallel_bias(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """Activation split on the contracted dim, weight on its input features, bias whole:
    partial sums, the bias added once after the reduction."""
    if len(node.input_meta) < 3:
        return []
    if node.op == "aten.linear.default":  # linear(x, W (out, in), b)
        activation, weight = node.input_meta[0], node.input_meta[1]
        placed = (Shard(len(activation.shape) - 1), Shard(len(weight.shape) - 1), R)
    else:  # addmm(b, x (m, k), W (k, n))
        activation = node.input_meta[1]
        placed = (R, Shard(len(activation.shape) - 1), Shard(0))
    return [AxisCandidate(placed, (Partial(),))]


__all__ = ["convention_candidates", "register_convention", "vocabulary_parallel_loss"]
