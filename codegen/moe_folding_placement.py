"""Where a folded MoE layer's experts live among the ``dp x tp`` ranks of a compiled program.

A folded layout (``planner.families.moe_folding``) places the experts over EP ranks, each
split over ETP ranks; with ``EDP = dp x tp / (EP x ETP)`` the ranks hold EDP copies of that
placement. The runtime (``codegen.runtime.moe.ExpertParallelMoE``) runs copies as one placement over all
the ranks, each copy taking an equal share of its expert's slots and the copies' gradients
summed: the same step.
"""

from __future__ import annotations

from planner.strategy import ExpertLayout


def folded_replicas(layout: ExpertLayout, ranks: int) -> tuple[tuple[tuple[int, float], ...], ...]:
    """``layout``'s placement over ``ranks`` folded ranks: for each expert, (rank, share of
    its slots) of every rank holding it (a ``literal``-ready tuple). Megatron's order: ETP
    innermost, then EP, then EDP, so ETP slice ``i`` of EP position ``p`` in copy ``c`` is
    folded rank ``(c x EP + p) x ETP + i``; each of an expert's ETP ranks takes an equal share
    of its slots (``codegen.runtime.moe_folding.SlicedExperts`` gathers them back)."""
    ep, etp = layout.placement.devices, layout.tensor_parallel
    copies = ranks // (ep * etp)
    return tuple(
        tuple((int((copy * ep + device) * etp + piece), float(share) / (copies * etp))
              for copy in range(copies) for device, share in held for piece in range(etp))
        for held in layout.placement.replicas
    )
