"""The candidates part of the ``pipeline`` family (``planner.families``)."""

from __future__ import annotations

import dataclasses

from planner.plans import Plan
from search.context import SearchContext
from search.moe_folding import folded_stage_variants, with_stage_layouts
from search.moe_search import mixing_only_in_moe_layers
from search.pipeline_configs import MOE_RECOMPUTE_ORDER
from search.pipeline_search import PipelineSpace, pipeline_plans
from search.stage_experts import compiled_in_stages, runs_in_stages, stage_expert_variants

# What a pipeline of an MoE model searches (codegen.runtime.pipeline_moe runs it): stages on
# pp x dp, each MoE layer by its layout over the stage's dp ranks; gradients reduced once per
# step as a pipeline program reduces every DTensor gradient (the "ddp" flavour), Megatron-LM's
# placements for the dense ops, and no tensor parallelism beside the experts unless they fold
# over the stage's dp x tp ranks (folds_in_stages). A recomputed block routes again in
# backward, on every rank of its stage at once, so it recomputes alike. Its blocks may also
# recompute keeping their MoE layers' exchanges (planner.strategy.KEEP_A2A).
_MOE_SPACE = dict(flavours=("ddp",), tensor_parallel=(1,), sequence_parallel=(False,), searched_layout="off",
                  recompute=MOE_RECOMPUTE_ORDER)
# HuggingFace MoE blocks in stages are planned and priced, not compiled (search.stage_experts):
# their search also has ZeRO-1 on dp, the distributed optimizer DeepSeek-V3 trained with
# (technical report, arXiv 2412.19437, section 3.2), which shards the states of the weights the stage's dp ranks share
# and leaves each rank's own experts whole.
_HF_MOE_FLAVOURS = ("ddp", "zero1")


def folds_in_stages(context: SearchContext) -> bool:
    """Whether the pipeline grid of an MoE model also prices tensor-parallel stages with the
    experts folded over each stage's dp x tp ranks (Megatron-Core's MoE parallel folding,
    ``planner.families.moe_folding``): when the MoE layers may be planned by layout and the
    user's constraints allow the folding family."""
    return context.moe_layouts and context.constraints.allows_family("moe-folding")


def pipeline_candidates(context: SearchContext) -> list[Plan]:
    """The best plans of the pipeline grid (``search.pipeline_search``: pp x dp x tp meshes,
    micro-batches, schedules, dp flavours, recomputation, stages sliced by dynamic
    programming), simulated; they compete with the plans found before them. On one node
    the grid is searched only when none of those fits without recomputation: small
    single-node models keep the plans (and compiled programs) they had while pipelines
    compile for only some dp flavours and schedules (``codegen.pipeline_emit.unsupported``).
    None with ``--tp-layouts summa``, and for a model whose samples mix (micro-batches would
    compute another step) unless the mixing is all inside MoE layers the MoE runtime runs
    (``search.moe_search.mixing_only_in_moe_layers``, whatever the batch per device): then
    each stage runs its MoE layers by the layouts of ``search.stage_experts`` over its dp
    ranks, routing every micro-batch on its own, or, on a tensor-parallel stage, folded over
    its dp x tp ranks (``search.moe_folding.folded_stage_variants``, when ``folds_in_stages``)."""
    # The batch need not split over every device (the MoE family's condition), only over dp.
    moe = not context.summa_only and runs_in_stages(context.graph) and mixing_only_in_moe_layers(context.graph,
                                                                                                context.coupled)
    if context.summa_only or (context.whole_batch_only and not moe):
        return []
    if context.cluster.num_nodes < 2 and any(p.estimate.fits and p.recompute == "none" for p in context.found):
        return []
    constraints = context.constraints
    space = PipelineSpace(
        flavours=tuple(f for f in PipelineSpace.flavours if constraints.allows_family(f)) or PipelineSpace.flavours,
        allows_mesh=constraints.allows_mesh if constraints.any else None,
    )
    if moe:
        graph, cluster, routing, precision = context.graph, context.cluster, context.routing, context.precision
        flavours = _MOE_SPACE["flavours"] if all(compiled_in_stages(b) for b in graph.moe_blocks) else _HF_MOE_FLAVOURS
        folding = folds_in_stages(context)

        def expert_layouts(mesh, micro_batches):
            if "tp" in mesh.names:  # tensor parallel stages: experts folded over dp x tp (search.moe_folding)
                return folded_stage_variants(graph, routing, mesh, context.moe_dispatch) if folding else {}
            return stage_expert_variants(graph, cluster, routing, precision, mesh, micro_batches)

        space = dataclasses.replace(
            space, **{**_MOE_SPACE, "flavours": flavours, **({"tensor_parallel": None} if folding else {})},
            # DualPipe hides each micro-batch's all-to-alls under another's compute, which is
            # simulated, not compiled: tried when the user opts into that (--moe-dispatch
            # overlapped, planner.expert_layouts.MOE_DISPATCHES).
            dualpipe=context.moe_dispatch == "overlapped",
            expert_layouts=expert_layouts, lay_out_experts=with_stage_layouts if folding else None,
        )
    return pipeline_plans(context.graph, context.cluster, context.spec, context.model_name, context.precision,
                          context.budget, space)
