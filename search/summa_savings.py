"""What a plan's SUMMA layouts save against 1-D tensor parallelism, per layer, for the report.

For every linear of the plan that runs a ``SummaLayout``, ``cost_model.summa.matmul_cost``
prices it twice on the same devices (one grid of the plan's mesh): under its layout, and
under 1-D tensor parallelism over those devices (the better of Megatron's column and row
split for that matmul). The figures are per step (forward and backward, every micro-batch),
per device: seconds with the overlap each algorithm allows, and bytes sent. Layers are
grouped by module path with the block index folded (``blocks.*.mlp.c_fc``), so a 48-layer
model gives a handful of lines. The result is plain text saved in the plan (its search
summary), so a report of a loaded plan says the same without the cost model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cost_model.summa import Grid, matmul_cost
from cost_model.summa_node import LINEAR_OPS, grid_ranks, linear_shape, summa_linear_cost
from planner.strategy import SummaLayout
from planner.units import format_bytes, format_seconds


@dataclass
class LayerSaving:
    """One group of linears (same module path but for the block index) under one layout."""

    module: str
    layout: str
    count: int = 0
    summa_s: float = 0.0
    one_d_s: float = 0.0
    summa_bytes: float = 0.0
    one_d_bytes: float = 0.0


def layer_savings(plan, graph) -> list[LayerSaving]:
    """Per group of SUMMA linears: seconds and bytes per device per step, SUMMA vs 1-D."""
    micro_batches = plan.pipeline.micro_batches if plan.pipeline else plan.accumulation_steps
    groups: dict[tuple[str, str], LayerSaving] = {}
    for strategy in plan.strategies:
        layout = strategy.layout
        if not isinstance(layout, SummaLayout) or strategy.op not in LINEAR_OPS:
            continue
        node = graph.node(strategy.node)
        module = re.sub(r"\.\d+\.", ".*.", f".{strategy.module}.").strip(".")
        words = layout.describe().replace(" (swapped)", "")
        saving = groups.setdefault((module, words), LayerSaving(module, words))
        summa = summa_linear_cost(node, plan.mesh, plan.cluster, layout, plan.precision, micro_batches)
        shape, ranks = linear_shape(node, plan.mesh, micro_batches), grid_ranks(plan.mesh, layout)
        one_d = min((matmul_cost(shape, Grid(family, layout.devices), plan.cluster, ranks, plan.precision)
                     for family in ("1d_column", "1d_row")), key=lambda cost: cost.total_s)
        saving.count += 1
        saving.summa_s += summa.total_s * micro_batches
        saving.one_d_s += one_d.total_s * micro_batches
        saving.summa_bytes += summa.bytes_per_device() * micro_batches
        saving.one_d_bytes += one_d.bytes_per_device() * micro_batches
    return list(groups.values())


def savings_text(plan, graph) -> str:
    """One sentence per group (empty when the plan has no SUMMA linear)."""
    savings = layer_savings(plan, graph)
    if not savings:
        return ""
    devices = next(s.layout.devices for s in plan.strategies if isinstance(s.layout, SummaLayout))
    parts = [
        f"{s.module} ({s.count}x, {s.layout}): {format_seconds(s.summa_s)} vs {format_seconds(s.one_d_s)}, "
        f"{format_bytes(s.summa_bytes)} vs {format_bytes(s.one_d_bytes)} sent per device"
        for s in savings
    ]
    summa_s, one_d_s = sum(s.summa_s for s in savings), sum(s.one_d_s for s in savings)
    return (f"SUMMA linears against 1-D tensor parallelism on the same {devices} devices (per step, matmuls alone): "
            + "; ".join(parts) + f"; in all {format_seconds(summa_s)} vs {format_seconds(one_d_s)}"
            + (f" ({_relative(summa_s, one_d_s)})" if one_d_s else ""))


def _relative(summa_s: float, one_d_s: float) -> str:
    change = summa_s / one_d_s - 1
    return f"SUMMA {abs(change):.0%} {'slower' if change > 0 else 'faster'}"
