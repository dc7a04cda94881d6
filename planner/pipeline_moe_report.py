"""The MoE layers of a pipeline plan, stage by stage: the report tables the ``pipeline``
family adds when its stages run MoE layers by their layouts (``search.stage_experts``): one
row per layer, and one per stage summing what the stage's layers leave on its critical path.

A layer runs over its stage's ranks of its layout's ``axis``: the stage's dp ranks, or its
dp x tp ranks for a folded plan (``planner.families.moe_folding``), where the experts' EP
ranks are repeated EDP times (each copy taking its share of the expert's slots) and each
expert may be split over ETP ranks. Loads are per device of that group."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from planner.expert_layouts import EXPERT_MODE_WORDS, ExpertLayout, expert_axis_size
from planner.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from planner.plans import Plan


def _stage_of_layers(plan: "Plan") -> dict[str, int]:
    """Each MoE layer's pipeline stage: that of its first op."""
    stage_of: dict[str, int] = {}
    for strategy in plan.strategies:
        for layout in plan.expert_layouts:
            if strategy.module == layout.module or strategy.module.startswith(layout.module + "."):
                stage_of.setdefault(layout.module, strategy.stage)
    return stage_of


def group_ranks(plan: "Plan", layout: ExpertLayout) -> int:
    """Ranks of one stage that ``layout``'s layer runs over: its ``axis`` on the plan's mesh
    (``dp``, or ``dp x tp`` folded); 1 when the mesh lacks that axis."""
    try:
        return expert_axis_size(plan.mesh, layout.axis)
    except KeyError:
        return 1


def busiest_share(layout: ExpertLayout, ranks: int) -> float:
    """The busiest of ``ranks`` devices' share of the layer's expert work (routed choices
    times expert width): by its placement's loads (uniform when the layout has none), an EP
    rank's load split evenly over its ``ranks / EP`` devices (EDP copies each taking an equal
    share of the slots, ETP ranks each a slice of the width); ``1 / ranks`` when every rank
    runs its own tokens."""
    if layout.placement is None:
        return 1.0 / ranks
    loads = layout.expert_loads or tuple(1.0 / layout.experts for _ in range(layout.experts))
    return max(layout.placement.device_loads(loads)) / max(1, ranks // layout.placement.devices)


def layout_words(layout: ExpertLayout, ranks: int) -> str:
    """How one layer runs over its ``ranks``: the mode, and for expert parallelism its
    degrees (``EP4``, ``EP2 x EDP2``, ``x ETP2``), the axis, the placement and the all-to-all."""
    words = EXPERT_MODE_WORDS[layout.mode]
    if layout.mode != "expert_parallel" or layout.placement is None:
        return f"{words} over {layout.axis}"
    ep, etp = layout.placement.devices, layout.tensor_parallel
    degrees = f"EP{ep}" + (f" x EDP{ranks // (ep * etp)}" if ranks > ep * etp else "") + (f" x ETP{etp}" if etp > 1 else "")
    details = ", ".join(part for part in (layout.placement.method, layout.all_to_all) if part)
    return f"{words} {degrees} over {layout.axis} ({details})"


def _exposed(layout: ExpertLayout) -> str:
    return "-" if layout.exposed_all_to_all_s is None else format_seconds(layout.exposed_all_to_all_s)


def stage_moe_table(plan: "Plan") -> Table | None:
    """One row per MoE layer: its stage, its layout over the stage's ranks (``layout_words``), its simulated
    expert compute and communication per step (all-to-alls and the routing's all-gather, all
    micro-batches), the all-to-alls' time left on the critical path (less what runs under
    another micro-batch's compute, ``Plan.moe_a2a_overlap``), the busiest device's share of
    the layer's expert work (``busiest_share``), and the expert weights and dispatch buffers on the fullest
    device. None without expert layouts."""
    if not plan.expert_layouts or plan.pipeline is None:
        return None
    stage_of = _stage_of_layers(plan)
    axes = sorted({(layout.axis, group_ranks(plan, layout)) for layout in plan.expert_layouts})
    over = ", ".join(f"{ranks} {axis} ranks" for axis, ranks in axes)
    table = Table(title=f"MoE layers in the stages (each over its stage's {over})")
    for column in ("stage", "MoE layer", "layout", "expert compute", "all-to-all + routing", "exposed all-to-all",
                   "busiest device", "expert bytes"):
        table.add_column(column, justify="left" if column in ("MoE layer", "layout") else "right")
    for layout in plan.expert_layouts:
        stage, ranks = stage_of.get(layout.module), group_ranks(plan, layout)
        table.add_row(
            "-" if stage is None else str(stage), layout.module, layout_words(layout, ranks),
            format_seconds(layout.cost.compute_s), format_seconds(layout.cost.communication_s), _exposed(layout),
            f"{busiest_share(layout, ranks):.1%} of expert work", format_bytes(layout.cost.memory_bytes),
        )
    return table


def stage_moe_summary(plan: "Plan") -> Table | None:
    """One row per pipeline stage that runs MoE layers: how many, their layouts, the
    all-to-all time they leave exposed per step (summed; "-" when the plan predates the
    figure), and the busiest device's load at the stage's most loaded layer, as a share of
    its expert work and over an even share of its group (1.00x: perfectly balanced). None without
    expert layouts."""
    if not plan.expert_layouts or plan.pipeline is None:
        return None
    stage_of = _stage_of_layers(plan)
    by_stage: dict[int, list[ExpertLayout]] = {}
    for layout in plan.expert_layouts:
        by_stage.setdefault(stage_of.get(layout.module, -1), []).append(layout)
    overlap = "; all-to-alls under another micro-batch's compute" if plan.moe_a2a_overlap else ""
    table = Table(title=f"MoE per pipeline stage{overlap}")
    for column in ("stage", "MoE layers", "layouts", "exposed all-to-all", "busiest device"):
        table.add_column(column, justify="left" if column == "layouts" else "right")
    for stage in sorted(by_stage):
        layouts = by_stage[stage]
        exposed = [layout.exposed_all_to_all_s for layout in layouts]
        # The most loaded layer's busiest device, over an even share of its group.
        busiest, ranks = max((busiest_share(layout, group_ranks(plan, layout)), group_ranks(plan, layout))
                             for layout in layouts)
        words = list(dict.fromkeys(layout_words(layout, group_ranks(plan, layout)) for layout in layouts))
        table.add_row(
            "-" if stage < 0 else str(stage), str(len(layouts)), "; ".join(words),
            "-" if None in exposed else format_seconds(sum(exposed)),
            f"{busiest:.1%} of expert work ({busiest * ranks:.2f}x even)",
        )
    return table
