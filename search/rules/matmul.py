"""Matmul-like ops, one helper for the family: an einsum string describes each op.

For an einsum ``"mk,kn->mn"`` on one mesh axis:

* a letter that survives into the output (``m``, ``n``, batch letters) may be split: every
  operand holding it at full size is ``Shard`` on it, operands that broadcast it stay
  ``Replicate``, the output is ``Shard`` on it. Uneven sizes are fine: every operand and the
  output chunk that letter identically.
* a contracted letter (``k``) may be split in every operand: each rank sums over its slice
  of ``k``, the output is ``Partial()``.
* the op is linear in each operand: one operand ``Partial`` and the others ``Replicate``
  gives a ``Partial`` output (the bias partial alike; a whole bias for an average).

A bias added to the product (``linear``, ``addmm``, ``baddbmm``) is split like the output
where it has the letter, ``Replicate`` where it broadcasts, and ``Partial`` whenever the
output is (each rank adds its share of the bias, not the whole bias: adding a replicated bias
on every rank would count it ``axis_size`` times; Megatron-LM's program adds it once after
the reduction, a convention: ``search.rules.conventions``).
"""

from __future__ import annotations

import string

from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from planner.graph import OpNode, TensorMeta
from search.rules.common import AVG, SUM, R
from search.rules.registry import AxisCandidate, register_rule


def einsum_candidates(
    spec: str, operands: list[TensorMeta], out: TensorMeta, axis_size: int, bias: TensorMeta | None = None
) -> list[tuple[tuple[Placement, ...], Placement]]:
    """(operand placements [+ bias placement last], output placement) for ``spec``.

    Args:
        spec: ``"ab,bc->ac"``-style, one letter per dim of each operand and of the output.
        operands: metas of the operands, in the order of ``spec``.
        out: meta of the output.
        axis_size: ranks on the mesh axis.
        bias: meta of a tensor added to the product (broadcast to the output), if any.
    """
    inputs_spec, out_spec = spec.split("->")
    operand_specs = inputs_spec.split(",")
    if len(operand_specs) != len(operands) or len(out_spec) != len(out.shape):
        raise ValueError(f"einsum '{spec}' does not fit operands {[str(m) for m in operands]} -> {out}")
    sizes: dict[str, int] = {}
    for letters, meta in zip(operand_specs, operands):
        for letter, size in zip(letters, meta.shape):
            sizes[letter] = max(sizes.get(letter, 1), size)
    results: list[tuple[tuple[Placement, ...], Placement]] = []
    for letter in dict.fromkeys("".join(operand_specs)):
        size = sizes[letter]
        if size < 2 or size < axis_size:
            continue
        placed = tuple(
            Shard(letters.index(letter)) if letter in letters and meta.shape[letters.index(letter)] == size else R
            for letters, meta in zip(operand_specs, operands)
        )
        if letter in out_spec:
            out_dim = out_spec.index(letter)
            output: Placement = Shard(out_dim)
            bias_placement = _bias_shard(bias, len(out.shape), out_dim) if bias is not None else None
        else:
            if any(p == R for letters, p in zip(operand_specs, placed) if letter in letters):
                continue  # a contracted letter broadcast in one operand: not a plain contraction
            output, bias_placement = SUM, SUM
        results.append((placed + ((bias_placement,) if bias is not None else ()), output))
    for flavour in (SUM, AVG):  # linear in each operand (and in the bias)
        for index in range(len(operands)):
            placed = tuple(flavour if i == index else R for i in range(len(operands)))
            results.append((placed + ((flavour,) if bias is not None else ()), flavour))
            if bias is not None and flavour == AVG:  # a whole bias shifts an average alike
                results.append((placed + (R,), flavour))
    return results


def _bias_shard(bias: TensorMeta, out_rank: int, out_dim: int) -> Placement:
    dim = out_dim - (out_rank - len(bias.shape))
    return R if dim < 0 or bias.shape[dim] == 1 else Shard(dim)


def _letters(count: int, skip: str = "kmn") -> str:
    return "".join(letter for letter in string.ascii_lowercase if letter not in skip)[:count]


def matmul_spec(left_rank: int, right_rank: int) -> str:
    """The einsum of ``torch.matmul`` for operands of these ranks (batch dims broadcast)."""
    if left_rank == 1 and right_rank == 1:
        return "k,k->"
    if left_rank == 1:
        batch = _letters(right_rank - 2)
        return f"k,{batch}kn->{batch}n"
    if right_rank == 1:
        batch = _letters(left_rank - 2)
        return f"{batch}mk,k->{batch}m"
    out_batch = _letters(max(left_rank, right_rank) - 2)
    left_batch = out_batch[len(out_batch) - (left_rank - 2) :]
    right_batch = out_batch[len(out_batch) - (right_rank - 2) :]
    return f"{left_batch}mk,{right_batch}kn->{out_batch}mn"


def _rule(node: OpNode, axis_size: int, operands: list[int], spec: str, bias_index: int | None) -> list[AxisCandidate]:
    """The einsum candidates mapped onto the node's inputs (``operands``: their positions)."""
    if max(operands) >= len(node.input_meta):
        return []  # a tensor passed twice is recorded once: operands cannot be told apart
    metas = [node.input_meta[i] for i in operands]
    bias = node.input_meta[bias_index] if bias_index is not None and bias_index < len(node.input_meta) else None
    found = []
    for placed, output in einsum_candidates(spec, metas, node.output_meta[0], axis_size, bias):
        inputs: list[Placement] = [R] * len(node.input_meta)
        for index, placement in zip(operands, placed):
            inputs[index] = placement
        if bias is not None:
            inputs[bias_index] = placed[-1]
        found.append(AxisCandidate(tuple(inputs), (output,)))
    return found


@register_rule("aten.linear.default")
def linear_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """``linear(x, W, b)``: x (..., k), W (n, k), b (n,) -> (..., n)."""
    batch = _letters(len(node.input_meta[0].shape) - 1)
    return _rule(node, axis_size, [0, 1], f"{batch}k,nk->{batch}n", 2 if len(node.input_meta) > 2 else None)


@register_rule("aten.mm.default")
def mm_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """``mm(a, b)``: (m, k) @ (k, n)."""
    return _rule(node, axis_size, [0, 1], "mk,kn->mn", None)


@register_rule("aten.addmm.default")
def addmm_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """``addmm(bias, a, b)``: bias + (m, k) @ (k, n) (``beta``/``alpha`` scale linearly)."""
    return _rule(node, axis_size, [1, 2], "mk,kn->mn", 0)


@register_rule("aten.bmm.default")
def bmm_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """``bmm(a, b)``: (b, m, k) @ (b, k, n)."""
    return _rule(node, axis_size, [0, 1], "bmk,bkn->bmn", None)


@register_rule("aten.baddbmm.default")
def baddbmm_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """``baddbmm(bias, a, b)``: bias + (b, m, k) @ (b, k, n)."""
    return _rule(node, axis_size, [1, 2], "bmk,bkn->bmn", 0)


@register_rule("aten.matmul.default")
def matmul_rule(node: OpNode, axis_size: int) -> list[AxisCandidate]:
    """``matmul(a, b)`` with broadcast batch dims."""
    if len(node.input_meta) != 2:
        return []  # matmul(x, x) recorded once: cannot tell the operands apart
    spec = matmul_spec(len(node.input_meta[0].shape), len(node.input_meta[1].shape))
    return _rule(node, axis_size, [0, 1], spec, None)
