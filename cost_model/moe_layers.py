"""How a plan's Mixture-of-Experts layers enter the simulated step.

A plan with ``expert_layouts`` runs each MoE layer its own way (``planner.strategy.
ExpertLayout``); the traced ops of the layer (router, routing, dispatch, experts, combine)
are not priced by their placements as other ops are. Instead:

- the **experts** (the ops of the module that owns the stacked expert weights) are priced by
  ``cost_model.moe.moe_layer_cost`` in the layout's mode, on the busiest device, their GEMMs
  on the kernels the plan's ``expert_implementation`` names (empty: the compiled program's,
  ``planner.expert_kernels.expert_kernel``): forward and
  backward compute, and the dispatch and combine all-to-alls (or the expert-sliced gather
  and reduce-scatter), which sit on the critical path (the experts wait for their tokens);
  with them, on the layer's anchor op, the memory-bound kernels around the expert GEMMs as
  those kernels' program runs them (``memory_op_times``: Megatron-Core's activation function
  and permutations of the received rows, ``expert_memory_op_times``; the compiled programs'
  own, ``cost_model.expert_memory_ops``);
- the **routing** ops around them run on each rank's own tokens: their traced work split
  over the ``dp`` ranks, no resharding (tokens move only by the layout's collectives), and
  the layer hands its output back split as the batch is; one small all-gather of each
  rank's counts of choices per expert (forward) puts the choices in the whole batch's order;
- **memory** per device: expert weights, gradients and optimizer states of the experts the
  device holds (expert parallel: its copies; data parallel: all; expert-sliced: 1/world of
  each), the activations the experts keep for the busiest device's copies, and the dispatch
  buffers of the micro-batch in flight (``dispatch_buffer_bytes``: expert parallel, a send
  buffer of the device's own kept copies and a receive buffer of the busiest device's, padded
  to the capacity; expert-sliced, the gathered copies);
- **gradients**: expert weights are all-reduced over ``dp`` with the other replicated
  weights only in ``data_parallel`` mode; the copies of expert-parallel experts have their
  gradients summed (one all-reduce over the group of every copied expert, in backward);
- **sharded copies** (``ExpertLayout.sharded_copies``, expert data parallelism): each device
  holds 1/r of its experts' weights, gradients and optimizer states (r copies per expert),
  and, as FSDP2 runs a unit (``codegen.runtime.expert_copies``), all-gathers its experts'
  weights over its copy group before the layer's forward and again before its backward
  (on the collective stream, overlapped with the compute before it as FSDP's prefetch is:
  ``NodeCost.weight_gather_s``) and reduce-scatters their gradients there after every
  micro-batch's backward (FSDP2 has no ``no_sync``; overlapped with the rest of backward on
  the reduce-scatter stream: ``NodeCost.copy_reduce_s``), in place of the copies'
  all-reduce. The gathered weights of the layer running and of the one prefetched are alive
  at once (communication buffers). A folded layout (``cost_model.moe_folding``) shards over
  its expert-data-parallel groups (``expert_data_parallel_groups``), as Megatron-FSDP does.

The collectives are the compiled program's (``codegen/runtime/moe.py``, ``moe_modes.py``).

``laid_out_layers`` gathers all of this for the simulator; ``price_layout`` is what the
search scores a candidate layout with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from cost_model.collectives import collective_time
from cost_model.compute import efficiencies
from cost_model.expert_memory_ops import (BATCHED_GELU_KERNELS, batched_gelu_times, expert_loop_kernels,
                                          expert_loop_times)
from cost_model.memory_kernels import STREAMING_EFFICIENCY
from cost_model.simulation_cache import graph_facts
from cost_model.moe import MoECost, MoELayer, element_bytes, expert_activation_bytes, moe_layer_cost
from cost_model.moe_folding import folded_layer_cost
from planner.cluster import Cluster
from planner.graph import OpGraph
from planner.moe_blocks import MoEBlock
from planner.program_shape import shards_expert_copies_in_bf16
from planner.families.moe_folding.section import folding_of
from planner.expert_kernels import BATCHED_MATMUL, PER_EXPERT_LOOP, expert_kernel
from planner.expert_layouts import FOLDED_AXIS_JOIN
from planner.strategy import CostParts, ExpertLayout, expert_axes

# Memory-bound kernels around an expert-parallel rank's expert GEMMs a pass, forward and
# backward alike (``expert_memory_op_times``): the activation function and the permutation of
# the received rows into expert order and back (Megatron-Core's fused ``bias_swiglu``,
# ``permute`` and ``unpermute``, one kernel each with ``--moe-permute-fusion``).
EXPERT_MEMORY_KERNELS = 3


@dataclass(frozen=True)
class LaidOutLayer:
    """One MoE layer of a plan, priced for one micro-batch on the busiest device.

    ``nodes`` are all the layer's ops, ``expert_nodes`` those of its experts; ``anchor`` (the
    first expert op) carries the layer's expert cost in the simulation, the other expert ops
    none. ``param_fraction`` is the share of each stacked expert weight a device holds;
    ``gradients_synced`` whether those gradients are all-reduced over ``dp``."""

    block: MoEBlock
    layout: ExpertLayout
    cost: MoECost
    nodes: frozenset[str]
    expert_nodes: frozenset[str]
    anchor: str
    expert_weights: tuple[str, ...]  # qualified names
    param_fraction: float
    gradients_synced: bool
    replica_sync_s: float  # summing the gradients of copied experts, per step
    copy_gather_s: float  # sharded copies: one all-gather of the device's experts, per pass
    copy_reduce_s: float  # sharded copies: the reduce-scatter of their gradients, per micro-batch
    copy_sent_bytes: float  # bytes a device sends for those, per micro-batch (two gathers, one reduce-scatter)
    gathered_bytes: float  # sharded copies: the device's experts' weights gathered whole
    routing_sync_s: float  # the routing's all-gather of counts, per micro-batch, in forward
    activation_bytes: float
    buffer_bytes: float
    # Of ``activation_bytes``, what the experts' activation function keeps beyond its input
    # (for SwiGLU: silu(gate) and its product with up, the second matmul's input), and the
    # seconds to run it again: what Megatron-Core's ``moe_act`` recomputation drops and adds
    # (planner.strategy.NORMS_MOE_ACT, cost_model.recompute).
    activation_function_bytes: float = 0.0
    activation_function_s: float = 0.0
    # The memory-bound kernels around the experts' GEMMs, forward and backward seconds a
    # micro-batch (``expert_memory_op_times``): carried by the anchor op with the GEMMs.
    memory_ops_forward_s: float = 0.0
    memory_ops_backward_s: float = 0.0
    # (forward, backward) kernels the host launches for the experts a micro-batch beyond the
    # layer's one op: the grouped GEMM's per-expert GEMMs (``MoECost.gemm_launches``) and the
    # memory-bound kernels around them (``EXPERT_MEMORY_KERNELS``). The anchor op charges the
    # host a launch for each (``cost_model.node_costs``), as the device already pays one.
    expert_launches: tuple[int, int] = (0, 0)
    # Folded layouts: the ranks holding the same experts (EDP = folded ranks / (EP x ETP)),
    # over which Megatron-Core's distributed optimizer shards the experts' states
    # (``cost_model.step_memory.expert_state_shards``); 1 otherwise.
    expert_data_parallel: int = 1
    # The copies each expert's weights are sharded over (``copies_sharded_over``), else 1.
    copy_shards: int = 1


def moe_layer_of(block: MoEBlock, tokens: int) -> MoELayer:
    """The cost model's view of ``block`` when ``tokens`` tokens enter it."""
    return MoELayer(tokens=tokens, hidden=block.hidden, ffn=block.ffn, experts=block.experts, top_k=block.top_k,
                    matmuls=block.matmuls)


def layer_tokens(graph: OpGraph, block: MoEBlock) -> int:
    """Tokens entering ``block`` in one step: the rows its router reads (every dim of the
    router's input but the last). The router weight may reach its matmul through ops that
    only convert it (DeepSeek-V3 casts it to fp32 first): those are followed to the op that
    multiplies it with the activations."""
    weight_like = {f"{block.module}.{block.router}"}  # the router weight and its conversions
    for node in graph.moe_nodes(block.module):
        carried = [i for i, name in enumerate(node.inputs) if name in weight_like]
        carried += [node.inputs.index(node.param_inputs[node.params.index(p)]) for p in node.params if p in weight_like]
        if not carried:
            continue
        others = [meta for i, meta in enumerate(node.input_meta) if i not in carried]
        if not others:  # a conversion of the weight alone: its output carries the weight on
            weight_like.add(node.name)
            continue
        tokens = 1
        for size in others[0].shape[:-1]:
            tokens *= size
        return tokens
    raise ValueError(f"MoE layer {block.module!r}: no traced op multiplies its router weight "
                     f"{block.module}.{block.router!r} with the tokens")


def expert_module(block: MoEBlock) -> str:
    """The module path that owns the stacked expert weights (``blocks.0.moe.experts``)."""
    owner = block.expert_weights[0].rpartition(".")[0]
    return f"{block.module}.{owner}" if owner else block.module


def price_layout(
    block: MoEBlock, layout: ExpertLayout, tokens: int, cluster: Cluster, precision: str, micro_batches: int = 1,
    ranks: Sequence[int] | None = None, implementation: str = "",
) -> MoECost:
    """``moe_layer_cost`` of ``block`` run as ``layout`` says, over ``ranks`` (all of
    ``cluster``'s devices when None), for one micro-batch of a step whose ``tokens`` tokens
    enter the layer (``tokens`` are the group's: a pipeline stage's dp ranks see the batch
    once, whatever the other axes), the expert GEMMs on ``implementation``'s kernels (a
    ``Plan.expert_implementation``; empty: the compiled program's for this block and mode)."""
    return moe_layer_cost(
        moe_layer_of(block, tokens // micro_batches),
        layout.mode,
        cluster,
        list(ranks) if ranks is not None else list(range(cluster.world_size)),
        token_share=layout.expert_loads or None,
        placement=layout.placement,
        capacity_factor=layout.capacity_factor or None,
        algorithm=layout.all_to_all,
        precision=precision,
        routing_groups=block.routing_groups,
        implementation=expert_kernel(implementation, block.runtime, layout.mode),
    )


def replica_sync_time(block: MoEBlock, layout: ExpertLayout, cluster: Cluster, precision: str,
                      ranks: Sequence[int] | None = None) -> float:
    """Seconds summing the gradients of the experts that have copies (expert parallel
    only), as the compiled program does (``codegen.runtime.moe``): one all-reduce over the
    whole group of every copied expert's gradient, each rank adding its copies (zeros for
    the experts it does not hold). Sharded copies reduce-scatter instead (``copy_shard_costs``)."""
    if layout.placement is None or layout.sharded_copies:
        return 0.0
    copied = sum(1 for copies in layout.placement.replicas if len(copies) > 1)
    if not copied:
        return 0.0
    gradients = copied * block.matmuls * block.hidden * block.ffn * element_bytes(precision)
    group = list(ranks) if ranks is not None else list(range(layout.placement.devices))
    return collective_time("all_reduce", gradients, cluster, group)


@dataclass(frozen=True)
class CopyShardCosts:
    """What sharding each expert over its r copies costs one device of a layer (seconds,
    bytes): one all-gather of its experts' weights over its copy group, the reduce-scatter
    of their gradients there, the bytes it sends for two gathers (forward and backward) and
    one reduce-scatter, and the gathered weights' bytes."""

    gather_s: float = 0.0
    reduce_s: float = 0.0
    sent_bytes: float = 0.0
    gathered_bytes: float = 0.0


def expert_data_parallel_groups(layout: ExpertLayout, folded: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """The expert-data-parallel groups of a folded ``layout`` over the ``folded`` ranks (mesh
    order): the ranks holding the same experts, ``EP x ETP`` apart
    (``cost_model.moe_folding``: Megatron's order, ETP innermost, then EP, then EDP), one
    group per position in the EP x ETP block."""
    block = layout.placement.devices * layout.tensor_parallel
    return tuple(tuple(folded[start::block]) for start in range(block))


def copy_shard_costs(block: MoEBlock, layout: ExpertLayout, cluster: Cluster, precision: str,
                     folded: Sequence[int] | None = None) -> CopyShardCosts:
    """``CopyShardCosts`` of ``layout`` (zeros unless ``sharded_copies``): over the
    placement's copy groups, or, for a folded layout over ``folded`` ranks, its
    expert-data-parallel groups (``expert_data_parallel_groups``). Every copy group
    gathers at once, so the groups share the inter-node links (``concurrent_groups``); the
    slowest group is charged. Weights and gradients move in the dtypes the compiled program
    moves them in: a bf16 plan's experts gather bf16 and reduce-scatter fp32 gradients
    (``planner.program_shape.shards_expert_copies_in_bf16``); otherwise both in the
    precision's element size. Megatron-FSDP moves the same: bf16 weights gathered, gradients
    reduced in fp32 (NVIDIA/Megatron-LM 1e057005, megatron/training/arguments.py: under
    ``--bf16`` ``accumulate_allreduce_grads_in_fp32`` unless ``--grad-reduce-in-bf16``, which
    becomes the custom FSDP's ``grad_reduce_in_fp32``, megatron/training/training.py)."""
    if not layout.sharded_copies:
        return CopyShardCosts()
    groups = (expert_data_parallel_groups(layout, folded) if folded is not None
              else layout.placement.copy_groups)
    copies = len(groups[0])
    experts_held = layout.placement.most_experts_per_device
    elements = experts_held * block.matmuls * block.hidden * block.ffn
    gathered = elements * element_bytes(precision)
    reduced = elements * 4 if shards_expert_copies_in_bf16(precision) else gathered  # fp32 reduce_dtype
    shapes = {tuple(group) for group in groups}
    gather = max(collective_time("all_gather", gathered, cluster, list(g), concurrent_groups=len(groups)) for g in shapes)
    reduce = max(collective_time("reduce_scatter", reduced, cluster, list(g), concurrent_groups=len(groups))
                 for g in shapes)
    # A ring all-gather or reduce-scatter sends (r - 1) / r of the whole tensor from each device:
    # two gathers (forward, backward) and one reduce-scatter.
    sent = (2 * gathered + reduced) * (copies - 1) / copies
    return CopyShardCosts(gather, reduce, sent, gathered)


def dispatch_buffer_bytes(block: MoEBlock, layout: ExpertLayout, cost: MoECost, tokens: int, world: int,
                          precision: str) -> float:
    """Bytes of the dispatch buffers one device holds while a layer of ``cost`` (priced for a
    micro-batch of ``tokens`` tokens) exchanges its copies: expert parallel, the send side
    (its own ``tokens / world x top_k`` copies, less the dropped share) plus the receive side
    (the busiest device's copies, padded to the capacity: ``cost.buffer_bytes``), rows of
    ``hidden`` elements; expert-sliced, the gathered copies; data parallel, none. One
    micro-batch's: the layer's collectives run one at a time in the simulated step."""
    if layout.mode == "expert_sliced":
        return cost.buffer_bytes
    if layout.mode != "expert_parallel":
        return 0.0
    sent = tokens / world * block.top_k * (1.0 - cost.dropped_fraction) * block.hidden * element_bytes(precision)
    return sent + cost.buffer_bytes


def copies_sharded_over(layout: ExpertLayout, ranks: int = 0) -> int:
    """r, the copies each expert's weights are sharded over (``sharded_copies``), else 1: a
    folded layout's over ``ranks`` (dp x tp), its EDP = ranks / (EP x ETP); otherwise the
    placement's copies."""
    if not layout.sharded_copies:
        return 1
    if FOLDED_AXIS_JOIN in layout.axis:
        return ranks // (layout.placement.devices * layout.tensor_parallel)
    return len(layout.placement.copy_groups[0])


def routing_sync_time(block: MoEBlock, cluster: Cluster, ranks: Sequence[int] | None = None) -> float:
    """Seconds of the one collective every mode's routing makes in forward: an all-gather of
    each rank's count of choices per (choice rank, expert), int64, so each rank places its
    choices in the whole batch's order (``codegen.runtime.moe.route``), over ``ranks`` (all
    of ``cluster``'s devices when None)."""
    group = list(ranks) if ranks is not None else list(range(cluster.world_size))
    if len(group) == 1:
        return 0.0
    return collective_time("all_gather", len(group) * block.top_k * block.experts * 8, cluster, group)


def expert_group(mesh, axis: str) -> tuple[int, ...]:
    """The ranks of the first group along mesh axis ``axis`` (the others' coordinates 0): the
    group an MoE layer's layout is priced on. On a ``dp`` mesh, every rank; in a pipeline
    (``pp x dp``), the first stage's dp ranks, whose tokens are the whole batch's once (each
    stage's group is priced alike: the cluster is homogeneous where pipelines are searched).
    A folded ``axis`` (``"dp*tp"``: ``planner.strategy.expert_axes``) spans every rank of its
    axes, in mesh order."""
    group = (0,)
    for name in expert_axes(axis):
        stride = 1
        for other, size in reversed(mesh.axes):
            if other == name:
                break
            stride *= size
        else:
            raise ValueError(f"mesh {mesh} has no axis {name!r}")
        group = tuple(rank + k * stride for rank in group for k in range(mesh.axis_size(name)))
    return tuple(sorted(group))


def routing_sync_bytes(block: MoEBlock, world: int) -> float:
    """Bytes one device sends for that all-gather: (n-1)/n of its n x top_k x experts int64."""
    return (world - 1) * block.top_k * block.experts * 8.0


def param_share(layout: ExpertLayout, world: int) -> tuple[float, bool]:
    """(share of each stacked expert weight a device holds, whether its gradient is
    all-reduced over ``dp``) under ``layout``; expert parallel counts the fullest device
    (with sharded copies, 1/r of each of its experts)."""
    if layout.mode == "data_parallel":
        return 1.0, True
    if layout.mode == "expert_sliced":
        return 1.0 / world, False
    placement = layout.placement
    return (placement.most_experts_per_device / layout.experts / copies_sharded_over(layout, world)
            / layout.tensor_parallel), False


def laid_out_layers(plan, graph: OpGraph, micro_batches: int) -> dict[str, LaidOutLayer]:
    """The plan's MoE layers by module path, priced (see the module docstring).

    Raises:
        ValueError: a layout names a module that is not an MoE layer of ``graph``, or whose
            experts or top-k differ from the traced layer's.
    """
    if not plan.expert_layouts:
        return {}
    facts = graph_facts(graph)
    cache, by_identity = facts.moe_layers, facts.moe_layers_by_identity
    layers = {}
    folding = folding_of(plan)  # a folded plan prices its layers over dp x tp (cost_model.moe_folding)
    for layout in plan.expert_layouts:
        implementation = getattr(plan, "expert_implementation", "")
        known = (id(layout), id(plan.cluster), id(plan.mesh), plan.precision, micro_batches, implementation)
        if known in by_identity:
            layers[layout.module] = by_identity[known][-1]
            continue
        # The layout without its cost annotation (a simulated plan's layouts carry one).
        key = (dataclasses.replace(layout, cost=CostParts()), plan.cluster, plan.precision,
               expert_group(plan.mesh, layout.axis), micro_batches, folding, implementation)
        if key not in cache:
            cache[key] = _laid_out(layout, plan, graph, micro_batches)
        by_identity[known] = (layout, plan.cluster, plan.mesh, cache[key])
        layers[layout.module] = cache[key]
    return layers


def _laid_out(layout: ExpertLayout, plan, graph: OpGraph, micro_batches: int) -> LaidOutLayer:
    """One layer of ``laid_out_layers``."""
    blocks = {block.module: block for block in graph.moe_blocks}
    group = expert_group(plan.mesh, layout.axis)
    block = blocks.get(layout.module)
    if block is None:
        raise ValueError(f"expert layout for {layout.module!r}, which is not an MoE layer of the traced model")
    if (block.experts, block.top_k) != (layout.experts, layout.top_k):
        raise ValueError(
            f"expert layout for {layout.module!r} has {layout.experts} experts, top-{layout.top_k}; the model's "
            f"layer has {block.experts}, top-{block.top_k}"
        )
    nodes = graph.moe_nodes(block.module)
    owner = expert_module(block)
    experts = [node.name for node in nodes if node.module == owner or node.module.startswith(owner + ".")]
    if not experts:
        raise ValueError(f"MoE layer {block.module!r}: no traced op of its experts ({owner!r})")
    tokens = layer_tokens(graph, block)
    # Layers of one shape priced with equal layouts cost the same (nothing below reads the
    # module): DeepSeek-V3's 58 MoE layers are priced once per layout, not 58 times.
    shape = (dataclasses.replace(block, module=""), tokens, _layout_without_module(layout), plan.cluster,
             plan.precision, plan.mesh, group, micro_batches, folding_of(plan),
             getattr(plan, "expert_implementation", ""))
    priced = graph_facts(graph).moe_layer_prices
    if shape not in priced:
        priced[shape] = _priced(block, layout, tokens, plan, group, micro_batches)
    (cost, activations, replica_sync, buffers, fraction, synced, sharding, routing_sync,
     function_bytes, function_s, memory_ops, launches) = priced[shape]
    return LaidOutLayer(
        block=block,
        layout=layout,
        cost=cost,
        nodes=frozenset(node.name for node in nodes),
        expert_nodes=frozenset(experts),
        anchor=experts[0],
        expert_weights=tuple(f"{block.module}.{name}" for name in block.expert_weights),
        param_fraction=fraction,
        gradients_synced=synced,
        replica_sync_s=replica_sync,
        copy_gather_s=sharding.gather_s,
        copy_reduce_s=sharding.reduce_s,
        copy_sent_bytes=sharding.sent_bytes,
        gathered_bytes=sharding.gathered_bytes,
        routing_sync_s=routing_sync,
        activation_bytes=activations,
        buffer_bytes=buffers,
        activation_function_bytes=function_bytes,
        activation_function_s=function_s,
        memory_ops_forward_s=memory_ops[0],
        memory_ops_backward_s=memory_ops[1],
        expert_launches=launches,
        expert_data_parallel=(len(group) // (layout.placement.devices * (layout.tensor_parallel or 1))
                              if folding_of(plan) is not None and layout.placement is not None else 1),
        copy_shards=copies_sharded_over(layout, len(group)),
    )


def _layout_without_module(layout: ExpertLayout) -> tuple:
    """What prices a layout, its module and cost annotation aside."""
    return (layout.mode, layout.experts, layout.top_k, layout.capacity_factor, layout.axis, layout.all_to_all,
            layout.placement, layout.routing, layout.expert_loads, layout.sharded_copies, layout.tensor_parallel)


def _priced(block: MoEBlock, layout: ExpertLayout, tokens: int, plan, group: tuple, micro_batches: int) -> tuple:
    """The module-independent figures of ``_laid_out``: (cost, activation bytes, copies'
    gradient sum, dispatch buffer bytes, parameter share, whether gradients are synced over
    dp, the sharded copies' costs, the routing all-gather, the activation function's bytes and
    seconds, the memory-bound kernels' seconds, the experts' kernel launches)."""
    world = len(group)
    element = element_bytes(plan.precision)
    folding = folding_of(plan)
    implementation = getattr(plan, "expert_implementation", "")
    if folding is not None:  # EP x ETP folded over dp x tp (cost_model.moe_folding)
        folded = folded_layer_cost(moe_layer_of(block, tokens // micro_batches), layout, plan.cluster, group,
                                   plan.mesh.axis_size("tp"), folding.sequence_parallel, plan.precision,
                                   block.routing_groups, expert_kernel(implementation, block.runtime, layout.mode))
        cost, activations, replica_sync = folded.moe, folded.activation_bytes, folded.edp_sync_s
        ep_ranks = layout.placement.devices
        buffers = dispatch_buffer_bytes(block, layout, cost, tokens // micro_batches * ep_ranks // world, ep_ranks,
                                        plan.precision)
    else:
        cost = price_layout(block, layout, tokens, plan.cluster, plan.precision, micro_batches, group, implementation)
        activations = expert_activation_bytes(moe_layer_of(block, 0), cost.busiest_copies, element)
        replica_sync = replica_sync_time(block, layout, plan.cluster, plan.precision, group)
        buffers = dispatch_buffer_bytes(block, layout, cost, tokens // micro_batches, world, plan.precision)
    fraction, synced = param_share(layout, world)
    sharding = copy_shard_costs(block, layout, plan.cluster, plan.precision, group if folding is not None else None)
    function_bytes, function_s = activation_function_costs(block, cost.busiest_copies,
                                                           (layout.tensor_parallel or 1) if folding is not None else 1,
                                                           element, plan.cluster.device_of(group[0]))
    memory_ops, memory_kernels = memory_op_times(expert_kernel(implementation, block.runtime, layout.mode), block,
                                                 cost, tokens / micro_batches / world,
                                                 (layout.tensor_parallel or 1) if folding is not None else 1,
                                                 element, plan.cluster.device_of(group[0]))
    # What the host launches for the experts beyond the layer's one op: their GEMMs and the
    # memory-bound kernels around them.
    launches = (cost.gemm_launches[0] + memory_kernels[0], cost.gemm_launches[1] + memory_kernels[1])
    return (cost, activations, replica_sync, buffers, fraction, synced, sharding,
            routing_sync_time(block, plan.cluster, group), function_bytes, function_s, memory_ops, launches)


def memory_op_times(kernel: str, block: MoEBlock, cost: MoECost, held_tokens: float, etp: int, element: int,
                    device) -> tuple[tuple[float, float], tuple[int, int]]:
    """((forward, backward) seconds, (forward, backward) kernels) of the memory-bound kernels
    around the experts' GEMMs of a layer priced ``cost`` whose experts run on ``kernel``
    (``planner.expert_kernels``), on the busiest device, which holds ``held_tokens`` tokens: the
    compiled program's own (``cost_model.expert_memory_ops``: the GELU over the padded buffers
    of ``torch_bmm``, the gathers, copies and SwiGLU of ``per_expert_loop``), or Megatron-Core's
    fused ones (``expert_memory_op_times``) for ``te_grouped_gemm`` and for ``model_experts``,
    whose kernels are not modelled (the price every layer had before). The kernels are what
    the host launches for them beside the GEMMs."""
    shape = cost.kernels
    if kernel == BATCHED_MATMUL and shape is not None:
        return (batched_gelu_times(shape.local_experts * shape.rows, shape.ffn, element, device),
                BATCHED_GELU_KERNELS)
    if kernel == PER_EXPERT_LOOP and shape is not None:
        return (expert_loop_times(block, cost.busiest_copies, shape.local_experts, held_tokens, shape.ffn, element,
                                  device), expert_loop_kernels(shape.local_experts))
    return (expert_memory_op_times(block, cost.busiest_copies, etp, element, device),
            (EXPERT_MEMORY_KERNELS, EXPERT_MEMORY_KERNELS))


def expert_memory_op_times(block: MoEBlock, rows: float, etp: int, element: int, device) -> tuple[float, float]:
    """(forward, backward) seconds of the memory-bound kernels around the experts' GEMMs for
    ``rows`` token copies on a device holding 1/``etp`` of each expert's hidden width, each a
    contiguous kernel at ``STREAMING_EFFICIENCY`` of the bandwidth plus the device's launch
    overhead (``cost_model.compute.efficiencies``):

    - the activation function (Megatron-Core's fused ``bias_swiglu``, one kernel): forward
      reads its input, (matmuls - 1) hidden widths a row, and writes one; backward reads the
      output's gradient (one) and the input, and writes the input's gradient (matmuls - 1);
    - the permutation of the received rows into expert order before the first GEMM and back
      after the second (Megatron-Core's ``permute`` / ``unpermute``, token_dispatcher.py; one
      fused kernel each with ``--moe-permute-fusion``), each reading and writing ``rows`` rows
      of the model width; backward the same two on the gradients. Counted at the copies on
      both sides: DeepEP's dispatch delivers a token bound for several local experts once, so
      its permutation reads fewer rows (high by up to that share); the all-to-all dispatcher
      also permutes on the sending side (low by that).

    Before session 13 none of these was priced: the layer's other expert ops cost nothing
    (``cost_model.node_costs``). Activation-function recomputation adds its forward again
    (``activation_function_costs``)."""
    width = block.ffn / etp
    bandwidth = device.memory_bandwidth * STREAMING_EFFICIENCY
    function_forward = rows * element * block.matmuls * width
    function_backward = rows * element * (2 * (block.matmuls - 1) + 1) * width
    permutations = 2 * (2 * rows * element * block.hidden)  # two kernels, each reading and writing the rows
    launches = EXPERT_MEMORY_KERNELS * efficiencies(device)[2]
    return ((function_forward + permutations) / bandwidth + launches,
            (function_backward + permutations) / bandwidth + launches)


def activation_function_costs(block: MoEBlock, rows: float, etp: int, element: int, device) -> tuple[float, float]:
    """(bytes, seconds) of the experts' activation function for ``rows`` token copies on a
    device holding 1/``etp`` of each expert's hidden width. Bytes: what it keeps beyond its
    input, (matmuls - 1) hidden-wide tensors a row (SwiGLU: silu(gate) and silu(gate) * up;
    a GELU MLP: gelu's output), which ``cost_model.moe.expert_activation_bytes`` counts and
    Megatron-Core's ``moe_act`` recomputation discards (its output-discarding checkpoint keeps
    the function's input, the first matmul's output). Seconds: the function run again, one
    fused elementwise kernel reading its input ((matmuls - 1) widths) and writing its output
    (one), memory-bound at ``cost_model.memory_kernels.STREAMING_EFFICIENCY`` of the device's
    bandwidth (a contiguous kernel, as Megatron's fused ``bias_swiglu`` is)."""
    width = block.ffn / etp
    kept = rows * element * (block.matmuls - 1) * width
    moved = rows * element * block.matmuls * width
    return kept, moved / (device.memory_bandwidth * STREAMING_EFFICIENCY)


def annotated_layouts(layouts, layers: dict[str, LaidOutLayer], micro_batches: int) -> tuple[ExpertLayout, ...]:
    """``layouts`` with each layer's simulated cost parts for one step (all micro-batches):
    expert compute, its collectives (and copied experts' gradient sums, or with sharded
    copies their gathers and reduce-scatter), and the bytes of expert weights (sharded copies:
    1/r of them) and dispatch buffers (and gathered weights) on the fullest device, for the report."""
    annotated = []
    for layout in layouts:
        layer = layers[layout.module]
        cost = layer.cost
        annotated.append(dataclasses.replace(layout, cost=CostParts(
            compute_s=(cost.forward_compute_s + cost.backward_compute_s) * micro_batches,
            communication_s=((cost.communication_s + layer.routing_sync_s + 2 * layer.copy_gather_s
                              + layer.copy_reduce_s) * micro_batches + layer.replica_sync_s),
            memory_bytes=int(cost.weight_bytes / layer.copy_shards + layer.buffer_bytes
                             + 2 * layer.gathered_bytes),
        )))
    return tuple(annotated)
