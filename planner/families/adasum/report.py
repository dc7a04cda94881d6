"""Adasum's lines of the report (vocabulary layer): a convergence choice, its cost priced."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.report_parts import Paragraph

if TYPE_CHECKING:
    from planner.plans import Plan


def adasum_section(plan: "Plan") -> list:
    """The report part of the ``adasum`` family (``planner.families``): what Adasum is for
    (convergence at large batches, not speed) and what its step costs."""
    section = plan.sections["adasum"]
    copies, local = section.copies(plan), section.local
    inside = f"the {local} ranks of each node average their gradients, then " if local > 1 else ""
    levels = copies.bit_length() - 1
    return [Paragraph(
        f"Adasum is a convergence choice for large batches, not a speed-up: {inside}the {copies} gradients are "
        f"combined pairwise by (1 - g1.g2/(2|g1|^2)) g1 + (1 - g1.g2/(2|g2|^2)) g2, tensor by tensor, which "
        f"lets a large global batch train in fewer steps than averaging (Maleki et al., MLSys 2021: BERT-Large "
        f"with LAMB at 64K, 20% fewer epochs). Its price is in the simulated step above: {levels} swaps of every "
        f"gradient bucket with one partner (recursive doubling) plus three dot products and a combination per "
        f"tensor, in place of a ring all-reduce. The search never picks it for speed: it is chosen with "
        f"--family adasum. Lossy in the sense of parity: the step differs from one device's by design."
    )]
