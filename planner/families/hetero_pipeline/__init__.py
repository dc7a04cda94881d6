"""Pipelines over device groups of different types (Metis, ATC'24): each group of equal
devices cut into one or more stages of a width common to all stages, the stage order chosen,
the blocks balanced by each stage's speed and memory (a stage on H100s holds more layers than
one on A100s); and the pipelines on the fastest group alone, the slower devices left out
(Sailor). Everything it adds lives in this folder:

- ``section.py``: ``HeteroStagesSection``, the plan's ``"hetero-pp"`` key (vocabulary).
- ``balance.py``: the exact split of the blocks over stages on different devices (vocabulary).
- ``widths.py``: stages of different widths (FlashFlex/HexiScale), their layouts and exact
  split (vocabulary); priced by ``candidates.width_estimates``, kept as plans by
  ``candidates.uneven_width_plans`` when they beat every layout of one width.
- ``costs.py``: every op priced on its own stage's device (cost-model layer).
- ``candidates.py``: every order of the groups, balanced, estimated; the best simulated
  (search layer).
- ``report.py``: per stage, its devices, blocks, busy time and memory (vocabulary).

The program is the pipeline family's (``codegen.pipeline_emit``): stages holding different
numbers of blocks, on an even pp x dp mesh, are what it already compiles, and the stage order
is the plan's cluster's node order. Stages of different widths (the section's ``widths``) are
compiled by this family's emitter, ``codegen.uneven_width_emit`` (the pipeline family's stage
modules, run by ``codegen.runtime.uneven_width_pipeline``: GPipe, rows sent between the ranks
of stages of different widths, gradients summed over each stage's own ranks).
"""

from __future__ import annotations

from planner.families import Family
from planner.families.hetero_pipeline.section import JSON_KEY, HeteroStagesSection

FAMILIES = (
    Family(
        JSON_KEY, "pp stages per device type and width, blocks by speed",
        lambda plan: JSON_KEY in plan.sections, axes=(), refines=("pipeline",), section=HeteroStagesSection,
        candidates="planner.families.hetero_pipeline.candidates:hetero_pipeline_candidates", search_order=52,
        costs="planner.families.hetero_pipeline.costs:StageDeviceStep",
        report="planner.families.hetero_pipeline.report:hetero_pipeline_section",
        # Stages of different widths (the section's widths) compile here, before the
        # pipeline family (emit_order 20) would write them as one even pp mesh.
        emitter="codegen.uneven_width_emit:compile_uneven_width_plan", emit_order=19,
        claims=lambda plan: bool(JSON_KEY in plan.sections and plan.sections[JSON_KEY].widths),
    ),
)
