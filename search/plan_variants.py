"""Variants of a plan that every family may want: the same plan with its repeated blocks
recomputed, and a plan whose ``dp`` axis sits beside others with its weights split over
``dp`` (ZeRO-2/FSDP composed with tensor or pipeline parallelism)."""

from __future__ import annotations

import dataclasses

from cost_model.simulator import simulated
from planner.graph import OpGraph
from planner.plans import Plan


def composed_flavours(plan: Plan, graph: OpGraph) -> list[Plan]:
    """``plan`` (DDP on its ``dp`` axis beside other axes) again with weights split over
    ``dp``: ZeRO-2 (gathered where read, kept until backward), with and without recomputed
    blocks, and FSDP (gathered again in backward: compiled inside recomputed blocks, so only
    with recomputation). ZeRO-1 is left out: ZeRO-2 holds less for no more communication.
    None on a mesh with ``dp`` alone (the data-parallel flavours cover it) or without ``dp``."""
    names = plan.mesh.names
    if "dp" not in names or len(names) == 1 or plan.mesh.axis_size("dp") == 1:
        return []
    zero2 = simulated(dataclasses.replace(plan, dp_flavour="zero2"), graph)
    if not graph.blocks:
        return [zero2]
    return [zero2, *recomputing([zero2], graph), simulated(dataclasses.replace(plan, dp_flavour="fsdp", recompute="full"), graph)]


def recomputing(plans: list[Plan], graph: OpGraph) -> list[Plan]:
    """Each plan again with its repeated blocks recomputed in backward (none for a model
    without repeated blocks: recomputation checkpoints blocks), and, for graph programs,
    with only the blocks' attention cores recomputed (Megatron-LM's selective
    recomputation) where that keeps fewer activations. Data-parallel programs checkpoint a
    core only when it is a module of its own, which the graph does not say: they get full
    recomputation alone."""
    if not graph.blocks:
        return []
    variants = []
    for plan in plans:
        variants.append(simulated(dataclasses.replace(plan, recompute="full"), graph))
        if plan.label and plan.recompute == "none":
            selective = simulated(dataclasses.replace(plan, recompute="selective"), graph)
            if selective.estimate.memory.activations < plan.estimate.memory.activations:
                variants.append(selective)
    return variants
