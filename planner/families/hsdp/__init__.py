"""HSDP (hybrid sharding): FSDP2 on a 2-D ``replicate x shard`` mesh of the ``dp`` ranks.

Weights, gradients and optimizer states are sharded inside each group of ``shard``
consecutive ranks (inside one node) and replicated across the ``dp / shard`` groups:
forward and backward all-gather inside a group, gradients are reduce-scattered inside it and
all-reduced across groups, so only a 1/shard slice of the gradients crosses the links
between nodes and no weight gather does. It is what multi-node FSDP runs use on slow
networks (torchtitan's ``dp_replicate x dp_shard``).

The first family added through the registry alone; everything it is lives in this folder:

- ``section.py``: ``HsdpSection(shard)``, the plan's ``"hsdp"`` key (vocabulary).
- ``candidates.py``: the fsdp plan on ``dp`` alone again with each shard size that keeps a
  group inside a node (search layer).
- ``costs.py``: the step contributor that shards over the group and adds the all-reduce
  across groups (cost-model layer).
- ``emit.py``, ``runtime.py``: the fsdp program with ``parallelize`` on the 2-D mesh
  (codegen layer, and what the compiled program imports).
- ``report.py``: the report's lines on the groups (vocabulary).
"""

from __future__ import annotations

from planner.families import Family
from planner.families.hsdp.section import HsdpSection

FAMILIES = (
    Family(
        "hsdp", "FSDP inside node groups, replicated across them (HSDP)",
        lambda plan: "hsdp" in plan.sections, data_parallel=True, refines=("fsdp",), section=HsdpSection,
        candidates="planner.families.hsdp.candidates:hsdp_candidates", search_order=25,
        costs="planner.families.hsdp.costs:HybridShardingStep",
        emitter="planner.families.hsdp.emit:compile_hsdp_plan", claims=lambda plan: "hsdp" in plan.sections,
        emit_order=15, report="planner.families.hsdp.report:hsdp_section",
    ),
)
