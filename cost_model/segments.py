"""Segments: consecutive ops of one virtual stage summed into one unit of the task graph.

A segment is a repeated block (the unit activation recomputation checkpoints, as Megatron-LM
and the compiled programs checkpoint a transformer layer), or the ops before the first block
or after the last. ``build_segment`` sums its nodes' costs (``cost_model.node_costs``),
parameters and input bytes, reading the plan's facts from the ``StepContext``. Which nodes
form which segment depends on the graph alone (``segment_members``); a delta simulation
rebuilds only the segments whose nodes or inputs it re-costed (``refresh_segments``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch.distributed.tensor import Replicate, Shard

from cost_model.host_dispatch import host_wait
from cost_model.host_syncs import layer_syncs_in_forward, synced_host_wait
from cost_model.node_costs import NodeCost
from cost_model.step_context import StepContext
from planner.graph import OpGraph
from planner.sharded_states_layout import sliced_dim


@dataclass
class Segment:
    """Consecutive ops on one virtual stage: a repeated block, or the ops around the blocks."""

    name: str
    stage: int
    block: bool = False  # a repeated block: the unit activation recomputation checkpoints
    nodes: list[str] = field(default_factory=list)
    forward_s: float = 0.0
    backward_s: float = 0.0
    forward_comm_s: float = 0.0
    backward_comm_s: float = 0.0
    # Host seconds to issue its ops (GPU clusters); forward_s and backward_s already include
    # the device's wait for the host where these are longer (cost_model.host_dispatch).
    host_forward_s: float = 0.0
    host_backward_s: float = 0.0
    host_wait_s: float = 0.0  # of which, forward and backward: the device waiting for the host
    # Host syncs in its forward per micro-batch (MoE dispatches, cost_model.host_syncs): each
    # splits the forward's host-vs-device bound into parts.
    host_syncs: int = 0
    saved_bytes: float = 0.0
    buffer_bytes: float = 0.0  # the largest transient buffer of one of its ops (NodeCost.buffer_bytes)
    input_bytes: float = 0.0  # floating-point values it reads from other segments
    checkpoint_bytes: float = 0.0  # those of them made in other blocks: what recomputation keeps
    score_bytes: float = 0.0
    score_forward_s: float = 0.0
    # Its MoE layers' exchanges (dispatch and combine all-to-alls, routing all-gather): the
    # forward seconds of them in ``forward_comm_s`` and the bytes of their outputs for one
    # micro-batch, what recomputation ``full_keep_a2a`` keeps instead of repeating them.
    kept_exchange_s: float = 0.0
    kept_exchange_bytes: float = 0.0
    # What recomputation ``norms_moe_act`` (planner.strategy.NORMS_MOE_ACT) drops and adds:
    # the bytes the block's own norms keep (``norm_bytes``), the bytes of their inputs that
    # nothing else keeps, which their checkpoints then hold (``norm_input_bytes``), their
    # forward seconds; the bytes and seconds of its MoE layers' expert activation functions
    # (``LaidOutLayer.activation_function_bytes`` / ``_s``).
    norm_bytes: float = 0.0
    norm_input_bytes: float = 0.0
    norm_forward_s: float = 0.0
    moe_act_bytes: float = 0.0
    moe_act_forward_s: float = 0.0
    params: dict[str, float] = field(default_factory=dict)  # name -> local bytes per element-size 1
    # name -> the local tensor's shape where it is known (not for an MoE layout's parts of
    # expert weights): which dimension ZeRO-1 slices (planner.sharded_states_layout).
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dp_synced: set[str] = field(default_factory=set)
    axis_bytes: dict[str, float] = field(default_factory=dict)
    axis_sync_s: float = 0.0  # NodeCost.axis_sync_s of its nodes
    weight_gather_s: float = 0.0  # NodeCost.weight_gather_s of its nodes, per pass
    copy_reduce_s: float = 0.0  # NodeCost.copy_reduce_s of its nodes, per micro-batch
    # Weights each rank holds its own of (experts split by an MoE layout): kept out of the
    # dp flavour's sharding, gathering and gradient reduction.
    per_rank: set[str] = field(default_factory=set)

    def shardable_elements(self) -> float:
        """Local parameter elements the dp flavour shards (all but ``per_rank`` ones)."""
        return sum(count for name, count in self.params.items() if name not in self.per_rank)

    def zero1_gathered_elements(self, dp: int) -> list[float]:
        """Local elements of each weight that ZeRO-1 over ``dp`` ranks all-gathers after the
        optimizer step (one all-gather each, of the whole local tensor): every weight but the
        ``per_rank`` ones (stepped whole on their rank) and those with no dimension ``dp``
        divides (stepped whole everywhere); a weight of unknown local shape counts as sliced."""
        return [count for name, count in self.params.items()
                if count > 0 and name not in self.per_rank
                and (name not in self.shapes or sliced_dim(self.shapes[name], dp) is not None)]


def local_shape(shape, placements, axes) -> tuple[int, ...]:
    """A tensor's local shape under ``placements`` on a mesh of ``axes`` ((name, size) each):
    each ``Shard(d)`` divides dimension d by its axis's size (rounded up: DTensor's first
    ranks hold the larger pieces of an uneven split)."""
    local = list(shape)
    for (_, size), placement in zip(axes, placements):
        if isinstance(placement, Shard):
            local[placement.dim] = -(-local[placement.dim] // size)
    return tuple(local)


@dataclass(frozen=True)
class SegmentProfile:
    """One segment's costs for one micro-batch on one device (``Simulator.segment_profiles``).

    ``time_s``, ``kept_bytes`` and ``transient_bytes`` are keyed by recomputation mode
    (``planner.strategy.RECOMPUTE_MODES``): forward + backward seconds with the
    tensor-parallel collectives on the critical path; bytes kept for backward per
    micro-batch in flight; bytes alive only while the segment recomputes.
    ``param_elements`` are the local parameter elements (``synced_elements`` those whose
    gradients are reduced over ``dp``); ``input_bytes`` what it reads from earlier segments;
    ``synced_tensors`` the elements of each parameter tensor reduced over ``dp`` (a graph
    program reduces each in its own collective) and ``param_tensors`` how many it has;
    ``synced_shapes`` the local shape of each of those tensors (None where unknown), from
    which ZeRO-1's gathers follow for any ``dp`` (``planner.sharded_states_layout``);
    ``per_rank_elements`` the elements of weights no rank shares (below).
    """

    name: str
    block: bool
    time_s: dict[str, float]
    kept_bytes: dict[str, float]
    transient_bytes: dict[str, float]
    param_elements: float
    synced_elements: float
    input_bytes: float
    synced_tensors: tuple[float, ...] = ()
    param_tensors: int = 0
    synced_shapes: tuple[tuple[int, ...] | None, ...] = ()
    # Of ``param_elements``, those each rank holds its own of (experts split by an MoE
    # layout, ``Segment.per_rank``): no dp flavour shards their states, gradients or weights.
    per_rank_elements: float = 0.0
    # Its MoE layers' dispatch buffers for one micro-batch (``Segment.kept_exchange_bytes``):
    # the simulator holds the largest layer's as a communication buffer while it exchanges.
    exchange_bytes: float = 0.0
    # Of every mode's ``time_s``, the forward pass's seconds (its forward collectives
    # included): the same in every mode, since recomputation repeats the forward in backward.
    forward_s: float = 0.0

    def zero1_gathered_tensors(self, dp: int) -> list[float]:
        """Elements of each of ``synced_tensors`` that ZeRO-1 over ``dp`` ranks all-gathers
        after the step: those with a dimension ``dp`` divides, or of unknown shape."""
        shapes = self.synced_shapes or (None,) * len(self.synced_tensors)
        return [size for size, shape in zip(self.synced_tensors, shapes)
                if shape is None or sliced_dim(shape, dp) is not None]

@dataclass(frozen=True)
class SegmentMembers:
    """Which nodes form each segment, in graph order; fixed by the graph."""

    keys: tuple[tuple, ...]  # one per segment, in the order segments appear
    labels: dict[tuple, str]
    members: dict[tuple, tuple[str, ...]]
    segment_of: dict[str, tuple]  # node name -> its segment's key
    in_block: frozenset[str]  # nodes of repeated blocks


def segment_members(graph: OpGraph) -> SegmentMembers:
    """Group ``graph``'s nodes into segments: each repeated block, and before/after them."""
    members: dict[tuple, list[str]] = {}
    labels: dict[tuple, str] = {}
    segment_of: dict[str, tuple] = {}
    seen_block = False
    for node in graph.nodes:
        if node.block is not None:
            seen_block = True
            key = ("block",) + node.block
            label = f"{node.block[0]}.{node.block[1]}"
        else:
            key = ("tail",) if seen_block else ("head",)
            label = "after blocks" if seen_block else "before blocks"
        labels.setdefault(key, label)
        members.setdefault(key, []).append(node.name)
        segment_of[node.name] = key
    in_block = frozenset(name for key, names in members.items() if key[0] == "block" for name in names)
    return SegmentMembers(tuple(members), labels, {key: tuple(names) for key, names in members.items()},
                          segment_of, in_block)


def build_segments(context: StepContext, costs: dict[str, NodeCost], layout: SegmentMembers) -> list[Segment]:
    """Every segment, built afresh from the current node costs."""
    return [build_segment(context, costs, key, layout) for key in layout.keys]


def refresh_segments(context: StepContext, costs: dict[str, NodeCost], layout: SegmentMembers,
                     segments: list[Segment], changed: set[str]) -> list[Segment]:
    """``segments`` with those that hold a node of ``changed`` or read one's output rebuilt
    (a new list: the old one may be shared by a cache)."""
    stale = {layout.segment_of[name] for name in changed}
    for name in changed:
        for reader in context.consumers.get(name, ()):
            stale.add(layout.segment_of[reader])
    return [build_segment(context, costs, key, layout) if key in stale else segment
            for key, segment in zip(layout.keys, segments)]


def build_segment(context: StepContext, costs: dict[str, NodeCost], key: tuple, layout: SegmentMembers) -> Segment:
    """The segment ``key`` of ``layout``: its nodes' costs, parameters and input bytes summed."""
    sequence = context.plan.summary.tokens_per_sample
    dp_index = context.mesh.names.index("dp") if "dp" in context.mesh.names else None
    names = layout.members[key]
    segment = Segment(name=layout.labels[key], stage=context.strategies[names[0]].stage, block=key[0] == "block")
    # Forward (device, host) seconds: summed before the first host sync, op by op after each
    # (cost_model.host_syncs).
    before_sync, after_syncs = [0.0, 0.0], []
    for name in names:
        node = context.nodes[name]
        strategy = context.strategies[name]
        cost = costs[name]
        segment.nodes.append(name)
        segment.forward_s += cost.forward_s
        segment.backward_s += cost.backward_s
        segment.forward_comm_s += cost.forward_comm_s
        segment.backward_comm_s += cost.backward_comm_s
        segment.host_forward_s += cost.host_forward_s
        segment.host_backward_s += cost.host_backward_s
        layer = context.moe_layer_of.get(name)
        if context.host is not None and layer is not None and name == layer.anchor:
            for _ in range(layer_syncs_in_forward(layer.layout.mode, layer.cost.sent_bytes > 0)):
                after_syncs.append([])  # the dispatch syncs before the exchange (its anchor) is issued
                segment.host_syncs += 1
        if after_syncs and layer is not None and name == layer.anchor:
            # Right after the sync the host issues the exchange (one op), which the device runs
            # while the host launches the experts' kernels (cost_model.node_costs); the
            # combine, priced with the dispatch, is put before the experts too: optimistic.
            exchange_host = min(context.host.forward_s, cost.host_forward_s)
            after_syncs[-1].append((cost.forward_comm_s, exchange_host))
            after_syncs[-1].append((cost.forward_s, cost.host_forward_s - exchange_host))
        elif after_syncs:
            after_syncs[-1].append((cost.forward_s + cost.forward_comm_s, cost.host_forward_s))
        else:
            before_sync[0] += cost.forward_s + cost.forward_comm_s
            before_sync[1] += cost.host_forward_s
        segment.saved_bytes += cost.saved_bytes
        segment.axis_sync_s += cost.axis_sync_s
        segment.weight_gather_s += cost.weight_gather_s
        segment.copy_reduce_s += cost.copy_reduce_s
        segment.buffer_bytes = max(segment.buffer_bytes, cost.buffer_bytes)
        for axis, sent in cost.axis_bytes.items():
            segment.axis_bytes[axis] = segment.axis_bytes.get(axis, 0.0) + sent
        if sequence and node.output_meta and len(node.output_meta[0].shape) >= 2 and node.output_meta[0].shape[-2:] == (sequence, sequence):
            segment.score_bytes += cost.saved_bytes  # attention scores: dropped by selective recompute
            segment.score_forward_s += cost.forward_s
        if layer is not None and name == layer.anchor:  # the layer's exchanges are priced on its anchor
            segment.kept_exchange_s += cost.forward_comm_s
            segment.kept_exchange_bytes += layer.buffer_bytes
            segment.moe_act_bytes += layer.activation_function_bytes
            segment.moe_act_forward_s += layer.activation_function_s
        if segment.block and is_block_norm(node, segment.name):
            segment.norm_bytes += cost.saved_bytes
            segment.norm_forward_s += cost.forward_s
        for param, placements in strategy.params.items():
            meta = context.graph.parameters.get(param)
            if meta is None:
                continue
            if layer is not None and param in layer.expert_weights:
                # The layout says which experts (or which slice of each) a device holds.
                segment.params[param] = meta.numel * layer.param_fraction
                if layer.param_fraction == 1:
                    segment.shapes[param] = tuple(meta.shape)
                if layer.gradients_synced:
                    if dp_index is not None:
                        segment.dp_synced.add(param)
                else:
                    segment.per_rank.add(param)
                continue
            shards = math.prod(size for (axis, size), p in zip(context.mesh.axes, placements) if isinstance(p, Shard))
            segment.params[param] = meta.numel / shards
            segment.shapes[param] = local_shape(meta.shape, placements, context.mesh.axes)
            # The loss depends on every rank's own samples, so the gradient of every
            # weight replicated over dp is a partial sum there, whatever its op's output.
            if dp_index is not None and isinstance(placements[dp_index], Replicate):
                segment.dp_synced.add(param)
    if context.host is not None:
        forward_wait = synced_host_wait(tuple(before_sync), after_syncs)
        backward_wait = host_wait(segment.backward_s + segment.backward_comm_s, segment.host_backward_s)
        segment.forward_s += forward_wait
        segment.backward_s += backward_wait
        segment.host_wait_s = forward_wait + backward_wait
    if segment.block:
        segment.norm_input_bytes = norm_input_bytes(context, costs, names, segment.name)
    members = set(names)
    sources = {
        source
        for name in names
        for position, source in enumerate(context.nodes[name].inputs)
        if source in context.nodes and source not in members and context.nodes[name].input_meta[position].dtype.is_floating_point
    }
    for source in sorted(sources):
        size = context.output_bytes(context.nodes[source], context.strategies[source])
        segment.input_bytes += size
        if source in layout.in_block:
            # Made inside another block, which recomputation does not keep: this
            # block's checkpoint holds it. (Values made around the blocks are kept
            # by their own segment already.)
            segment.checkpoint_bytes += size
    return segment


def is_block_norm(node, block: str) -> bool:
    """Whether ``node`` belongs to one of ``block``'s own normalisation layers (a direct child
    module whose class is a norm: Llama's and Qwen's ``input_layernorm`` and
    ``post_attention_layernorm``, Megatron-Core's input_layernorm and pre_mlp_layernorm), not
    one nested deeper (Qwen3's q_norm and k_norm inside its attention)."""
    module = node.module or ""
    return module.rpartition(".")[0] == block and (node.module_type or "").endswith("Norm")


def norm_input_bytes(context: StepContext, costs: dict[str, NodeCost], names, block: str) -> float:
    """Bytes of one micro-batch of the inputs of ``block``'s own norms that no op keeps for
    backward: what their checkpoints hold when recomputation drops the norms' own tensors."""
    norms = {name for name in names if is_block_norm(context.nodes[name], block)}
    sources = {
        source
        for name in norms
        for position, source in enumerate(context.nodes[name].inputs)
        if source in context.nodes and source not in norms
        and context.nodes[name].input_meta[position].dtype.is_floating_point
        and context.graph.parameters.get(source) is None
    }
    return sum(context.output_bytes(context.nodes[source], context.strategies[source])
               for source in sorted(sources) if not costs[source].saved_bytes)
