"""Uneven data parallelism's candidates for the search (search layer): on a cluster of more
than one kind of device, each even data-parallel plan again with every rank's batch share
balanced to its speed and memory, and the data-parallel plans on the fastest devices alone.

The search then compares them with the even plans the data-parallel families found (whose
step waits for the slowest device at an equal share) and keeps the fastest that fits: the
uneven plan when the slow devices still help, the fast devices alone when the slow ones
cost more (their share of the all-reduce, their memory) than they add (Sailor's choice of
which devices to use at all).
"""

from __future__ import annotations

import dataclasses

from cost_model.simulator import simulated
from planner.device_groups import device_groups, rank_devices, sub_cluster
from planner.errors import PlanningError
from planner.families.uneven_dp.costs import compute_seconds, share_time_model
from planner.families.uneven_dp.section import UnevenSection
from planner.families.uneven_dp.shares import balanced_shares, micro_batch_sizes
from planner.families.uneven_dp.costs import plan_rank_bytes
from planner.families.uneven_dp.state_shares import memory_state_weights
from planner.graph import OpGraph
from planner.plans import Plan
from search.context import SearchContext
from search.data_parallel import data_parallel_plan

FAMILY = "uneven"


def memory_caps(plan: Plan, steps: int = 1, states_placed: bool = False) -> tuple[int, ...]:
    """The most samples each rank of the even ``plan`` (no accumulation) can take in its
    device's memory in ``steps`` micro-batches: what does not grow with the share (weights,
    gradients, optimizer states, buffers) plus the even share's activations per sample,
    times the largest micro-batch (``steps`` micro-batches of c samples hold a share of up to
    ``steps * c``). With ``states_placed`` the optimizer states and the flavour's buffers are
    left out: the states will be split by the room each rank has left
    (``with_state_shares``), that program's buffers exist in its optimizer step alone
    (``costs.StateSharesStep``), and the simulation of that plan says whether it fits."""
    memory = plan.estimate.memory
    fixed = memory.total - memory.activations - (
        memory.optimizer_states + memory.communication_buffers if states_placed else 0)
    per_sample = memory.activations / (plan.batch_size / plan.mesh.axis_size("dp"))
    caps = []
    for device in rank_devices(plan.cluster):
        room = device.memory_bytes - fixed
        per_micro_batch = plan.batch_size if per_sample <= 0 else max(0, int(room // per_sample))
        caps.append(min(plan.batch_size, steps * per_micro_batch))
    return tuple(caps)


def uneven_plan(plan: Plan, graph: OpGraph, steps: int = 1, states_placed: bool = False) -> Plan | None:
    """``plan`` (an even data-parallel plan on ``dp`` alone, no accumulation) with balanced
    shares (``shares.balanced_shares`` on each rank's fitted time line,
    ``costs.share_time_model``, capped by ``memory_caps``) in ``steps`` micro-batches per
    rank (each share cut by ``shares.micro_batch_sizes``), simulated, with each rank's
    predicted busy seconds and bytes (its largest micro-batch's activations) in its section;
    None when no shares fit, or when the shares come out even unless ``states_placed`` (the
    caps leave the optimizer states out, ``memory_caps``: the states will be placed unevenly,
    so even batch shares still make a plan of their own)."""
    devices = rank_devices(plan.cluster)
    lines = {device: share_time_model(plan, graph, device, steps) for device in set(devices)}
    shares = balanced_shares(plan.batch_size, [lines[d][0] for d in devices], [lines[d][1] for d in devices],
                             memory_caps(plan, steps, states_placed), least=steps)
    if shares is None or len(set(shares)) == 1 and not states_placed:  # even states need uneven shares
        return None
    memory = plan.estimate.memory
    per_sample = memory.activations / (plan.batch_size / len(devices))
    busy = {pair: compute_seconds(plan, graph, *pair, steps) for pair in set(zip(devices, shares))}  # few pairs
    section = UnevenSection(
        shares,
        busy_s=tuple(busy[pair] for pair in zip(devices, shares)),
        memory_bytes=tuple(int(memory.total - memory.activations + per_sample * micro_batch_sizes(share, steps)[0])
                           for share in shares),
    )
    return simulated(dataclasses.replace(plan, accumulation_steps=steps, sections={**plan.sections, FAMILY: section}),
                     graph)


def with_state_shares(plan: Plan, graph: OpGraph) -> Plan | None:
    """The ZeRO-1 ``plan`` of uneven batch shares with its optimizer states split by memory
    (Cephalo: ``state_shares``), simulated; None for another flavour. Rank r's room is its
    device's bytes less what it holds besides the states (``section.memory_bytes[r]`` less
    the even states; its DDP bucket stands for the exchange's bucket of the same size);
    ``state_shares.memory_state_weights`` splits the states of every parameter to leave the
    most room on the fullest rank, and the simulation says whether the plan fits. The
    section's per-rank bytes are then the new plan's."""
    if plan.dp_flavour != "zero1":
        return None
    section = plan.sections[FAMILY]
    memory, dp = plan.estimate.memory, plan.mesh.axis_size("dp")
    rooms = [device.memory_bytes - (held - memory.optimizer_states)
             for device, held in zip(rank_devices(plan.cluster), section.memory_bytes)]
    weights = memory_state_weights(rooms, memory.optimizer_states * dp)
    placed = dataclasses.replace(section, state_shares=weights)
    held = plan_rank_bytes(dataclasses.replace(plan, sections={**plan.sections, FAMILY: placed}), graph)
    shared = dataclasses.replace(placed, memory_bytes=held)
    return simulated(dataclasses.replace(plan, sections={**plan.sections, FAMILY: shared}), graph)


def fitting_uneven_plan(plan: Plan, graph: OpGraph) -> Plan | None:
    """The fitting plan of balanced shares for the even ``plan``: at once, or where the batch
    does not fit at once, in the fewest micro-batches (2, 4, 8, ..., at least one sample
    each) that fit, as the search accumulates even plans (``search.data_parallel``). Not
    for a model with batch norm: its statistics are taken per micro-batch, and micro-batches
    of uneven shares hold other samples than one device's would."""
    found = uneven_plan(plan, graph)
    if found is not None and found.estimate.fits:
        return found
    if any("batch_norm" in node.op for node in graph.nodes):
        return None
    steps = 2
    while steps * plan.mesh.axis_size("dp") <= plan.batch_size:
        found = uneven_plan(plan, graph, steps)
        if found is not None and found.estimate.fits:
            return found
        steps *= 2
    return None


def states_by_memory_plan(plan: Plan, graph: OpGraph) -> Plan | None:
    """For the even ZeRO-1 ``plan`` whose balanced shares do not fit at once: the plan of
    balanced shares capped without the states, its states then split by memory
    (``with_state_shares``), when it fits; else None. The search weighs it against
    ``fitting_uneven_plan``'s, which may accumulate instead."""
    if plan.dp_flavour != "zero1":
        return None
    found = uneven_plan(plan, graph)
    if found is not None and found.estimate.fits:
        return None  # the states need no placing
    placed = uneven_plan(plan, graph, states_placed=True)
    shared = None if placed is None else with_state_shares(placed, graph)
    return shared if shared is not None and shared.estimate.fits else None


def fastest_devices_plans(context: SearchContext, flavours: set[str]) -> list[Plan]:
    """The data-parallel plans of ``flavours`` on the nodes of the fastest device alone (the
    others left out), each with a warning naming what was left out; none when the batch does
    not divide over those devices."""
    dtype = "bfloat16" if context.precision != "fp32" else "float32"
    fastest = max(device_groups(context.cluster), key=lambda group: group.peak_flops(dtype))
    cluster = sub_cluster(context.cluster, fastest.device)
    left_out = context.cluster.world_size - cluster.world_size
    warning = (f"devices left out: {left_out} of the {context.cluster.world_size} ranks of cluster "
               f"{context.cluster.name!r} are slower than {fastest.device.name}; this plan runs on the "
               f"{cluster.world_size} {fastest.device.name} ranks alone (torchrun them alone)")
    plans = []
    for flavour in sorted(flavours):
        try:
            plans.append(data_parallel_plan(context.graph, cluster, context.spec, context.model_name, flavour,
                                            (*context.warnings, warning), context.precision))
        except PlanningError:  # the batch does not divide over the fast devices
            return []
    return plans


def uneven_candidates(context: SearchContext) -> list[Plan]:
    """The candidates part of the ``uneven`` family (``planner.families``): on a cluster of
    two or more kinds of device, every even data-parallel plan found so far (``dp`` alone,
    no accumulation, no section) with balanced shares (``fitting_uneven_plan``: accumulating
    where the batch does not fit at once; ``states_by_memory_plan``: ZeRO-1's states split
    by memory instead), and the plans of
    the same flavours on the fastest devices alone (``fastest_devices_plans``) where the
    constraints allow those flavours. None on a
    cluster of one device kind, for a model whose samples mix, with ``--tp-layouts summa``,
    or when the constraints leave the family out."""
    if (context.whole_batch_only or context.summa_only or not context.constraints.allows_family(FAMILY)
            or len(device_groups(context.cluster)) < 2):
        return []
    even = [plan for plan in context.found
            if plan.mesh.names == ("dp",) and not plan.sections and not plan.label and plan.pipeline is None
            and plan.accumulation_steps == 1 and plan.cluster == context.cluster]
    if not even:  # --family uneven alone: the ddp plan to start from
        try:
            even = [data_parallel_plan(context.graph, context.cluster, context.spec, context.model_name, "ddp",
                                       context.warnings, context.precision)]
        except PlanningError:
            # The batch does not divide over every device: other families (tensor
            # parallelism, the fast devices alone) may still plan it, so this family
            # offers nothing, unless it is the only one asked for: then its reason is the answer.
            if context.constraints.families == frozenset({FAMILY}):
                raise
            return []
    found = [plan for base in even for plan in (fitting_uneven_plan(base, context.graph),
                                                 states_by_memory_plan(base, context.graph)) if plan is not None]
    # The fast devices alone run the flavours' plain programs: only where --family allows them.
    flavours = {plan.dp_flavour for plan in even if context.constraints.allows_family(plan.dp_flavour)}
    return found + (fastest_devices_plans(context, flavours) if flavours else [])
