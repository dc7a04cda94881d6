"""The folded MoE plan's lines of the report (vocabulary layer): how each MoE layer's ranks
split into expert-tensor-parallel, expert-parallel and expert-data-parallel groups, and what
moves between the attention layout and the experts'."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.errors import one_line
from planner.expert_layouts import FOLDED_DP_TP, expert_axis_size
from planner.report_parts import Paragraph

if TYPE_CHECKING:
    from planner.plans import Plan


def folding_section(plan: "Plan") -> list:
    """The report part of the ``moe_folding`` family (``planner.families``): one paragraph
    per distinct (EP, ETP) among the MoE layers, and one on the tokens' way between layouts."""
    ranks = expert_axis_size(plan.mesh, FOLDED_DP_TP)
    tp = plan.mesh.axis_size("tp")
    by_shape: dict[tuple[int, int], list[str]] = {}
    for layout in plan.expert_layouts:
        by_shape.setdefault((layout.placement.devices, layout.tensor_parallel), []).append(one_line(layout.module)[:60])
    lines = []
    for (ep, etp), modules in by_shape.items():
        named = modules[0] + (f" and {len(modules) - 1} more" if len(modules) > 1 else "")
        split = f"each expert's width split over {etp} consecutive ranks (ETP), " if etp > 1 else ""
        lines.append(Paragraph(
            f"MoE parallel folding ({named}): the {ranks} ranks of dp x tp"
            f"{' in each pipeline stage' if plan.pipeline is not None else ''} hold the experts as ETP={etp} x "
            f"EP={ep} x EDP={ranks // (ep * etp)}: {split}the experts spread over {ep} ranks {etp} apart (EP, "
            f"tokens exchanged by all-to-all), {ranks // (ep * etp)} copies of that (EDP, expert gradients "
            f"all-reduced over the copies)", hanging="    ",
        ))
    sequence_parallel = plan.sections["moe-folding"].sequence_parallel
    lines.append(Paragraph(
        "tokens between the layouts: the residual stream is split on the sequence over tp, the MoE layers take "
        "it as it is" if sequence_parallel else
        f"tokens between the layouts: each of the {tp} tp ranks of a dp rank takes 1/{tp} of its tokens into the "
        f"MoE layer (a local slice) and the layer's output is all-gathered over tp (backward: the input's "
        f"gradient all-gathered)", hanging="    ",
    ))
    return lines
