"""Building a plan before it is simulated: the fields every strategy family shares.

The simulator needs a whole ``Plan`` to price it, so plans are first built with a pending
estimate (``PENDING``) and then passed through ``cost_model.simulator.simulated``.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate

from planner.cluster import Cluster
from planner.graph import OpGraph
from planner.model_spec import ModelSpec
from planner.plans import ModelSummary, Plan
from planner.strategy import MemoryBreakdown, Mesh, NodeStrategy, Placements, SimResult

PENDING = SimResult(step_time_s=0.0, compute_s=0.0, communication_s=0.0, memory=MemoryBreakdown(), device_memory_bytes=0)


def model_summary(graph: OpGraph, model_name: str) -> ModelSummary:
    """What the report says about the model; tokens per sample from the first integer input."""
    tokens = next(
        (i.meta.shape[1] for i in graph.inputs if i.meta and not i.meta.dtype.is_floating_point and len(i.meta.shape) >= 2),
        0,
    )
    return ModelSummary(
        name=model_name,
        parameters=graph.parameter_count,
        parameter_bytes=graph.parameter_bytes,
        forward_flops=graph.total_flops,
        ops=len(graph),
        tracer=graph.tracer,
        blocks=dict(graph.blocks),
        tokens_per_sample=tokens,
        block_runs=graph.block_runs_text(),
    )


def unsimulated_plan(
    graph: OpGraph,
    cluster: Cluster,
    spec: ModelSpec | None,
    model_name: str,
    mesh: Mesh,
    strategies: tuple[NodeStrategy, ...],
    inputs: dict[str, Placements | None],
    **settings: Any,
) -> Plan:
    """A plan of ``graph`` on ``mesh`` with ``strategies`` and a pending estimate.

    ``settings`` are the other ``Plan`` fields (``dp_flavour``, ``recompute``, ``pipeline``,
    ``precision``, ``label``, ...); ``dp_flavour`` defaults to ``"ddp"``.
    """
    settings.setdefault("dp_flavour", "ddp")
    return Plan(
        model=spec,
        cluster=cluster,
        mesh=mesh,
        batch_size=graph.batch_size,
        inputs=inputs,
        strategies=strategies,
        estimate=PENDING,
        summary=model_summary(graph, model_name),
        graph=graph,
        **settings,
    )


def input_placements(graph: OpGraph, mesh: Mesh, strategies: tuple[NodeStrategy, ...]) -> dict[str, Placements | None]:
    """Each graph input is fed the way its first reader takes it (each rank slices locally)."""
    by_node = {s.node: s for s in strategies}
    placements = {}
    for graph_input in graph.inputs:
        if graph_input.meta is None:
            placements[graph_input.name] = None
            continue
        reader = next((n for n in graph.nodes if graph_input.name in n.inputs), None)
        if reader is None:
            placements[graph_input.name] = tuple(Replicate() for _ in mesh.names)
        else:
            placements[graph_input.name] = by_node[reader.name].inputs[reader.inputs.index(graph_input.name)]
    return placements
