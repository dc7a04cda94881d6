"""The plan as one self-contained HTML page: ``planner report PLAN --html report.html``.

One file, no network: the styles and the script are inlined (``planner/html_assets/``), the
plan's figures travel as one JSON block, and the page draws everything itself in SVG. It
opens from a ``file://`` URL, offline, in any current browser. Sections:

* the verdict, what looks wrong and the warnings, the details (the text report's words);
* the strategy by module, a collapsible tree with each op's placements and a badge where an
  input is redistributed (its producer wrote it otherwise), filterable by text;
* the simulated step per device and stream (compute, collectives, pipeline sends), exposed
  communication (a collective no compute hides) marked, zoomable;
* memory per pipeline stage (the devices of a stage hold alike) as bars stacked by kind
  against the device's capacity; bytes each device sends per mesh axis;
* the plans the search considered, step time against memory, with the device's capacity as
  the line that separates what fits, the chosen plan marked;
* per MoE layer, the load of each device before placement (round-robin) and after;
* the pipeline's stage map and the SUMMA grids of the mesh;
* with ``--measured``, predicted against measured per op class and collective;
* the report's tables (time, memory, family sections) as tables.

A plan is shared data: every string reaches the page through the JSON block (``<``, ``>``,
``&`` escaped as ``\\u003c``...) and the script puts it into the page as text
(``textContent``), never as markup.

Vocabulary layer: reads a ``Plan`` (and a timeline, measured parts), nothing is simulated.
"""

from __future__ import annotations

import html
import json
import re
from collections import OrderedDict
from importlib import resources
from typing import Iterable, Sequence

from planner.expert_layouts import ExpertPlacement
from planner.pipeline_report import stage_contents
from planner.report import ReportItem, report_details, report_items, table_data
from planner.report_parts import Paragraph
from planner.strategy import placements_str
from planner.summa_report import has_summa_layouts, layer_family
from planner.verdict import plan_label

# Streams drawn as computation; every other stream is communication (collectives, sends).
COMPUTE_STREAMS = ("compute",)
# A marker in the page's head: how an existing file is recognised as one soap-planner wrote
# (``is_html_report``), so ``--html`` never overwrites a user's page.
HTML_MARKER = '<meta name="generator" content="soap-planner report">'
# Devices (timeline rows) drawn: a pipeline's stages; more would not be readable.
MOST_TIMELINE_DEVICES = 16


def html_report(plan, *, timeline: Sequence = (), measured: Sequence | None = None) -> str:
    """The page (module docstring) for ``plan``; ``timeline``: the simulator's events
    (``TimelineEvent``: device, stream, name, start_s, duration_s), ``measured``: parts with
    ``name``, ``predicted_s`` and ``measured_s`` (``planner.compare``)."""
    data = report_page_data(plan, timeline=timeline, measured=measured)
    style = _asset("report.css")
    script = _asset("report.js")
    title = html.escape(f"soap-planner: {plan_label(plan)}")
    return (
        f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n{HTML_MARKER}\n"
        f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>{title}</title>\n"
        f"<style>\n{style}\n</style>\n</head>\n<body>\n<main id=\"report\"></main>\n"
        f"<script type=\"application/json\" id=\"plan-data\">{_script_json(data)}</script>\n"
        f"<script>\n{script}\n</script>\n</body>\n</html>\n"
    )


def is_html_report(path) -> bool:
    """True when ``path`` is a page ``html_report`` wrote."""
    from planner.outputs import file_head

    return HTML_MARKER in file_head(path)


def report_page_data(plan, *, timeline: Sequence = (), measured: Sequence | None = None) -> dict:
    """Everything the page draws, as plain JSON data."""
    items = report_items(plan)
    estimate = plan.estimate
    return {
        "title": _paragraph_texts(items, "title")[0],
        "verdict": _paragraph_texts(items, "verdict")[0],
        "notes": [{"kind": item.section, "text": item.content.text} for item in items
                  if item.section in ("note", "warning")],
        "details": [list(detail) for detail in report_details(plan)],
        "summary": {"step_s": estimate.step_time_s, "mfu": estimate.mfu, "memory": estimate.memory.total,
                    "capacity": estimate.device_memory_bytes, "fits": estimate.fits,
                    "communication_s": estimate.communication_s, "bubble": estimate.bubble_fraction},
        "modules": module_tree_rows(plan),
        "timeline": timeline_data(timeline),
        "memory": memory_data(plan),
        "bytes_per_axis": dict(sorted(estimate.bytes_per_axis.items())),
        "candidates": candidates_data(plan),
        "moe": moe_loads(plan),
        "pipeline": pipeline_map(plan),
        "summa": summa_grids(plan),
        "measured": None if measured is None else [
            {"name": part.name, "predicted_s": part.predicted_s, "measured_s": part.measured_s} for part in measured],
        "tables": [{"section": item.section, **table_data(item.content)} for item in items if _is_table(item)],
    }


def module_tree_rows(plan) -> list[dict]:
    """One row per op: its module path, op, placements, weights, share of compute, and how
    many of its inputs are redistributed (the producer's output placement differs)."""
    produced = {s.node: s.outputs[0] for s in plan.strategies if s.outputs}
    total = sum(s.cost.compute_s for s in plan.strategies) or 1.0
    node_inputs = _node_inputs(plan)
    rows = []
    for strategy in plan.strategies:
        moved = 0
        for position, source in enumerate(node_inputs.get(strategy.node, ())):
            if source in produced and position < len(strategy.inputs) and produced[source] != strategy.inputs[position]:
                moved += 1
        rows.append({
            "module": strategy.module, "node": strategy.node, "op": strategy.op.removeprefix("aten."),
            "placement": strategy.describe(),
            "weights": ", ".join(f"{name.rsplit('.', 1)[-1]} {placements_str(p)}" for name, p in strategy.params.items()),
            "layout": strategy.layout.describe() if hasattr(strategy.layout, "describe") else "",
            "share": strategy.cost.compute_s / total, "stage": strategy.stage, "reshards": moved,
        })
    return rows


def timeline_data(timeline: Iterable) -> dict:
    """Lanes of (device, stream) with their events ``[start, duration, name]`` in seconds, and
    each device's exposed communication: the parts of its collectives no compute covers."""
    lanes: OrderedDict[tuple[str, str], list] = OrderedDict()
    for event in timeline:
        lanes.setdefault((event.device, event.stream), []).append([event.start_s, event.duration_s, event.name])
    devices = list(OrderedDict.fromkeys(device for device, _ in lanes))[:MOST_TIMELINE_DEVICES]
    exposed = {}
    for device in devices:
        busy = _union([(start, start + length) for (owner, stream), events in lanes.items()
                       if owner == device and stream in COMPUTE_STREAMS for start, length, _ in events])
        waits = _union([(start, start + length) for (owner, stream), events in lanes.items()
                        if owner == device and stream not in COMPUTE_STREAMS for start, length, _ in events])
        exposed[device] = [[start, end - start] for start, end in _subtract(waits, busy) if end - start > 0]
    end = max((start + length for events in lanes.values() for start, length, _ in events), default=0.0)
    return {
        "end_s": end,
        "lanes": [{"device": device, "stream": stream, "compute": stream in COMPUTE_STREAMS, "events": events}
                  for (device, stream), events in lanes.items() if device in devices],
        "exposed": exposed,
    }


def memory_data(plan) -> dict:
    """Bytes by kind on each pipeline stage's devices (one entry without a pipeline)."""
    estimate = plan.estimate
    stages = estimate.stage_memory if len(estimate.stage_memory) > 1 else (estimate.memory,)
    kinds = ("weights", "gradients", "optimizer_states", "activations", "communication_buffers")
    return {
        "capacity": estimate.device_memory_bytes,
        "kinds": list(kinds),
        "bars": [{"name": f"stage {index}" if len(stages) > 1 else "every device",
                  **{kind: getattr(memory, kind) for kind in kinds}} for index, memory in enumerate(stages)],
    }


def candidates_data(plan) -> list[dict]:
    """The chosen plan and its runners-up: step time, memory, fits, route."""
    estimate = plan.estimate
    rows = [{"name": plan_label(plan), "step_s": estimate.step_time_s, "memory": estimate.memory.total,
             "fits": estimate.fits, "chosen": True, "route": ""}]
    rows += [{"name": alt.name, "step_s": alt.step_time_s, "memory": alt.memory_bytes, "fits": alt.fits,
              "chosen": False, "route": alt.route} for alt in plan.runners_up]
    return rows


def moe_loads(plan) -> list[dict]:
    """Per expert-parallel MoE layer: each device's share of the routed tokens with the
    experts placed round-robin (before) and as the plan places them (after)."""
    layers = []
    for layout in plan.expert_layouts:
        if layout.mode != "expert_parallel" or layout.placement is None:
            continue
        loads = layout.expert_loads or tuple(1.0 / layout.experts for _ in range(layout.experts))
        devices = layout.placement.devices
        before = ExpertPlacement.round_robin(layout.experts, devices).device_loads(loads)
        layers.append({"module": layout.module, "before": list(before),
                       "after": list(layout.placement.device_loads(loads))})
    return layers


def pipeline_map(plan) -> dict | None:
    """Which modules each pipeline stage (and virtual stage) runs."""
    pipeline = plan.pipeline
    if pipeline is None:
        return None
    by_stage: OrderedDict[int, list] = OrderedDict()
    for strategy in plan.strategies:
        by_stage.setdefault(strategy.stage, []).append(strategy)
    chunks = [{"module_stage": stage, "rank_stage": stage % pipeline.stages, "contents": stage_contents(members)}
              for stage, members in sorted(by_stage.items())]
    return {"stages": pipeline.stages, "virtual": pipeline.virtual_stages, "schedule": pipeline.schedule,
            "micro_batches": pipeline.micro_batches, "chunks": chunks}


def summa_grids(plan) -> dict | None:
    """The mesh's SUMMA axes as grids of rank numbers (row x col, one grid per ``dep`` layer
    and ``dp`` replica) and which layers use which family."""
    if not has_summa_layouts(plan):
        return None
    names = list(plan.mesh.names)
    sizes = [size for _, size in plan.mesh.axes]
    # Rank of mesh coordinates: row-major over the mesh's axes (DeviceMesh's layout).
    strides = [1] * len(sizes)
    for index in range(len(sizes) - 2, -1, -1):
        strides[index] = strides[index + 1] * sizes[index + 1]
    size = dict(zip(names, sizes))
    grids = []
    others = [name for name in names if name not in ("row", "col")]
    for flat in range(max(1, plan.mesh.size // (size.get("row", 1) * size.get("col", 1)))):
        coordinates, rest = {}, flat
        for name in reversed(others):
            coordinates[name] = rest % size[name]
            rest //= size[name]
        cells = []
        for row in range(size.get("row", 1)):
            cells.append([sum(strides[names.index(name)] * value for name, value in
                              {**coordinates, "row": row, "col": col}.items() if name in names)
                          for col in range(size.get("col", 1))])
        grids.append({"label": ", ".join(f"{name}={value}" for name, value in coordinates.items()) or "mesh",
                      "cells": cells})
    families: OrderedDict[str, int] = OrderedDict()
    for strategy in plan.strategies:
        if strategy.params:
            family = layer_family(strategy)
            families[family] = families.get(family, 0) + 1
    return {"grids": grids, "families": [[family, count] for family, count in families.items()]}


def _node_inputs(plan) -> dict[str, tuple[str, ...]]:
    """Node -> its input node names, when the plan kept its graph (a freshly planned one)."""
    graph = getattr(plan, "graph", None)
    if graph is None:
        return {}
    return {node.name: tuple(node.inputs) for node in graph.nodes}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _subtract(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``spans`` (merged) outside ``cover`` (merged)."""
    left = []
    for start, end in spans:
        cursor = start
        for cover_start, cover_end in cover:
            if cover_end <= cursor or cover_start >= end:
                continue
            if cover_start > cursor:
                left.append((cursor, cover_start))
            cursor = max(cursor, cover_end)
        if cursor < end:
            left.append((cursor, end))
    return left


def _paragraph_texts(items: list[ReportItem], section: str) -> list[str]:
    return [item.content.text for item in items if item.section == section and isinstance(item.content, Paragraph)]


def _is_table(item: ReportItem) -> bool:
    from rich.table import Table

    return isinstance(item.content, Table)


def _script_json(data: dict) -> str:
    """``data`` as JSON safe inside a ``<script>`` element: no ``<``, ``>`` or ``&`` can end
    it or start markup (escaped as ``\\u003c``...), and U+2028/2029 escaped too."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    return re.sub(r"[<>&\u2028\u2029]", lambda match: f"\\u{ord(match[0]):04x}", text)


def _asset(name: str) -> str:
    return resources.files("planner").joinpath("html_assets", name).read_text(encoding="utf-8")
