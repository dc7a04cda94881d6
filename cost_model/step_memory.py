"""Memory of one device in a step: weights, gradients and optimizer states after the
sharding of the contributor that owns the parameters (``StepContributor.parameter_sharding``:
the data-parallel flavour's), activations held by the micro-batches in flight, communication
buffers; and the bytes each mesh axis carries. Functions of the ``StepContext``.
"""

from __future__ import annotations

from cost_model.deepspeed_checkpointing import kept_checkpoint_bytes
from cost_model.megatron_grad_sync import runs_megatron_sync
from cost_model.parameter_bytes import FP32_GRADIENT_BYTES, PARAM_BYTES
from cost_model.recompute import activation_bytes
from cost_model.schedules import schedule as pipeline_schedule
from cost_model.segments import Segment
from cost_model.step_context import StepContext
from cost_model.step_contributor import ParameterSharding, StepContributor, overriding
from planner.device_groups import rank_devices
from planner.strategy import MemoryBreakdown


def fullest_rank_memory(context: StepContext, contributors: tuple[StepContributor, ...], costs: dict[str, NodeCost],
                        memory: MemoryBreakdown) -> tuple[MemoryBreakdown, int] | None:
    """Where a contributor gives each rank its own memory (``StepContributor.rank_memory``):
    the breakdown of the rank whose memory fills the largest fraction of its own device's
    capacity, and that capacity (a rank of a larger device may hold more and still fit);
    else None."""
    for rank_memory in overriding(contributors, "rank_memory"):
        by_rank = rank_memory(context, costs, memory)
        if by_rank:
            capacities = [device.memory_bytes for device in rank_devices(context.cluster)]
            rank = max(range(len(by_rank)), key=lambda r: (by_rank[r].total / max(capacities[r], 1), -r))
            return by_rank[rank], capacities[rank]
    return None


def parameter_sharding(context: StepContext, contributors: tuple[StepContributor, ...]) -> ParameterSharding:
    """How the parameters are sharded: the first contributor's that owns them, else not at all."""
    for contributor in contributors:
        sharding = contributor.parameter_sharding(context)
        if sharding is not None:
            return sharding
    return ParameterSharding()


def device_parameters(segments: list[Segment]) -> Segment:
    """The parameters a device holding ``segments`` keeps, each once however many of its
    segments read it (a weight tied between the token embedding and the output layer is read
    by the first and the last segment, and stepped once): one ``Segment`` holding their
    ``params``, ``shapes`` and ``per_rank``, nothing else."""
    held = Segment(name="parameters", stage=segments[0].stage if segments else 0)
    for segment in segments:
        held.params.update(segment.params)
        held.shapes.update(segment.shapes)
        held.per_rank |= segment.per_rank
    return held


def expert_state_shards(context: StepContext) -> dict[str, int]:
    """Expert weights whose optimizer states Megatron-Core's distributed optimizer shards over
    their expert-data-parallel group, by qualified name -> that group's size: its expert
    parameters get their own optimizer over ``intra_expt_dp_group`` (NVIDIA/Megatron-LM
    megatron/core/optimizer/__init__.py, ``get_megatron_optimizer``: the ``is_expert_parallel``
    param groups, ``data_parallel_group=intra_expt_dp_group``), as the dense ones over dp.
    Empty unless the plan runs that optimizer; a weight not listed is stepped whole."""
    if not runs_megatron_sync(context):
        return {}
    # Sharded copies hold 1/EDP of their weights already (``LaidOutLayer.param_fraction``).
    return {weight: layer.expert_data_parallel for layer in context.moe_layers.values()
            for weight in layer.expert_weights if layer.expert_data_parallel > 1 and layer.copy_shards == 1}


def _own_state_elements(context: StepContext, params: dict[str, float], per_rank: set[str]) -> float:
    """Elements of the device's own (``per_rank``) weights whose optimizer states it steps:
    each divided by its expert-data-parallel shards (``expert_state_shards``)."""
    shards = expert_state_shards(context)
    return sum(count / shards.get(name, 1) for name, count in params.items() if name in per_rank)


def optimizer_state_bytes(context: StepContext, segments: list[Segment], sharding: ParameterSharding) -> float:
    """Bytes the optimizer step reads and writes on a device holding ``segments``: weights,
    gradients and states of its parameters (each once: ``device_parameters``), the shardable
    ones divided by the states' shards (but for those ZeRO-1 steps whole:
    ``ParameterSharding.whole_state_elements``)."""
    weights, grads, states = PARAM_BYTES[context.plan.precision]
    held = device_parameters(segments)
    elements = sum(held.params.values())
    shardable = held.shardable_elements() - sharding.whole_state_elements(held.params, held.shapes, held.per_rank)
    own = sum(count for name, count in held.params.items() if name in held.per_rank)
    stepped_own = _own_state_elements(context, held.params, held.per_rank)
    return (shardable / sharding.states + elements - shardable - own + stepped_own) * (weights + grads + states)


def stage_memory(context: StepContext, contributors: tuple[StepContributor, ...], stage: int,
                 segments: list[Segment]) -> MemoryBreakdown:
    """Peak memory of one device of pipeline stage ``stage``, which runs ``segments``."""
    plan = context.plan
    weight_b, grad_b, state_b = PARAM_BYTES[plan.precision]
    if plan.pipeline is not None and plan.pipeline.gradient_accumulation == "fp32-copy":
        # DeepSpeed's BF16_Optimizer keeps an fp32 gradient the size of the whole 16-bit
        # group (deepspeed/runtime/bf16_optimizer.py: fp32_groups_gradients_flat, zeros_like
        # the bf16 flat group, in fp32) beside the 16-bit gradients each backward writes.
        grad_b = FP32_GRADIENT_BYTES + grad_b
    elif runs_megatron_sync(context):
        # Megatron-Core under --bf16 accumulates into an fp32 gradient buffer the size of every
        # local weight, not sharded over dp (cost_model.megatron_grad_sync; Megatron-LM's
        # docs/source/api-guide/dist_optimizer.md: "bf16 param, fp32 grads": 6 + 12/d bytes
        # per parameter with the distributed optimizer, 2 of weights and 4 of gradients).
        grad_b = FP32_GRADIENT_BYTES
    held = device_parameters(segments)
    params, shapes, per_rank = held.params, held.shapes, held.per_rank
    elements = sum(params.values())
    own = sum(count for name, count in params.items() if name in per_rank)  # never sharded over dp
    shared = elements - own
    sharding = parameter_sharding(context, contributors)
    weights = shared * weight_b / sharding.weights + own * weight_b
    grads = shared * grad_b / sharding.gradients + own * grad_b
    whole = sharding.whole_state_elements(params, shapes, per_rank)  # ZeRO-1 steps these whole
    own_states = _own_state_elements(context, params, per_rank)  # experts: 1/EDP under Megatron's optimizer
    states = (shared - whole) * state_b / sharding.states + (own_states + whole) * state_b
    buffers_state = sum(meta.nbytes for meta in context.graph.buffers.values()) if stage == 0 else 0
    activations = _peak_activations(context, stage, segments)
    comm = 0.0
    for contributor in contributors:  # the data-parallel flavour's gathered units or bucket
        comm += contributor.communication_buffer_bytes(context, segments, elements, weight_b, grad_b)
    if context.pp > 1:
        comm += 2 * max((s.input_bytes for s in segments), default=0.0)
    # One MoE layer dispatches at a time: the largest of their buffers, with (sharded
    # copies) its experts' gathered weights and those of the layer prefetched.
    comm += max((layer.buffer_bytes + 2 * layer.gathered_bytes for layer in context.moe_layers.values()), default=0.0)
    # One op runs at a time: the largest transient buffer of one (a SUMMA matmul's blocks).
    comm += max((segment.buffer_bytes for segment in segments), default=0.0)
    return MemoryBreakdown(
        weights=int(weights + buffers_state),
        gradients=int(grads),
        optimizer_states=int(states),
        activations=int(activations),
        communication_buffers=int(comm),
    )


def _peak_activations(context: StepContext, stage: int, segments: list[Segment]) -> float:
    """Peak bytes held for backward by the micro-batches in flight on this device."""
    chunk_bytes: dict[int, float] = {}
    transient = 0.0
    for segment in segments:
        chunk = segment.stage // context.pp
        kept, recomputed = activation_bytes(segment, context.plan.recompute_at(segment.stage))
        kept -= segment.checkpoint_bytes - kept_checkpoint_bytes(context, segment)  # DeepSpeed's partitioned checkpoint
        transient = max(transient, recomputed)
        chunk_bytes[chunk] = chunk_bytes.get(chunk, 0.0) + kept
    held = peak = 0.0
    for kind, _, chunk in pipeline_schedule(context.schedule_name, stage, context.pp, context.micro_batches,
                                            context.chunks):
        held += chunk_bytes.get(chunk, 0.0) if kind == "F" else -chunk_bytes.get(chunk, 0.0)
        peak = max(peak, held)
    if context.plan.moe_a2a_overlap and context.micro_batches > 1:
        # The next micro-batch's forward runs beside this one's backward (cost_model.moe_overlap):
        # one more micro-batch's activations held (Megatron-Core adds a warm-up micro-batch).
        peak = min(peak + max(chunk_bytes.values(), default=0.0),
                   context.micro_batches * sum(chunk_bytes.values()))
    return peak + transient


def pipeline_boundary_bytes(context: StepContext) -> list[tuple[float, float]]:
    """Per boundary between (virtual) stages k and k+1, the bytes of one micro-batch one
    device sends over it: (forward: every value made by stage k or before that a later
    stage reads, integer ones and graph inputs such as the targets included, as
    ``codegen.pipeline_emit`` relays them; backward: the gradients of its floating-point
    values made by ops). Parameters are not sent (each stage holds its own)."""
    stages = context.pp * context.chunks
    forward, backward = [0.0] * (stages - 1), [0.0] * (stages - 1)
    graph, strategies = context.graph, context.strategies
    params = set(graph.parameters)
    graph_inputs = {graph_input.name: graph_input for graph_input in graph.inputs}
    last_reader: dict[str, int] = {}
    for node in graph.nodes:
        stage = strategies[node.name].stage
        for name in node.inputs:
            if name not in params:
                last_reader[name] = max(last_reader.get(name, -1), stage)
    for name, reader in sorted(last_reader.items()):
        if name in graph_inputs:
            meta, made = graph_inputs[name].meta, 0
            local = (meta.nbytes / context.shard_factor(context.plan.inputs.get(name) or ()) / context.micro_batches
                     if meta else 0.0)
            float_bytes = 0.0  # a graph input gets no gradient
        elif name in strategies:
            node, strategy = context.nodes[name], strategies[name]
            made = strategy.stage
            local = float_bytes = 0.0
            for meta, placements in zip(node.output_meta, strategy.outputs):
                scale = context.activation_scale if meta.dtype.is_floating_point else 1.0
                size = meta.nbytes * scale / context.shard_factor(placements) / context.micro_batches
                local += size
                float_bytes += size if meta.dtype.is_floating_point else 0.0
        else:
            continue
        for boundary in range(made, min(reader, stages - 1)):
            forward[boundary] += local
            backward[boundary] += float_bytes
    return list(zip(forward, backward))


def bytes_per_axis(context: StepContext, contributors: tuple[StepContributor, ...],
                   segments: list[Segment], boundaries: list[tuple[float, float]] | None = None) -> dict[str, float]:
    """Bytes a device of the busiest stage sends per step, by mesh axis. ``boundaries``:
    ``pipeline_boundary_bytes(context)`` where the caller has it already (it reads every
    node: a delta re-simulation keeps it while no stage or output placement changes)."""
    totals: dict[str, float] = {}
    by_stage: dict[int, dict[str, float]] = {}
    for segment in segments:
        stage_totals = by_stage.setdefault(segment.stage % context.pp, {})
        for axis, sent in segment.axis_bytes.items():
            stage_totals[axis] = stage_totals.get(axis, 0.0) + sent * context.micro_batches
        for contributor in contributors:  # the data-parallel flavour's gathers and reductions
            contributor.add_axis_bytes(context, segment, stage_totals)
    if context.pp > 1:
        if boundaries is None:
            boundaries = pipeline_boundary_bytes(context)
        for boundary, (forward, backward) in enumerate(boundaries):
            # The sender of the activations is stage k's device; stage k+1's device
            # sends their gradients back.
            for device, sent in ((boundary % context.pp, forward), ((boundary + 1) % context.pp, backward)):
                stage_totals = by_stage.setdefault(device, {})
                stage_totals["pp"] = stage_totals.get("pp", 0.0) + sent * context.micro_batches
    for stage_totals in by_stage.values():
        for axis, sent in stage_totals.items():
            totals[axis] = max(totals.get(axis, 0.0), sent)
    return totals
