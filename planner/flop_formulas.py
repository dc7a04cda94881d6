"""FLOP formulas for matmul ops that ``torch.utils.flop_counter`` does not count.

Grouped matmuls multiply each row block of one operand by its own matrix (a Mixture-of-
Experts layer's tokens, sorted by expert, by that expert's weight). PyTorch's flop counter
has no formula for ``aten._grouped_mm``, and transformers 5 runs its stacked experts
(Mixtral, Qwen-MoE, OLMoE, ...) through its own custom op ``transformers::grouped_mm_fallback``
wherever ``_grouped_mm`` cannot run (CPUs, meta tensors, non-bf16 weights): uncounted, the
experts' matmuls, most of such a model's work, would cost nothing in the simulator.

Both compute, for every row of the left operand, one product with a (K x N) matrix, whatever
the grouping: ``2 x numel(left) x N`` FLOPs, N the right operand's last dimension ((S, K) x
(E, K, N) with offsets: 2 S K N; batched (E, M, K) x (E, K, N): 2 E M K N; (M, K) x (K, N)
grouped over K: 2 M K N).
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula

# (namespace, op) of the grouped matmuls formulas are registered for, once each exists
# (transformers defines its op when its MoE integration is imported).
GROUPED_MATMUL_OPS = (("aten", "_grouped_mm"), ("transformers", "grouped_mm_fallback"))


def grouped_matmul_flops(left_shape, right_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of a grouped matmul of ``left_shape`` by ``right_shape`` (module docstring)."""
    return 2 * math.prod(left_shape) * right_shape[-1]


def register_grouped_matmul_formulas() -> None:
    """Register ``grouped_matmul_flops`` for each op of ``GROUPED_MATMUL_OPS`` that exists now
    and has no formula yet (called before counting a traced graph's FLOPs)."""
    for namespace, name in GROUPED_MATMUL_OPS:
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None and packet not in flop_registry:
            register_flop_formula(packet)(grouped_matmul_flops)


# Namespaces of the ops PyTorch's flop counter knows (those without a formula do no matmul).
COUNTED_NAMESPACES = ("aten.", "prims.")


def uncounted_custom_ops(graph) -> dict[str, int]:
    """Ops of ``graph`` from other libraries (custom ops) counted at 0 FLOPs, by op name with
    their node counts: the simulator prices them by the bytes they move only."""
    found: dict[str, int] = {}
    for node in graph.nodes:
        # Python callables in the graph (``getitem`` picking one output of a multi-output op)
        # are not ops and compute nothing; custom ops are ``namespace.name.overload``.
        if "." not in node.op or node.op.startswith(COUNTED_NAMESPACES) or node.flops:
            continue
        if any(meta.dtype.is_floating_point for meta in node.output_meta):
            found[node.op] = found.get(node.op, 0) + 1
    return found
