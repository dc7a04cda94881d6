"""The report's part for pipelines over device groups of different types (vocabulary
layer): per stage, its ranks, device, blocks, predicted busy time and memory, the slowest link
its gradient sync and its hop to the next stage cross (``planner.cluster_links``), and the
stage the step waits for. (A plan leaving devices out says so in its warnings.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from planner.cluster import LinkSpec, format_si
from planner.cluster_links import crossed_link
from planner.report_parts import Paragraph

def link_words(link: LinkSpec | None) -> str:
    """A link as the report names it: ``"within a node"`` (None), else its bandwidth per device."""
    return "within a node" if link is None else f"{format_si(link.bandwidth, 'B/s')}/device"


if TYPE_CHECKING:
    from planner.plans import Plan


def hetero_pipeline_section(plan: "Plan") -> list:
    """The report part of the ``hetero-pp`` family (``planner.families``): a table of the
    stages and a line naming the stage the step waits for."""
    section = plan.sections["hetero-pp"]
    stage_ranks = section.stage_ranks(plan)  # each stage's ranks (of one width, or the section's widths)
    pp = len(stage_ranks)
    table = Table(title="Pipeline stages on device groups: each stage's device and share of the model")
    for column in ("stage", "ranks", "device", "blocks", "busy (predicted)", "memory (predicted)", "gradient sync over",
                   "to the next stage"):
        table.add_column(column, justify="right" if column in ("stage", "blocks") or "(" in column else "left")
    cluster = plan.cluster
    for stage, name in enumerate(section.stage_devices):
        busy = section.busy_s[stage] if section.busy_s else None
        memory = section.memory_bytes[stage] if section.memory_bytes else None
        ranks = stage_ranks[stage]
        onward = "-" if stage == pp - 1 else link_words(crossed_link(cluster, [ranks[0], stage_ranks[stage + 1][0]]))
        table.add_row(str(stage), f"{ranks[0]}-{ranks[-1]}", name,
                      str(section.blocks[stage]) if section.blocks else "-",
                      "-" if busy is None else f"{busy * 1e3:.3f} ms",
                      "-" if memory is None else f"{memory / 2**20:.2f} MiB",
                      "-" if len(ranks) == 1 else link_words(crossed_link(cluster, ranks)),
                      onward)
    parts: list = [table]
    if section.busy_s:
        widths = ("" if not section.widths else
                  f", each stage data parallel over its ranks (widths {'/'.join(map(str, section.widths))}, GPipe)")
        slowest = max(range(pp), key=lambda stage: section.busy_s[stage])
        parts.append(Paragraph(
            f"Blocks are balanced by each device's speed and memory{widths}; the step waits for stage {slowest} "
            f"({section.stage_devices[slowest]}). Start the cluster's nodes in the plan's order: node rank 0 runs "
            f"stage 0 ({section.stage_devices[0]})."
        ))
    return parts
