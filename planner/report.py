"""The strategy report: what was chosen, where the memory goes, and why it won.

Rendered with rich tables into plain text, so it reads the same in a terminal, a log and a
test. It reads only the ``Plan``: no tracing or search happens here.
"""

from __future__ import annotations

import io
import re
import textwrap
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.table import Table

from planner.cluster_edits import provenance
from planner.families import with_part
from planner.flavour_text import FLAVOUR_TEXT
from planner.report_parts import Paragraph
from planner.strategy import KEEP_A2A, NodeStrategy
from planner.terminal import InertConsole
from planner.terminal_width import DEFAULT_WIDTH
from planner.units import format_bytes, format_count, format_flops, format_seconds
from planner.verdict import findings, plan_label, plan_route, verdict

if TYPE_CHECKING:
    from planner.plans import Plan

# Columns of the report when no width is given (the CLI gives the terminal's).
REPORT_WIDTH = DEFAULT_WIDTH



def render_report(plan: "Plan", width: int = REPORT_WIDTH) -> str:
    """The plan as readable text (see ``Plan.report``): a verdict paragraph first (what was
    chosen, why, at what cost), then what looks wrong and the warnings, then the details;
    every line at most ``width`` columns where the words allow (tables shrink to fit)."""
    buffer = io.StringIO()
    # Every string of the plan file passes through this console: escaped, never markup.
    console = InertConsole(file=buffer, width=width, force_terminal=False, color_system=None)
    for item in report_items(plan):
        if isinstance(item.content, Paragraph):
            console.print(_paragraph(item.content.text, width, indent=item.content.indent, hanging=item.content.hanging))
        else:
            console.print(item.content)
        if item.gap_after:
            console.print()
    return buffer.getvalue()


def report_data(plan: "Plan") -> dict:
    """The report's content as plain data for scripts (``--format json``): the same sections
    as the text, each ``{"section", "text"}`` for a paragraph or ``{"section", "title",
    "columns", "rows"}`` for a table, in the text's order."""
    sections = []
    for item in report_items(plan):
        if isinstance(item.content, Paragraph):
            sections.append({"section": item.section, "text": item.content.text})
        elif isinstance(item.content, Table):
            sections.append({"section": item.section, **table_data(item.content)})
        else:  # a family's plain string or other renderable
            sections.append({"section": item.section, "text": str(item.content)})
    return {"plan": plan.name, "step_time_s": plan.estimate.step_time_s, "fits": plan.estimate.fits,
            "memory_bytes": plan.estimate.memory.total, "mfu": plan.estimate.mfu, "sections": sections}


def table_data(table: Table) -> dict:
    """A rich ``Table`` as ``{"title", "columns", "rows"}`` of plain strings."""
    columns = [str(column.header) for column in table.columns]
    cells = [[str(cell) for cell in column.cells] for column in table.columns]
    rows = [list(row) for row in zip(*cells)] if cells else []
    return {"title": str(table.title or ""), "columns": columns, "rows": rows}


@dataclass(frozen=True)
class ReportItem:
    """One part of the report: a ``Paragraph`` or a rich ``Table``, the name of the section it
    belongs to (``verdict``, ``note``, ``detail:mesh``, ``strategy``, a family's name...), and
    whether a blank line follows it in the text."""

    section: str
    content: "Paragraph | Table | str"
    gap_after: bool = False


def report_items(plan: "Plan") -> list[ReportItem]:
    """The report's parts in order; the text and the JSON are both made from them."""
    summary = plan.summary
    source = plan.model.describe() if plan.model else summary.name
    items = [
        ReportItem("title", Paragraph(f"soap-planner plan for {source}: {summary.name}, {format_count(summary.parameters)} "
                                      f"parameters, on {plan.cluster.name} ({plan.world_size} devices)", indent=""), True),
        ReportItem("verdict", Paragraph(verdict(plan), indent=""), True),
    ]
    notes = [("note", f"note: {finding}") for finding in findings(plan)]
    notes += [("warning", f"warning: {warning}") for warning in plan.warnings]
    for position, (section, note) in enumerate(notes):
        items.append(ReportItem(section, Paragraph(note), gap_after=position == len(notes) - 1))
    for label, text in report_details(plan):
        items.append(ReportItem(f"detail:{label}", Paragraph(f"{label:<9} {text}", hanging=" " * 12)))
    items.append(ReportItem("strategy", _strategy_table(plan)))
    for family in with_part("report"):  # each family's own section (planner.families)
        if family.uses(plan):
            for part in family.part("report")(plan):
                items.append(ReportItem(family.name, part))
    items.append(ReportItem("memory", _memory_table(plan)))
    items.append(ReportItem("memory", Paragraph(_memory_verdict(plan), indent="")))
    items.append(ReportItem("time", _time_table(plan)))
    if plan.runners_up:
        items.append(ReportItem("runners-up", _alternatives_table(plan)))
    return items


def report_details(plan: "Plan") -> list[tuple[str, str]]:
    """The labelled lines under the verdict: model, cluster, mesh, strategy, batch..."""
    summary = plan.summary
    blocks = summary.block_runs or ", ".join(f"{group} x{count}" for group, count in summary.blocks.items()) or "none"
    details = [
        ("model", f"{summary.name}: {format_count(summary.parameters)} parameters ({format_bytes(summary.parameter_bytes)}), "
         f"{format_flops(summary.forward_flops)} forward per step, {summary.ops} ops traced by {summary.tracer}; "
         f"repeated blocks: {blocks}"),
        ("cluster", "; ".join(filter(None, (plan.cluster.describe(), provenance(plan.cluster))))),
        ("mesh", f"{plan.mesh}  ({plan.world_size} ranks)"),
        ("strategy", _strategy_text(plan)),
    ]
    local = plan.batch_size // plan.mesh.axis_size("dp") if "dp" in plan.mesh.names else plan.batch_size
    # A family section that splits the batch its own way (layer separation, uneven shares) words the line.
    batch_text = next((section.batch_text(plan) for section in plan.sections.values() if hasattr(section, "batch_text")),
                      f"global {plan.batch_size}, {local} per data-parallel rank")
    details.append(("batch", batch_text))
    if plan.fsdp_units:
        details.append(("FSDP units", f"{_collapse_units(plan.fsdp_units)} + root"))
    if plan.search_summary:
        details.append(("search", plan.search_summary))
    if plan.left_out is not None:  # the search's record of the devices this plan leaves idle
        details.append(("left out", plan.left_out.text(plan)))
    details.append((
        "recompute",
        f"{_recompute_text(plan)}; pipeline {'none' if plan.pipeline is None else _pipeline_text(plan)}; "
        f"precision {plan.precision}; optimizer {plan.optimizer}",
    ))
    if plan.timings:
        details.append(("planned in", ", ".join(f"{key.removesuffix('_s')} {value:.1f} s" for key, value in plan.timings.items())))
    return details


def _paragraph(text: str, width: int, indent: str = "", hanging: str | None = None) -> str:
    """``text`` wrapped to ``width`` columns, continuation lines indented (``hanging``)."""
    return textwrap.fill(
        text, width=width, initial_indent=indent, subsequent_indent=indent if hanging is None else hanging,
        break_on_hyphens=False, break_long_words=False,
    )


def _recompute_text(plan: "Plan") -> str:
    """``full``, or ``per stage: full, full, selective, none`` when the stages differ; what
    ``full_keep_a2a`` means, where a stage uses it."""
    per_stage = plan.pipeline.stage_recompute if plan.pipeline is not None else ()
    text = "per stage: " + ", ".join(per_stage) if per_stage and len(set(per_stage)) > 1 else plan.recompute
    if KEEP_A2A in (*per_stage, plan.recompute):
        text += (f" ({KEEP_A2A}: blocks recomputed in backward except their MoE layers' all-to-alls, whose "
                 "dispatch and combine outputs are kept from forward)")
    return text


def _pipeline_text(plan: "Plan") -> str:
    pipeline = plan.pipeline
    virtual = f", {pipeline.virtual_stages} virtual stages each" if pipeline.virtual_stages > 1 else ""
    return f"{pipeline.stages} stages, {pipeline.schedule}, {pipeline.micro_batches} micro-batches{virtual}"


def _strategy_text(plan: "Plan") -> str:
    # A family section that changes what the strategy is says so itself (HSDP's groups).
    own = [section.strategy_text(plan) for section in plan.sections.values() if hasattr(section, "strategy_text")]
    if own:
        return "; ".join(own)
    if plan.label == "soap":
        return (
            "SOAP: each op's sharding over the mesh chosen by the search (table below); weights replicated "
            "on dp have their gradients all-reduced over dp"
        )
    if plan.label == "megatron":
        return "Megatron-LM: column/row-parallel blocks on tp, layers split over pp, batch over dp"
    if plan.expert_layouts:
        return (
            f"{FLAVOUR_TEXT[plan.dp_flavour]}; each Mixture-of-Experts layer runs by its own layout (table below): "
            f"its experts replicated, sliced, or spread over the devices with tokens moved by all-to-all"
        )
    return FLAVOUR_TEXT[plan.dp_flavour]


def _strategy_table(plan: "Plan") -> Table:
    table = Table(title="Strategy by module (placements per mesh axis: S(d) shard dim d, R replicate, P partial)")
    for column in ("module", "ops", "share of compute", "parameters", "main op: inputs -> outputs"):
        table.add_column(column, justify="right" if column in ("ops", "share of compute") else "left")
    total = sum(s.cost.compute_s for s in plan.strategies) or 1.0
    for module, members in _group_by_module(plan.strategies).items():
        main = max(members, key=lambda s: (s.cost.compute_s, len(s.params)))
        params = sorted({placement for s in members for placement in _param_text(s)})
        table.add_row(
            module or "<root>",
            str(len(members)),
            f"{sum(s.cost.compute_s for s in members) / total:.1%}",
            ", ".join(params) or "-",
            f"{main.op.removeprefix('aten.')}: {main.describe()}",
        )
    return table


def _group_by_module(strategies: tuple[NodeStrategy, ...]) -> "OrderedDict[str, list[NodeStrategy]]":
    """Group ops by module path, folding repeated blocks (``blocks.0``..``blocks.3`` -> ``blocks.*``)."""
    groups: OrderedDict[str, list[NodeStrategy]] = OrderedDict()
    for strategy in strategies:
        key = re.sub(r"\.\d+(?=\.|$)", ".*", strategy.module)
        key = ".".join(key.split(".")[:4])
        groups.setdefault(key, []).append(strategy)
    return groups


def _param_text(strategy: NodeStrategy) -> list[str]:
    from planner.strategy import placements_str

    return [f"{name.rsplit('.', 1)[-1]} {placements_str(p)}" for name, p in strategy.params.items()]


def _memory_table(plan: "Plan") -> Table:
    memory = plan.estimate.memory
    capacity = plan.estimate.device_memory_bytes
    table = Table(title=f"Memory per device, fullest device ({plan.estimate.method})")
    table.add_column("kind")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    rows = [
        ("weights (+buffers)", memory.weights),
        ("gradients", memory.gradients),
        ("optimizer states", memory.optimizer_states),
        ("activations", memory.activations),
        ("communication buffers", memory.communication_buffers),
    ]
    for name, value in rows:
        table.add_row(name, format_bytes(value), f"{value / max(1, memory.total):.0%}")
    table.add_row("total", format_bytes(memory.total), f"{memory.total / capacity:.1%} of {format_bytes(capacity)}")
    if len(plan.estimate.stage_memory) > 1:
        for stage, stage_memory in enumerate(plan.estimate.stage_memory):
            table.add_row(f"pipeline stage {stage}", format_bytes(stage_memory.total), f"{stage_memory.total / capacity:.1%}")
    return table


def _memory_verdict(plan: "Plan") -> str:
    memory, capacity = plan.estimate.memory, plan.estimate.device_memory_bytes
    if plan.estimate.fits:
        return f"memory: fits ({format_bytes(capacity - memory.total)} to spare on the fullest device)"
    stages = plan.estimate.stage_memory
    if len(stages) > 1:
        over = ", ".join(str(i) for i, m in enumerate(stages) if m.total > capacity)
        where = f"on the devices of pipeline stage(s) {over}"
    else:
        where = "on every device"
    return f"memory: DOES NOT FIT: {format_bytes(memory.total - capacity)} missing {where}"


def _time_table(plan: "Plan") -> Table:
    estimate = plan.estimate
    table = Table(title=f"Time per step ({estimate.method})")
    table.add_column("part")
    table.add_column("value", justify="right")
    table.add_row("step time", format_seconds(estimate.step_time_s))
    table.add_row("compute on the busiest device (forward + backward + optimizer)", format_seconds(estimate.compute_s))
    table.add_row("exposed communication (step minus the same step with free collectives)", format_seconds(estimate.communication_s))
    if plan.pipeline is not None:
        table.add_row("pipeline bubble (idle share of compute)", f"{estimate.bubble_fraction:.1%}")
    if estimate.host_wait_s > 0.01 * estimate.step_time_s:
        table.add_row("of compute, waiting for the host to issue ops (kernels shorter than their dispatch)",
                      format_seconds(estimate.host_wait_s))
    if estimate.step_time_s > 0:
        table.add_row("throughput", f"{estimate.samples_per_s:,.1f} samples/s" + (
            f", {estimate.tokens_per_s:,.0f} tokens/s" if estimate.tokens_per_s else ""))
    if estimate.model_flops:
        table.add_row("model FLOPs per device (Megatron-LM count)", f"{estimate.tflops_per_device:,.2f} TFLOP/s, MFU {estimate.mfu:.1%}")
    for axis, sent in sorted(estimate.bytes_per_axis.items()):
        table.add_row(f"bytes sent per device on '{axis}'", format_bytes(sent))
    return table


def _alternatives_table(plan: "Plan") -> Table:
    """The chosen plan and its runners-up: the route the search reached each by (the best of
    each route starred), step time, MFU, memory on the fullest device, whether it fits and
    why it lost."""
    table = Table(title="Why this plan: the runners-up (*: the best plan the search reached that way)")
    for column in ("plan", "found by", "step time", "MFU", "memory", "fits", "against the chosen plan"):
        numeric = column in ("step time", "MFU", "memory")
        table.add_column(column, justify="right" if numeric else "left", no_wrap=numeric)
    chosen_route = plan_route(plan)
    leaders = _route_leaders(plan.runners_up, chosen_route)
    estimate = plan.estimate
    table.add_row(
        f"{plan_label(plan)} (chosen)", f"{chosen_route} *", format_seconds(estimate.step_time_s),
        f"{estimate.mfu:.1%}", format_bytes(estimate.memory.total), "yes" if estimate.fits else "no", "",
    )
    for position, alt in enumerate(plan.runners_up):
        route = f"{alt.route} *" if leaders.get(alt.route) == position else alt.route
        table.add_row(
            alt.name, route or "-", format_seconds(alt.step_time_s), f"{alt.mfu:.1%}", format_bytes(alt.memory_bytes),
            "yes" if alt.fits else "no", alt.note,
        )
    return table


def _route_leaders(alternatives, chosen_route: str) -> dict[str, int]:
    """Route -> position of its best runner-up (fastest that fits, else least memory); the
    chosen plan leads its own route. The search always lists each route's best
    (``search.runners_up``), so the best listed is the route's best."""
    leaders: dict[str, int] = {}
    for position, alt in enumerate(alternatives):
        if not alt.route or alt.route == chosen_route:
            continue
        key = (not alt.fits, alt.step_time_s if alt.fits else alt.memory_bytes)
        current = leaders.get(alt.route)
        if current is None or key < (not alternatives[current].fits, alternatives[current].step_time_s
                                     if alternatives[current].fits else alternatives[current].memory_bytes):
            leaders[alt.route] = position
    return leaders


def _collapse_units(units: tuple[str, ...]) -> str:
    groups: OrderedDict[str, list[str]] = OrderedDict()
    for unit in units:
        group, _, index = unit.rpartition(".")
        groups.setdefault(group, []).append(index)
    return ", ".join(f"{group}.[{ids[0]}..{ids[-1]}]" if len(ids) > 1 else f"{group}.{ids[0]}" for group, ids in groups.items())
