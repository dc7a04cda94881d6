"""The report's tensor-parallel layout section: which family each layer's matmuls and norms
run (1-D splits, 2-D SUMMA, 2.5-D, 3-D) and their predicted time.

One row per module path with the block index folded (``blocks.*.mlp.c_fc``); the figures
are the simulator's annotations of the plan's strategies (compute and communication per
step, summed over the group). It reads only the plan; what the SUMMA layers save against
1-D is in the plan's search summary (``search.summa_savings``), computed when it was made.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from rich.table import Table

from planner.errors import one_line
from planner.strategy import SummaLayout
from planner.units import format_seconds

if TYPE_CHECKING:
    from planner.plans import Plan

# Ops whose layout the section names: the matmul-like ones and the norms between them.
_LAYER_OPS = ("aten.linear.default", "aten.layer_norm.default", "aten.rms_norm.default")


def has_summa_layouts(plan: "Plan") -> bool:
    """Whether any op of the plan runs a SUMMA layout."""
    return any(isinstance(s.layout, SummaLayout) for s in plan.strategies)


def layer_family(strategy) -> str:
    """``3-D q=2`` for a SUMMA layout (the role swap folded), ``1-D`` for a weight split on
    one axis, ``replicated`` otherwise."""
    if isinstance(strategy.layout, SummaLayout):
        return strategy.layout.describe().replace(" (swapped)", "")
    split = any(getattr(p, "dim", None) is not None for placements in strategy.params.values() for p in placements)
    return "1-D" if split else "replicated"


def summa_table(plan: "Plan") -> Table:
    """One row per layer group: its family, ops, and predicted compute and communication."""
    table = Table(title="Tensor-parallel layout by layer (1-D splits or SUMMA; simulator, per step)")
    for column in ("layer", "ops", "layout", "compute", "communication"):
        table.add_column(column, justify="right" if column in ("ops", "compute", "communication") else "left")
    rows: dict[tuple[str, str], list] = {}
    for strategy in plan.strategies:
        if strategy.op in _LAYER_OPS:
            module = re.sub(r"\.\d+\.", ".*.", f".{strategy.module}.").strip(".") or "<root>"
            rows.setdefault((module, layer_family(strategy)), []).append(strategy)
    for (module, family), members in rows.items():
        table.add_row(one_line(module)[:60], str(len(members)), family,
                      format_seconds(sum(s.cost.compute_s for s in members)),
                      format_seconds(sum(s.cost.communication_s for s in members)))
    return table


def summa_section(plan: "Plan") -> list:
    """The report part of the ``summa`` family (``planner.families``): the layers' layouts, when
    any op runs a SUMMA layout."""
    return [summa_table(plan)] if has_summa_layouts(plan) else []
