"""Pipeline parallelism: stages on a ``pp`` axis, 1F1B and interleaved schedules, and for MoE
models planned with ``--moe-dispatch overlapped`` DeepSeek-V3's DualPipe (simulated only,
``cost_model.dualpipe_step``; compile refuses it in one line).

Parts: candidates ``search.pipeline_candidates`` (the grid of ``search.pipeline_search``,
asked after the families before it so it is searched on one node only when they fall
short), costs ``cost_model.schedules`` and ``cost_model.dualpipe_step``, emitter
``codegen.pipeline_emit.compile_pipeline_plan``, report ``planner.pipeline_report.pipeline_section``.
"""

from __future__ import annotations

from planner.families import Family

FAMILIES = (
    Family(
        "pipeline", "pp stages: 1F1B, interleaved; DualPipe (simulated only)", lambda plan: plan.pipeline is not None,
        axes=("pp",), candidates="search.pipeline_candidates:pipeline_candidates", search_order=50,
        emitter="codegen.pipeline_emit:compile_pipeline_plan", claims=lambda plan: plan.pipeline is not None,
        emit_order=20, report="planner.pipeline_report:pipeline_section",
    ),
)
