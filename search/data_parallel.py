"""Data-parallel plans: the whole model on every device, the batch split over a ``dp`` axis.

Four flavours are built and simulated, from the most memory per device to the least:

- DDP: weights, gradients and optimizer states replicated; gradients all-reduced.
- ZeRO-1: gradients all-reduced as DDP, optimizer states sharded over ``dp`` (each rank
  updates its share of the parameters and the updated weights are gathered back).
- ZeRO-2: gradients reduce-scattered and optimizer states sharded; weights whole during the
  step (gathered once in forward and kept until backward ends).
- FSDP (ZeRO-3): weights, gradients and optimizer states sharded; weights gathered per unit
  in forward and again in backward.

The fastest flavour that fits in memory wins; the others are kept as runners-up with the
reason each lost.
"""

from __future__ import annotations

import dataclasses

from cost_model.colocation import CoRunner
from cost_model.simulator import simulated
from planner.cluster import Cluster
from planner.errors import PlanningError
from planner.graph import OpGraph
from planner.model_spec import ModelSpec
from planner.plans import Plan
from planner.strategy import Alternative, Mesh, SimResult
from planner.verdict import plan_route
from search.beside import choose_beside
from search.layouts import data_parallel_layout
from search.context import SearchContext
from search.plan_builder import unsimulated_plan
from search.plan_variants import recomputing

DATA_PARALLEL_FLAVOURS = ("ddp", "zero1", "zero2", "fsdp")
# Flavours compiled as FSDP2 units (``fully_shard`` per repeated block plus the root): ZeRO-2
# is FSDP2 that keeps the gathered weights from forward to backward.
FSDP_UNIT_FLAVOURS = ("zero2", "fsdp")


def plan_data_parallel(
    graph: OpGraph,
    cluster: Cluster,
    spec: ModelSpec | None,
    model_name: str,
    dp_flavour: str | None = None,
    warnings: tuple[str, ...] = (),
    precision: str = "fp32",
    flavours: tuple[str, ...] = DATA_PARALLEL_FLAVOURS,
    co_runner: CoRunner | None = None,
) -> Plan:
    """The best data-parallel plan of ``graph`` on all of ``cluster``'s devices (beside
    ``co_runner``: the flavour with the shortest co-located round, ``search.beside``).

    Args:
        graph: the traced model.
        cluster: the cluster; every device is one data-parallel rank.
        spec: how to rebuild the model inside torchrun (``None``: the plan cannot be compiled).
        model_name: shown in the report.
        dp_flavour: force one of ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"fsdp"``; ``None`` picks
            the fastest that fits.
        warnings: notes gathered while tracing, carried into the plan.
        precision: ``fp32``, or mixed ``bf16``/``fp16`` (simulated; codegen runs fp32).
        flavours: the flavours that may compete when ``dp_flavour`` is None (a user's
            ``--family`` constraint).

    Raises:
        PlanningError: the batch does not split over the devices, or no flavour fits.
    """
    from search.megatron import megatron_baseline

    if dp_flavour is not None and dp_flavour not in DATA_PARALLEL_FLAVOURS:
        raise PlanningError(
            f"data-parallel flavour '{dp_flavour}' is not available; choose one of {', '.join(DATA_PARALLEL_FLAVOURS)}"
        )
    candidates = [dp_flavour] if dp_flavour else [flavour for flavour in DATA_PARALLEL_FLAVOURS if flavour in flavours]
    plans = {
        flavour: data_parallel_plan(graph, cluster, spec, model_name, flavour, warnings, precision)
        for flavour in DATA_PARALLEL_FLAVOURS
    }
    for flavour in candidates:  # too many activations at once: the same plan in micro-batches
        plans[flavour] = accumulating(plans[flavour], graph) or plans[flavour]
    fitting = [flavour for flavour in candidates if plans[flavour].estimate.fits]
    if not fitting:
        raise does_not_fit(cluster, {flavour: plans[flavour].estimate for flavour in DATA_PARALLEL_FLAVOURS})
    chosen = min(fitting, key=lambda flavour: plans[flavour].estimate.step_time_s)
    if co_runner is not None:
        beside, line = choose_beside(co_runner, [plans[flavour] for flavour in fitting], graph)
        chosen = next(flavour for flavour in fitting if plans[flavour] is beside)
        plans[chosen] = dataclasses.replace(beside, search_summary="; ".join(filter(None, (beside.search_summary, line))))
    runners_up = tuple(
        alternative(plans[flavour], plans[chosen]) for flavour in DATA_PARALLEL_FLAVOURS if flavour != chosen
    )
    megatron = megatron_baseline(graph, cluster, spec, model_name, precision)
    if megatron is not None:  # what tensor parallelism would give, for the comparison
        runners_up += (dataclasses.replace(alternative(megatron, plans[chosen]), name=f"baseline {megatron.name}"),)
    return dataclasses.replace(plans[chosen], runners_up=runners_up)


def data_parallel_plan(
    graph: OpGraph,
    cluster: Cluster,
    spec: ModelSpec | None,
    model_name: str,
    flavour: str,
    warnings: tuple[str, ...] = (),
    precision: str = "fp32",
) -> Plan:
    """A simulated data-parallel plan of one flavour (``ddp``, ``zero1``, ``zero2``, ``fsdp``)."""
    dp = cluster.world_size
    if graph.batch_size % dp:
        multiple = -(-graph.batch_size // dp) * dp
        raise PlanningError(
            f"the global batch of {graph.batch_size} is not divisible by the data-parallel degree {dp}; "
            f"use a global batch that is a multiple of {dp} (e.g. --set batch_size={multiple}) or fewer devices"
        )
    mesh = Mesh((("dp", dp),))
    strategies, inputs = data_parallel_layout(graph, mesh)
    plan = unsimulated_plan(
        graph, cluster, spec, model_name, mesh, strategies, inputs,
        dp_flavour=flavour,
        fsdp_units=fsdp_units(graph) if flavour in FSDP_UNIT_FLAVOURS else (),
        precision=precision,
        warnings=warnings,
    )
    return simulated(plan, graph)


def accumulating(plan: Plan, graph: OpGraph) -> Plan | None:
    """``plan`` with gradient accumulation over the fewest micro-batches (2, 4, 8, ... of
    each rank's samples) that make it fit, or None when it fits already, cannot be cut, or
    does not fit even one sample at a time. Fewer micro-batches keep each matmul larger and
    the data-parallel reduction as rare; only activations shrink with more."""
    if plan.estimate.fits or plan.pipeline is not None:
        return None
    memory = plan.estimate.memory
    if memory.total - memory.activations > plan.estimate.device_memory_bytes:
        # Micro-batches shrink only the activations: weights, gradients, optimizer states
        # and communication buffers alone overflow the device, so no count can fit.
        return None
    dp = plan.mesh.axis_size("dp") if "dp" in plan.mesh.names else 1
    local = plan.batch_size // dp
    steps = 2
    while steps <= local:
        if local % steps == 0:
            variant = simulated(dataclasses.replace(plan, accumulation_steps=steps), graph)
            if variant.estimate.fits:
                return variant
        steps *= 2
    return None


def fsdp_units(graph: OpGraph) -> tuple[str, ...]:
    """Module paths wrapped as separate FSDP units (the root holds the rest): each repeated
    block; in a model without repeated blocks (a plain stack of layers), each module that
    owns parameters, so no rank ever gathers the whole model at once."""
    blocks = graph.block_paths()
    if blocks:
        return blocks
    owners = dict.fromkeys(name.rpartition(".")[0] for name in graph.parameters)
    owners.pop("", None)  # parameters of the root itself stay in the root unit
    # A unit must be the only user of its parameters: a weight read elsewhere (tied to a
    # head, reused by another module) stays in the root, which FSDP2 gathers for the step.
    for node in graph.nodes:
        for param in node.params:
            owner = param.rpartition(".")[0]
            if owner in owners and not (node.module == owner or node.module.startswith(owner + ".")):
                owners.pop(owner)
    # A module with parameters inside another (ERNIE-4.5's router holds its bias in a child
    # module) joins its ancestor's unit: FSDP2 cannot shard a parameter that an enclosing
    # unit, wrapped first, has already sharded, and the memory model counts such a parameter
    # in the first unit whose path prefixes it (the ancestor) anyway.
    nested = [owner for owner in owners if any(owner.startswith(other + ".") for other in owners)]
    for owner in nested:
        owners.pop(owner)
    return tuple(owners) if len(owners) > 1 else ()


def alternative(plan: Plan, best: Plan) -> Alternative:
    """``plan`` summarised as a runner-up of ``best``, with the reason it lost."""
    estimate, chosen = plan.estimate, best.estimate
    if not estimate.fits:
        note = f"does not fit: needs {_size(estimate.memory.total)} of {_size(estimate.device_memory_bytes)} per device"
    else:
        slower = estimate.step_time_s / chosen.step_time_s - 1 if chosen.step_time_s else 0.0
        reason = "more exposed communication" if estimate.communication_s > chosen.communication_s else "more compute"
        note = f"{slower:+.1%} step time ({reason})"
    return Alternative(
        name=plan.name, step_time_s=estimate.step_time_s, memory_bytes=estimate.memory.total, fits=estimate.fits, note=note,
        mfu=estimate.mfu, route=plan_route(plan),
    )


def does_not_fit(cluster: Cluster, estimates: dict[str, SimResult]) -> PlanningError:
    """The error for a model no candidate fits: how much one device needs, how many it takes.

    The device count scales what FSDP shards (weights, gradients, optimizer states) and what
    the batch splits (activations) to the cluster's capacity; FSDP's unsharded unit buffers
    do not shrink with more devices, so when they alone overflow a device no count helps.
    """
    best_flavour, best = min(estimates.items(), key=lambda item: item[1].memory.total)
    capacity = cluster.min_device_memory
    need = f"the smallest plan ({best_flavour}) needs {_size(best.memory.total)} per device but a device has {_size(capacity)}"
    fsdp = estimates.get("fsdp", best)
    room = capacity - fsdp.memory.communication_buffers
    if room <= 0:
        return PlanningError(
            f"the model does not fit with data parallelism: {need}, and one layer's unsharded weights "
            f"({_size(fsdp.memory.communication_buffers)} for FSDP's gathered units) exceed a device whatever the "
            f"device count; layers this large need tensor or pipeline parallelism"
        )
    shardable = fsdp.memory.weights + fsdp.memory.gradients + fsdp.memory.optimizer_states + fsdp.memory.activations
    needed_devices = -(-shardable * cluster.world_size // room)
    return PlanningError(
        f"the model does not fit: {need}; with FSDP it would take about {needed_devices} devices, "
        f"or a smaller model or batch"
    )


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def data_parallel_candidates(context: SearchContext) -> list[Plan]:
    """The candidates part of the data-parallel families (``planner.families``): each
    flavour the constraints allow on the mesh of ``dp`` alone, then each again with its
    blocks recomputed. None when that mesh is not searched, for a model whose samples mix
    (a DDP batch split would compute another step) or with ``--tp-layouts summa``."""
    if context.whole_batch_only or context.summa_only or not any(mesh.names == ("dp",) for mesh in context.meshes):
        return []
    flavours = [
        data_parallel_plan(context.graph, context.cluster, context.spec, context.model_name, flavour, context.warnings,
                           context.precision)
        for flavour in DATA_PARALLEL_FLAVOURS if context.constraints.allows_family(flavour)
    ]
    return flavours + recomputing(flavours, context.graph)
