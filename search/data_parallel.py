"""Data-parallel plans: the whole model on every device, the batch split over a ``dp`` axis.

Two flavours are built and compared: DDP (weights replicated, gradients all-reduced) and
FSDP (weights, gradients and optimizer states sharded, ZeRO-3). The fastest flavour that
fits in memory wins; the other is kept as the runner-up with the reason it lost.

Placements of each op are derived by following the batch through the graph: a tensor
computed from a batch-sharded tensor is sharded on the dimension that carries the batch,
a scalar reduced from one (the loss) is ``Partial("avg")``, everything else (weights and
what is computed from weights alone) is replicated.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from cost_model.analytic import data_parallel_estimate
from planner.cluster import Cluster
from planner.errors import PlanningError
from planner.graph import OpGraph, TensorMeta
from planner.model_spec import ModelSpec
from planner.plans import ModelSummary, Plan
from planner.strategy import Alternative, CostParts, Estimate, Mesh, NodeStrategy, Placements

DATA_PARALLEL_FLAVOURS = ("ddp", "fsdp")


def plan_data_parallel(
    graph: OpGraph,
    cluster: Cluster,
    spec: ModelSpec | None,
    model_name: str,
    dp_flavour: str | None = None,
    warnings: tuple[str, ...] = (),
) -> Plan:
    """The best data-parallel plan of ``graph`` on all of ``cluster``'s devices.

    Args:
        graph: the traced model.
        cluster: the cluster; every device is one data-parallel rank.
        spec: how to rebuild the model inside torchrun (``None``: the plan cannot be compiled).
        model_name: shown in the report.
        dp_flavour: force ``"ddp"`` or ``"fsdp"``; ``None`` picks the fastest that fits.
        warnings: notes gathered while tracing, carried into the plan.

    Raises:
        PlanningError: the batch does not split over the devices, or no flavour fits.
    """
    dp = cluster.world_size
    if dp_flavour is not None and dp_flavour not in DATA_PARALLEL_FLAVOURS:
        raise PlanningError(
            f"data-parallel flavour '{dp_flavour}' is not available; choose one of {', '.join(DATA_PARALLEL_FLAVOURS)}"
        )
    if graph.batch_size % dp:
        multiple = -(-graph.batch_size // dp) * dp
        raise PlanningError(
            f"the global batch of {graph.batch_size} is not divisible by the data-parallel degree {dp}; "
            f"use a global batch that is a multiple of {dp} (e.g. --set batch_size={multiple}) or fewer devices"
        )
    mesh = Mesh((("dp", dp),))
    units = fsdp_units(graph)
    unit_bytes = list(unit_parameter_bytes(graph, units).values())[::-1]  # root first
    estimates = {
        flavour: data_parallel_estimate(graph, cluster, flavour, unit_bytes=unit_bytes)
        for flavour in DATA_PARALLEL_FLAVOURS
    }
    candidates = [dp_flavour] if dp_flavour else list(DATA_PARALLEL_FLAVOURS)
    fitting = [flavour for flavour in candidates if estimates[flavour].fits]
    if not fitting:
        raise _does_not_fit(graph, cluster, {f: estimates[f] for f in candidates})
    chosen = min(fitting, key=lambda flavour: estimates[flavour].step_time_s)
    runners_up = tuple(
        Alternative(
            name=f"{flavour} ({mesh})",
            step_time_s=estimates[flavour].step_time_s,
            memory_bytes=estimates[flavour].memory.total,
            fits=estimates[flavour].fits,
            note=_why_not(flavour, estimates[flavour], estimates[chosen]),
        )
        for flavour in DATA_PARALLEL_FLAVOURS
        if flavour != chosen
    )
    input_placements = {
        graph_input.name: ((Shard(0),) if graph_input.batch_dim == 0 else (Replicate(),)) if graph_input.meta else None
        for graph_input in graph.inputs
    }
    return Plan(
        model=spec,
        cluster=cluster,
        mesh=mesh,
        dp_flavour=chosen,
        batch_size=graph.batch_size,
        inputs=input_placements,
        strategies=batch_sharded_strategies(graph, estimates[chosen]),
        estimate=estimates[chosen],
        summary=ModelSummary(
            name=model_name,
            parameters=graph.parameter_count,
            parameter_bytes=graph.parameter_bytes,
            forward_flops=graph.total_flops,
            ops=len(graph),
            tracer=graph.tracer,
            blocks=dict(graph.blocks),
        ),
        fsdp_units=units if chosen == "fsdp" else (),
        runners_up=runners_up,
        warnings=warnings,
    )


def fsdp_units(graph: OpGraph) -> tuple[str, ...]:
    """Module paths wrapped as separate FSDP units: each repeated block (the root holds the rest)."""
    return tuple(f"{group}.{index}" for group, count in graph.blocks.items() for index in range(count))


def unit_parameter_bytes(graph: OpGraph, units: tuple[str, ...]) -> dict[str, int]:
    """Parameter bytes of each FSDP unit; ``""`` is the root unit (parameters in no block)."""
    sizes = {unit: 0 for unit in units}
    sizes[""] = 0
    for name, meta in graph.parameters.items():
        owner = next((unit for unit in units if name.startswith(unit + ".")), "")
        sizes[owner] += meta.nbytes
    return sizes


def batch_sharded_strategies(graph: OpGraph, estimate: Estimate) -> tuple[NodeStrategy, ...]:
    """Per-op placements on a 1-D ``dp`` mesh when the batch is split over it."""
    placement_of: dict[str, Placement] = {
        graph_input.name: Shard(0) if graph_input.batch_dim == 0 else Replicate()
        for graph_input in graph.inputs
        if graph_input.meta
    }
    compute_share = estimate.compute_s / max(1, graph.total_flops)
    strategies = []
    for node in graph.nodes:
        inputs = tuple(placement_of.get(name, Replicate()) for name in node.inputs)
        batch_input = next(
            ((meta, p) for meta, p in zip(node.input_meta, inputs) if isinstance(p, Shard)), None
        )
        outputs = tuple(_output_placement(batch_input, out) for out in node.output_meta)
        if outputs:
            placement_of[node.name] = outputs[0]
        strategies.append(
            NodeStrategy(
                node=node.name,
                op=node.op,
                module=node.module,
                inputs=tuple((p,) for p in inputs),
                outputs=tuple((p,) for p in outputs),
                params={name: (Replicate(),) for name in node.params},
                cost=CostParts(compute_s=node.flops * compute_share),
            )
        )
    return tuple(strategies)


def _output_placement(batch_input: tuple[TensorMeta, Placement] | None, output: TensorMeta) -> Placement:
    if batch_input is None:
        return Replicate()
    meta, placement = batch_input
    if not output.shape:
        return Partial("avg")  # a reduction over the batch, e.g. the mean loss
    batch = meta.shape[placement.dim]
    if placement.dim < len(output.shape) and output.shape[placement.dim] == batch:
        return Shard(placement.dim)
    for dim, size in enumerate(output.shape):
        if size % batch == 0:
            return Shard(dim)  # the batch was moved or folded into this dimension
    return Partial("avg")


def _why_not(flavour: str, estimate: Estimate, best: Estimate) -> str:
    if not estimate.fits:
        return f"does not fit: needs {_gib(estimate.memory.total)} of {_gib(estimate.device_memory_bytes)} per device"
    slower = estimate.step_time_s / best.step_time_s - 1 if best.step_time_s else 0.0
    reason = "more communication" if estimate.communication_s > best.communication_s else "more compute"
    return f"{slower:+.0%} step time ({reason})"


def _does_not_fit(graph: OpGraph, cluster: Cluster, estimates: dict[str, Estimate]) -> PlanningError:
    best_flavour, best = min(estimates.items(), key=lambda item: item[1].memory.total)
    per_device = best.memory.total
    capacity = cluster.min_device_memory
    # Weights, gradients and optimizer states shard with FSDP; activations split with the batch.
    sharded = best.memory.weights + best.memory.gradients + best.memory.optimizer_states + best.memory.activations
    needed_devices = -(-sharded * cluster.world_size // max(1, capacity - best.memory.communication_buffers))
    return PlanningError(
        f"the model does not fit with data parallelism: the smallest plan ({best_flavour}) needs "
        f"{_gib(per_device)} per device but a device has {_gib(capacity)}; it would take about "
        f"{needed_devices} devices with FSDP, or a smaller model or batch"
    )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
