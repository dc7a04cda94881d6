"""MoE layers by expert layout: each layer expert parallel, data parallel or sliced, the rest
of the model data parallel.

Parts: candidates ``search.moe_search.moe_candidates``, costs ``cost_model.moe_layers``,
emitter ``codegen.moe_emit.render_moe_program`` with the runtime ``codegen/runtime/moe*.py``,
report ``planner.moe_report.moe_section``.
"""

from __future__ import annotations

from planner.families import Family

FAMILIES = (
    Family(
        "moe", "MoE layers by expert layout (expert/data parallel, sliced)", lambda plan: bool(plan.expert_layouts),
        candidates="search.moe_search:moe_candidates", search_order=10,
        # A pipeline's stages run their MoE layers themselves (codegen.pipeline_emit).
        emitter="codegen.moe_emit:render_moe_program", claims=lambda plan: bool(plan.expert_layouts) and plan.pipeline is None,
        emit_order=10,
        report="planner.moe_report:moe_section",
    ),
)
