"""Candidates of the ``moe_folding`` family: tensor parallelism beside expert parallelism.

On each ``dp x tp`` mesh the search is asked to consider (``SearchContext.meshes``, after the
user's ``--mesh``/``--max``; with ``--mesh pp=P`` also ``pp x dp x tp``, 1F1B over P
micro-batches), a folded plan lays the dense ops out Megatron-style on ``tp``
(``search.layouts.megatron_layout``: column/row-parallel projections, split heads, a
vocabulary-parallel embedding and head), keeps every MoE layer's own ops (router, routing,
experts) replicated on ``tp`` (they run by their layout, not by placements), and runs each
MoE layer expert parallel over the folded ``dp*tp`` ranks (``planner.families.moe_folding``):
for every expert-parallel degree EP that divides the experts and every expert-tensor-parallel
degree ETP that divides the experts' hidden width, with EP x ETP dividing the ranks, the
experts placed round-robin over EP. Each is simulated (``cost_model.moe_folding`` prices the
tokens' trips between the layouts, the all-to-alls and ETP's gather and reduce-scatter), and
all of them compete with the other families' plans on their simulated step.

Folded pipelines by default: the pipeline grid (``search.pipeline_candidates``,
``search.pipeline_search``) prices every ``pp x dp x tp`` mesh of an MoE model with the
layouts of ``folded_stage_variants`` (the largest EP of ETP 1 over each stage's ``dp*tp``
ranks: the fewest expert copies), choosing stages, micro-batches, schedule, ZeRO-1 and recomputation
as for any pipeline; ``with_stage_layouts`` makes its plans folded. That is how the search
finds Megatron-Core's Mixtral-8x22B layout on 64 H100s (TP4 x EP8 x PP8 x DP2, 128
micro-batches, ZeRO-1; ``benchmarks/moe_frontier.py``).

Models whose MoE layers are not ``examples/moe.py``'s routed GELU layers (HuggingFace's blocks
keep their own router) get the folded plans of this module's ``folded_candidates`` (no
pipeline, or ``--mesh pp=P``'s) only when ``--mesh`` fixes ``tp > 1``: compiled without a
pipeline they run DDP without recomputation, and these plans have not been measured for speed
or planning time at scale (each is a full simulation per EP on every ``dp x tp`` mesh).

``FOLDED_SEQUENCE_PARALLEL``: the residual stream's layouts tried. The sequence-parallel one is
priced (``cost_model.moe_folding``) but not searched: compiled folded programs do not write it
yet (``codegen.moe_folding_emit`` refuses it in one line). Compiled programs split experts
(ETP > 1) only without a pipeline, without expert copies (EP x ETP = dp x tp) and for routed
GELU layers; the other ETP layouts are searched and priced only under a ``--moe-dispatch``
other than ``compiled``, and refused by compile in one line.
"""

from __future__ import annotations

import dataclasses

from cost_model.simulator import simulated
from planner.errors import PlanningError
from planner.families.moe_folding.section import JSON_KEY, MoeFoldingSection
from planner.cluster import Cluster
from planner.graph import OpGraph
from planner.model_spec import ModelSpec
from planner.moe_blocks import ROUTED_GELU
from planner.plans import Plan
from planner.routing import RoutingStats
from planner.strategy import FOLDED_DP_TP, ExpertLayout, ExpertPlacement, Mesh, NodeStrategy, PipelineConfig
from search.context import SearchContext
from search.layouts import megatron_layout
from search.moe_search import MOE_LABEL, routing_label
from search.plan_builder import unsimulated_plan

FOLDED_SEQUENCE_PARALLEL = (False,)
EP_OPTIONS = 4  # expert-parallel degrees searched per ETP and mesh, the largest first (folded_degrees)
# Expert-parallel degrees (ETP 1) each pipeline mesh of the grid is priced with, the largest first
# (folded_stage_variants): every variant is one more segment simulation per micro-batch size on
# every pipeline mesh. One keeps DeepSeek-V3 on 256 H100s within its planning time (with two it
# took 62 s here against 36 s without folded stages, 154 segment simulations), and the largest EP
# is what won at every frontier row measured (Mixtral-8x22B: EP8 over TP4 x DP2; DeepSeek-V3: EP8
# over TP2 x DP4).
STAGE_EP_OPTIONS = 1


def folded_meshes(context: SearchContext) -> list[Mesh]:
    """The ``dp x tp`` meshes (tp >= 2) among those the search considers, and, when the user
    fixes ``--mesh pp=P``, the ``pp x dp x tp`` meshes with that ``P`` the constraints allow
    (tp inside a node)."""
    meshes = [mesh for mesh in context.meshes if mesh.names == ("dp", "tp") and mesh.axis_size("tp") > 1]
    pp = context.constraints.mesh.get("pp", 1)
    world = context.cluster.world_size
    if pp > 1 and world % pp == 0:
        per_node = context.cluster.min_devices_per_node
        for tp in range(2, world // pp + 1):
            if (world // pp) % tp or per_node % tp:
                continue
            mesh = Mesh((("pp", pp), ("dp", world // pp // tp), ("tp", tp)))
            if context.constraints.allows_mesh(mesh):
                meshes.append(mesh)
    return meshes


def folded_degrees(experts: int, ffn: int, ranks: int, tp: int) -> list[tuple[int, int]]:
    """The (EP, ETP) searched for a layer of ``experts`` experts of hidden width ``ffn`` over
    ``ranks`` = dp x tp ranks: EP > 1 divides the experts, ETP the width and ``tp`` (ETP runs
    inside a tensor-parallel group, as Megatron-Core's ETP groups do), EP x ETP the ranks;
    for each ETP the ``EP_OPTIONS`` largest EPs (the fewest expert copies: the least memory;
    the bound keeps a 256-expert model on hundreds of GPUs to a few simulations per mesh)."""
    found = []
    for etp in range(1, tp + 1):
        if tp % etp or ffn % etp:
            continue
        eps = [ep for ep in range(2, ranks // etp + 1) if experts % ep == 0 and ranks % (ep * etp) == 0]
        found += [(ep, etp) for ep in eps[-EP_OPTIONS:]]
    return sorted(found)


def degrees_every_layer_allows(graph: OpGraph, ranks: int, tp: int) -> set[tuple[int, int]]:
    """The (EP, ETP) of ``folded_degrees`` that every MoE layer of ``graph`` allows over
    ``ranks`` = dp x tp ranks (one layout degree for the whole model)."""
    shared: set[tuple[int, int]] | None = None
    for block in graph.moe_blocks:
        options = set(folded_degrees(block.experts, block.ffn, ranks, tp))
        shared = options if shared is None else shared & options
    return shared or set()


def folded_layouts(graph: OpGraph, routing: RoutingStats, ep: int, etp: int,
                   sharded_copies: bool = False) -> tuple[ExpertLayout, ...]:
    """One layout per MoE layer of ``graph``: expert parallel on ``dp*tp`` with EP ``ep``
    (round-robin) and ETP ``etp``; ``sharded_copies``: each expert sharded over its
    expert-data-parallel copies (``ExpertLayout.sharded_copies``)."""
    layouts = []
    for block in graph.moe_blocks:
        statistics = routing.layer(block.module, block.experts, block.top_k)
        layouts.append(ExpertLayout(
            module=block.module, mode="expert_parallel", experts=block.experts, top_k=block.top_k,
            capacity_factor=block.capacity_factor, axis=FOLDED_DP_TP,
            placement=ExpertPlacement.round_robin(block.experts, ep), routing=routing_label(routing, block.module),
            expert_loads=tuple(statistics.token_share), tensor_parallel=etp, sharded_copies=sharded_copies,
        ))
    return tuple(layouts)


def dense_strategies(graph: OpGraph, mesh: Mesh, sequence_parallel: bool) -> tuple[tuple[NodeStrategy, ...], dict]:
    """Megatron's layout of ``graph`` on ``mesh``, with the MoE layers' own parameters
    replicated on ``tp`` (each rank holds the whole router: it routes its own tokens).

    Raises:
        PlanningError: Megatron's layout does not apply (``megatron_layout``).
    """
    strategies, inputs = megatron_layout(graph, mesh, sequence_parallel=sequence_parallel)
    return moe_params_whole_on_tp(graph, mesh, strategies), inputs


def moe_params_whole_on_tp(graph: OpGraph, mesh: Mesh, strategies: tuple[NodeStrategy, ...]) -> tuple[NodeStrategy, ...]:
    """``strategies`` with the parameters of every MoE layer's own ops replicated on ``tp``
    (each tp rank routes its share of the tokens with the whole router; the experts run by
    the layer's layout, not by placements)."""
    from torch.distributed.tensor import Replicate

    inside = {node.name for block in graph.moe_blocks for node in graph.moe_nodes(block.module)}
    tp_index = mesh.names.index("tp")

    def replicated_on_tp(placements):
        return tuple(Replicate() if index == tp_index else p for index, p in enumerate(placements))

    return tuple(
        dataclasses.replace(s, params={name: replicated_on_tp(p) for name, p in s.params.items()})
        if s.node in inside and s.params else s
        for s in strategies
    )


def with_stage_layouts(plan: Plan, layouts: tuple[ExpertLayout, ...], overlap: bool = False) -> Plan:
    """``plan`` (of the pipeline grid, without MoE layouts yet) with ``layouts`` and
    ``overlap`` (its all-to-alls under another micro-batch's compute); when the layouts fold
    over ``dp*tp`` (``folded_stage_variants``), also made a folded plan: the MoE layers' own
    parameters whole on ``tp``, the family's section and label."""
    if not layouts or any(layout.axis != FOLDED_DP_TP for layout in layouts):
        return dataclasses.replace(plan, expert_layouts=layouts, moe_a2a_overlap=overlap)
    strategies = moe_params_whole_on_tp(plan.graph, plan.mesh, plan.strategies)
    return dataclasses.replace(plan, strategies=strategies, label=MOE_LABEL, expert_layouts=layouts,
                               moe_a2a_overlap=overlap, sections={**plan.sections, JSON_KEY: MoeFoldingSection(False)})


def folded_stage_variants(graph: OpGraph, routing: RoutingStats | None, mesh: Mesh,
                          moe_dispatch: str = "compiled") -> dict[str, tuple[ExpertLayout, ...]]:
    """The folded layouts the pipeline grid prices on a ``pp x dp x tp`` mesh (tp >= 2), by
    variant name: every MoE layer expert parallel over its stage's ``dp*tp`` ranks with the
    ``STAGE_EP_OPTIONS`` largest EPs of ETP 1 that every layer allows (the fewest expert
    copies: the least memory), and, when the dispatch is not the compiled one, the largest
    EP of each ETP > 1 (compiled pipelines run whole experts, ``codegen.pipeline_emit``).
    Empty for any other mesh: a pipeline without dp or tp folds nothing here, and one
    without stages is ``folded_candidates``' (whose compiled programs differ)."""
    if mesh.names != ("pp", "dp", "tp") or not graph.moe_blocks:
        return {}
    ranks, tp = mesh.axis_size("dp") * mesh.axis_size("tp"), mesh.axis_size("tp")
    shared = degrees_every_layer_allows(graph, ranks, tp)
    chosen = [(ep, 1) for ep in sorted(ep for ep, etp in shared if etp == 1)[-STAGE_EP_OPTIONS:]]
    if moe_dispatch != "compiled":
        for etp in sorted({etp for _, etp in shared} - {1}):
            chosen.append((max(ep for ep, other in shared if other == etp), etp))
    routing = routing or RoutingStats()
    return {f"folded-ep{ep}-etp{etp}": folded_layouts(graph, routing, ep, etp) for ep, etp in chosen}


def folded_plan(graph: OpGraph, cluster: Cluster, spec: ModelSpec | None, model_name: str, mesh: Mesh, ep: int,
                etp: int = 1, *, sequence_parallel: bool = False, routing: RoutingStats | None = None,
                precision: str = "fp32", warnings: tuple[str, ...] = (), micro_batches: int = 1,
                dp_flavour: str = "ddp", recompute: str = "none", accumulation_steps: int = 1,
                dense: tuple[tuple[NodeStrategy, ...], dict] | None = None) -> Plan:
    """The simulated folded plan on ``mesh`` (``dp x tp``, or ``pp x dp x tp``: pipeline
    stages of Megatron's even split, 1F1B over ``micro_batches``) with EP ``ep`` and ETP
    ``etp`` for every MoE layer (module docstring). ``dp_flavour``, ``recompute`` and
    (without a pipeline) ``accumulation_steps`` are the plan's (the Megatron-Core grid,
    ``search.megatron_moe``, sets them; the search keeps the defaults). ``dense``: what
    ``dense_strategies(graph, mesh, sequence_parallel)`` gave, when the caller keeps it.
    Under ``dp_flavour="fsdp"`` the experts are sharded too, each over its EDP = dp x tp /
    (EP x ETP) copies where there are two or more and ETP is 1 (``ExpertLayout.sharded_copies``,
    written in the plan's layouts), as Megatron-FSDP shards expert parameters over the
    expert-data-parallel group (NVIDIA/Megatron-LM 1e057005,
    megatron/core/distributed/custom_fsdp/param_and_grad_buffer.py: each FSDP unit's expert
    parameters a parameter group of their own, ``expert_data_parallel_group``). Compiled
    folded programs run DDP only (``codegen.moe_folding_emit.check_foldable`` refuses the rest).

    Raises:
        PlanningError: Megatron's layout does not split the model over ``tp`` or ``pp``.
        ValueError: the degrees do not fold over the mesh (``MoeFoldingSection.check``).
    """
    strategies, inputs = dense or dense_strategies(graph, mesh, sequence_parallel)
    pipeline = None
    if "pp" in mesh.names:
        pipeline = PipelineConfig(stages=mesh.axis_size("pp"), schedule="1f1b", micro_batches=micro_batches)
    base = unsimulated_plan(graph, cluster, spec, model_name, mesh, strategies, inputs, dp_flavour=dp_flavour,
                            precision=precision, warnings=tuple(warnings), label=MOE_LABEL, pipeline=pipeline,
                            recompute=recompute, accumulation_steps=accumulation_steps)
    edp = mesh.axis_size("dp") * mesh.axis_size("tp") // (ep * etp)
    sharded = dp_flavour == "fsdp" and edp > 1 and etp == 1
    plan = dataclasses.replace(base, expert_layouts=folded_layouts(graph, routing or RoutingStats(), ep, etp, sharded),
                               sections={**base.sections, JSON_KEY: MoeFoldingSection(sequence_parallel)})
    return simulated(plan, graph)


def folded_candidates(context: SearchContext) -> list[Plan]:
    """The candidates part of the ``moe_folding`` family (module docstring): every folded
    plan on every ``dp x tp`` mesh the search considers, when the MoE layers may be planned
    by layout and the constraints allow the family."""
    if not context.moe_layouts or context.summa_only or not context.constraints.allows_family("moe-folding"):
        return []
    hf_blocks = any(block.runtime != ROUTED_GELU for block in context.graph.moe_blocks)
    if hf_blocks and context.constraints.mesh.get("tp", 1) < 2:
        # HuggingFace's blocks are folded here only when the user asks for tensor parallelism
        # (--mesh tp=N); by default the pipeline grid folds them in stages (module docstring).
        return []
    graph, plans = context.graph, []
    for mesh in folded_meshes(context):
        dp = mesh.axis_size("dp")
        if graph.batch_size % dp:
            continue
        ranks = dp * mesh.axis_size("tp")
        # A pipeline's micro-batches: as many as stages (1F1B's fill), of whole samples per dp rank.
        micro_batches = mesh.axis_size("pp") if "pp" in mesh.names else 1
        if (graph.batch_size // dp) % micro_batches:
            continue
        for ep, etp in sorted(degrees_every_layer_allows(graph, ranks, mesh.axis_size("tp"))):
            # Experts split over tp (ETP > 1) compile only without a pipeline, with EP x ETP
            # covering every rank and for routed GELU layers (codegen.moe_folding_emit); other
            # splits are priced for a team whose trainer runs them (--moe-dispatch other than
            # compiled), never chosen by default.
            if etp != 1 and context.moe_dispatch == "compiled" and (
                    hf_blocks or "pp" in mesh.names or ep * etp != ranks):
                continue
            for sequence_parallel in FOLDED_SEQUENCE_PARALLEL:
                try:
                    plans.append(folded_plan(graph, context.cluster, context.spec, context.model_name, mesh, ep, etp,
                                             sequence_parallel=sequence_parallel, routing=context.routing,
                                             precision=context.precision, warnings=context.warnings,
                                             micro_batches=micro_batches))
                except PlanningError:
                    break  # Megatron's layout does not split this model over tp
    if plans:
        best = min(plans, key=lambda plan: (not plan.estimate.fits, plan.estimate.step_time_s))
        context.notes.append(f"MoE folded over dp x tp: {len(plans)} plan(s), best {best.name}")
    return plans
