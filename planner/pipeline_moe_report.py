"""The MoE layers of a pipeline plan, stage by stage: the report tables the ``pipeline``
family adds when its stages run MoE layers by their layouts (``search.stage_experts``): one
row per layer, and one per stage summing what the stage's layers leave on its critical path."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from planner.expert_layouts import ExpertLayout, expert_modes_summary
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


def _dp_ranks(plan: "Plan") -> int:
    return plan.mesh.axis_size("dp") if "dp" in plan.mesh.names else 1


def busiest_share(layout: ExpertLayout, ranks: int) -> float:
    """The busiest device's share of the layer's routed choices: by its placement's loads
    (uniform when the layout has none), or ``1 / ranks`` when every rank runs its own tokens."""
    if layout.placement is None:
        return 1.0 / ranks
    loads = layout.expert_loads or tuple(1.0 / layout.experts for _ in range(layout.experts))
    return max(layout.placement.device_loads(loads))


def _exposed(layout: ExpertLayout) -> str:
    return "-" if layout.exposed_all_to_all_s is None else format_seconds(layout.exposed_all_to_all_s)


def stage_moe_table(plan: "Plan") -> Table | None:
    """One row per MoE layer: its stage, its layout over the stage's dp ranks, its simulated
    expert compute and communication per step (all-to-alls and the routing's all-gather, all
    micro-batches), the all-to-alls' time left on the critical path (less what runs under
    another micro-batch's compute, ``Plan.moe_a2a_overlap``), the busiest device's share of
    the layer's routed choices, and the expert weights and dispatch buffers on the fullest
    device. None without expert layouts."""
    if not plan.expert_layouts or plan.pipeline is None:
        return None
    stage_of = _stage_of_layers(plan)
    ranks = _dp_ranks(plan)
    table = Table(title=f"MoE layers in the stages (each over its stage's {ranks} dp ranks)")
    for column in ("stage", "MoE layer", "layout", "expert compute", "all-to-all + routing", "exposed all-to-all",
                   "busiest device", "expert bytes"):
        table.add_column(column, justify="left" if column in ("MoE layer", "layout") else "right")
    for layout in plan.expert_layouts:
        stage = stage_of.get(layout.module)
        table.add_row(
            "-" if stage is None else str(stage), layout.module, expert_modes_summary((layout,)),
            format_seconds(layout.cost.compute_s), format_seconds(layout.cost.communication_s), _exposed(layout),
            f"{busiest_share(layout, ranks):.1%} of choices", format_bytes(layout.cost.memory_bytes),
        )
    return table


def stage_moe_summary(plan: "Plan") -> Table | None:
    """One row per pipeline stage that runs MoE layers: how many, their layouts, the
    all-to-all time they leave exposed per step (summed; "-" when the plan predates the
    figure), and the busiest device's load at the stage's most loaded layer, as a share of
    its routed choices and over an even share (1.00x: perfectly balanced). None without
    expert layouts."""
    if not plan.expert_layouts or plan.pipeline is None:
        return None
    stage_of = _stage_of_layers(plan)
    ranks = _dp_ranks(plan)
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
        busiest = max(busiest_share(layout, ranks) for layout in layouts)
        table.add_row(
            "-" if stage < 0 else str(stage), str(len(layouts)), expert_modes_summary(tuple(layouts)),
            "-" if None in exposed else format_seconds(sum(exposed)),
            f"{busiest:.1%} of choices ({busiest * ranks:.2f}x even)",
        )
    return table
