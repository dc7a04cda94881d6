"""How each Mixture-of-Experts layer runs: the ``moe`` plan family.

The plan: every device a data-parallel rank (mesh ``dp=world``; the dense ops laid out as
``search.data_parallel`` lays them out, in DDP, ZeRO-2 or FSDP: ``DENSE_FLAVOURS``), and each MoE layer with its own ``ExpertLayout``
chosen from its routing statistics among:

- ``data_parallel``: every device holds every expert and runs its own tokens;
- ``expert_sliced``: every expert's FFN sliced over the devices (when they divide it);
- ``expert_parallel``: experts spread over the devices, tokens moved by all-to-all, with
  the placements of ``search.expert_placement`` from the layer's loads: round-robin (when
  the experts divide evenly), EPLB's and ours (``balanced``), with one slot per device more
  than the experts need as well (room for copies of hot experts); each with a ``flat``
  all-to-all, and a ``hierarchical`` one when the devices span nodes (and DeepEP's
  ``deduplicated`` one there when the search is told the trainer runs it: ``moe_dispatch``);
- ``expert_parallel`` with sharded copies (expert data parallelism,
  ``ExpertLayout.sharded_copies``): every grid placement (``ExpertPlacement.copied_grid``:
  ``s`` experts per device, each expert on ``r >= 2`` consecutive devices, for every ``s``
  that divides the experts into groups that divide the devices), each expert's weights,
  gradients and optimizer states sharded over its ``r`` copies: what lets a model whose
  experts do not fit whole on their copies (Mixtral-8x7B on 32 GPUs) run expert parallel.

On a ``dp`` mesh each layer's time is nearly its own: expert compute, collectives and
gradient reduction (``layer_score``), and the step's MoE time about their sum, so the search
starts from each layer's fastest layout. Two things are properties of the whole plan and
are settled by simulating it: memory (while the plan does not fit, layers move to smaller
layouts, the least time per byte saved first), and overlap (DDP reduces the gradients of
replicated experts while backward goes on, which a per-layer sum cannot see). Layers of
one shape with the same loads form a class and get one layout. When the classes' candidates
combine into at most ``ENUMERATION_LIMIT`` plans, every combination is simulated and the
fastest that fits wins (exact over class-wide choices); otherwise coordinate descent tries
every candidate of each class in turn, keeping a change when the simulated plan fits and is
faster, for at most ``REFINE_SWEEPS`` sweeps. Either way the work is a fixed number of
simulations, the same on any machine. Three things keep each cheap without changing what
is found: a candidate differs from the plan simulated before it only in its layouts, so
only its MoE layers' ops are costed again (``cost_model.simulator``'s delta on layouts); a
candidate whose step lower bound (``Simulator.step_lower_bound``, its busiest compute
stream) cannot beat the best fitting plan is not scheduled (``PRUNE``); and candidates are
compared by their estimates, only the plans returned annotated for the report.

When the whole batch's activations do not fit, the plan accumulates gradients over
micro-batches (``accumulation_counts``), as every MoE trainer runs large batches: each
micro-batch is routed on its own (its capacity, drops and balance loss; the compiled
program's ``codegen.runtime.moe.route`` routes whatever one forward holds), the layers are
scored per micro-batch (``layer_score``) and the simulator prices each micro-batch's expert
compute and all-to-alls and holds one micro-batch's activations and dispatch buffers.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from cost_model.collectives import collective_time
from cost_model.moe import element_bytes
from cost_model.moe_layers import (
    copy_shard_costs,
    dispatch_buffer_bytes,
    layer_tokens,
    param_share,
    price_layout,
    replica_sync_time,
    routing_sync_time,
)
from cost_model.parameter_bytes import bytes_per_parameter
from cost_model.simulator import Simulator, estimated, simulated
from planner.cluster import Cluster
from planner.errors import PlanningError
from planner.graph import OpGraph
from planner.model_spec import ModelSpec
from planner.moe_blocks import HF_STACKED_EXPERTS, ROUTED_GELU, MoEBlock
from planner.plans import Plan
from planner.routing import RoutingStats
from planner.strategy import EXPERT_MODES, KEEP_A2A, ExpertLayout, ExpertPlacement, Mesh
from search.context import SearchContext
from search.expert_placement import SEARCH_EVALUATIONS_PER_EXPERT, balanced, eplb
from search.data_parallel import FSDP_UNIT_FLAVOURS, fsdp_units
from search.layouts import data_parallel_layout
from search.plan_builder import unsimulated_plan

MOE_LABEL = "moe"
REFINE_SWEEPS = 2  # sweeps over the classes of identical layers, each candidate simulated
ENUMERATION_LIMIT = 128  # combinations of class layouts simulated exhaustively, at most
# Candidates whose step lower bound (cost_model.simulator.Simulator.step_lower_bound) cannot
# beat the best fitting plan found are not scheduled: the same plan, less work (a switch so
# tests can compare the pruned search with the unpruned one).
PRUNE = True
# How the dense part around the MoE layers may be data parallel: the flavours compiled MoE
# programs wrap it in (DDP, or FSDP2 units with or without resharding after forward); the
# experts a rank holds alone stay out of them.
DENSE_FLAVOURS = ("ddp", "zero2", "fsdp")
# Placements our balanced placement may evaluate per call, at most (each solves a small LP):
# what keeps a layer of 256 experts on 256 GPUs to seconds.
PLACEMENT_EVALUATIONS = 256


@dataclass(frozen=True)
class ScoredLayout:
    """A candidate layout of one layer with its time per step (``layer_score``) and the
    bytes it puts on the fullest device (expert states, kept activations, dispatch buffers)."""

    layout: ExpertLayout
    time_s: float
    memory_bytes: float


def runs_by_layout(block: MoEBlock) -> bool:
    """Whether compiled programs can run ``block`` by an ``ExpertLayout``: a routed GELU
    layer (``examples/moe.py``'s structure) in every mode, HuggingFace's stacked SwiGLU
    experts expert-parallel or replicated (``codegen.moe_emit``)."""
    return block.runtime in (ROUTED_GELU, HF_STACKED_EXPERTS)


def modes_compiled_for(block: MoEBlock) -> tuple[str, ...]:
    """The layout modes a compiled program runs ``block`` in: HuggingFace's blocks keep
    their own router and swap only the experts, which the expert-sliced mode would slice
    inside the routing (not written)."""
    if block.runtime == HF_STACKED_EXPERTS:
        return ("data_parallel", "expert_parallel")
    return EXPERT_MODES


def routing_label(routing: RoutingStats, module: str) -> str:
    """What a layout records as its routing source: the statistics' source, or ``uniform``
    for a layer they do not cover."""
    if module in routing.layers:
        return routing.source
    return "uniform" if not routing.layers else f"uniform (not in: {routing.source})"[:200]


def layer_candidates(block: MoEBlock, loads: tuple[float, ...], source: str, cluster: Cluster,
                     tokens: int, precision: str, sharded_copies: bool = False,
                     moe_dispatch: str = "compiled") -> list[ExpertLayout]:
    """Every layout the search considers for ``block`` on all of ``cluster``'s devices (see
    the module docstring), in a fixed order; the grid placements with sharded copies only
    when ``sharded_copies``; the deduplicated all-to-all only with ``moe_dispatch``
    ``"deduplicated"`` or ``"overlapped"``."""
    world = cluster.world_size
    common = dict(module=block.module, experts=block.experts, top_k=block.top_k,
                  capacity_factor=block.capacity_factor, axis="dp", routing=source, expert_loads=loads)
    layouts = [ExpertLayout(mode="data_parallel", **common)]
    if world == 1:
        return layouts
    if block.ffn % world == 0 and "expert_sliced" in modes_compiled_for(block):
        layouts.append(ExpertLayout(mode="expert_sliced", **common))
    for placement in expert_placements(block, loads, cluster, tokens, precision):
        for algorithm in _all_to_alls(block, cluster, moe_dispatch):
            layouts.append(ExpertLayout(mode="expert_parallel", all_to_all=algorithm, placement=placement, **common))
    return layouts + (copied_grid_candidates(block, loads, source, cluster, moe_dispatch) if sharded_copies else [])


def copied_grid_candidates(block: MoEBlock, loads: tuple[float, ...], source: str, cluster: Cluster,
                           moe_dispatch: str = "compiled") -> list[ExpertLayout]:
    """The layouts ``layer_candidates`` adds with ``sharded_copies``: every grid placement
    (``grid_placements``) with each expert sharded over its copies, with each all-to-all."""
    common = dict(module=block.module, experts=block.experts, top_k=block.top_k,
                  capacity_factor=block.capacity_factor, axis="dp", routing=source, expert_loads=loads)
    return [ExpertLayout(mode="expert_parallel", all_to_all=algorithm, placement=placement, sharded_copies=True,
                         **common)
            for placement in grid_placements(block.experts, cluster.world_size)
            for algorithm in _all_to_alls(block, cluster, moe_dispatch)]


def _all_to_alls(block: MoEBlock, cluster: Cluster, moe_dispatch: str) -> list[str]:
    """The all-to-alls an expert-parallel layout of ``block`` is tried with: flat; across
    nodes the two-level one too (written for the routed GELU runtime,
    ``codegen.runtime.moe_exchange``), and DeepEP's deduplicated one with ``moe_dispatch``
    ``"deduplicated"`` or ``"overlapped"`` (priced only: no runtime to match)."""
    algorithms = ["flat"] + (["hierarchical"] if _spans_nodes(cluster) and block.runtime == ROUTED_GELU else [])
    if moe_dispatch in ("deduplicated", "overlapped") and _spans_nodes(cluster):
        algorithms.append("deduplicated")
    return algorithms


def grid_placements(experts: int, world: int) -> list[ExpertPlacement]:
    """``ExpertPlacement.copied_grid`` for every number of experts per device that splits
    the experts into groups dividing ``world`` with at least 2 copies each, fewest experts
    per device first."""
    return [ExpertPlacement.copied_grid(experts, world, per_device) for per_device in range(1, experts + 1)
            if experts % per_device == 0 and world % (experts // per_device) == 0 and world * per_device // experts >= 2]


def expert_placements(block: MoEBlock, loads: tuple[float, ...], cluster: Cluster, tokens: int,
                      precision: str) -> list[ExpertPlacement]:
    """Round-robin (when the experts divide over the devices), EPLB and ours with the fewest
    slots per device that hold every expert, and with one slot more (copies of hot experts),
    from the routed shares and, with a capacity, from the padded work too; identical
    placements once. Ours minimises the layer's simulated time with a flat all-to-all."""
    world = cluster.world_size
    per_node = cluster.devices_per_node if cluster.is_homogeneous else None
    placements = []
    if block.experts % world == 0:
        placements.append(ExpertPlacement.round_robin(block.experts, world))
    fewest = math.ceil(block.experts / world)

    def layer_time(placement: ExpertPlacement) -> float:
        layout = ExpertLayout(block.module, "expert_parallel", block.experts, block.top_k, block.capacity_factor,
                              placement=placement, expert_loads=loads)
        return price_layout(block, layout, tokens, cluster, precision).total_s

    # With a capacity every expert computes a buffer padded to the capacity, whatever its
    # share: placing by the padded work (even) competes with placing by the routed shares.
    sources = [loads] + ([tuple(1.0 / block.experts for _ in loads)] if block.capacity_factor else [])
    # Group-limited routing (DeepSeek-V3) limits the nodes a token reaches only when its groups
    # lie on nodes: EPLB's hierarchical policy packs whole groups onto nodes.
    groups = block.routing_groups[0] if block.routing_groups else None
    for slots in (fewest, fewest + 1):
        for work in sources:
            placements.append(eplb(work, world, slots, per_node, groups))
            placements.append(balanced(work, world, slots, cost=layer_time, devices_per_node=per_node, groups=groups,
                                       evaluations=min(PLACEMENT_EVALUATIONS, SEARCH_EVALUATIONS_PER_EXPERT * block.experts)))
    unique: dict[tuple, ExpertPlacement] = {}
    for placement in placements:
        unique.setdefault(placement.replicas, placement)
    return list(unique.values())


def layer_score(block: MoEBlock, layout: ExpertLayout, tokens: int, cluster: Cluster, precision: str,
                micro_batches: int = 1) -> ScoredLayout:
    """One layer's time per step under ``layout`` (expert compute and collectives, copied
    experts' gradient sums, and in ``data_parallel`` mode the all-reduce of the expert
    gradients, counted whole: DDP overlaps it with backward only as far as backward lasts;
    with sharded copies their two gathers and reduce-scatter, counted whole likewise: the
    simulated plan overlaps them) and its bytes on the fullest device (with sharded copies,
    the gathered weights of the layer running and of the one prefetched). With
    ``micro_batches`` (gradient accumulation) the layer routes, moves and computes each
    micro-batch's tokens in turn (``price_layout`` of one, times their count; the weights
    gathered and, with sharded copies, their gradients reduce-scattered for each) and keeps
    one micro-batch's activations and buffers; other gradients are reduced once per step."""
    cost = price_layout(block, layout, tokens, cluster, precision, micro_batches)
    world = cluster.world_size
    fraction, synced = param_share(layout, world)
    held = block.expert_parameters * fraction
    gradient_sync = collective_time(
        "all_reduce", held * bytes_per_parameter(precision)[1], cluster, list(range(world))
    ) if synced and world > 1 else 0.0
    sharding = copy_shard_costs(block, layout, cluster, precision)
    # Sharded copies are reduce-scattered after every micro-batch's backward (FSDP2 has no no_sync).
    per_micro_batch = cost.total_s + routing_sync_time(block, cluster) + 2 * sharding.gather_s + sharding.reduce_s
    time_s = micro_batches * per_micro_batch + replica_sync_time(block, layout, cluster, precision) + gradient_sync
    element = element_bytes(precision)
    activations = cost.busiest_copies * element * (block.hidden + 2 * (block.matmuls - 1) * block.ffn)
    buffers = dispatch_buffer_bytes(block, layout, cost, tokens // micro_batches, world, precision)
    memory = held * sum(bytes_per_parameter(precision)) + activations + buffers + 2 * sharding.gathered_bytes
    return ScoredLayout(layout, time_s, memory)


def choose_layouts(
    graph: OpGraph, cluster: Cluster, routing: RoutingStats, precision: str, sharded_copies: bool = False,
    moe_dispatch: str = "compiled", micro_batches: int = 1, candidates: dict[tuple, list[ExpertLayout]] | None = None,
) -> dict[str, list[ScoredLayout]]:
    """Each MoE layer's candidates scored, fastest first (ties: fewer bytes, then the
    candidate order); layers of equal shape and loads share one scoring. ``sharded_copies``:
    the grid placements with each expert sharded over its copies are candidates too.
    ``micro_batches``: scored for a step that accumulates over that many (``layer_score``).
    ``candidates``: layouts already made for a layer class, kept across calls (placing the
    experts is the costly part, and does not depend on the micro-batches)."""
    candidates = {} if candidates is None else candidates
    scored: dict[str, list[ScoredLayout]] = {}
    shared: dict[tuple, list[ScoredLayout]] = {}
    for block in graph.moe_blocks:
        statistics = routing.layer(block.module, block.experts, block.top_k)
        loads = tuple(statistics.token_share)
        source = routing_label(routing, block.module)
        tokens = layer_tokens(graph, block)
        key = (block.experts, block.top_k, block.capacity_factor, block.hidden, block.ffn, block.matmuls, tokens,
               loads, source)
        if key not in shared:
            made, plain = (*key, sharded_copies, moe_dispatch), (*key, False, moe_dispatch)
            if plain not in candidates:  # placing the experts is the costly part: done once per class
                candidates[plain] = layer_candidates(block, loads, source, cluster, tokens, precision, False,
                                                     moe_dispatch)
            if made not in candidates:
                candidates[made] = candidates[plain] + copied_grid_candidates(block, loads, source, cluster,
                                                                              moe_dispatch)
            options = [layer_score(block, layout, tokens, cluster, precision, micro_batches)
                       for layout in candidates[made]]
            order = sorted(range(len(options)), key=lambda i: (options[i].time_s, options[i].memory_bytes, i))
            shared[key] = [options[i] for i in order]
        scored[block.module] = [
            dataclasses.replace(option, layout=dataclasses.replace(option.layout, module=block.module))
            for option in shared[key]
        ]
    return scored


def moe_plan(graph: OpGraph, cluster: Cluster, spec: ModelSpec | None, model_name: str,
             layouts: Mapping[str, ExpertLayout], warnings: tuple[str, ...] = (), precision: str = "fp32",
             base: Plan | None = None, annotate: bool = True) -> Plan:
    """The simulated ``moe`` plan with ``layouts`` (one per MoE layer of ``graph``): DDP
    over all devices for the dense ops (``base``, from ``moe_base_plan``, when given).
    ``annotate=False``: its estimate only (``cost_model.simulator.estimated``), for plans a
    search compares and may throw away."""
    base = base or moe_base_plan(graph, cluster, spec, model_name, warnings, precision)
    plan = dataclasses.replace(base, expert_layouts=tuple(layouts[b.module] for b in graph.moe_blocks))
    return simulated(plan, graph) if annotate else estimated(plan, graph)


def moe_base_plan(graph: OpGraph, cluster: Cluster, spec: ModelSpec | None, model_name: str,
                  warnings: tuple[str, ...] = (), precision: str = "fp32") -> Plan:
    """The ``moe`` plan's dense part, not simulated and without layouts: the strategies of
    ``search.data_parallel``'s DDP plan on ``dp=world``.

    Raises:
        PlanningError: the batch does not split over the devices.
    """
    world = cluster.world_size
    if graph.batch_size % world:
        raise PlanningError(
            f"the global batch of {graph.batch_size} is not divisible by the {world} devices; use a global batch "
            f"that is a multiple of {world}"
        )
    mesh = Mesh((("dp", world),))
    strategies, inputs = data_parallel_layout(graph, mesh)
    return unsimulated_plan(graph, cluster, spec, model_name, mesh, strategies, inputs, dp_flavour="ddp",
                            precision=precision, warnings=warnings, label=MOE_LABEL)


def search_moe_plan(graph: OpGraph, cluster: Cluster, spec: ModelSpec | None, model_name: str,
                    routing: RoutingStats | None = None, warnings: tuple[str, ...] = (),
                    precision: str = "fp32", moe_dispatch: str = "compiled") -> tuple[Plan, list[Plan]]:
    """The searched ``moe`` plan (see the module docstring) and the plans that run every
    layer in one fixed way (data parallel; expert-sliced; expert parallel, round-robin, flat
    all-to-all), which compete with it and explain it. The dense part is tried with each
    of ``DENSE_FLAVOURS`` (the fixed plans take the winner's). When no plan fits holding the
    whole batch's activations, the search runs again with gradient accumulation over the
    fewest micro-batches that fit (``accumulation_counts``; each micro-batch routed on its
    own, as MoE trainers route them), and again with every repeated block recomputed in
    backward, first keeping the MoE layers' exchanges (``full_keep_a2a``), then repeating
    them (``full``), also accumulating when that alone does not fit; the fastest plan that
    fits wins. When the best plan found does not fit, or with some dense flavour the layers'
    fastest layouts together did not fit (memory chose for them), all of this runs again with
    the layouts that shard each expert over its copies among the candidates, and the better of
    the two searches wins (so a model whose fastest layouts fit with every flavour is planned
    as before, at the same cost).

    ``moe_dispatch``: as ``layer_candidates`` takes it.

    Raises:
        PlanningError: the model has no MoE layer, or the batch does not split over the devices.
    """
    if not graph.moe_blocks:
        raise PlanningError("the model has no Mixture-of-Experts layer this planner recognises (planner.moe_blocks)")
    routing = routing or RoutingStats()
    base = moe_base_plan(graph, cluster, spec, model_name, warnings, precision)  # before any scoring: batch checked
    flavours = DENSE_FLAVOURS if cluster.world_size > 1 else ("ddp",)
    candidates: dict[tuple, list[ExpertLayout]] = {}  # each layer class's layouts, made once
    best = None
    for sharded_copies in (False, True):
        if sharded_copies and not any(grid_placements(b.experts, cluster.world_size) for b in graph.moe_blocks):
            break  # no layer's experts form a grid over the devices
        found_best, memory_bound = None, False
        # Blocks recomputed in backward, and micro-batches, only when nothing fits without;
        # keeping the MoE layers' exchanges (KEEP_A2A) before repeating them too ("full").
        for recompute in ("none", KEEP_A2A, "full") if graph.blocks else ("none",):
            counts, steps = accumulation_counts(graph, cluster), 1
            while steps:
                scored = choose_layouts(graph, cluster, routing, precision, sharded_copies, moe_dispatch, steps,
                                        candidates)
                at_steps, tried = None, []
                for flavour in flavours:
                    dense = dataclasses.replace(
                        base, dp_flavour=flavour, recompute=recompute, accumulation_steps=steps,
                        fsdp_units=fsdp_units(graph) if flavour in FSDP_UNIT_FLAVOURS else (),
                    )
                    found = _search_with(graph, cluster, spec, model_name, scored, warnings, precision, dense)
                    memory_bound = memory_bound or found[2]
                    # Judged with each layer's smallest layout: the plan found may hold the
                    # fastest ones when nothing fits (the activations decided that).
                    tried.append(found[0] if found[0].estimate.fits else found[1](_smallest(scored)))
                    if at_steps is None or _rank(found[0]) < _rank(at_steps[0]):
                        at_steps = (*found, scored)
                if found_best is None or _rank(at_steps[0]) < _rank(found_best[0]):
                    found_best = at_steps
                if at_steps[0].estimate.fits:
                    break
                wanted = _micro_batches_wanted(tried)  # None: more micro-batches help no flavour
                steps = next((c for c in counts if wanted and c >= max(2 * steps, wanted)), 0)
            if found_best[0].estimate.fits and found_best[0].accumulation_steps == 1:
                break
        if best is None or _rank(found_best[0]) < _rank(best[0]):
            best = found_best
        if found_best[0].estimate.fits and not memory_bound:
            break
    plan, build, _, scored = best
    if moe_dispatch == "overlapped":
        plan = with_overlap_if_faster(plan, graph)
    fixed = [build(picks) for picks in _fixed_modes(scored)]
    # Only the plans kept are annotated for the report (the search compared estimates).
    return simulated(plan, graph), [simulated(other, graph) for other in fixed
                                    if other.expert_layouts != plan.expert_layouts]


def with_overlap_if_faster(plan: Plan, graph: OpGraph) -> Plan:
    """``plan`` with its expert-parallel layers' all-to-alls under another micro-batch's
    compute (``Plan.moe_a2a_overlap``) when that simulates faster and still fits (it holds one
    more micro-batch's activations), else ``plan``. Nothing to overlap without an
    expert-parallel layer or with one micro-batch."""
    micro_batches = plan.pipeline.micro_batches if plan.pipeline else plan.accumulation_steps
    if micro_batches < 2 or not any(layout.mode == "expert_parallel" for layout in plan.expert_layouts):
        return plan
    overlapped = simulated(dataclasses.replace(plan, moe_a2a_overlap=True), graph)
    return overlapped if _rank(overlapped) < _rank(plan) else plan


def accumulation_counts(graph: OpGraph, cluster: Cluster) -> list[int]:
    """The micro-batch counts an ``moe`` plan may accumulate over, fewest first: 1 (none),
    then 2, 4, 8, ... of those dividing each rank's part of the batch (as
    ``search.data_parallel.accumulating`` tries them: fewer keep the matmuls larger)."""
    local = graph.batch_size // cluster.world_size
    counts, steps = [1], 2
    while steps <= local:
        if local % steps == 0:
            counts.append(steps)
        steps *= 2
    return counts


def _smallest(scored: Mapping[str, list[ScoredLayout]]) -> dict[str, int]:
    """Each layer's candidate with the fewest bytes on the fullest device."""
    return {module: min(range(len(options)), key=lambda i: (options[i].memory_bytes, i))
            for module, options in scored.items()}


def _micro_batches_wanted(plans: list[Plan]) -> float | None:
    """The fewest micro-batches that could make one of ``plans`` (one step's plans that do
    not fit, one per dense flavour) fit, if its activations shrink with the micro-batch and
    nothing else does: the search skips the counts below it (each costs a search per flavour).
    None when weights, gradients, optimizer states and buffers alone overflow every plan's
    device: no count can help."""
    wanted = []
    for plan in plans:
        memory = plan.estimate.memory
        room = plan.estimate.device_memory_bytes - (memory.total - memory.activations)
        if room > 0:
            wanted.append(plan.accumulation_steps * memory.activations / room)
    return min(wanted, default=None)


def _search_with(graph, cluster, spec, model_name, scored, warnings, precision, base: Plan):
    """The best plan over ``scored``'s layouts with ``base``'s dense part and recomputation
    (see the module docstring), the function that builds a plan from a choice, and whether
    memory bound the choice (the layers' fastest layouts together did not fit)."""
    choice = {module: 0 for module in scored}

    def build(picks: Mapping[str, int], beat: float | None = None) -> Plan | None:
        """The plan of ``picks``, estimated; None when ``beat`` (seconds) is given and the
        plan's step lower bound (``Simulator.step_lower_bound``) is no faster: it could not
        beat a fitting plan of that step, so it is not scheduled (``PRUNE``)."""
        layouts = {m: scored[m][i].layout for m, i in picks.items()}
        if beat is None or not PRUNE:
            return moe_plan(graph, cluster, spec, model_name, layouts, warnings, precision, base, annotate=False)
        plan = dataclasses.replace(base, expert_layouts=tuple(layouts[b.module] for b in graph.moe_blocks))
        simulator = Simulator(plan, graph)
        if simulator.step_lower_bound() >= beat:
            return None
        return dataclasses.replace(plan, estimate=simulator.run(trace=False))

    plan = build(choice)
    memory_bound = not plan.estimate.fits
    while not plan.estimate.fits:
        overflow = plan.estimate.memory.total - plan.estimate.device_memory_bytes
        moved = _shrink(scored, choice, overflow)
        if not moved:
            break  # nothing smaller left: the caller sees a plan that does not fit
        plan = build(choice)
    return _refine(scored, choice, build, plan), build, memory_bound


def _refine(scored: Mapping[str, list[ScoredLayout]], choice: dict[str, int], build, plan: Plan) -> Plan:
    """Coordinate descent over the classes of identical layers by simulation (see the
    module docstring): ``choice`` is updated in place; returns the best plan found."""
    classes: dict[tuple, list[str]] = {}
    for module, options in scored.items():
        key = tuple((dataclasses.replace(o.layout, module=""), o.time_s, o.memory_bytes) for o in options)
        classes.setdefault(key, []).append(module)

    rank = _rank
    groups = list(classes.values())
    if math.prod(len(scored[modules[0]]) for modules in groups) <= ENUMERATION_LIMIT:
        for indices in itertools.product(*(range(len(scored[modules[0]])) for modules in groups)):
            trial = {module: index for modules, index in zip(groups, indices) for module in modules}
            if trial == choice:
                continue
            candidate = build(trial, _to_beat(plan))
            if candidate is not None and rank(candidate) < (rank(plan)[0], rank(plan)[1] * (1 - 1e-12)):
                choice.update(trial)
                plan = candidate
        return plan
    for _ in range(REFINE_SWEEPS):
        improved = False
        for modules in classes.values():
            for index in range(len(scored[modules[0]])):
                if all(choice[module] == index for module in modules):
                    continue
                trial = {**choice, **{module: index for module in modules}}
                candidate = build(trial, _to_beat(plan))
                if candidate is not None and rank(candidate) < (rank(plan)[0], rank(plan)[1] * (1 - 1e-12)):
                    choice.update(trial)
                    plan, improved = candidate, True
        if not improved:
            break
    return plan


def _to_beat(plan: Plan) -> float | None:
    """The step a candidate must beat to replace ``plan`` (as ``_refine`` compares them), when
    ``plan`` fits; None when it does not (then any plan that fits beats it, whatever its step)."""
    return plan.estimate.step_time_s * (1 - 1e-12) if plan.estimate.fits else None


def _rank(plan: Plan) -> tuple[bool, float]:
    """Plans that fit first, then the faster."""
    return not plan.estimate.fits, plan.estimate.step_time_s


def _shrink(scored: Mapping[str, list[ScoredLayout]], choice: dict[str, int], overflow: float) -> bool:
    """Move layers to layouts with fewer bytes, the least time per byte saved first, until
    the bytes saved cover ``overflow``; False when no layer has a smaller layout."""
    saved = 0.0
    moved = False
    while saved < overflow:
        best = None
        for module, options in scored.items():
            current = options[choice[module]]
            for index, option in enumerate(options):
                freed = current.memory_bytes - option.memory_bytes
                if freed <= 0:
                    continue
                rate = (option.time_s - current.time_s) / freed
                if best is None or rate < best[0]:
                    best = (rate, module, index, freed)
        if best is None:
            return moved
        _, module, index, freed = best
        choice[module], saved, moved = index, saved + freed, True
    return moved


def _fixed_modes(scored: Mapping[str, list[ScoredLayout]]) -> list[dict[str, int]]:
    """Choices running every layer one way, where every layer has that candidate: data
    parallel, expert-sliced, expert parallel with a flat all-to-all and round-robin placement
    (EPLB's when the experts do not divide over the devices)."""
    def expert_parallel(method: str):
        return lambda layout: (layout.mode == "expert_parallel" and layout.all_to_all == "flat"
                               and layout.placement.method.startswith(method))

    round_robin_exists = all(any(expert_parallel("round-robin")(o.layout) for o in options) for options in scored.values())
    wanted = [
        lambda layout: layout.mode == "data_parallel",
        lambda layout: layout.mode == "expert_sliced",
        expert_parallel("round-robin" if round_robin_exists else "EPLB"),
    ]
    choices = []
    for matches in wanted:
        picks = {module: next((i for i, o in enumerate(options) if matches(o.layout)), None)
                 for module, options in scored.items()}
        if all(index is not None for index in picks.values()):
            choices.append(picks)
    return choices


def _spans_nodes(cluster: Cluster) -> bool:
    return len(cluster.nodes) > 1


def moe_family_allowed(graph: OpGraph, cluster: Cluster, coupled) -> bool:
    """Whether the ``moe`` family (data parallelism, MoE layers by layout) may plan
    ``graph``: it has MoE layers, the batch splits over every device, and every op at which
    the samples mix lies inside an MoE layer (whose runtime reproduces the whole batch's routing),
    and the MoE runtime can run every MoE layer (``runs_by_layout``)."""
    if graph.batch_size % cluster.world_size:
        return False
    return mixing_only_in_moe_layers(graph, coupled)


def mixing_only_in_moe_layers(graph: OpGraph, coupled) -> bool:
    """Whether ``graph`` has MoE layers the MoE runtime runs (``runs_by_layout``) and every op
    at which the samples mix (``coupled``) lies inside one: then its layers may be laid out,
    on every device (``moe_family_allowed``) or over each pipeline stage's dp ranks, whatever
    the batch per device."""
    if not graph.moe_blocks:
        return False
    if not all(runs_by_layout(block) for block in graph.moe_blocks):
        return False  # compiled programs could not run the layouts (search.moe_search.runs_by_layout)
    inside = {node.name for block in graph.moe_blocks for node in graph.moe_nodes(block.module)}
    return all(op.node in inside for op in coupled)


def moe_candidates(context: SearchContext) -> list[Plan]:
    """The candidates part of the ``moe`` family (``planner.families``): the searched MoE
    plan and the plans with every layer in one fixed mode, when the family may plan the
    model (``SearchContext.moe_layouts``) and the constraints allow it."""
    if not context.moe_layouts or context.summa_only or not context.constraints.allows_family("moe"):
        return []
    context.progress("choosing the MoE layers' layouts", 0.0)
    searched, fixed = search_moe_plan(context.graph, context.cluster, context.spec, context.model_name, context.routing,
                                      context.warnings, context.precision, context.moe_dispatch)
    return [searched, *fixed]
