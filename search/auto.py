"""The outer search: meshes, per-op sharding (CP-SAT and/or MCMC), data-parallel flavour.

For every mesh shape that respects the topology (``dp x tp`` with the tensor-parallel axis
inside a node, innermost), the per-op strategies are chosen by CP-SAT (``search.ilp``) and/or
MCMC over the simulator (``search.mcmc``); on a 1-D ``dp`` mesh the data-parallel plans
(DDP, ZeRO-1, ZeRO-2, FSDP) compete too. Every result is simulated; the fastest plan that
fits in memory wins, and the others, with the data-parallel and Megatron baselines, are kept
as runners-up so the report can say why the winner won.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from cost_model.simulator import simulated
from planner.cluster import Cluster
from planner.constraints import SearchConstraints
from planner.errors import PlanningError
from planner.graph import OpGraph
from planner.model_spec import ModelSpec
from planner.plans import Plan
from planner.routing import RoutingStats

from planner.strategy import Mesh
from search.batch_coupling import batch_coupled_ops, coupling_warning
from search.blocks import block_representatives
from search.budget import SearchBudget
from search.cost_tables import build_cost_tables
from search.data_parallel import DATA_PARALLEL_FLAVOURS, accumulating, data_parallel_plan, does_not_fit
from search.ilp import solve
from search.layouts import batch_input_placements, combine
from search.mcmc import mcmc
from search.node_candidates import node_strategies
from search.moe_search import runs_by_layout, search_moe_plan
from search.megatron import megatron_baseline
from search.pipeline_search import PipelineSpace, pipeline_plans
from search.plan_builder import input_placements, unsimulated_plan
from search.runners_up import runners_up
from search.rules.summa import is_summa_mesh
from search.summa_hint import summa_hint
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
) -> Plan:
    """The fastest plan that fits, over meshes, per-op shardings and data-parallel flavours.

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
    summa = [mesh for mesh in summa_meshes(graph, cluster, precision, tp_layouts) if constraints.allows_mesh(mesh)]
    if tp_layouts == "summa":
        if not summa:
            raise PlanningError(
                f"no 2-D/2.5-D/3-D tensor-parallel mesh fits {cluster.world_size} devices and a batch of "
                f"{graph.batch_size}: SUMMA needs q x q x d devices (q >= 2) with the batch divisible by the "
                f"devices its rows split over; use --tp-layouts auto, or a device count such as 4, 8 or 16"
            )
        return _summa_only_plan(graph, cluster, spec, model_name, summa, search, budget, seed, warnings, precision,
                                constraints)
    unconstrained = candidate_meshes(cluster, graph.batch_size)
    meshes = [mesh for mesh in unconstrained if constraints.allows_mesh(mesh)] + summa
    if not unconstrained and not summa:
        raise PlanningError(
            f"the global batch of {graph.batch_size} does not split over any data-parallel degree of the "
            f"{cluster.world_size} devices; use a batch that is a multiple of {cluster.world_size}"
        )
    plans: list[Plan] = []
    notes: list[str] = []
    # A model whose samples mix (an MoE router's token counts) runs only as a program over
    # the whole batch: slices of it (DP wrappers, micro-batches) would compute another step.
    coupled = batch_coupled_ops(graph)
    moe_family = moe_family_allowed(graph, cluster, coupled)
    if coupled:
        warnings = (*warnings, coupling_warning(coupled, moe_layouts=moe_family))
    skipped = [block.module for block in graph.moe_blocks if not runs_by_layout(block)]
    if skipped:
        notes.append(f"MoE layers ({', '.join(skipped[:2])}{', ...' if len(skipped) > 2 else ''}) not planned by layout: "
                     f"the compiled MoE runtime does not run their structure")
    if moe_family and constraints.allows_family("moe"):
        if on_progress:
            on_progress("choosing the MoE layers' layouts", 0.0)
        searched, fixed = search_moe_plan(graph, cluster, spec, model_name, routing, warnings, precision)
        plans += [searched, *fixed]
    for position, mesh in enumerate(meshes):
        if on_progress:
            on_progress(f"searching mesh {mesh} ({position + 1}/{len(meshes)})", position / len(meshes))
        if mesh.names == ("dp",) and not coupled:
            flavours = [
                data_parallel_plan(graph, cluster, spec, model_name, f, warnings, precision)
                for f in DATA_PARALLEL_FLAVOURS if constraints.allows_family(f)
            ]
            plans += flavours + _recomputing(flavours, graph)
        # Each mesh gets an equal part of the wall clock the meshes before it left (the work
        # budgets are per mesh already): one slow mesh cannot leave the next with nothing.
        share = budget.share(len(meshes) - position)
        if mesh.names == ("dp",) and not constraints.allows_family("ddp"):
            continue  # weights stay whole on dp in searched plans: on dp alone that is DDP, left out
        plans += _searched_plan(graph, cluster, spec, model_name, mesh, search, share, seed, warnings, precision, notes)
    if not coupled:
        plans += _pipeline_plans(graph, cluster, spec, model_name, precision, budget, plans, constraints)
        # Gradient accumulation: what does not fit at once may fit one micro-batch at a time.
        plans += [variant for plan in plans if (variant := accumulating(plan, graph))]
    baselines = _baselines(graph, cluster, spec, model_name, precision, {p.name for p in plans}, whole_batch_only=bool(coupled))
    if not coupled:
        baselines += [variant for plan in baselines if (variant := accumulating(plan, graph))]
    # The baselines compete too: a search that cannot beat Megatron's layout returns it.
    plans, baselines = _allowed(plans, constraints), _allowed(baselines, constraints)
    fitting = [plan for plan in (*plans, *baselines) if plan.estimate.fits]
    if not fitting:
        raise _nothing_fits(cluster, [*plans, *baselines], constraints)
    best = min(fitting, key=lambda plan: plan.estimate.step_time_s)
    if on_progress:
        on_progress("done", 1.0)
    summary = _constraints_note(constraints)
    summary += f"{search} search (effort {budget.effort:g}) over {len(meshes)} mesh(es): " + "; ".join(notes)
    summary += _with_savings(best, graph)
    cut = budget.cut_warning()
    return dataclasses.replace(
        best,
        runners_up=runners_up(best, plans, baselines),
        # Every plan carries the model's warnings, but baselines built elsewhere (Megatron
        # pipelines) carry only their own: keep both, once each.
        warnings=tuple(dict.fromkeys((*warnings, *best.warnings, *((cut,) if cut else ())))),
        search_summary=summary,
    )


def plan_on_mesh(graph: OpGraph, cluster: Cluster, mesh: Mesh, *, tp_layouts: str = "auto", search: str = "ilp",
                 precision: str = "bf16", effort: float = 1.0, model_name: str = "model", spec: ModelSpec | None = None) -> Plan:
    """The searched plan of one given mesh, simulated (for studies and benchmarks that
    compare layouts on meshes the outer search might not pick, e.g. 1-D over 64 devices).

    Args:
        mesh: any mesh over the cluster's devices (SUMMA axes included).
        tp_layouts: as in ``search_plan`` (``"summa"``: linears in SUMMA layouts only).
        search: ``"ilp"``, ``"mcmc"`` or ``"auto"``.
    """
    if tp_layouts not in TP_LAYOUTS:
        raise PlanningError(f"tp_layouts must be one of {', '.join(TP_LAYOUTS)}, got {str(tp_layouts)[:20]!r}")
    plans = _searched_plan(graph, cluster, spec, model_name, mesh, search, SearchBudget(effort=effort), 0, (), precision, [],
                           tp_layouts=tp_layouts)
    return plans[0]


def _summa_only_plan(graph, cluster, spec, model_name, meshes, search, budget: SearchBudget, seed, warnings, precision,
                     constraints: SearchConstraints) -> Plan:
    """``tp_layouts="summa"``: the fastest fitting plan over the SUMMA meshes alone (the
    fastest of all when none fits, so the report can say by how much)."""
    plans, notes = [], []
    for position, mesh in enumerate(meshes):
        share = budget.share(len(meshes) - position)
        plans += _searched_plan(graph, cluster, spec, model_name, mesh, search, share, seed, warnings, precision, notes,
                                tp_layouts="summa")
    plans = _allowed(plans, constraints)
    fitting = [plan for plan in plans if plan.estimate.fits]
    if not fitting:
        raise _nothing_fits(cluster, plans, constraints)
    best = min(fitting, key=lambda plan: plan.estimate.step_time_s)
    summary = _constraints_note(constraints) + f"{search} search (effort {budget.effort:g}) over {len(meshes)} SUMMA mesh(es) (--tp-layouts summa): " + "; ".join(notes)
    summary += _with_savings(best, graph)
    cut = budget.cut_warning()
    return dataclasses.replace(
        best, runners_up=runners_up(best, plans, []),
        warnings=tuple(dict.fromkeys((*warnings, *best.warnings, *((cut,) if cut else ())))), search_summary=summary,
    )


def _searched_plan(graph, cluster, spec, model_name, mesh, search, budget: SearchBudget, seed, warnings, precision, notes,
                   tp_layouts: str = "auto") -> list[Plan]:
    """The searched plan of one mesh (and its recomputing variant). CP-SAT starts from a
    layout built directly (Megatron's with tp, data parallelism without, SUMMA's on a SUMMA
    mesh) and falls back to it, so every mesh gets a plan; the simulator then says whether
    it fits."""
    representative = block_representatives(graph)
    strategies_of = node_strategies(graph, mesh, only=set(representative.values()), tp_layouts=tp_layouts)
    seed_strategies, inputs = combine(graph, mesh, {"dp": _dp_axis(graph)} if "dp" in mesh.names else {})
    skeleton = unsimulated_plan(graph, cluster, spec, model_name, mesh, seed_strategies, inputs, precision=precision, warnings=warnings)
    tables = build_cost_tables(skeleton, graph, strategies_of, representative)
    hint = _hint(graph, mesh, tables)
    choice, how = dict(hint), []
    if search in ("auto", "ilp"):
        result = _solve_fitting(tables, cluster, hint, budget)
        if result is None:
            how.append("no sharding fits without recomputation")
            result = solve(tables, memory_bytes=None, work=budget.ilp_work(), wall_clock_cap_s=budget.seconds_left(), hint=hint)
        if result.cut_by_wall_clock:
            budget.note_cut(f"CP-SAT on mesh {mesh}")
        choice = result.choice
        if result.from_hint:
            gap = "" if result.bound_s <= 0 else f", gap {result.gap:.1%}"
            how.append(f"CP-SAT found nothing better than the layout it started from{gap}")
        else:
            how.append(f"CP-SAT {'optimal' if result.optimal else f'gap {result.gap:.1%}'}")
    if search in ("auto", "mcmc"):
        refine = mcmc(
            skeleton, tables, start=choice, seed=seed, iterations=budget.mcmc_proposals(len(graph.nodes)),
            wall_clock_cap_s=budget.seconds_left(),
            patience=500 if search == "auto" else None,  # refining a CP-SAT solution: a short walk
        )
        if refine.cut_by_wall_clock:
            budget.note_cut(f"MCMC on mesh {mesh}")
        choice = refine.choice
        how.append(f"MCMC {refine.iterations} proposals")
    def plan_of(chosen: dict[str, int]) -> Plan:
        strategies = tuple(tables.candidates[node.name][chosen[node.name]].strategy for node in graph.nodes)
        laid_out = dataclasses.replace(skeleton, strategies=strategies, inputs=input_placements(graph, mesh, strategies), label="soap")
        return simulated(laid_out, graph)

    plan = plan_of(choice)
    if hint and choice != hint:
        # CP-SAT's objective is a sum of per-op costs; the simulator overlaps and schedules.
        # Where they disagree, the layout the search started from may simulate faster: keep it.
        start = plan_of(hint)
        if (not start.estimate.fits, start.estimate.step_time_s) < (not plan.estimate.fits, plan.estimate.step_time_s):
            plan = start
            how.append("the starting layout simulates faster: kept")
    notes.append(f"mesh {mesh}: {', '.join(how)}")
    return [plan, *_recomputing([plan], graph), *composed_flavours(plan, graph)]


def _with_savings(plan: Plan, graph: OpGraph) -> str:
    """The per-layer SUMMA vs 1-D comparison (``search.summa_savings``) as a last sentence."""
    text = savings_text(plan, graph)
    return f". {text}" if text else ""


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
    return [zero2, *_recomputing([zero2], graph), simulated(dataclasses.replace(plan, dp_flavour="fsdp", recompute="full"), graph)]


def _solve_fitting(tables, cluster: Cluster, hint, budget: SearchBudget):
    """CP-SAT with the memory constraint, or None when no sharding fits without recomputation."""
    # Memory is a sum of independent per-node choices: when even the smallest candidate of
    # every node overflows the device, no solve is needed to know nothing fits.
    if sum(min(c.memory_bytes for c in options) for options in tables.candidates.values()) > cluster.min_device_memory:
        return None
    try:
        return solve(
            tables, memory_bytes=cluster.min_device_memory, work=budget.ilp_work(),
            wall_clock_cap_s=budget.seconds_left(), hint=hint,
        )
    except PlanningError:
        return None


def _recomputing(plans: list[Plan], graph: OpGraph) -> list[Plan]:
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


def _hint(graph: OpGraph, mesh: Mesh, tables) -> dict[str, int]:
    """A starting solution for CP-SAT: the Megatron layout when the mesh has tp, the SUMMA
    block layout on a SUMMA mesh (``search.summa_hint``), else data parallelism, mapped onto
    each node's candidates (all-replicate where it has no match)."""
    from search.layouts import megatron_layout

    if is_summa_mesh(mesh):
        return summa_hint(graph, tables.candidates)

    try:
        layout, _ = megatron_layout(graph, mesh) if "tp" in mesh.names else combine(graph, mesh, {"dp": _dp_axis(graph)})
    except PlanningError:
        return {}
    wanted = {s.node: (s.inputs, s.outputs, tuple(s.params.values())) for s in layout}
    hint = {}
    for name, options in tables.candidates.items():
        key = wanted.get(name)
        hint[name] = next(
            (i for i, c in enumerate(options) if (c.strategy.inputs, c.strategy.outputs, tuple(c.strategy.params.values())) == key),
            0,
        )
    return hint


def moe_family_allowed(graph: OpGraph, cluster: Cluster, coupled) -> bool:
    """Whether the ``moe`` family (data parallelism, MoE layers by layout) may plan
    ``graph``: it has MoE layers, the batch splits over every device, and every op at which
    the samples mix lies inside an MoE layer (whose runtime reproduces the whole batch's routing),
    and the MoE runtime can run every MoE layer (``runs_by_layout``)."""
    if not graph.moe_blocks or graph.batch_size % cluster.world_size:
        return False
    if not all(runs_by_layout(block) for block in graph.moe_blocks):
        return False  # compiled programs could not run the layouts (search.moe_search.runs_by_layout)
    inside = {node.name for block in graph.moe_blocks for node in graph.moe_nodes(block.module)}
    return all(op.node in inside for op in coupled)


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


def _pipeline_plans(graph, cluster, spec, model_name, precision, budget: SearchBudget, others: list[Plan],
                    constraints: SearchConstraints) -> list[Plan]:
    """The best plans of the pipeline grid (``search.pipeline_search``: pp x dp x tp meshes,
    micro-batches, schedules, dp flavours, recomputation, stages sliced by dynamic
    programming), simulated; they compete with ``others``. On one node the grid is searched
    only when no other plan fits without recomputation: small single-node models keep the
    plans (and compiled programs) they had while pipelines compile for only some dp
    flavours and schedules (``codegen.pipeline_emit.unsupported``)."""
    if cluster.num_nodes < 2 and any(p.estimate.fits and p.recompute == "none" for p in others):
        return []
    space = PipelineSpace(
        flavours=tuple(f for f in PipelineSpace.flavours if constraints.allows_family(f)) or PipelineSpace.flavours,
        allows_mesh=constraints.allows_mesh if constraints.any else None,
    )
    return pipeline_plans(graph, cluster, spec, model_name, precision, budget, space)


def _dp_axis(graph: OpGraph):
    from search.propagation import propagate

    return propagate(graph, batch_input_placements(graph), {})


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
            built += [megatron, *_recomputing([megatron], graph), *composed_flavours(megatron, graph)]
    return built

