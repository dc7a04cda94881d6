"""MoE parallel folding: attention and dense layers tensor parallel on ``tp``, MoE layers
expert parallel (and expert-tensor parallel) over the same ``dp x tp`` ranks, as
Megatron-Core folds them (``section.py`` says how).

Parts: section ``section.MoeFoldingSection``, candidates ``search.moe_folding``, the
layer's costs ``cost_model.moe_folding`` (through ``cost_model.moe_layers``), emitter
``codegen.moe_folding_emit`` with the runtime ``codegen/runtime/moe_folding.py``, report ``report.folding_section``.
"""

from __future__ import annotations

from planner.families import Family
from planner.families.moe_folding.section import JSON_KEY, MoeFoldingSection

FAMILIES = (
    Family(
        "moe-folding", "dense layers tensor parallel, experts EP x ETP over dp x tp",
        lambda plan: JSON_KEY in plan.sections,
        refines=("moe",), section=MoeFoldingSection,
        candidates="search.moe_folding:folded_candidates", search_order=12,
        emitter="codegen.moe_folding_emit:render_folded_program", claims=lambda plan: JSON_KEY in plan.sections,
        emit_order=5,
        report="planner.families.moe_folding.report:folding_section",
    ),
)
