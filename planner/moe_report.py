"""The report's Mixture-of-Experts section: how each MoE layer runs and how even its load is.

For every layer (identical layers share a row): the mode, the capacity factor, the
all-to-all algorithm, the placement (experts per device, extra copies of hot experts), and
the load balance: the busiest device's routed tokens over the mean, with round-robin
placement and with the plan's, from the routing statistics the plan was made with (named
under the table). It reads only the plan; every text it shows from the plan file goes
through ``one_line``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from planner.errors import one_line
from planner.expert_layouts import FOLDED_AXIS_JOIN
from planner.strategy import EXPERT_MODE_WORDS, ExpertLayout, ExpertPlacement, expert_axis_size
from planner.units import format_bytes, format_seconds
from planner.report_parts import Paragraph

if TYPE_CHECKING:
    from planner.plans import Plan


def moe_table(plan: "Plan") -> Table:
    """One row per group of identical MoE layers (see the module docstring)."""
    devices = expert_axis_size(plan.mesh, plan.expert_layouts[0].axis)
    table = Table(title=f"Mixture-of-Experts layers ({len(plan.expert_layouts)}) on {devices} devices")
    for column in ("layers", "mode", "capacity", "all-to-all", "placement", "max/mean load: round-robin -> plan",
                   "time per layer"):
        table.add_column(column, justify="right" if column == "time per layer" else "left")
    rows: dict[tuple, list[ExpertLayout]] = {}
    for layout in plan.expert_layouts:
        rows.setdefault(_row(layout, devices), []).append(layout)
    for row, members in rows.items():
        names = one_line(members[0].module)[:60] + (f" and {len(members) - 1} more" if len(members) > 1 else "")
        table.add_row(names, *row, format_seconds(max(layout.cost.total_s for layout in members)))
    return table


def moe_notes(plan: "Plan") -> list[str]:
    """Lines under the table: where the routing statistics came from, and what the
    load-balance figures mean."""
    sources = list(dict.fromkeys(one_line(layout.routing)[:200] for layout in plan.expert_layouts))
    memory = max(layout.cost.memory_bytes for layout in plan.expert_layouts)
    return [
        f"routing statistics: {'; '.join(sources[:3])}{' and more' if len(sources) > 3 else ''}",
        "max/mean load: routed tokens of the busiest device over the mean device (1.00 is even; the step waits "
        "for the busiest); replicated and sliced experts are even by construction",
        f"expert weights and dispatch buffers of the fullest layer: {format_bytes(memory)} per device",
        _kernels_note(plan),
    ]


def _kernels_note(plan: "Plan") -> str:
    """Which kernels the experts' GEMMs were priced on (``Plan.expert_implementation``)."""
    named = one_line(str(plan.expert_implementation))[:40]
    if named:
        return f"expert kernels: {named}, as the plan names them"
    return ("expert kernels: the compiled program's (one batched matmul over capacity-padded buffers for routed "
            "GELU layers, one GEMM per expert for expert-parallel HuggingFace experts, the model's own module for "
            "replicated ones)")


def _row(layout: ExpertLayout, devices: int) -> tuple[str, ...]:
    capacity = "dropless" if layout.capacity_factor == 0 else f"{layout.capacity_factor:g}"
    algorithm = layout.all_to_all if layout.mode == "expert_parallel" else "-"
    return (
        EXPERT_MODE_WORDS.get(layout.mode, one_line(layout.mode)[:40]),
        capacity,
        algorithm,
        _placement_text(layout, devices),
        _balance_text(layout, devices),
    )


def _placement_text(layout: ExpertLayout, devices: int) -> str:
    if layout.mode == "data_parallel":
        return f"all {layout.experts} experts on every device"
    if layout.mode == "expert_sliced":
        return f"1/{devices} of every expert's FFN on each device"
    placement = layout.placement
    held = [len(placement.experts_on(device)) for device in range(placement.devices)]
    copied = [expert for expert, copies in enumerate(placement.replicas) if len(copies) > 1]
    extra = sum(len(placement.replicas[expert]) - 1 for expert in copied)
    per_device = f"{min(held)}" if min(held) == max(held) else f"{min(held)}-{max(held)}"
    copies = (
        f", {extra} extra copies of experts {_list(copied)}" if copied else ", no copies"
    )
    if layout.sharded_copies and FOLDED_AXIS_JOIN in layout.axis:  # over the EDP ranks holding the same experts
        edp = devices // (placement.devices * layout.tensor_parallel)
        copies = f", each expert sharded over its {edp} expert-data-parallel copies"
    elif layout.sharded_copies:  # the copies of each expert hold a shard of it each
        copies += f", each expert sharded over its {len(placement.copy_groups[0])} copies"
    return f"{one_line(placement.method)[:40] or 'given'}: {per_device} experts per device{copies}"


def _balance_text(layout: ExpertLayout, devices: int) -> str:
    loads = layout.expert_loads or tuple(1.0 / layout.experts for _ in range(layout.experts))
    before = _max_over_mean(ExpertPlacement.round_robin(layout.experts, devices), loads)
    after = before if layout.placement is None else _max_over_mean(layout.placement, loads)
    if layout.mode != "expert_parallel":
        after = 1.0
    return f"{before:.2f} -> {after:.2f}"


def _max_over_mean(placement: ExpertPlacement, loads) -> float:
    device_loads = placement.device_loads(loads)
    mean = sum(device_loads) / len(device_loads)
    return max(device_loads) / mean if mean else 1.0


def _list(experts: list[int]) -> str:
    shown = ", ".join(str(expert) for expert in experts[:6])
    return shown + (f" (+{len(experts) - 6})" if len(experts) > 6 else "")


def moe_section(plan: "Plan") -> list:
    """The report part of the ``moe`` family (``planner.families``): the layers' table and its notes."""
    return [moe_table(plan), *(Paragraph(line, hanging="    ") for line in moe_notes(plan))]
