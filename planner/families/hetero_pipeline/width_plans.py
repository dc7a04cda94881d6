"""Pipelines of stages of different widths as plans the search compares and ``compile`` writes
(search layer): the layouts ``candidates.width_estimates`` prices (``widths.py``), those whose
widths differ, turned into plans run by ``codegen.runtime.uneven_width_pipeline``.

A plan of stages of widths ``(w_0, ..., w_{P-1})`` over W ranks is stored as a pipeline plan on
the mesh ``pp`` = W alone (the plan format needs a mesh covering every rank once, and no
rectangular pp x dp mesh holds stages of different widths), its ops on stages 0..P-1, with the
section's ``widths`` saying which ranks each stage holds (the first ``w_0`` ranks stage 0, and
so on). Its pipeline is GPipe (what the runtime runs) over ``micro_batches x lcm(widths)``
*units* (the runtime's granularity: rank j of stage s runs the units of its 1/w_s of each
micro-batch's rows). Its estimate is the layout's price (``method`` says so): the general
simulator prices rectangular meshes, every rank of a pp coordinate alike, which these plans
are not.
"""

from __future__ import annotations

import dataclasses
import math

from planner.cluster import Cluster
from planner.device_groups import device_groups
from planner.families.hetero_pipeline.candidates import (
    FAMILY,
    WidthEstimate,
    hetero_pipeline_candidates,
    ordered_cluster,
    width_estimates,
)
from planner.families.hetero_pipeline.section import HeteroStagesSection
from planner.graph import OpGraph
from planner.plans import Plan
from planner.strategy import Mesh, PipelineConfig
from search.context import SearchContext
from search.pipeline_search import Configuration, Estimate, PipelineGrid, PipelineSpace

METHOD = "hetero-pp widths: sum of stage times + (m - 1) x slowest, GPipe"

__all__ = ["every_candidate", "uneven_width_plans", "width_plan"]


def width_plan(estimate: WidthEstimate, graph: OpGraph, cluster, spec, model_name: str, precision: str,
               budget, warnings: tuple[str, ...] = ()) -> Plan:
    """``estimate`` (a layout of stages of different widths) as a plan (module docstring)."""
    layout, step = estimate.step.layout, estimate.step
    groups = device_groups(cluster)
    ordered = ordered_cluster(cluster, groups, layout.groups)
    world, stages = ordered.world_size, len(layout.widths)
    units = estimate.micro_batches * math.lcm(*layout.widths)
    # The strategies of a pipeline of P stages of one rank each (no dp: each stage's ranks hold
    # it whole), on a cluster of P ranks; the plan then moves onto every rank.
    config = Configuration(1, stages, 1, graph.batch_size // units, units, "1f1b", 1, "ddp", "none")
    alone = Cluster(f"{cluster.name}-stages"[:120], (dataclasses.replace(ordered.nodes[0], devices=stages, site=""),),
                    cluster.inter_link, cluster.backend)
    grid = PipelineGrid(graph, alone, precision, PipelineSpace(searched_layout="off"), budget)
    plan = grid.unsimulated(Estimate(step.step_s, config, step.blocks, 0.0), spec, model_name)
    devices = tuple(groups[g].device.name for g in layout.groups)
    section = HeteroStagesSection(devices, blocks=step.blocks,
                                  busy_s=tuple(seconds * estimate.micro_batches for seconds in step.stage_s),
                                  memory_bytes=tuple(m.total for m in estimate.memory), widths=layout.widths)
    # The stage nearest its device's memory: what the report's "fits" line is about.
    fullest = max(range(stages), key=lambda s: estimate.memory[s].total / groups[layout.groups[s]].memory_bytes)
    result = dataclasses.replace(
        plan.estimate, step_time_s=step.step_s, compute_s=max(step.stage_s) * estimate.micro_batches,
        communication_s=estimate.sync_s + estimate.hops_s, memory=estimate.memory[fullest],
        device_memory_bytes=int(groups[layout.groups[fullest]].memory_bytes), stage_memory=estimate.memory, method=METHOD,
        samples_per_s=graph.batch_size / step.step_s,
    )
    return dataclasses.replace(
        plan, cluster=ordered, mesh=Mesh((("pp", world),)), label="",
        pipeline=PipelineConfig(stages=world, schedule="gpipe", micro_batches=units), estimate=result,
        sections={FAMILY: section}, warnings=warnings,
    )


def uneven_width_plans(context: SearchContext) -> list[Plan]:
    """The best ``SearchBudget.pipeline_candidates()`` layouts whose stages differ in width, as
    plans (fp32, DDP inside each stage: what the runtime compiles); none when the constraints
    fix a mesh or the hetero-pp family's other candidates do not apply."""
    if context.precision != "fp32" or context.constraints.any or not context.constraints.allows_family("ddp"):
        return []
    graph = context.graph
    found = [e for e in width_estimates(graph, context.cluster, context.precision, context.budget)
             if e.step.layout.uneven]
    return [width_plan(e, graph, context.cluster, context.spec, context.model_name, context.precision, context.budget,
                       context.warnings) for e in found[:context.budget.pipeline_candidates()]]


def every_candidate(context: SearchContext) -> list[Plan]:
    """The candidates part of the ``hetero-pp`` family (``planner.families``): the pipelines
    of stages of one width per layout (``candidates.hetero_pipeline_candidates``) and, where
    those apply, the layouts of stages of different widths."""
    plans = hetero_pipeline_candidates(context)
    return plans + uneven_width_plans(context) if plans else plans
