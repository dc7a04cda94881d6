"""The outer search: every family's candidates, then the fastest plan that fits.

``search_plan`` builds one ``SearchContext`` (``search.context``) and asks each family
registered in ``planner.families`` for its plans, in the registry's search order: the MoE
layouts, the data-parallel flavours on ``dp`` alone, the op-by-op search of every ``dp x tp``
and SUMMA mesh (``search.mesh_search``: CP-SAT and/or MCMC), the pipeline grid, and any
family added since. Every plan is simulated; the fastest that fits in memory and meets the
user's constraints wins, and the others, with the data-parallel and Megatron baselines, are
kept as runners-up so the report can say why the winner won.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from cost_model.colocation import CoRunner
from planner.cluster import Cluster
from planner.constraints import SearchConstraints
from planner.errors import PlanningError
from planner.families import resolve, with_part
from planner.graph import OpGraph
from planner.model_spec import ModelSpec
from planner.plans import Plan
from planner.routing import RoutingStats
from planner.strategy import Mesh
from search.batch_coupling import batch_coupled_ops, coupling_warning
from search.beside import choose_beside
from search.budget import SearchBudget
from search.context import SearchContext
from search.data_parallel import DATA_PARALLEL_FLAVOURS, accumulating, data_parallel_plan, does_not_fit
from search.left_out import left_out_record
from search.megatron import megatron_baseline
from search.moe_search import moe_family_allowed, runs_by_layout
from search.plan_variants import composed_flavours, recomputing
from search.runners_up import runners_up
from search.summa_meshes import TP_LAYOUTS, summa_meshes
from search.summa_savings import savings_text

SEARCHES = ("auto", "ilp", "mcmc")


def candidate_meshes(cluster: Cluster, batch_size: int) -> list[Mesh]:
    """``dp x tp`` meshes: tp divides the devices of a node (tensor parallelism stays on the
    fast links), dp divides the batch."""
    world = cluster.world_size
    per_node = cluster.min_devices_per_node
    meshes = []
    for tp in range(1, per_node + 1):
        if per_node % tp or world % tp:
            continue
        dp = world // tp
        if batch_size % dp:
            continue
        axes = tuple((name, size) for name, size in (("dp", dp), ("tp", tp)) if size > 1) or (("dp", 1),)
        meshes.append(Mesh(axes))
    return meshes


def search_plan(
    graph: OpGraph,
    cluster: Cluster,
    spec: ModelSpec | None,
    model_name: str,
    *,
    search: str = "auto",
    budget: SearchBudget | None = None,
    seed: int = 0,
    warnings: tuple[str, ...] = (),
    precision: str = "fp32",
    on_progress: Callable[[str, float], None] | None = None,
    routing: RoutingStats | None = None,
    tp_layouts: str = "auto",
    constraints: SearchConstraints | None = None,
    moe_dispatch: str = "compiled",
    co_runner: CoRunner | None = None,
) -> Plan:
    """The fastest plan that fits, over meshes, per-op shardings and data-parallel flavours
    (beside ``co_runner``: the plan with the shortest co-located round, ``search.beside``).

    Args:
        search: ``"ilp"`` (CP-SAT), ``"mcmc"`` (simulator-scored), or ``"auto"`` (CP-SAT,
            then a short MCMC refinement).
        budget: the work each mesh may take and the wall-clock safety cap
            (``search.budget``); the default is effort 1. The same graph, cluster, seed
            and effort give the same plan on any machine unless the cap acts.
        on_progress: called with (what is being searched, fraction of the meshes done).
        routing: routing statistics of the MoE layers (uniform when None), from which the
            ``moe`` family (``search.moe_search``) chooses each layer's layout.
        tp_layouts: ``"auto"`` (SUMMA meshes beside the 1-D ones where they can matter),
            ``"summa"`` (SUMMA meshes only, linears in SUMMA layouts; no baselines,
            pipelines or data-parallel plans compete) or ``"1d"`` (``search.summa_meshes``).
        constraints: the user's fixed axis sizes, bounds and families
            (``planner.constraints``): meshes and families they rule out are never searched,
            and only plans they allow compete or appear as runners-up.
        moe_dispatch: ``"compiled"``, ``"deduplicated"`` or ``"overlapped"``: whether
            expert-parallel layers may use DeepEP's deduplicated all-to-all, and their
            all-to-alls run under another micro-batch's compute (``planner.api.plan``).
        co_runner: a job already on the devices (``cost_model.colocation.CoRunner``): the
            kept plans are re-ranked by their round co-located with it, among those that fit
            beside it, and the search summary says so.

    Raises:
        PlanningError: nothing fits on any mesh (the message says how much memory the
            smallest plan needs per device and how many devices it would take).
        ConstraintError: the constraints allow no plan on this cluster and batch.
    """
    if search not in SEARCHES:
        raise PlanningError(f"search must be one of {', '.join(SEARCHES)}, got '{search}'")
    budget = budget or SearchBudget()
    if tp_layouts not in TP_LAYOUTS:
        raise PlanningError(f"tp_layouts must be one of {', '.join(TP_LAYOUTS)}, got {str(tp_layouts)[:20]!r}")
    constraints = constraints or SearchConstraints()
    constraints.check_cluster(cluster)
    constraints.check_batch(graph.batch_size)
    context = SearchContext(
        graph=graph, cluster=cluster, spec=spec, model_name=model_name, search=search, budget=budget, seed=seed,
        warnings=warnings, precision=precision, constraints=constraints, routing=routing, tp_layouts=tp_layouts,
        moe_dispatch=moe_dispatch, meshes=_searched_meshes(graph, cluster, precision, tp_layouts, constraints), on_progress=on_progress,
    )
    if not context.summa_only:
        # A model whose samples mix (an MoE router's token counts) runs only as a program over
        # the whole batch: slices of it (DP wrappers, micro-batches) would compute another step.
        context.coupled = tuple(batch_coupled_ops(graph))
        context.moe_layouts = moe_family_allowed(graph, cluster, context.coupled)
        if context.coupled:
            context.warnings = (*warnings, coupling_warning(list(context.coupled), moe_layouts=context.moe_layouts))
        skipped = [block.module for block in graph.moe_blocks if not runs_by_layout(block)]
        if skipped:
            context.notes.append(
                f"MoE layers ({', '.join(skipped[:2])}{', ...' if len(skipped) > 2 else ''}) not planned by layout: "
                f"the compiled MoE runtime does not run their structure"
            )
    # Every family's candidates, in the registry's search order (each part asked once: the
    # data-parallel flavours share theirs, as tp and summa do).
    for reference in dict.fromkeys(family.candidates for family in with_part("candidates")):
        context.found += resolve(reference)(context)
    plans = context.found
    baselines: list[Plan] = []
    if not context.summa_only:
        if not context.whole_batch_only:
            # Gradient accumulation: what does not fit at once may fit one micro-batch at a time.
            plans += [variant for plan in plans if (variant := accumulating(plan, graph))]
        baselines = _baselines(graph, cluster, spec, model_name, precision, {p.name for p in plans},
                               whole_batch_only=context.whole_batch_only)
        if not context.whole_batch_only:
            baselines += [variant for plan in baselines if (variant := accumulating(plan, graph))]
    # The baselines compete too: a search that cannot beat Megatron's layout returns it.
    plans, baselines = _allowed(plans, constraints), _allowed(baselines, constraints)
    fitting = [plan for plan in (*plans, *baselines) if plan.estimate.fits]
    if not fitting:
        raise _nothing_fits(cluster, [*plans, *baselines], constraints)
    best = min(fitting, key=lambda plan: plan.estimate.step_time_s)
    beside = ""
    if co_runner is not None:
        best, beside = choose_beside(co_runner, fitting, graph)
    context.progress("done", 1.0)
    what = "SUMMA mesh(es) (--tp-layouts summa)" if context.summa_only else "mesh(es)"
    summary = _constraints_note(constraints)
    summary += f"{search} search (effort {budget.effort:g}) over {len(context.meshes)} {what}: " + "; ".join(
        [*context.notes, *([beside] if beside else [])])
    summary += _with_savings(best, graph)
    cut = budget.cut_warning()
    return dataclasses.replace(
        best,
        runners_up=runners_up(best, plans, baselines),
        # Every plan carries the model's warnings, but baselines built elsewhere (Megatron
        # pipelines) carry only their own: keep both, once each.
        warnings=tuple(dict.fromkeys((*context.warnings, *best.warnings, *((cut,) if cut else ())))),
        search_summary=summary,
        left_out=left_out_record(best, cluster, fitting),
    )


def _searched_meshes(graph: OpGraph, cluster: Cluster, precision: str, tp_layouts: str,
                     constraints: SearchConstraints) -> list[Mesh]:
    """The meshes searched op by op: the ``dp x tp`` meshes the constraints allow, then the
    SUMMA meshes (those alone with ``tp_layouts="summa"``)."""
    summa = [mesh for mesh in summa_meshes(graph, cluster, precision, tp_layouts) if constraints.allows_mesh(mesh)]
    if tp_layouts == "summa":
        if not summa:
            raise PlanningError(
                f"no 2-D/2.5-D/3-D tensor-parallel mesh fits {cluster.world_size} devices and a batch of "
                f"{graph.batch_size}: SUMMA needs q x q x d devices (q >= 2) with the batch divisible by the "
                f"devices its rows split over; use --tp-layouts auto, or a device count such as 4, 8 or 16"
            )
        return summa
    unconstrained = candidate_meshes(cluster, graph.batch_size)
    if not unconstrained and not summa:
        raise PlanningError(
            f"the global batch of {graph.batch_size} does not split over any data-parallel degree of the "
            f"{cluster.world_size} devices; use a batch that is a multiple of {cluster.world_size}"
        )
    return [mesh for mesh in unconstrained if constraints.allows_mesh(mesh)] + summa


def _with_savings(plan: Plan, graph: OpGraph) -> str:
    """The per-layer SUMMA vs 1-D comparison (``search.summa_savings``) as a last sentence."""
    text = savings_text(plan, graph)
    return f". {text}" if text else ""


def _allowed(plans: list[Plan], constraints: SearchConstraints) -> list[Plan]:
    """The plans ``constraints`` allow (all of them without constraints)."""
    return [plan for plan in plans if constraints.allows_plan(plan)] if constraints.any else plans


def _nothing_fits(cluster: Cluster, plans: list[Plan], constraints: SearchConstraints) -> PlanningError:
    """The error when no allowed plan fits: the constraints' own when they allowed none."""
    if not plans:
        return constraints.nothing_allowed()
    error = does_not_fit(cluster, {_key(plan): plan.estimate for plan in plans})
    if constraints.any:
        return PlanningError(f"{error} (searching only what {constraints.describe()} allows)")
    return error


def _constraints_note(constraints: SearchConstraints) -> str:
    """The search summary's first words when the user constrained the search."""
    return f"constrained by {constraints.describe()}; " if constraints.any else ""


def _key(plan: Plan) -> str:
    return f"{plan.name}{', recompute ' + plan.recompute if plan.recompute != 'none' else ''}"


def _baselines(graph, cluster, spec, model_name, precision, exclude: set[str], whole_batch_only: bool = False) -> list[Plan]:
    """The data-parallel flavours and Megatron for the comparison, when they build and are
    not among the searched plans already; with ``whole_batch_only`` (a model whose samples
    mix) only programs over the whole batch: no data-parallel wrappers, no pipelines."""
    built = []
    attempts = [
        lambda f=f: data_parallel_plan(graph, cluster, spec, model_name, f, (), precision)
        for f in DATA_PARALLEL_FLAVOURS
        if f"{f} ({Mesh((('dp', cluster.world_size),))})" not in exclude  # simulated above already
        and not whole_batch_only
    ]
    for attempt in attempts:
        try:
            plan = attempt()
        except PlanningError:
            continue
        if plan.name not in exclude:
            built.append(plan)
    for sequence_parallel in (False, True):
        megatron = megatron_baseline(graph, cluster, spec, model_name, precision, sequence_parallel=sequence_parallel)
        if megatron is not None and megatron.name not in exclude and not (whole_batch_only and megatron.pipeline):
            built += [megatron, *recomputing([megatron], graph), *composed_flavours(megatron, graph)]
    return built

