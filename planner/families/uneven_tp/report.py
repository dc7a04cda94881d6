"""Uneven tensor parallelism's lines of the report (vocabulary layer): per device, its type, its
share of each split tensor and its predicted busy time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from planner.device_groups import rank_devices
from planner.report_parts import Paragraph

if TYPE_CHECKING:
    from planner.plans import Plan

# Layers of the same kind and shares are one row: a 40-block model has a few distinct rows.
MAX_ROWS = 24


def uneven_tp_section(plan: "Plan") -> list:
    """The report part of the ``uneven-tp`` family (``planner.families``): a table with a row
    per split (layers of the same kind and shares grouped) and a column per rank, each cell
    that rank's share of the split dimension; then each rank's device and busy time."""
    section = plan.sections["uneven-tp"]
    devices = rank_devices(plan.cluster)
    table = Table(title="Uneven tensor parallelism: each rank's share of each split tensor")
    table.add_column("layers", justify="left")
    table.add_column("split", justify="left")
    for rank, device in enumerate(devices):
        table.add_column(f"rank {rank}\n{device.name}", justify="right")
    groups: dict[tuple, list[str]] = {}
    for layer in section.layers:
        groups.setdefault((layer.kind, layer.shares, layer.fused), []).append(layer.module)
    for (kind, shares, fused), modules in list(groups.items())[:MAX_ROWS]:
        named = modules[0] if len(modules) == 1 else f"{modules[0]} and {len(modules) - 1} more"
        dim = {"batch": "rows", "column": "output features", "row": "input features"}[kind]
        table.add_row(named, f"{kind} ({dim}{', fused' if fused else ''})", *(f"{share} ({share / sum(shares):.0%})" for share in shares))
    parts: list = [table]
    if section.busy_s:
        slowest = max(range(len(devices)), key=lambda rank: section.busy_s[rank])
        busy = ", ".join(f"rank {rank} ({devices[rank].name}) {seconds * 1e3:.3f} ms"
                         for rank, seconds in enumerate(section.busy_s))
        parts.append(Paragraph(
            f"Predicted compute per rank: {busy}. Every other op runs whole on every rank; each split layer waits "
            f"for its slowest rank and its collectives (all-gather-v of the uneven slices, all-reduces of "
            f"partial sums). The busiest rank is {slowest} ({devices[slowest].name})."
        ))
    return parts
