"""``planner explain``'s text: per op, its placement's cost parts beside each alternative's.

Reads the explanations ``search.explain.explain_ops`` makes (duck-typed here: this module is
vocabulary and imports no search code) and lays them out as the report does, inert and
sized to the terminal. One op gets its full table; several (``--module``, ``--layer``) get a
line each (the choice, the cheapest alternative and its verdict) and the table of the op
that costs the most.
"""

from __future__ import annotations

import io
import textwrap

from rich.table import Table

from planner.terminal import InertConsole
from planner.units import format_bytes, format_seconds

# Alternatives listed per op in the full table; the rest are counted.
MOST_ROWS = 12


def render_explanations(explanations, width: int) -> str:
    """The explanations as text ``width`` columns wide (module docstring)."""
    buffer = io.StringIO()
    console = InertConsole(file=buffer, width=width, force_terminal=False, color_system=None)
    if len(explanations) > 1:
        summary = Table(title=f"{len(explanations)} ops: the chosen placement against the best alternative")
        for column in ("op", "chosen", "cost", "best alternative", "its verdict"):
            summary.add_column(column, justify="right" if column == "cost" else "left")
        for explanation in explanations:
            others = [option for option in explanation.options if not option.chosen]
            best = others[0] if others else None
            summary.add_row(
                f"{explanation.node} ({_short(explanation.op)})", explanation.chosen.placement(),
                format_seconds(explanation.chosen.total_s),
                best.placement() if best else "-", explanation.verdict(best) if best else "no other placement offered",
            )
        console.print(summary)
        console.print()
    for explanation in _detailed(explanations):
        console.print(_op_table(explanation))
        hidden = len(explanation.options) - MOST_ROWS
        if hidden > 0:
            console.print(f"  ... and {hidden} more alternatives, each slower than those above")
    console.print(textwrap.fill(
        "Costs per step with the other ops held where the plan put them: compute = forward + backward; "
        "communication = the op's own collectives and gradient sync; resharding = moving its inputs from "
        "their producers and its output to its consumers; memory = its weights, gradients, optimizer "
        "states and saved activations per device. An alternative cheaper here lost on the whole step: "
        "repeated blocks share one choice, and the search's last word is the simulator's (overlap, "
        "the pipeline, memory), which a per-op sum does not see.", width=width, break_on_hyphens=False))
    return buffer.getvalue()


def _detailed(explanations):
    """The op to show in full: the only one, or the one whose chosen placement costs most."""
    if len(explanations) == 1:
        return explanations
    return [max(explanations, key=lambda explanation: explanation.chosen.total_s)]


def _op_table(explanation) -> Table:
    table = Table(title=f"{explanation.node}: {_short(explanation.op)} in {explanation.module or '<root>'}")
    for column in ("placement (inputs -> outputs; weights)", "compute", "comm.", "reshard", "total", "memory", "verdict"):
        numeric = column in ("compute", "comm.", "reshard", "total", "memory")
        table.add_column(column, justify="right" if numeric else "left")
    shown = list(explanation.options[:MOST_ROWS])
    if not any(option.chosen for option in shown):
        shown[-1] = explanation.chosen  # the plan's choice is always shown
    for option in shown:
        table.add_row(
            option.placement(), format_seconds(option.compute_s), format_seconds(option.communication_s),
            format_seconds(option.resharding_s), format_seconds(option.total_s), format_bytes(option.memory_bytes),
            explanation.verdict(option),
        )
    return table


def _short(op: str) -> str:
    return op.removeprefix("aten.")
