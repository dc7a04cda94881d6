"""Adasum's candidates for the search: the ddp plan with an ``"adasum"`` section, only when
the user names the family (``--family adasum``): Adasum changes what a step computes (a
convergence choice), so the search never picks it for speed (search layer)."""

from __future__ import annotations

import dataclasses

from cost_model.simulator import simulated
from planner.errors import PlanningError
from planner.families.adasum.section import AdasumSection, is_power_of_two, refusal
from planner.plans import Plan
from search.context import SearchContext
from search.data_parallel import data_parallel_plan


def node_average_size(world: int, devices_per_node: int) -> int:
    """Ranks averaged inside a node: a node's devices on a multi-node cluster (Horovod's
    hierarchical Adasum), else 1 (Adasum over every rank)."""
    return devices_per_node if world > devices_per_node else 1


def adasum_candidates(context: SearchContext) -> list[Plan]:
    """The candidates part of the ``adasum`` family (``planner.families``): the ddp plan of
    the whole cluster with ``AdasumSection(local)`` (``node_average_size``), simulated; none
    unless ``--family`` names adasum.

    Raises:
        PlanningError: ``--family adasum`` on a cluster without a power of two of copies
            (one line: ``section.refusal``).
    """
    families = context.constraints.families
    if families is None or "adasum" not in families or context.whole_batch_only:
        return []
    cluster = context.cluster
    local = node_average_size(cluster.world_size, cluster.min_devices_per_node)
    if not is_power_of_two(cluster.world_size // local) or cluster.world_size // local < 2:
        raise PlanningError(refusal(cluster.world_size, local))
    ddp = [plan for plan in context.found if plan.dp_flavour == "ddp" and not plan.label and not plan.sections
           and plan.mesh.names == ("dp",) and plan.accumulation_steps == 1]
    if not ddp:
        ddp = [data_parallel_plan(context.graph, cluster, context.spec, context.model_name, "ddp",
                                  context.warnings, context.precision)]
    return [simulated(dataclasses.replace(plan, sections={**plan.sections, "adasum": AdasumSection(local)}),
                      context.graph) for plan in ddp]
