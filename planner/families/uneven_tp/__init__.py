"""Uneven tensor parallelism (ACCPAR, Song et al., HPCA 2020): each linear layer split over
the ranks by batch rows, output features (column) or input features (row), each rank taking
a share of the split dimension by its device's speed, within its memory; every other op
runs whole on every rank. For a heterogeneous cluster whose layers are too large, or whose
batch too small, for data parallelism alone.

- ``section.py``: ``UnevenTpSection``, the plan's ``"uneven-tp"`` key: per layer, its kind
  and shares (vocabulary).
- ``ratios.py``: each layer's kind and integer shares, exact (vocabulary).
- ``costs.py``: each rank's compute on its own device, the uneven collectives, the layer
  waiting for the slowest rank (cost-model layer).
- ``candidates.py``: the plan on a cluster of two or more kinds of device (search layer).
- ``emit.py``, ``runtime.py``: the model's modules with the split layers replaced by
  ``UnevenLinear``s, uneven slices joined by all-gather-v (all-to-all with uneven sizes) or
  kept split between fused layers (codegen layer).
- ``regions.py``: the splittable layers, and the groups whose activation may stay split
  between them (vocabulary).
- ``report.py``: per device, its type, its share of each split tensor and its busy time.
"""

from __future__ import annotations

from planner.families import Family
from planner.families.uneven_tp.section import JSON_KEY, UnevenTpSection

FAMILIES = (
    Family(
        JSON_KEY, "tensor parallel, uneven per-layer splits by speed (ACCPAR)",
        lambda plan: JSON_KEY in plan.sections, refines=("tp",), also_on_axes=("tp",),
        section=UnevenTpSection,
        candidates="planner.families.uneven_tp.candidates:uneven_tp_candidates", search_order=27,
        costs="planner.families.uneven_tp.costs:UnevenTensorStep",
        emitter="planner.families.uneven_tp.emit:compile_uneven_tp_plan", claims=lambda plan: JSON_KEY in plan.sections,
        emit_order=13, report="planner.families.uneven_tp.report:uneven_tp_section",
    ),
)
