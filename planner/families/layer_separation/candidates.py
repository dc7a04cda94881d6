"""Layer separation's candidates for the search: for a CNN (``trunk.find_trunk``), the ddp
plan of the whole cluster with each split into trunk and head ranks that the batch and the
ranks allow, simulated; the search keeps the fastest plan of all families, so layer
separation wins only where the simulator prices it faster (slow networks, large fully
connected layers) (search layer)."""

from __future__ import annotations

import dataclasses

from cost_model.simulator import simulated
from planner.families.layer_separation.section import LayerSeparationSection
from planner.families.layer_separation.trunk import find_trunk
from planner.plans import Plan
from search.context import SearchContext
from search.data_parallel import data_parallel_plan


def head_rank_counts(world: int, batch: int) -> list[int]:
    """Head ranks ``H`` a split of ``world`` ranks may use: at least one trunk rank per head
    rank, ``world - H`` a multiple of ``H`` (each head rank serves as many trunk ranks), and
    a batch that splits evenly over both groups."""
    return [heads for heads in range(1, world // 2 + 1)
            if (world - heads) % heads == 0 and batch % (world - heads) == 0 and batch % heads == 0]


def layer_separation_candidates(context: SearchContext) -> list[Plan]:
    """The candidates part of the ``layer-separation`` family (``planner.families``): one
    plan per ``head_rank_counts``, or none for a model without a convolutional trunk, on one
    device, with mixing samples, with a batch the ranks do not divide, or when the constraints
    leave the family out or fix mesh sizes (a layer-separation plan has the ``dp`` mesh alone)."""
    if context.whole_batch_only or not context.constraints.allows_family("layer-separation"):
        return []
    cluster, graph = context.cluster, context.graph
    if cluster.world_size < 2 or context.constraints.mesh or context.constraints.max:
        return []
    if graph.batch_size % cluster.world_size:
        return []  # the ddp plan it is built on splits the batch over every rank
    trunk = find_trunk(graph)
    if trunk is None:
        return []
    counts = head_rank_counts(cluster.world_size, graph.batch_size)
    if not counts:
        return []
    ddp = data_parallel_plan(graph, cluster, context.spec, context.model_name, "ddp", context.warnings,
                             context.precision)
    return [simulated(dataclasses.replace(ddp, sections={"layer-separation": LayerSeparationSection(trunk.path, heads)}),
                      graph) for heads in counts]
