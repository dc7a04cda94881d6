"""HSDP's lines of the report (vocabulary layer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.report_parts import Paragraph

if TYPE_CHECKING:
    from planner.plans import Plan


def hsdp_section(plan: "Plan") -> list:
    """The report part of the ``hsdp`` family (``planner.families``): how the dp ranks are
    grouped and what crosses between the groups."""
    section = plan.sections["hsdp"]
    replicate, shard = section.replicate(plan), section.shard
    return [Paragraph(
        f"Hybrid sharding (HSDP): the {replicate * shard} dp ranks form {replicate} groups of {shard} consecutive "
        f"ranks (inside a node); FSDP shards weights, gradients and optimizer states over the {shard} ranks of a "
        f"group (all-gathers and reduce-scatters stay inside it) and keeps one copy per group, whose 1/{shard} "
        f"gradient shards are all-reduced over the {replicate} groups"
    )]
