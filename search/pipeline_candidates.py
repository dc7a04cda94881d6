"""The candidates part of the ``pipeline`` family (``planner.families``)."""

from __future__ import annotations

from planner.plans import Plan
from search.context import SearchContext
from search.pipeline_search import PipelineSpace, pipeline_plans


def pipeline_candidates(context: SearchContext) -> list[Plan]:
    """The best plans of the pipeline grid (``search.pipeline_search``: pp x dp x tp meshes,
    micro-batches, schedules, dp flavours, recomputation, stages sliced by dynamic
    programming), simulated; they compete with the plans found before them. On one node
    the grid is searched only when none of those fits without recomputation: small
    single-node models keep the plans (and compiled programs) they had while pipelines
    compile for only some dp flavours and schedules (``codegen.pipeline_emit.unsupported``).
    None for a model whose samples mix (micro-batches would compute another step) or with
    ``--tp-layouts summa``."""
    if context.whole_batch_only or context.summa_only:
        return []
    if context.cluster.num_nodes < 2 and any(p.estimate.fits and p.recompute == "none" for p in context.found):
        return []
    constraints = context.constraints
    space = PipelineSpace(
        flavours=tuple(f for f in PipelineSpace.flavours if constraints.allows_family(f)) or PipelineSpace.flavours,
        allows_mesh=constraints.allows_mesh if constraints.any else None,
    )
    return pipeline_plans(context.graph, context.cluster, context.spec, context.model_name, context.precision,
                          context.budget, space)
