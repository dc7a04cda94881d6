"""The ``pipeline`` family's section of the report: the stages, what each rank holds, its busy
time and memory, and what each mesh axis runs."""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import TYPE_CHECKING

from rich.table import Table

from planner.flavour_text import FLAVOUR_TEXT
from planner.pipeline_moe_report import stage_moe_summary, stage_moe_table
from planner.report_parts import Paragraph
from planner.strategy import NodeStrategy
from planner.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from planner.plans import Plan


def pipeline_section(plan: "Plan") -> list:
    """The report part of the ``pipeline`` family (``planner.families``); with the stages'
    MoE layers (``planner.pipeline_moe_report``) when they run by layouts."""
    moe = [table for table in (stage_moe_table(plan), stage_moe_summary(plan)) if table is not None]
    return [Paragraph(_pipeline_summary(plan)), _pipeline_table(plan), *moe, Paragraph(_axes_text(plan))]


def _pipeline_table(plan: "Plan") -> Table:
    """One row per pipeline rank: the blocks (and other ops) its virtual stages hold, its
    simulated busy time per step and its memory."""
    pipeline, estimate = plan.pipeline, plan.estimate
    table = Table(title=f"Pipeline stages ({estimate.method})")
    for column in ("rank", "holds (virtual stages in order)", "recompute", "compute + tp comm", "memory"):
        table.add_column(column, justify="right" if column in ("rank", "compute + tp comm", "memory") else "left")
    by_stage: dict[int, list[NodeStrategy]] = {}
    for strategy in plan.strategies:
        by_stage.setdefault(strategy.stage, []).append(strategy)
    for rank in range(pipeline.stages):
        chunks = [by_stage.get(v, []) for v in range(rank, pipeline.stages * pipeline.virtual_stages, pipeline.stages)]
        busy = sum(s.cost.compute_s + s.cost.communication_s for chunk in chunks for s in chunk)
        memory = estimate.stage_memory[rank].total if rank < len(estimate.stage_memory) else 0
        holds = " | ".join(stage_contents(chunk) for chunk in chunks)
        stages = range(rank, pipeline.stages * pipeline.virtual_stages, pipeline.stages)
        recompute = " | ".join(plan.recompute_at(stage) for stage in stages)
        table.add_row(str(rank), holds, recompute, format_seconds(busy), format_bytes(memory))
    return table


def _pipeline_summary(plan: "Plan") -> str:
    pipeline = plan.pipeline
    virtual = f", {pipeline.virtual_stages} virtual stages per rank" if pipeline.virtual_stages > 1 else ""
    return (
        f"Pipeline: {pipeline.stages} stages, {pipeline.schedule}{virtual}, {pipeline.micro_batches} micro-batches, "
        f"bubble {plan.estimate.bubble_fraction:.1%} of the busiest rank's step"
    )


def stage_contents(strategies: list[NodeStrategy]) -> str:
    """``blocks.0-5 + wte, wpe``: the repeated blocks as index ranges, then the other
    top-level modules."""
    blocks: OrderedDict[str, list[int]] = OrderedDict()
    others: list[str] = []
    for strategy in strategies:
        match = re.match(r"(.*?)\.(\d+)(?=\.|$)", strategy.module)
        if match:
            indices = blocks.setdefault(match[1], [])
            if int(match[2]) not in indices:
                indices.append(int(match[2]))
        elif strategy.module:
            top = strategy.module.split(".")[0]
            if top not in others:
                others.append(top)
    parts = [f"{prefix}.{_ranges(indices)}" for prefix, indices in blocks.items()]
    return " + ".join(parts + ([", ".join(others)] if others else [])) or "-"


def _ranges(indices: list[int]) -> str:
    spans, start = [], None
    for position, index in enumerate(sorted(indices)):
        if start is None:
            start = previous = index
        elif index != previous + 1:
            spans.append((start, previous))
            start = index
        previous = index
        if position == len(indices) - 1:
            spans.append((start, previous))
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _axes_text(plan: "Plan") -> str:
    """Which mesh axis does what, the data-parallel flavour included."""
    roles = {"pp": "pipeline stages", "tp": "tensor parallelism (Megatron column/row-parallel blocks)"}
    parts = []
    for axis, size in plan.mesh.axes:
        if axis == "dp":
            parts.append(f"'dp' ({size} ranks) runs {FLAVOUR_TEXT[plan.dp_flavour].split(':')[0]}")
        else:
            parts.append(f"'{axis}' ({size} ranks) runs {roles.get(axis, axis)}")
    return f"axes: {'; '.join(parts)}. Stage time: forward + backward of every micro-batch, recomputation excluded."
