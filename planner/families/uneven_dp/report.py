"""Uneven data parallelism's lines of the report (vocabulary layer): per device, its type,
its share of the batch (and of the optimizer states, where they are split by memory), its
predicted busy time and memory (against its own device's capacity), and the straggler."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from planner.device_groups import rank_devices
from planner.report_parts import Paragraph

if TYPE_CHECKING:
    from planner.plans import Plan


def uneven_section(plan: "Plan") -> list:
    """The report part of the ``uneven`` family (``planner.families``): a table of the ranks
    (grouped where device and share agree) and a line naming the rank the step waits for."""
    section = plan.sections["uneven"]
    devices = rank_devices(plan.cluster)
    table = Table(title="Uneven data parallelism: each rank's share of the batch")
    weights = section.state_shares
    columns = ("ranks", "device", "share", *(("optimizer states",) if weights else ()), "busy (predicted)",
               "memory (predicted)")
    for column in columns:
        table.add_column(column, justify="left" if column in ("ranks", "device") else "right")
    rows: list[list] = []
    for rank, share in enumerate(section.shares):
        busy = section.busy_s[rank] if section.busy_s else None
        memory = section.memory_bytes[rank] if section.memory_bytes else None
        states = (f"{weights[rank] / sum(weights):.1%}",) if weights else ()
        key = (devices[rank].name, share, *states, busy, memory, devices[rank].memory_bytes)
        if rows and rows[-1][1:] == list(key):
            rows[-1][0] = (rows[-1][0][0], rank)
        else:
            rows.append([(rank, rank), *key])
    for (first, last), name, share, *states, busy, memory, capacity in rows:
        table.add_row(
            str(first) if first == last else f"{first}-{last}", name,
            f"{share} of {plan.batch_size}", *states, "-" if busy is None else f"{busy * 1e3:.3f} ms",
            "-" if memory is None else f"{memory / 2**20:.2f} MiB ({memory / max(capacity, 1):.2%} of "
                                       f"{capacity / 2**30:.2f} GiB)",
        )
    parts: list = [table]
    if section.busy_s:
        slowest = max(range(len(section.shares)), key=lambda rank: section.busy_s[rank])
        fastest = min(range(len(section.shares)), key=lambda rank: section.busy_s[rank])
        parts.append(Paragraph(
            f"Each rank's loss is weighted by its share before the {plan.dp_flavour} gradient reduction, so the step "
            f"equals one device's on the whole batch. The step waits for rank {slowest} ({devices[slowest].name}, "
            f"{section.busy_s[slowest] * 1e3:.3f} ms of compute); the least busy rank, {fastest} "
            f"({devices[fastest].name}), waits {(section.busy_s[slowest] - section.busy_s[fastest]) * 1e3:.3f} ms"
        ))
    return parts
