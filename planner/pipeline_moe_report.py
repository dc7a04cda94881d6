"""The MoE layers of a pipeline plan, stage by stage: the report table the ``pipeline``
family adds when its stages run MoE layers by their layouts (``search.stage_experts``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from planner.expert_layouts import expert_modes_summary
from planner.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from planner.plans import Plan


def stage_moe_table(plan: "Plan") -> Table | None:
    """One row per MoE layer: its stage, its layout over the stage's dp ranks, its simulated
    expert compute and communication per step (all-to-alls and the routing's all-gather, all
    micro-batches), the busiest device's share of the layer's routed choices, and the expert
    weights and dispatch buffers on the fullest device. None without expert layouts."""
    if not plan.expert_layouts or plan.pipeline is None:
        return None
    stage_of: dict[str, int] = {}
    for strategy in plan.strategies:
        for layout in plan.expert_layouts:
            if strategy.module == layout.module or strategy.module.startswith(layout.module + "."):
                stage_of.setdefault(layout.module, strategy.stage)
    ranks = plan.mesh.axis_size("dp") if "dp" in plan.mesh.names else 1
    table = Table(title=f"MoE layers in the stages (each over its stage's {ranks} dp ranks)")
    for column in ("stage", "MoE layer", "layout", "expert compute", "all-to-all + routing", "busiest device",
                   "expert bytes"):
        table.add_column(column, justify="left" if column in ("MoE layer", "layout") else "right")
    for layout in plan.expert_layouts:
        loads = layout.expert_loads or tuple(1.0 / layout.experts for _ in range(layout.experts))
        if layout.placement is not None:
            busiest = max(layout.placement.device_loads(loads))
        else:
            busiest = 1.0 / ranks  # every rank runs its own tokens
        stage = stage_of.get(layout.module)
        table.add_row(
            "-" if stage is None else str(stage), layout.module, expert_modes_summary((layout,)),
            format_seconds(layout.cost.compute_s), format_seconds(layout.cost.communication_s),
            f"{busiest:.1%} of choices", format_bytes(layout.cost.memory_bytes),
        )
    return table
