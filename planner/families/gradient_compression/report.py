"""The compression families' lines of the report (vocabulary layer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.families.gradient_compression.convergence import convergence_risk
from planner.families.gradient_compression.section import compression_of
from planner.report_parts import Paragraph

if TYPE_CHECKING:
    from planner.plans import Plan


def compression_section(plan: "Plan") -> list:
    """The report part of the compression families (``planner.families``):
    what is sent, that the plan is checked by convergence, not parity, the search summary's
    sentence on the predicted gain over the best uncompressed plan, and the convergence risk
    when the convergence benchmark measured the method outside its tolerance."""
    section = compression_of(plan)
    lines = [Paragraph(
        f"Gradient compression: {section.strategy_text(plan)}. It is lossy: the compiled program's --check refuses "
        f"(parity with one device cannot hold); benchmarks/compression_convergence.py compares its training loss "
        f"with uncompressed training."
    )]
    sentence = next((part for part in summary_parts(plan.search_summary or "") if "gradient compression" in part), None)
    if sentence is not None:
        lines.append(Paragraph(f"Why: {sentence}."))
    risk = convergence_risk(section, section.describe(plan))
    if risk is not None:
        lines.append(Paragraph(risk))
    return lines


def summary_parts(summary: str) -> list[str]:
    """The search summary's notes, split at its ``"; "`` separators outside parentheses (a
    plan's name, ``ddp (dp=8; powersgd rank 1)``, holds one too)."""
    parts, depth, start = [], 0, 0
    for index, character in enumerate(summary):
        depth += {"(": 1, ")": -1}.get(character, 0)
        if depth == 0 and summary.startswith("; ", index):
            parts.append(summary[start:index])
            start = index + 2
    return [*parts, summary[start:]]
