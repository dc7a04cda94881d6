"""Layer separation (Stanza): a CNN's convolutional trunk data parallel on most ranks, its
fully connected head on a few, activations sent forward to the head ranks and their
gradients back; each part's gradients reduced among its own ranks only. Exact, so a
compiled plan matches one device. Everything it is lives in this folder:

- ``trunk.py``: where a traced CNN is cut (its trunk module; vocabulary).
- ``section.py``: ``LayerSeparationSection(trunk, head_ranks)``, the plan's key (vocabulary).
- ``candidates.py``: the ddp plan with each allowed split, simulated (search).
- ``costs.py``: the step of trunk and head ranks, the sends, the two reductions (cost model).
- ``emit.py``, ``runtime.py``: the program and what it imports (codegen).
- ``report.py``: the report's paragraph, with the gain over the best plan without it.

The folder is ``layer_separation`` (a Python package name); the family is ``layer-separation``.
"""

from __future__ import annotations

from planner.families import Family
from planner.families.layer_separation.section import LayerSeparationSection

FAMILIES = (
    Family(
        "layer-separation", "CNN trunk data parallel, FC head on a few ranks (Stanza)",
        lambda plan: "layer-separation" in plan.sections, data_parallel=True, refines=("ddp",),
        section=LayerSeparationSection,
        candidates="planner.families.layer_separation.candidates:layer_separation_candidates", search_order=27,
        costs="planner.families.layer_separation.costs:LayerSeparationStep",
        emitter="planner.families.layer_separation.emit:compile_layer_separation_plan",
        claims=lambda plan: "layer-separation" in plan.sections, emit_order=17,
        report="planner.families.layer_separation.report:layer_separation_section",
    ),
)
