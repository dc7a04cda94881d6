"""Adasum (Horovod's adaptive summation): data parallelism whose gradients are combined by
``(1 - g1.g2/(2|g1|^2)) g1 + (1 - g1.g2/(2|g2|^2)) g2`` over pairs of ranks, recursively,
instead of averaged; hierarchical on multi-node meshes (average inside a node, Adasum across
nodes). A convergence choice for large batches, chosen by the user (``--family adasum``),
never by the search for speed. Everything it is lives in this folder:

- ``section.py``: ``AdasumSection(local)``, the plan's ``"adasum"`` key (vocabulary).
- ``candidates.py``: the ddp plan with the section, only under ``--family adasum`` (search).
- ``costs.py``: DDP's buckets, each priced as Adasum's swaps and combinations (cost model).
- ``emit.py``, ``runtime.py``: the ddp program with Adasum as DDP's communication hook
  (codegen, and what the compiled program imports).
- ``report.py``: the report's paragraph (vocabulary).
"""

from __future__ import annotations

from planner.families import Family
from planner.families.adasum.section import AdasumSection

FAMILIES = (
    Family(
        "adasum", "gradients combined by Adasum (a convergence choice, not speed)",
        lambda plan: "adasum" in plan.sections, data_parallel=True, refines=("ddp",), section=AdasumSection,
        candidates="planner.families.adasum.candidates:adasum_candidates", search_order=26,
        costs="planner.families.adasum.costs:AdasumStep",
        emitter="planner.families.adasum.emit:compile_adasum_plan", claims=lambda plan: "adasum" in plan.sections,
        emit_order=16, report="planner.families.adasum.report:adasum_section",
    ),
)
