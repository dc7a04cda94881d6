"""HSDP's candidates for the search: the fsdp plan on ``dp`` alone, again with each shard
group size that keeps a group inside a node (search layer)."""

from __future__ import annotations

import dataclasses

from cost_model.simulator import simulated
from planner.families.hsdp.section import HsdpSection
from planner.plans import Plan
from search.context import SearchContext
from search.data_parallel import data_parallel_plan
from search.plan_variants import recomputing


def shard_sizes(dp: int, devices_per_node: int) -> list[int]:
    """The shard group sizes HSDP may use: at least 2 ranks, inside a node (they divide the
    smallest node's devices), dividing ``dp`` into at least two groups."""
    return [size for size in range(2, min(dp - 1, devices_per_node) + 1) if devices_per_node % size == 0 and dp % size == 0]


def hsdp_candidates(context: SearchContext) -> list[Plan]:
    """The candidates part of the ``hsdp`` family (``planner.families``): for each shard size
    (``shard_sizes``), the fsdp plan of the whole cluster's ``dp`` and its recomputing
    variant with the section ``{"hsdp": HsdpSection(shard)}``, simulated. None on a cluster
    with no such size (one node of fewer than 3 devices, say), for a model whose samples mix,
    with ``--tp-layouts summa``, or when the constraints leave hsdp out."""
    if context.whole_batch_only or context.summa_only or not context.constraints.allows_family("hsdp"):
        return []
    dp_alone = [mesh for mesh in context.meshes if mesh.names == ("dp",)]
    if not dp_alone:
        return []
    sizes = shard_sizes(dp_alone[0].axis_size("dp"), context.cluster.min_devices_per_node)
    if not sizes:
        return []
    # The fsdp plans the data-parallel family found already, or built here when --family
    # left fsdp out: HSDP is the same program with another mesh under fully_shard.
    fsdp = [plan for plan in context.found
            if plan.dp_flavour == "fsdp" and not plan.label and plan.mesh == dp_alone[0] and not plan.sections
            and plan.accumulation_steps == 1]
    if not fsdp:
        base = data_parallel_plan(context.graph, context.cluster, context.spec, context.model_name, "fsdp",
                                  context.warnings, context.precision)
        fsdp = [base, *recomputing([base], context.graph)]
    return [
        simulated(dataclasses.replace(plan, sections={**plan.sections, "hsdp": HsdpSection(size)}), context.graph)
        for size in sizes for plan in fsdp
    ]
