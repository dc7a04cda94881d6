"""The compression families' lines of the report (vocabulary layer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.families.gradient_compression.section import compression_of
from planner.report_parts import Paragraph

if TYPE_CHECKING:
    from planner.plans import Plan


def compression_section(plan: "Plan") -> list:
    """The report part of the compression families (``planner.families``):
    what is sent, that the plan is checked by convergence, not parity, and the search
    summary's sentence on the predicted gain over the best uncompressed plan."""
    section = compression_of(plan)
    lines = [Paragraph(
        f"Gradient compression: {section.strategy_text(plan)}. It is lossy: the compiled program's --check refuses "
        f"(parity with one device cannot hold); benchmarks/compression_convergence.py compares its training loss "
        f"with uncompressed training."
    )]
    if plan.search_summary and "gradient compression" in plan.search_summary:
        sentence = next(part for part in plan.search_summary.split("; ") if "gradient compression" in part)
        lines.append(Paragraph(f"Why: {sentence}."))
    return lines
