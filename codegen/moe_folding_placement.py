"""Where a folded MoE layer's experts live among the ``dp x tp`` ranks of a compiled program.

A folded layout (``planner.families.moe_folding``) places the experts over EP ranks; with
``EDP = dp x tp / EP`` (ETP 1) the ranks hold EDP copies of that placement, in Megatron's
order (EP innermost: EP position ``p`` of copy ``c`` is folded rank ``c x EP + p``). The
runtime (``codegen.runtime.moe.ExpertParallelMoE``) runs copies as one placement over all
the ranks, each copy taking an equal share of its expert's slots and the copies' gradients
summed: the same step.
"""

from __future__ import annotations

from planner.strategy import ExpertLayout


def folded_replicas(layout: ExpertLayout, ranks: int) -> tuple[tuple[tuple[int, float], ...], ...]:
    """``layout``'s placement over ``ranks`` folded ranks: for each expert, (rank, share of
    its slots) of every copy (a ``literal``-ready tuple)."""
    ep = layout.placement.devices
    copies = ranks // ep
    return tuple(
        tuple((int(copy * ep + device), float(share) / copies) for copy in range(copies) for device, share in held)
        for held in layout.placement.replicas
    )
