"""``planner diff A B``: what differs between two plans, and what it does to the step.

Two plans of one model (the chosen plan and a runner-up re-planned with ``--mesh``, or a plan
before and after a change of cluster) are compared field by field: the predicted step time,
MFU, memory on the fullest device and whether each fits; the mesh, data-parallel flavour,
precision, recomputation, micro-batches, pipeline and each family's section; the bytes each
device sends per mesh axis; the placements of every module whose main op or weights run
differently (repeated blocks folded, as the report folds them); and the MoE layers whose
expert layout changed. Plans of different models are compared too, with a warning first.

Vocabulary layer: reads two ``Plan`` objects, nothing is traced or simulated.
"""

from __future__ import annotations

import io
import re
from collections import OrderedDict

from rich.table import Table

from planner.strategy import placements_str
from planner.terminal import InertConsole
from planner.units import format_bytes, format_seconds
from planner.verdict import plan_label

# Modules listed in the placements table; the rest are counted.
MOST_MODULES = 30


def plan_differences(a, b) -> list[tuple[str, str, str]]:
    """``(what, in A, in B)`` for every setting that differs (not the placements)."""
    rows = []

    def compare(what: str, left, right) -> None:
        if left != right:
            rows.append((what, str(left), str(right)))

    compare("mesh", a.mesh, b.mesh)
    compare("data-parallel flavour", a.dp_flavour, b.dp_flavour)
    compare("precision", a.precision, b.precision)
    compare("recomputation", a.recompute, b.recompute)
    compare("micro-batches (accumulation)", a.accumulation_steps, b.accumulation_steps)
    compare("global batch", a.batch_size, b.batch_size)
    compare("sequence parallel", a.sequence_parallel, b.sequence_parallel)
    compare("pipeline", _pipeline_text(a), _pipeline_text(b))
    compare("FSDP units", len(a.fsdp_units), len(b.fsdp_units))
    compare("cluster", a.cluster.name, b.cluster.name)
    for family in sorted(set(a.sections) | set(b.sections)):
        compare(f"{family} section", _section_text(a, family), _section_text(b, family))
    return rows


def module_differences(a, b) -> list[tuple[str, str, str]]:
    """``(module, A's placements, B's)`` for each module (repeated blocks folded) whose main
    op or weights are placed differently."""
    left, right = _module_placements(a), _module_placements(b)
    rows = []
    for module in OrderedDict.fromkeys([*left, *right]):
        if left.get(module) != right.get(module):
            rows.append((module or "<root>", left.get(module, "-"), right.get(module, "-")))
    return rows


def expert_differences(a, b) -> list[tuple[str, str, str]]:
    """``(MoE layer, A's layout, B's)`` for each layer whose expert layout differs."""
    left = {layout.module: _expert_text(layout) for layout in a.expert_layouts}
    right = {layout.module: _expert_text(layout) for layout in b.expert_layouts}
    return [(module, left.get(module, "-"), right.get(module, "-"))
            for module in OrderedDict.fromkeys([*left, *right]) if left.get(module) != right.get(module)]


def render_diff(a, b, names: tuple[str, str], width: int) -> str:
    """The comparison as text ``width`` columns wide (module docstring)."""
    buffer = io.StringIO()
    console = InertConsole(file=buffer, width=width, force_terminal=False, color_system=None)
    first, second = names
    if _model_key(a) != _model_key(b):
        console.print(f"warning: the plans are of different models ({_model_key(a)} and {_model_key(b)}); "
                      f"placements are compared by module path")
    console.print(f"A = {first}: {plan_label(a)}")
    console.print(f"B = {second}: {plan_label(b)}")
    console.print()
    console.print(_effect_table(a, b))
    settings = plan_differences(a, b)
    if settings:
        console.print(_three_columns("Settings that differ", ("setting", "A", "B"), settings))
    modules = module_differences(a, b)
    if modules:
        table = _three_columns(f"Placements that differ ({len(modules)} modules; S(d) shard dim d, R replicate, "
                               f"P partial)", ("module", "A", "B"), modules[:MOST_MODULES])
        console.print(table)
        if len(modules) > MOST_MODULES:
            console.print(f"  ... and {len(modules) - MOST_MODULES} more modules")
    experts = expert_differences(a, b)
    if experts:
        console.print(_three_columns("MoE layers whose expert layout differs", ("layer", "A", "B"), experts))
    if not (settings or modules or experts):
        console.print("The plans run the same layout: only their predictions can differ (other cluster figures).")
    return buffer.getvalue()


def _effect_table(a, b) -> Table:
    table = Table(title="Predicted effect (B against A)")
    for column in ("", "A", "B", "B - A"):
        table.add_column(column, justify="left" if not column else "right")
    ea, eb = a.estimate, b.estimate
    table.add_row("step time", format_seconds(ea.step_time_s), format_seconds(eb.step_time_s),
                  _change(ea.step_time_s, eb.step_time_s, format_seconds))
    table.add_row("MFU", f"{ea.mfu:.1%}", f"{eb.mfu:.1%}", f"{(eb.mfu - ea.mfu) * 100:+.1f} points")
    table.add_row("memory, fullest device", format_bytes(ea.memory.total), format_bytes(eb.memory.total),
                  _change(ea.memory.total, eb.memory.total, format_bytes))
    table.add_row("fits", "yes" if ea.fits else "no", "yes" if eb.fits else "no", "")
    table.add_row("exposed communication", format_seconds(ea.communication_s), format_seconds(eb.communication_s),
                  _change(ea.communication_s, eb.communication_s, format_seconds))
    for axis in sorted(set(ea.bytes_per_axis) | set(eb.bytes_per_axis)):
        left, right = ea.bytes_per_axis.get(axis, 0), eb.bytes_per_axis.get(axis, 0)
        table.add_row(f"bytes sent per device on '{axis}'", format_bytes(left), format_bytes(right),
                      _change(left, right, format_bytes))
    return table


def _change(left: float, right: float, formatter) -> str:
    difference = right - left
    sign = "+" if difference >= 0 else "-"
    relative = f" ({difference / left:+.1%})" if left else ""
    return f"{sign}{formatter(abs(difference))}{relative}"


def _three_columns(title: str, columns: tuple[str, str, str], rows) -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    return table


def _module_placements(plan) -> "OrderedDict[str, str]":
    """Module (repeated blocks folded: ``layers.*.mlp``) -> its main op's placements and
    its weights', as the report's strategy table shows them."""
    groups: OrderedDict[str, list] = OrderedDict()
    for strategy in plan.strategies:
        key = ".".join(re.sub(r"\.\d+(?=\.|$)", ".*", strategy.module).split(".")[:4])
        groups.setdefault(key, []).append(strategy)
    placements: OrderedDict[str, str] = OrderedDict()
    for module, members in groups.items():
        main = max(members, key=lambda s: (s.cost.compute_s, len(s.params)))
        weights = sorted({f"{name.rsplit('.', 1)[-1]} {placements_str(p)}" for s in members for name, p in s.params.items()})
        layout = f" [{main.layout.describe()}]" if hasattr(main.layout, "describe") else ""
        placements[module] = f"{main.op.removeprefix('aten.')}: {main.describe()}{layout}" + (
            f"; {', '.join(weights)}" if weights else "")
    return placements


def _expert_text(layout) -> str:
    placement = "" if layout.placement is None else f", placement {layout.placement.method or 'given'}"
    copies = ", sharded copies" if getattr(layout, "sharded_copies", False) else ""
    return f"{layout.mode} on {layout.axis}{placement}{copies}, all-to-all {layout.all_to_all}"


def _pipeline_text(plan) -> str:
    pipeline = plan.pipeline
    if pipeline is None:
        return "none"
    return f"{pipeline.stages} stages, {pipeline.schedule}, {pipeline.micro_batches} micro-batches, " \
           f"{pipeline.virtual_stages} virtual"


def _section_text(plan, family: str) -> str:
    section = plan.sections.get(family)
    return "-" if section is None else section.describe(plan)


def _model_key(plan) -> str:
    return plan.model.describe() if plan.model else plan.summary.name
