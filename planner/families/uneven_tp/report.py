"""Uneven tensor parallelism's lines of the report (vocabulary layer): per device, its type, its
share of each split tensor, its predicted busy time and memory against its own capacity."""

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
    that rank's share of the split dimension; then each rank's device, busy time and memory."""
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
    if section.busy_s or section.memory_bytes:
        parts.append(rank_table(section, devices))
    if section.busy_s:
        slowest = max(range(len(devices)), key=lambda rank: section.busy_s[rank])
        parts.append(Paragraph(
            f"Every other op runs whole on every rank; each split layer waits for its slowest rank and its "
            f"collectives (all-gather-v of the uneven slices, all-reduces of partial sums). The busiest rank is "
            f"{slowest} ({devices[slowest].name})."
        ))
    return parts


def rank_table(section, devices) -> Table:
    """Per rank: its device, predicted compute and memory against its own device's capacity
    (a rank of a larger device may hold more and still fit)."""
    table = Table(title="Uneven tensor parallelism: each rank's compute and memory (predicted)")
    for column in ("rank", "device", "busy", "memory", "of its device"):
        table.add_column(column, justify="left" if column in ("rank", "device") else "right")
    for rank, device in enumerate(devices):
        busy = f"{section.busy_s[rank] * 1e3:.3f} ms" if section.busy_s else "-"
        held = section.memory_bytes[rank] if section.memory_bytes else None
        table.add_row(str(rank), device.name, busy, "-" if held is None else f"{held / 2**20:.2f} MiB",
                      "-" if held is None else f"{held / max(device.memory_bytes, 1):.2%} of "
                                               f"{device.memory_bytes / 2**30:.2f} GiB")
    return table
