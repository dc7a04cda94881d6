"""SUMMA: 2-D/2.5-D/3-D tensor-parallel matmuls on ``row x col x dep`` axes.

Parts: meshes ``search.summa_meshes``, candidates ``search.mesh_search.searched_candidates``
(shared with ``tp``), layouts ``search.summa_layout``, costs ``cost_model.summa``, emitted
inside the graph program (``codegen.summa_emit``, claimed by ``tp``'s emitter), report
``planner.summa_report.summa_section``.
"""

from __future__ import annotations

from planner.families import Family

FAMILIES = (
    Family(
        "summa", "2-D/2.5-D/3-D tensor-parallel matmuls, row x col x dep (SUMMA)",
        lambda plan: any(plan.mesh.axis_size(axis) > 1 for axis in ("row", "col", "dep") if axis in plan.mesh.names),
        axes=("row", "col", "dep"), candidates="search.mesh_search:searched_candidates", search_order=31,
        report="planner.summa_report:summa_section",
    ),
)
