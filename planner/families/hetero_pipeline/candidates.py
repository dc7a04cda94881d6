"""Pipelines over device groups of different types (search layer), as Metis (Um et al.,
ATC'24) plans them: each device group cut into one or more stages of a common width (Metis's
device-group shapes: 4 H100 + 8 A100 as an H100 stage and two A100 stages of 4 ranks), the
stage order chosen, and the blocks balanced by each stage's speed and memory, so a stage on
H100s holds more layers than one on A100s. Also the pipelines on the fastest devices alone
(the slow ones left out, as Sailor may decide), each saying so in a warning.

For every width w dividing every group's size (``stage_layouts``: the group of n ranks as n/w
stages of w ranks, at most ``MAX_STAGES`` stages in all), every order of the groups (all of
them: a cluster has few device types; a group's stages stay together) and every
micro-batch size and dp flavour (1F1B, no tensor parallelism, no or full recomputation),
the segments' costs per micro-batch are priced on each group's device
(``search.pipeline_search.PipelineGrid.segment_costs`` on the cluster with every node given
that device), the blocks are cut by ``balance.balanced_stages`` (exact: the slowest stage is
least, each stage within its own device's memory), and the step is estimated as 1F1B runs
it, ``sum(stage seconds) + (m - 1) x slowest``. The best ``SearchBudget.pipeline_candidates()``
are simulated (``costs.py`` prices each stage on its device) and compete with every other plan.

The stage order is the order of the plan's cluster's nodes: a plan whose first stage runs
on the cluster file's second group lists that group's nodes first (start them as node rank
0 onwards).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from cost_model.collectives import collective_time
from cost_model.parameter_bytes import bytes_per_parameter
from cost_model.simulator import simulated
from planner.cluster import Cluster, DeviceSpec
from planner.device_groups import DeviceGroup, device_groups, sub_cluster
from planner.families.hetero_pipeline.balance import balanced_stages, stage_seconds
from planner.families.hetero_pipeline.section import JSON_KEY, HeteroStagesSection
from planner.families.hetero_pipeline.widths import LayoutStep, WidthLayout, layout_step, width_layouts
from planner.graph import OpGraph
from planner.plans import Plan
from planner.strategy import MemoryBreakdown, Mesh, PipelineConfig
from search.budget import SearchBudget
from search.context import SearchContext
from search.pipeline_search import Configuration, Estimate, PipelineGrid, PipelineSpace, pipeline_plans
from search.stage_slicing import SegmentCost, in_flight_per_stage, stage_memory

FAMILY = JSON_KEY
MAX_GROUPS = 4  # 4! = 24 stage orders; a rack rarely holds more device types
MAX_STAGES = 8  # a bound on the search, not a cost: the layouts multiply with the stages allowed
RECOMPUTE = ("none", "full")  # the least and the most a stage keeps
MICRO_BATCH_SIZES = PipelineSpace.micro_batch_sizes


@dataclass(frozen=True)
class StagedEstimate:
    """One order of the groups under one configuration, its blocks balanced."""

    step_s: float
    order: tuple[int, ...]  # stage s runs on group order[s] (a group cut into stages repeats)
    config: Configuration
    blocks: tuple[int, ...]  # blocks per stage
    stage_s: tuple[float, ...]  # seconds per micro-batch per stage
    memory_bytes: tuple[float, ...]  # bytes per device of each stage


def with_device(cluster: Cluster, device: DeviceSpec) -> Cluster:
    """``cluster`` with every node's device replaced by ``device`` (links unchanged): the
    homogeneous cluster a group's segment costs are priced on."""
    return dataclasses.replace(cluster, nodes=tuple(dataclasses.replace(node, device=device) for node in cluster.nodes),
                               derived_from=None)


def ordered_cluster(cluster: Cluster, groups: tuple[DeviceGroup, ...], order: tuple[int, ...]) -> Cluster:
    """``cluster`` with its nodes listed group by group in ``order`` (each group's nodes in
    their own order; a group named several times, cut into several stages, placed at its first
    mention): stage s's ranks are then group ``order[s]``'s."""
    rank: dict[DeviceSpec, int] = {}
    for position, group in enumerate(order):
        rank.setdefault(groups[group].device, position)
    nodes = sorted(cluster.nodes, key=lambda node: rank[node.device])
    return dataclasses.replace(cluster, nodes=tuple(nodes), derived_from=None)


def stage_groups(cluster: Cluster) -> tuple[DeviceGroup, ...] | None:
    """The cluster's device groups when there are 2 to ``MAX_GROUPS`` of them; None otherwise."""
    groups = device_groups(cluster)
    return groups if 2 <= len(groups) <= MAX_GROUPS else None


def stage_layouts(sizes: tuple[int, ...]) -> list[tuple[int, tuple[int, ...]]]:
    """Every ``(width, stages per group)`` cutting groups of ``sizes`` ranks into stages of one
    common width: the widths that divide every size, widest first, with at most
    ``MAX_STAGES`` stages in all (e.g. sizes (4, 8): (4, (1, 2)), (2, (2, 4)), (1, (4, 8)) would
    be 12 stages: left out)."""
    common = math.gcd(*sizes)
    found = []
    for width in range(common, 0, -1):
        if common % width == 0 and sum(size // width for size in sizes) <= MAX_STAGES:
            found.append((width, tuple(size // width for size in sizes)))
    return found


def _configurations(graph: OpGraph, pp: int, dp: int, flavours: tuple[str, ...]) -> list[Configuration]:
    """1F1B configurations of ``pp`` stages of ``dp`` ranks: every micro-batch size that
    divides the batch per dp rank, flavour and recomputation (FSDP beside pp with full
    recomputation only, as the pipeline grid allows it)."""
    if graph.batch_size % dp:
        return []
    local = graph.batch_size // dp
    found = []
    for size in MICRO_BATCH_SIZES:
        if local % size:
            continue
        for flavour in flavours if dp > 1 else ("ddp",):
            for recompute in RECOMPUTE:
                if flavour == "fsdp" and recompute != "full":
                    continue
                found.append(Configuration(1, pp, dp, size, local // size, "1f1b", 1, flavour, recompute))
    return found


def balanced_estimate(costs: list[list[SegmentCost]], flags: tuple[bool, ...], capacity: list[float],
                      order: tuple[int, ...], config: Configuration) -> StagedEstimate | None:
    """``config`` with stage s on group ``order[s]``: ``costs[g]`` the segments' costs on group
    g's device, ``capacity[g]`` the bytes its devices have for segments. None when no split fits."""
    first, last = flags.index(True), len(flags) - 1 - flags[::-1].index(True)
    head, tail = slice(0, first), slice(last + 1, len(flags))
    blocks = [i for i, flag in enumerate(flags) if flag]
    in_flight = in_flight_per_stage("1f1b", config.pp, config.micro_batches, 1)
    stages = len(order)

    def members(stage: int, start: int, end: int) -> list[SegmentCost]:
        own = costs[order[stage]]
        held = [own[blocks[k]] for k in range(start, end)]
        return (own[head] if stage == 0 else []) + held + (own[tail] if stage == stages - 1 else [])

    def fits(stage: int, start: int, end: int) -> bool:
        return stage_memory(members(stage, start, end), in_flight[stage]) <= capacity[order[stage]]

    block_s = [[costs[order[s]][k].time_s for k in blocks] for s in range(stages)]
    head_s = sum(c.time_s for c in costs[order[0]][head])
    tail_s = sum(c.time_s for c in costs[order[-1]][tail])
    found = balanced_stages(block_s, head_s, tail_s, fits)
    if found is None:
        return None
    counts, slowest = found
    seconds = stage_seconds(block_s, head_s, tail_s, counts)
    starts = list(itertools.accumulate((0, *counts)))
    memory = tuple(stage_memory(members(s, starts[s], starts[s + 1]), in_flight[s]) for s in range(stages))
    step = sum(seconds) + (config.micro_batches - 1) * slowest
    return StagedEstimate(step, order, config, counts, seconds, memory)


def staged_estimates(graph: OpGraph, cluster: Cluster, precision: str, flavours: tuple[str, ...],
                     budget: SearchBudget, allows_mesh=None) -> tuple[list[StagedEstimate], dict[DeviceSpec, PipelineGrid]]:
    """Every (stage layout, order, configuration) of the cluster's device groups, balanced,
    fastest estimate first, and the grid of each group's device (empty when the groups do not
    fit the family: see ``stage_groups`` and ``stage_layouts``)."""
    groups = stage_groups(cluster)
    if groups is None or not graph.blocks:
        return [], {}
    space = PipelineSpace(searched_layout="off")
    grids = {group.device: PipelineGrid(graph, with_device(cluster, group.device), precision, space, budget)
             for group in groups}
    found = []
    for width, cuts in stage_layouts(tuple(len(group.ranks) for group in groups)):
        pp = sum(cuts)
        for config in _configurations(graph, pp, width, flavours):
            if allows_mesh is not None and not allows_mesh(config.mesh):
                continue
            costs = [grids[group.device].segment_costs(config, config.recompute) for group in groups]
            if any(cost is None for cost in costs):
                continue
            flags = grids[groups[0].device].block_flags(config)
            if sum(flags) < pp:
                continue
            capacity = [group.memory_bytes - grids[group.device].fixed_bytes(config) for group in groups]
            for groups_order in itertools.permutations(range(len(groups))):
                order = tuple(group for group in groups_order for _ in range(cuts[group]))
                estimate = balanced_estimate(costs, flags, capacity, order, config)
                if estimate is not None:
                    found.append(estimate)
    found.sort(key=lambda e: (e.step_s, e.order, e.config))
    return found, grids


def staged_plan(estimate: StagedEstimate, graph: OpGraph, cluster: Cluster, grids: dict[DeviceSpec, PipelineGrid],
                spec, model_name: str, warnings: tuple[str, ...]) -> Plan:
    """``estimate`` as a simulated plan on the cluster ordered by its stages, with its section."""
    groups = device_groups(cluster)
    stage_devices = [groups[g].device for g in estimate.order]
    grid = grids[stage_devices[0]]
    plan = grid.unsimulated(Estimate(estimate.step_s, estimate.config, estimate.blocks, max(estimate.memory_bytes)),
                            spec, model_name)
    micro_batches = estimate.config.micro_batches
    section = HeteroStagesSection(
        tuple(device.name for device in stage_devices), blocks=estimate.blocks,
        busy_s=tuple(seconds * micro_batches for seconds in estimate.stage_s),
        memory_bytes=tuple(int(b + grids[d].fixed_bytes(estimate.config)) for b, d in zip(estimate.memory_bytes,
                                                                                            stage_devices)),
    )
    plan = dataclasses.replace(plan, cluster=ordered_cluster(cluster, groups, estimate.order), label="",
                               sections={FAMILY: section}, warnings=warnings)
    return simulated(plan, graph)


def fast_group_pipelines(context: SearchContext, flavours: tuple[str, ...], with_all: Plan) -> list[Plan]:
    """The pipeline grid's plans on the fastest device group alone, each warning which
    devices it leaves out and why (Sailor: a slow group may cost the step more than it
    adds): its predicted step against ``with_all``'s, the best pipeline on every device."""
    dtype = "bfloat16" if context.precision != "fp32" else "float32"
    groups = device_groups(context.cluster)
    fastest = max(groups, key=lambda group: group.peak_flops(dtype))
    cluster = sub_cluster(context.cluster, fastest.device)
    left = ", ".join(f"{len(g.ranks)} {g.device.name}" for g in groups if g is not fastest)
    space = PipelineSpace(flavours=flavours, searched_layout="off", per_stage_recompute=False,
                          sequence_parallel=(False,), tensor_parallel=(1,),
                          allows_mesh=context.constraints.allows_mesh if context.constraints.any else None)
    plans = pipeline_plans(context.graph, cluster, context.spec, context.model_name, context.precision,
                           context.budget, space)
    found = []
    for plan in plans:
        if plan.pipeline is None:
            continue
        ratio = with_all.estimate.step_time_s / plan.estimate.step_time_s
        warning = (f"devices left out: {left} of cluster {context.cluster.name!r}, slower than "
                   f"{fastest.device.name}: this pipeline on the {cluster.world_size} {fastest.device.name} ranks "
                   f"alone is predicted at {plan.estimate.step_time_s * 1e3:.4g} ms per step, against "
                   f"{with_all.estimate.step_time_s * 1e3:.4g} ms for the best pipeline on every device "
                   f"({ratio:.2f}x); torchrun it on those ranks alone")
        found.append(dataclasses.replace(plan, warnings=(*plan.warnings, warning)))
    return found


def hetero_pipeline_candidates(context: SearchContext) -> list[Plan]:
    """The candidates part of the ``hetero-pp`` family (``planner.families``): on a cluster
    of 2 to ``MAX_GROUPS`` device groups, the best pipelines with each group cut into stages
    of a common width (module docstring), the best of stages of different widths
    (``uneven_width_plans``), and the pipeline grid's plans on the fastest group alone when
    ``--family`` allows the ``pipeline`` family. None for a model without repeated blocks or
    with MoE layers, one whose samples mix, with ``--tp-layouts summa``, or when the
    constraints leave the family out."""
    graph = context.graph
    if (context.whole_batch_only or context.summa_only or graph.moe_blocks or not graph.blocks
            or not context.constraints.allows_family(FAMILY) or stage_groups(context.cluster) is None):
        return []
    flavours = tuple(f for f in ("ddp", "zero1", "fsdp") if context.constraints.allows_family(f)) or ("ddp",)
    constraints = context.constraints
    # The sizes --mesh and --max fix; the pp axis is this family's too, so it needs not the
    # pipeline family allowed (constraints.allows_mesh would ask for it).
    allows = None if not constraints.any else (lambda mesh: all(
        mesh.axis_size(axis) == size if axis in mesh.names else size == 1 for axis, size in constraints.mesh.items()
    ) and all(axis not in mesh.names or mesh.axis_size(axis) <= bound for axis, bound in constraints.max.items()))
    estimates, grids = staged_estimates(graph, context.cluster, context.precision, flavours, context.budget, allows)
    plans = [staged_plan(estimate, graph, context.cluster, grids, context.spec, context.model_name, context.warnings)
             for estimate in estimates[:context.budget.pipeline_candidates()]]
    if plans:  # stages of different widths (below), where the layouts of one width apply
        plans += uneven_width_plans(context, min(plan.estimate.step_time_s for plan in plans), flavours)
    if plans and context.constraints.allows_family("pipeline"):
        plans += fast_group_pipelines(context, flavours, min(plans, key=lambda plan: plan.estimate.step_time_s))
    return plans


@dataclass(frozen=True)
class WidthEstimate:
    """A layout of stages of possibly different widths (``widths.py``) priced on the cluster."""

    step: LayoutStep
    micro_batch: int  # samples per micro-batch (all of a stage's ranks together)
    micro_batches: int
    sync_s: float  # the slowest stage's gradient all-reduce over its own ranks
    hops_s: float  # the activations' and their gradients' hops between stages
    memory: tuple[MemoryBreakdown, ...] = ()  # per device of each stage, at the chosen split

    @property
    def step_s(self) -> float:
        return self.step.step_s


def width_estimates(graph: OpGraph, cluster: Cluster, precision: str, budget: SearchBudget,
                    micro_batch_sizes: tuple[int, ...] | None = None) -> list[WidthEstimate]:
    """Every layout of stages of any widths (``widths.width_layouts``) at every micro-batch
    size, each priced (``widths.layout_step``), fastest first (the first is what
    ``widths.best_layout`` picks over them all); the layouts whose stages share one width are
    among them, priced the same way. Each stage
    runs DDP over its own ranks without recomputation; its blocks are priced on its device at
    1/width of the micro-batch (``PipelineGrid.segment_costs``); after the pipeline drains the
    slowest stage's gradient all-reduce over its own ranks, on the links they cross
    (``collective_time``: a stage spanning sites pays the link between them), and 2 hops per
    stage boundary of the largest activation, split over the narrower stage's ranks. Every
    stage within its device's memory (GPipe: every micro-batch in flight). ``micro_batch_sizes``:
    only those sizes (samples per micro-batch) are tried (None: every divisor of the batch)."""
    groups = stage_groups(cluster)
    if groups is None or not graph.blocks:
        return []
    sizes = tuple(len(group.ranks) for group in groups)
    space = PipelineSpace(searched_layout="off")
    grids: dict[tuple[int, int], PipelineGrid] = {}

    def grid(group: int, ranks: int) -> PipelineGrid:
        """The grid pricing group ``group``'s device on a pipeline mesh of ``ranks`` ranks: one
        node of them, the group's own (segment costs of DDP do not cross nodes)."""
        if (group, ranks) not in grids:
            node = next(node for node in cluster.nodes if node.device == groups[group].device)
            alone = Cluster(f"{cluster.name}-stage"[:120], (dataclasses.replace(node, devices=ranks, site=""),),
                            cluster.inter_link, cluster.backend)
            grids[group, ranks] = PipelineGrid(graph, alone, precision, space, budget)
        return grids[group, ranks]

    weights, grads, states = bytes_per_parameter(precision)
    found = []
    for micro_batch in [size for size in range(1, graph.batch_size + 1) if graph.batch_size % size == 0
                        and (micro_batch_sizes is None or size in micro_batch_sizes)]:
        micro_batches = graph.batch_size // micro_batch
        layouts = width_layouts(sizes, MAX_STAGES, micro_batch)
        table: dict[tuple[int, int, int], tuple[Configuration, list[SegmentCost]] | None] = {}

        def priced(group: int, width: int, pp: int):
            key = (group, width, pp)
            if key not in table:
                config = Configuration(1, pp, width, micro_batch // width, micro_batches, "1f1b", 1, "ddp", "none")
                costs = grid(group, pp * width).segment_costs(config, "none")
                table[key] = None if costs is None else (config, costs, grid(group, pp * width))
            return table[key]

        for layout in layouts:
            pp = len(layout.groups)
            stage_costs = [priced(g, w, pp) for g, w in zip(layout.groups, layout.widths)]
            if any(entry is None for entry in stage_costs):
                continue
            flags = stage_costs[0][2].block_flags(stage_costs[0][0])
            if sum(flags) < pp:
                continue
            estimate = _width_estimate(layout, stage_costs, flags, groups, cluster, (weights, grads, states),
                                       micro_batch)
            if estimate is not None:
                found.append(estimate)
    found.sort(key=lambda e: (e.step_s, e.step.layout.groups, e.step.layout.widths))
    return found


def _width_estimate(layout: WidthLayout, stage_costs, flags, groups, cluster: Cluster,
                    parameter_bytes: tuple[float, float, float], micro_batch: int) -> WidthEstimate | None:
    """One layout priced (``width_estimates``): ``stage_costs[s]`` is stage s's (configuration,
    segment costs, grid); ``parameter_bytes`` the bytes of a weight, its gradient and its
    optimizer states per parameter."""
    grad_share = parameter_bytes[1] / sum(parameter_bytes)
    first, last = flags.index(True), len(flags) - 1 - flags[::-1].index(True)
    blocks = [i for i, flag in enumerate(flags) if flag]
    pp, micro_batches = len(layout.groups), stage_costs[0][0].micro_batches
    # GPipe, as the runtime of these layouts runs it (codegen.runtime.uneven_width_pipeline):
    # every stage holds all its micro-batches' activations until the backwards start.
    in_flight = in_flight_per_stage("gpipe", pp, micro_batches, 1)
    ordered = ordered_cluster(cluster, groups, layout.groups)
    starts = list(itertools.accumulate((0, *layout.widths)))

    def members(stage: int, i: int, j: int) -> list[SegmentCost]:
        costs = stage_costs[stage][1]
        return ((costs[:first] if stage == 0 else []) + [costs[blocks[k]] for k in range(i, j)]
                + (costs[last + 1:] if stage == pp - 1 else []))

    def rows(group: int, width: int):  # layout_step asks per stage; answer from this layout's stages
        stage = next(s for s in range(pp) if (layout.groups[s], layout.widths[s]) == (group, width))
        costs = stage_costs[stage][1]
        return ([costs[k].time_s for k in blocks], sum(c.time_s for c in costs[:first]),
                sum(c.time_s for c in costs[last + 1:]))

    def fits(_layout: WidthLayout, stage: int, i: int, j: int) -> bool:
        config, _, grid = stage_costs[stage]
        return stage_memory(members(stage, i, j), in_flight[stage]) <= (
            groups[layout.groups[stage]].memory_bytes - grid.fixed_bytes(config))

    sync_hops: dict[tuple[int, ...], tuple[float, float]] = {}

    def after(_layout: WidthLayout, counts: tuple[int, ...]) -> float:
        cuts = list(itertools.accumulate((0, *counts)))
        sync = max(collective_time("all_reduce", sum(c.static_bytes for c in members(s, cuts[s], cuts[s + 1]))
                                   * grad_share, ordered, list(range(starts[s], starts[s + 1])))
                   for s in range(pp))
        hops = 0.0
        for s in range(pp - 1):
            config, _, grid = stage_costs[s]
            per_rank = grid.boundary_bytes(config) * layout.widths[s]
            narrow = min(layout.widths[s], layout.widths[s + 1])
            hops += 2 * collective_time("send_recv", per_rank / narrow, ordered, [starts[s], starts[s + 1]])
        sync_hops[counts] = (sync, hops)
        return sync + hops

    step = layout_step(layout, rows, micro_batches, after, fits)
    if step is None:
        return None
    sync, hops = sync_hops[step.blocks]
    cuts = list(itertools.accumulate((0, *step.blocks)))
    memory = []
    for s in range(pp):  # as stage_memory counts it, split by kind
        held = members(s, cuts[s], cuts[s + 1])
        static = sum(c.static_bytes for c in held) / sum(parameter_bytes)
        memory.append(MemoryBreakdown(
            weights=int(static * parameter_bytes[0]), gradients=int(static * parameter_bytes[1]),
            optimizer_states=int(static * parameter_bytes[2]),
            activations=int(in_flight[s] * sum(c.activation_bytes for c in held)
                            + max((c.transient_bytes for c in held), default=0.0)),
            communication_buffers=int(stage_costs[s][2].fixed_bytes(stage_costs[s][0]))))
    return WidthEstimate(step, micro_batch, micro_batches, sync, hops, tuple(memory))


# ------------------------------------------------------------------ stages of different widths
# Pipelines of stages of different widths as plans the search compares and ``compile`` writes:
# the layouts ``width_estimates`` prices (``widths.py``) whose widths differ, turned into plans
# run by ``codegen.runtime.uneven_width_pipeline``.
#
# A plan of stages of widths ``(w_0, ..., w_{P-1})`` over W ranks is stored as a pipeline plan on
# the mesh ``pp`` = W alone (the plan format needs a mesh covering every rank once, and no
# rectangular pp x dp mesh holds stages of different widths), its ops on stages 0..P-1, with the
# section's ``widths`` saying which ranks each stage holds (the first ``w_0`` ranks stage 0, and
# so on). Its pipeline is GPipe (what the runtime runs) over ``micro_batches x lcm(widths)``
# *units* (the runtime's granularity: rank j of stage s runs the units of its 1/w_s of each
# micro-batch's rows). Its estimate is the layout's price on the simulator's scale
# (``uneven_width_plans``; ``method`` says so): the simulator prices rectangular meshes, every
# rank of a pp coordinate alike, which these plans are not.

METHOD = "hetero-pp widths: sum of stage times + (m - 1) x slowest, GPipe"

def width_plan(estimate: WidthEstimate, graph: OpGraph, cluster, spec, model_name: str, precision: str,
               budget, warnings: tuple[str, ...] = (), scale: float = 1.0) -> Plan:
    """``estimate`` (a layout of stages of different widths) as a plan (see above), its
    predicted times the layout's times ``scale`` (``uneven_width_plans``)."""
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
        plan.estimate, step_time_s=step.step_s * scale, compute_s=max(step.stage_s) * estimate.micro_batches * scale,
        communication_s=(estimate.sync_s + estimate.hops_s) * scale, memory=estimate.memory[fullest],
        device_memory_bytes=int(groups[layout.groups[fullest]].memory_bytes), stage_memory=estimate.memory,
        method=METHOD + ("" if scale == 1.0 else f", x {scale:.3g} (the simulator over this model on one width)"),
        samples_per_s=graph.batch_size / (step.step_s * scale),
    )
    return dataclasses.replace(
        plan, cluster=ordered, mesh=Mesh((("pp", world),)), label="",
        pipeline=PipelineConfig(stages=world, schedule="gpipe", micro_batches=units), estimate=result,
        sections={FAMILY: section}, warnings=warnings,
    )


def uneven_width_plans(context: SearchContext, simulated_even_s: float,
                       flavours: tuple[str, ...] = ("ddp",)) -> list[Plan]:
    """The best ``SearchBudget.pipeline_candidates()`` layouts whose stages differ in width and
    that beat every layout of one width as ``width_estimates`` prices them all, as plans (fp32,
    DDP inside each stage: what the runtime compiles); none when ``--mesh``/``--max`` fix sizes
    or ``flavours`` (those ``--family`` allows) leave DDP out.

    Their step is put on the simulator's scale, so the search compares like with like: the
    widths model leaves out what the simulator adds (per-op overheads, the schedule's exact
    overlap), so each price is multiplied by ``simulated_even_s`` (the family's best simulated
    plan of one width) over the widths model's price of its best layout of one width."""
    if context.precision != "fp32" or context.constraints.mesh or context.constraints.max or "ddp" not in flavours:
        return []
    graph = context.graph
    found = width_estimates(graph, context.cluster, context.precision, context.budget)
    even = [e.step_s for e in found if not e.step.layout.uneven]
    if not even:
        return []
    wins = [e for e in found if e.step.layout.uneven and e.step_s < min(even)]
    scale = simulated_even_s / min(even)
    return [width_plan(e, graph, context.cluster, context.spec, context.model_name, context.precision, context.budget,
                       context.warnings, scale) for e in wins[:context.budget.pipeline_candidates()]]
