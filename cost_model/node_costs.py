"""Node costs: one op's cost on one device for one micro-batch, under the plan's placements.

For every op, its share of work on one device is ``1 / (ranks splitting it x micro-batches)``
(an axis splits an op when the op's output is ``Shard`` or ``Partial`` on it); forward and
backward times come from the roofline in ``cost_model.compute``. Each input edge whose
producer placement differs from what the op reads costs a collective
(``cost_model.resharding``) on that axis's process group, counted once per (tensor, target
placement); a replicated activation read by an op with sharded weights (Megatron's
column-parallel input) gets a backward all-reduce. What else an op costs under some family
(SUMMA algorithms, vocabulary-parallel losses, split gathers, gradients of weights replicated
over an axis that splits the rows) the step's contributors add (``StepContributor.node_cost``,
``cost_model.step_contributor``).

``NodeCosts`` keeps the costs of the current strategies (``StepContext.strategies``) and which
reader of each (tensor, placement) pays its resharding, so ``reassign`` re-costs only what a
one-node change affects (delta simulation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch.distributed.tensor import Partial, Replicate, Shard

from cost_model.autocast_activations import runtime_widths
from cost_model.compute import efficiencies, op_times
from cost_model.fused_chains import chain_kernels, chain_op_times
from cost_model.gpu_kernels import generation_of
from cost_model.moe_layers import LaidOutLayer, routing_sync_bytes
from cost_model.moe_overlap import (
    block_compute_s, exchange_compute_slowdown, exposed_share, layer_passes, overlapped_pairs,
)
from cost_model.op_share import work_split
from cost_model.resharding import backward_collective, forward_collective
from cost_model.step_context import StepContext
from cost_model.step_contributor import overriding
from cost_model.tp_comm_overlap import EdgeOverlap, edge_overlap, regather_exposed
from planner.graph import OpNode
from planner.strategy import DUALPIPE, EXPERT_COPIES_AXIS, NodeStrategy, expert_axis_size

SENT_FRACTION = {  # bytes a rank sends per byte of collective size, ring algorithms, n ranks
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}


@dataclass
class NodeCost:
    """One op's cost on one device for one micro-batch."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    forward_comm_s: float = 0.0
    backward_comm_s: float = 0.0
    saved_bytes: float = 0.0
    axis_bytes: dict[str, float] = field(default_factory=dict)
    # Once per step, not per micro-batch: gradient all-reduces over non-dp axes (SUMMA
    # meshes, cost_model.summa_node), overlapped with the rest of the backward as dp's are.
    axis_sync_s: float = 0.0
    # Per pass (forward, and again backward), on the collective stream before the op's
    # segment runs, prefetched as FSDP's gathers are: an MoE layer's experts all-gathered
    # over their copies (``ExpertLayout.sharded_copies``).
    weight_gather_s: float = 0.0
    # Per micro-batch, on the reduce-scatter stream after the op's segment's backward: the
    # gradients of an MoE layer's sharded expert copies reduce-scattered over their copies
    # (FSDP2 reduce-scatters a unit after every backward, having no ``no_sync``; Megatron-FSDP
    # under ``optim_grads_params`` likewise, ``grad_reduce_every_bprop``).
    copy_reduce_s: float = 0.0
    # Transient bytes the op holds while it runs beyond its inputs and outputs (a SUMMA
    # matmul's received or gathered blocks and partial sums).
    buffer_bytes: float = 0.0
    # Host seconds to issue the op (GPU clusters, cost_model.host_dispatch): the segment
    # waits for the host where these add up to more than its device time.
    host_forward_s: float = 0.0
    host_backward_s: float = 0.0


# Ops whose backward needs none of their tensor inputs, and ops whose backward reads their
# own output (PyTorch's derivatives.yaml): what decides which activations autograd keeps.
_BACKWARD_READS_NO_INPUT = (
    "aten.add.Tensor", "aten.sub.Tensor", "aten.dropout.", "aten.native_dropout.", "aten.clone.", "aten.contiguous.",
    "aten.alias.", "aten._to_copy.", "aten.neg.", "aten.sum.", "aten.mean.",
    # stack and cat hand each input its slice of the gradient: StackBackward0 and CatBackward0
    # save only ``dim`` (torch 2.13's autograd, ``grad_fn._saved_*``).
    "aten.stack.", "aten.cat.",
    # A dtype or device conversion (``x.to(torch.float32)`` in an RMSNorm) runs as _to_copy,
    # whose ToCopyBackward0 saves only the input's options, not the input (derivatives.yaml,
    # _to_copy: ``self: _to_copy_backward(grad, self.options())``).
    "aten.to.", "aten.type_as.",
)
_BACKWARD_READS_OUTPUT = ("aten.relu.", "aten._softmax.", "aten.softmax.", "aten.tanh.", "aten.sigmoid.", "aten.exp.")
_DROPOUT = ("aten.dropout.", "aten.native_dropout.")
# Products and quotients: the gradient of one operand reads the other (derivatives.yaml,
# mul.Tensor: ``self: mul_tensor_backward(grad, other, ...)``; div.Tensor likewise), and
# autograd saves an operand only when the other operand's gradient is wanted (MulBackward0 /
# DivBackward0 leave ``_saved_self`` None when ``other`` requires no grad): x * cos with cos a
# constant table keeps cos, not x (a rotary embedding's products).
_BACKWARD_READS_OTHER_OPERAND = ("aten.mul.Tensor", "aten.div.Tensor")


class NodeCosts:
    """Every node's ``NodeCost`` under the context's current strategies (module docstring).

    ``kept`` and ``signature`` are the graph's facts (``simulation_cache.graph_facts``);
    ``contributors`` the step's contributors, each asked to add to every op's cost. ``costs``
    (node name -> cost), ``cache`` (costs by what they depend on) and ``first_use`` ((tensor,
    placement) -> the reader that pays its resharding) are filled by ``cost_all`` or taken
    from a plan costed before (``adopt``).
    """

    def __init__(self, context: StepContext, kept: dict[str, bool], signature: dict[str, int], contributors) -> None:
        self.context = context
        self.kept = kept
        self._requires_grad: set[str] | None = None  # requires_grad's answer, built on first use
        self.signature = signature
        self._node_cost_hooks = overriding(contributors, "node_cost")
        self.cache: dict[tuple, NodeCost] = {}
        # On a cluster of several device types a pipeline's stages may run on different
        # devices (planner.families.hetero_pipeline): twins in two stages cost differently.
        self.by_stage = not context.cluster.is_homogeneous
        self.first_use: dict[tuple, str] = {}
        self.costs: dict[str, NodeCost] = {}
        # Ops of norm and rotary chains another system's run fuses (Plan.fused_chains):
        # op name -> the fused kernel its chain's last op carries, None for the others.
        self.fused = chain_kernels(context.graph, getattr(context.plan, "fused_chains", ""))

    def cost_all(self) -> None:
        """Cost every node of the graph afresh."""
        self.cache = {}
        self.index_first_uses()
        self.costs = {node.name: self.cost_of(node) for node in self.context.graph.nodes}

    def adopt(self, cache: dict, first_use: dict, costs: dict) -> None:
        """Take the costs of a plan whose node costs equal this one's (copies: they change)."""
        self.cache, self.first_use, self.costs = dict(cache), dict(first_use), dict(costs)

    def reassign(self, node_name: str, old: NodeStrategy) -> set[str]:
        """Re-cost what changing ``node_name`` from ``old`` to its strategy in the context
        affects; returns the names re-costed. Only the (tensor, placement) keys this node
        reads, before or after, can change their first reader; readers that start or stop
        paying a shared resharding are re-costed too."""
        strategy = self.context.strategies[node_name]
        node = self.context.nodes[node_name]
        keys = {_read_key(node, old, position) for position in range(len(node.inputs))}
        keys |= {_read_key(node, strategy, position) for position in range(len(node.inputs))}
        moved = set()
        for key in keys:
            before = self.first_use.get(key)
            after = self._first_reader(key)
            if after is None:
                self.first_use.pop(key, None)
            else:
                self.first_use[key] = after
            if before != after:
                moved |= {before, after}
        recosted = {node_name, *self.context.consumers.get(node_name, []), *(m for m in moved if m)}
        recosted |= self._reading_through(node_name)
        for name in recosted:
            self.costs[name] = self.cost_of(self.context.nodes[name])
        return recosted

    def _reading_through(self, node_name: str) -> set[str]:
        """The nodes whose cost reads ``node_name``'s strategy beyond its own consumers: the
        readers of its consumers and of the views and dropouts made from either.
        ``_gathered_upstream`` looks past views at their producers' inputs (whether an input
        was gathered decides Megatron's 'f'), ``_tp_overlap_source`` past views and dropout
        at the op that made an edge: a linear's all-reduce goes when its input comes to be
        gathered two ops upstream."""
        consumers, nodes = self.context.consumers, self.context.nodes
        made = {node_name, *consumers.get(node_name, ())}
        frontier = list(made)
        while frontier:
            name = frontier.pop()
            for reader in consumers.get(name, ()):
                passes = nodes[reader].is_view or nodes[reader].op.startswith(_DROPOUT)
                if passes and nodes[reader].inputs[0] == name and reader not in made:
                    made.add(reader)
                    frontier.append(reader)
        return {reader for name in made for reader in consumers.get(name, ())}

    def _first_reader(self, key: tuple) -> str | None:
        """The first node, in graph order, that reads ``key``'s tensor in ``key``'s placement."""
        name = key[0]
        nodes, strategies = self.context.nodes, self.context.strategies
        for reader in self.context.consumers.get(name, ()):
            node, strategy = nodes[reader], strategies[reader]
            if any(source == name and _read_key(node, strategy, position) == key for position, source in enumerate(node.inputs)):
                return reader
        return None

    def index_first_uses(self) -> None:
        """The first consumer of each (tensor, placement) pays its resharding; later ones reuse it."""
        self.first_use = {}
        for node in self.context.graph.nodes:
            strategy = self.context.strategies[node.name]
            for position, name in enumerate(node.inputs):
                key = (name, strategy.inputs[position] if position < len(strategy.inputs) else None)
                self.first_use.setdefault(key, node.name)

    def cost_of(self, node: OpNode) -> NodeCost:
        """``node``'s cost under its current strategy, shared with every node costed alike."""
        moe_layer_of, strategies = self.context.moe_layer_of, self.context.strategies
        layer = moe_layer_of.get(node.name)
        if layer is not None:
            return self._moe_node_cost(node, layer)
        strategy = strategies[node.name]
        edges = []
        for position, name in enumerate(node.inputs):
            if name in moe_layer_of:
                continue  # an MoE layer hands its tokens back split as the batch is
            producer = strategies.get(name)
            wanted = strategy.inputs[position] if position < len(strategy.inputs) else None
            if producer is None or not producer.outputs or wanted is None:
                continue
            if self.first_use.get((name, wanted)) != node.name:
                continue
            edges.append((position, producer.outputs[0], wanted))
        # Which inputs' gradients it all-reduces (Megatron's 'f') depends on its producers'
        # producers too (``_gathered_upstream``): twins with the same strategies may differ.
        reductions = self.input_gradient_reductions(node, strategy)
        key = (
            self.signature[node.name], self.kept_for_backward(node.name),
            strategy.inputs, strategy.outputs, tuple(strategy.params.values()), tuple(edges), strategy.layout,
            reductions, runtime_widths(self.context, node),
        )
        if self.by_stage:
            key += (strategy.stage,)
        if node.name in self.fused:
            # Priced as its chain's fused kernel or as nothing, not as its twins outside a chain.
            key += ("fused chain", self.fused[node.name])
        if self.context.plan.tp_comm_overlap:
            # What an edge's collectives hide behind depends on the op that made it too.
            key += tuple((self.signature.get(source), id(strategies.get(source)), self.fused.get(source, "as traced"))
                         for source in (self._tp_overlap_source(node, position) for position, _, _ in edges))
        if key not in self.cache:
            self.cache[key] = self.compute(node, strategy, edges, reductions)
        return self.cache[key]

    def _moe_node_cost(self, node: OpNode, layer: LaidOutLayer) -> NodeCost:
        """An op of an MoE layer run by its layout (``cost_model.moe_layers``): the layer's
        expert cost (its GEMMs and the memory-bound kernels around them) on its anchor op,
        nothing on the other expert ops, and the routing ops'
        traced work split over the ranks (each routes its own tokens)."""
        cost = NodeCost()
        host = self.context.host
        if node.name in layer.expert_nodes:
            if node.name == layer.anchor:
                moe = layer.cost
                if host is not None:
                    # The host launches the layer's exchange here: after the dispatch's host
                    # sync (cost_model.host_syncs) the device waits for at least this. Then it
                    # launches the experts' kernels one by one, each a launch as on the device
                    # (cost_model.grouped_gemm: one cuBLAS GEMM per local expert and call).
                    launch = efficiencies(self.context.device)[2]
                    cost.host_forward_s = host.forward_s + layer.expert_launches[0] * launch
                    cost.host_backward_s = host.backward_s + layer.expert_launches[1] * launch
                # The GEMMs, and the activation function and permutations around them.
                cost.forward_s = moe.forward_compute_s + layer.memory_ops_forward_s
                cost.backward_s = moe.backward_compute_s + layer.memory_ops_backward_s
                exposed = self.a2a_exposed_share(layer) if self.context.plan.moe_a2a_overlap else 1.0
                cost.forward_comm_s = moe.forward_comm_s * exposed + layer.routing_sync_s
                cost.backward_comm_s = moe.backward_comm_s * exposed + layer.replica_sync_s / self.context.micro_batches
                cost.weight_gather_s = layer.copy_gather_s
                cost.copy_reduce_s = layer.copy_reduce_s  # sharded copies' reduce-scatter, every micro-batch
                cost.saved_bytes = layer.activation_bytes
                # The routing all-gather, over the layout's ranks (all of dp x tp when folded).
                routing = routing_sync_bytes(layer.block, expert_axis_size(self.context.mesh, layer.layout.axis))
                if moe.sent_bytes or routing:
                    cost.axis_bytes[layer.layout.axis] = moe.sent_bytes + routing
                if layer.copy_sent_bytes:  # over the copy groups, sub-groups of the layout's axis
                    cost.axis_bytes[EXPERT_COPIES_AXIS] = layer.copy_sent_bytes  # per micro-batch
            return cost
        split = expert_axis_size(self.context.mesh, layer.layout.axis) * self.context.micro_batches
        kept = not node.is_view and self.kept_for_backward(node.name)
        # A routing op costs what its signature, its share and whether it is kept say: a
        # DeepSeek-V3 search costs ~650k of them, nearly all twins of another layer's.
        key = ("moe_routing_op", self.signature[node.name], split, kept)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        self.cache[key] = cost
        cost.forward_s, cost.backward_s = op_times(node, 1.0 / split, self.context.device, self.context.plan.precision)
        if host is not None:  # the routing ops are issued one by one as any other op
            cost.host_forward_s = host.forward_s
            cost.host_backward_s = host.backward_s if any(m.dtype.is_floating_point for m in node.output_meta) else 0.0
        if kept:
            cost.saved_bytes = sum(
                meta.nbytes * self.context.activation_scale / split for meta in node.output_meta if meta.dtype.is_floating_point
            )
        return cost

    def a2a_exposed_share(self, layer: LaidOutLayer) -> float:
        """The share of ``layer``'s all-to-alls left exposed when each runs under another
        micro-batch's compute of its block (``Plan.moe_a2a_overlap``, ``cost_model.moe_overlap``)."""
        if layer.layout.mode != "expert_parallel":
            return 1.0
        key = ("moe_a2a_exposed", id(layer))  # the layer's block does not change within a simulation
        if key not in self.cache:
            context = self.context
            forward, backward = layer_passes(layer, block_compute_s(context, layer))
            # The pipeline rank running the layer: its stage module's index modulo the stages.
            rank = context.strategies[layer.anchor].stage % context.pp if layer.anchor in context.strategies else 0
            # A DualPipe plan's schedule (cost_model.dualpipe_step) decides which of its twin's
            # passes overlap; the twin pairs every micro-batch but one, as before.
            pipeline = context.plan.pipeline
            stages = 1 if pipeline is not None and pipeline.schedule == DUALPIPE else context.pp
            passes, pairs = overlapped_pairs(context.micro_batches, stages, context.chunks, rank)
            generation = generation_of(context.device)
            slowdown = exchange_compute_slowdown(layer.layout.all_to_all, generation.sms if generation else None,
                                                 context.overlap_slowdown)
            self.cache[key] = exposed_share(forward, backward, passes, pairs, slowdown)
        return self.cache[key]

    def kept_for_backward(self, name: str) -> bool:
        """Whether autograd keeps the output of ``name`` until backward: unless every reader
        (through views) is an op whose backward needs none of its inputs (additions pass the
        gradient through, copies and sums too, dropout keeps only its mask, relu and softmax
        keep their output instead). An op with no reader (the loss) or whose own backward reads its
        output (relu, softmax) keeps it."""
        if name not in self.kept:
            node = self.context.nodes.get(name)
            readers = self.context.consumers.get(name, [])
            if node is not None and (not readers or node.op.startswith(_BACKWARD_READS_OUTPUT)):
                self.kept[name] = True
            else:
                self.kept[name] = any(self._reader_keeps(r, name) for r in readers)
        return self.kept[name]

    def _reader_keeps(self, reader: str, name: str) -> bool:
        """Whether ``reader``'s backward keeps its input ``name`` (through a view: whatever
        keeps the view)."""
        node = self.context.nodes[reader]
        if not any(meta.dtype.is_floating_point for meta in node.output_meta):
            return False  # no differentiable output (export's _assert_tensor_metadata checks): no backward
        if node.is_view:
            return self.kept_for_backward(reader)
        if not self.requires_grad(reader):
            return False  # autograd records nothing for an op no gradient flows through
        if node.op.startswith(_BACKWARD_READS_NO_INPUT + _BACKWARD_READS_OUTPUT):
            return False
        if node.op in _BACKWARD_READS_OTHER_OPERAND:
            # Kept when an operand beside this one (the same tensor twice: x * x) needs a gradient.
            others = list(node.inputs)
            others.remove(name)
            return any(self.requires_grad(other) for other in others)
        return True

    def requires_grad(self, name: str) -> bool:
        """Whether the value ``name`` (a parameter, a graph input or an op's output) takes part
        in the gradient: a parameter, or a floating-point output of an op that reads one that
        does. Graph inputs (tokens, targets) and tables built from constants (arange, cos) do not."""
        if self._requires_grad is None:
            graph = self.context.graph
            # Parameters only: a buffer (a rotary table's ``inv_freq``) takes no gradient, so
            # what is built from it (cos, sin) does not make the products by it keep q and k.
            needs = {placeholder for node in graph.nodes
                     for qualified, placeholder in zip(node.params, node.param_inputs) if qualified in graph.parameters}
            for node in graph.nodes:  # topological order
                if any(source in needs for source in node.inputs) and any(
                        meta.dtype.is_floating_point for meta in node.output_meta):
                    needs.add(node.name)
            self._requires_grad = needs
        return name in self._requires_grad

    def compute(self, node: OpNode, strategy: NodeStrategy, edges, reductions: tuple | None = None) -> NodeCost:
        """``node``'s cost under ``strategy``, its inputs resharded along ``edges`` ((input
        position, producer placements, placements read) of the edges it pays), the gradients
        of its inputs ``reductions`` all-reduced (``input_gradient_reductions``, by default
        those of the current strategies)."""
        cost = NodeCost()
        work = 1.0 / (work_split(self.context.mesh, strategy) * self.context.micro_batches)
        plan = self.context.plan  # another system's loss, where the plan names one (Plan.loss_implementation)
        cost.forward_s, cost.backward_s = chain_op_times(
            node, self.fused, work, self.context.device, plan.precision,
            loss_implementation=getattr(plan, "loss_implementation", ""),
            metric_cross_entropies=getattr(plan, "metric_cross_entropies", 0))
        # Every line of a graph program is a DTensor op, views included; so is its backward.
        has_backward = any(meta.dtype.is_floating_point for meta in node.output_meta)
        # A fused chain's ops other than its last: the run issues nothing for them.
        issued = node.name not in self.fused or self.fused[node.name] is not None
        if issued and self.context.host is not None:
            cost.host_forward_s = self.context.host.forward_s
            cost.host_backward_s = self.context.host.backward_s if has_backward else 0.0
        elif issued:
            cost.forward_s += self.context.dtensor_dispatch.forward_s
            if has_backward:
                cost.backward_s += self.context.dtensor_dispatch.backward_s
        if not node.is_view:
            # An op's output is what its readers keep for backward (most ops save their input).
            cost.saved_bytes = self.context.output_bytes(node, strategy) if self.kept_for_backward(node.name) else 0.0
            dropout_p = next((a for a in node.attrs if isinstance(a, float)), 0.0) if node.op.startswith(_DROPOUT) else 0.0
            if dropout_p > 0 and node.output_meta:  # its boolean mask, a byte per element
                meta, placements = node.output_meta[0], strategy.outputs[0]
                cost.saved_bytes += meta.numel / self.context.shard_factor(placements) / self.context.micro_batches
        if strategy.produced is not None:
            # The op's own output resharded into its planned placement (an override).
            for meta, made, planned in zip(node.output_meta, strategy.produced, strategy.outputs):
                self.charge_edge(cost, meta, made, planned)
        for position, src, dst in edges:
            overlap = self._tp_overlap(node, strategy, position, src, dst, cost) if self.context.plan.tp_comm_overlap else None
            self.charge_edge(cost, node.input_meta[position], src, dst, overlap)
        if reductions is None:
            reductions = self.input_gradient_reductions(node, strategy)
        self._add_input_gradient_reduction(node, strategy, cost, reductions)
        # What the step's contributors add to an op (cost_model.step_contributor): SUMMA
        # matmuls and block norms, vocabulary-parallel losses, split gathers, the gradient
        # sync of weights replicated on a non-dp axis whose ranks saw other rows.
        for node_cost in self._node_cost_hooks:
            node_cost(self.context, node, strategy, cost)
        return cost

    def _tp_overlap(self, node: OpNode, strategy: NodeStrategy, position: int, src, dst, cost: NodeCost) -> EdgeOverlap | None:
        """How Transformer Engine hides this edge's tensor-parallel collectives behind the
        GEMMs beside it (``Plan.tp_comm_overlap``, ``cost_model.tp_comm_overlap``), or None."""
        if "tp" not in self.context.mesh.names:
            return None
        tp_index = self.context.mesh.names.index("tp")
        kind = forward_collective(src[tp_index], dst[tp_index])
        if kind is None:
            return None
        name = self._tp_overlap_source(node, position)
        producer, producer_strategy = self.context.nodes.get(name), self.context.strategies.get(name)
        producer_times = (0.0, 0.0)
        if producer is not None and producer_strategy is not None:
            work = 1.0 / (work_split(self.context.mesh, producer_strategy) * self.context.micro_batches)
            producer_times = chain_op_times(producer, self.fused, work, self.context.device,
                                            self.context.plan.precision)
        return edge_overlap(self.context, node, strategy, producer, producer_strategy, kind,
                            (cost.forward_s, cost.backward_s), producer_times)

    def _tp_overlap_source(self, node: OpNode, position: int) -> str:
        """The op that made ``node``'s input ``position``, past the views and dropout that
        carry a row-parallel matmul's partial sums to their reduce-scatter."""
        name = node.inputs[position]
        for _ in range(4):
            producer = self.context.nodes.get(name)
            if producer is None or not producer.inputs or not (producer.is_view or producer.op.startswith(_DROPOUT)):
                break
            name = producer.inputs[0]
        return name

    def charge_edge(self, cost: NodeCost, meta, src, dst, overlap: EdgeOverlap | None = None) -> None:
        """Forward collective and backward dual of one placement change, per mesh axis;
        ``overlap``: how Transformer Engine hides the ``tp`` axis's behind GEMMs (and
        gathers a column-parallel input again in backward), or None (run alone)."""
        has_grad = meta.dtype.is_floating_point
        for index, (axis, size) in enumerate(self.context.mesh.axes):
            if axis == "pp" or src[index] == dst[index]:
                continue
            # The tensor this axis's collective moves: split by the other axes that hold it
            # split by then. Reduce-scatters (Partial -> Shard) run one axis after another, in
            # mesh order: the later ones see a tensor the earlier ones already split, but an
            # earlier one still carries the whole partial tensor of the later axes.
            others = math.prod(
                s for j, (a, s) in enumerate(self.context.mesh.axes)
                if j != index and a != "pp" and isinstance(dst[j], Shard)
                and not (isinstance(src[j], Partial) and j > index)
            )
            full = meta.nbytes * self.context.activation_scale / others / self.context.micro_batches
            for kind, backward in (
                (forward_collective(src[index], dst[index]), False),
                (backward_collective(src[index], dst[index]) if has_grad else None, True),
            ):
                if kind is None:
                    continue
                size_bytes = full / size if kind == "all_to_all" else full
                seconds = self.context.collective(kind, size_bytes, axis)
                if overlap is not None and axis == "tp":
                    seconds = overlap.exposed(kind, backward, size_bytes, seconds, self.context, axis)
                seconds += self.context.redistribute_overhead_s
                if backward:
                    cost.backward_comm_s += seconds
                else:
                    cost.forward_comm_s += seconds
                cost.axis_bytes[axis] = cost.axis_bytes.get(axis, 0.0) + size_bytes * SENT_FRACTION[kind](size)
            if overlap is not None and axis == "tp" and overlap.regather_gemm_s and has_grad:
                # The input, kept as this rank's slice, gathered again for the weight gradient.
                gather = self.context.collective("all_gather", full, axis)
                cost.backward_comm_s += regather_exposed(overlap, gather, self.context) + self.context.redistribute_overhead_s
                cost.axis_bytes[axis] += full * SENT_FRACTION["all_gather"](size)

    def input_gradient_reductions(self, node: OpNode, strategy: NodeStrategy) -> tuple[tuple[int, int], ...]:
        """(input position, mesh axis index) of each input whose gradient ``node`` all-reduces
        in backward (Megatron's 'f'): a replicated floating-point activation it reads first,
        on an axis its weights are split on, not gathered on that axis (here or upstream)."""
        params = set(node.param_inputs)
        found = []
        for index, (axis, size) in enumerate(self.context.mesh.axes):
            if axis in ("pp", "dp") or size == 1:
                continue
            if not any(isinstance(p[index], Shard) for p in strategy.params.values()):
                continue
            for position, name in enumerate(node.inputs):
                meta = node.input_meta[position]
                wanted = strategy.inputs[position]
                if name in params or not meta.dtype.is_floating_point or not isinstance(wanted[index], Replicate):
                    continue
                if self.first_use.get((name, wanted)) != node.name:
                    continue
                producer = self.context.strategies.get(name)
                gathered_here = producer is not None and producer.outputs and isinstance(producer.outputs[0][index], Shard)
                if gathered_here or self._gathered_upstream(name, index):
                    continue  # the gather's backward reduce-scatter already sums this gradient
                found.append((position, index))
        return tuple(found)

    def _add_input_gradient_reduction(self, node: OpNode, strategy: NodeStrategy, cost: NodeCost,
                                      reductions: tuple[tuple[int, int], ...]) -> None:
        """Megatron's 'f': a replicated activation read by weights split on an axis gets a
        partial gradient there, summed by an all-reduce in backward (``reductions``:
        ``input_gradient_reductions``)."""
        for position, index in reductions:
            axis, size = self.context.mesh.axes[index]
            meta, wanted = node.input_meta[position], strategy.inputs[position]
            others = math.prod(
                s for j, (a, s) in enumerate(self.context.mesh.axes) if j != index and a != "pp" and isinstance(wanted[j], Shard)
            )
            full = meta.nbytes * self.context.activation_scale / others / self.context.micro_batches
            cost.backward_comm_s += self.context.collective("all_reduce", full, axis) + self.context.redistribute_overhead_s
            cost.axis_bytes[axis] = cost.axis_bytes.get(axis, 0.0) + full * SENT_FRACTION["all_reduce"](size)

    def _gathered_upstream(self, name: str, axis_index: int, hops: int = 8) -> bool:
        """Whether tensor ``name`` was all-gathered on this axis, directly or through views
        (as under sequence parallelism): its partial gradient is then reduce-scattered by the
        gather's backward and needs no all-reduce of its own."""
        for _ in range(hops):
            producer = self.context.strategies.get(name)
            node = self.context.nodes.get(name)
            if producer is None or node is None or not producer.outputs:
                return False
            if producer.produced is not None and isinstance(producer.produced[0][axis_index], Shard):
                return True
            gathered = [
                position for position, source in enumerate(node.inputs)
                if source in self.context.strategies and self.context.strategies[source].outputs
                and isinstance(self.context.strategies[source].outputs[0][axis_index], Shard)
                and isinstance(producer.inputs[position][axis_index], Replicate)
            ]
            if gathered:
                return True
            if not node.is_view or not node.inputs:
                return False
            name = node.inputs[0]
        return False


def _read_key(node: OpNode, strategy: NodeStrategy, position: int) -> tuple:
    """The (tensor, placement) ``node`` reads at input ``position`` under ``strategy``."""
    return (node.inputs[position], strategy.inputs[position] if position < len(strategy.inputs) else None)
