"""Execution simulator: predict the step time, memory and timeline of any plan.

How a plan becomes a simulated step (FlexFlow's simulator, Daydream's task graph):

1. **Node costs.** For every op, its share of work on one device is ``1 / (ranks splitting
   it x micro-batches)`` (an axis splits an op when the op's output is ``Shard`` or
   ``Partial`` on it); forward/backward times come from the roofline in
   ``cost_model.compute``. Each input edge whose producer placement differs from what the op
   reads costs a collective (``cost_model.resharding``) on that axis's process group,
   counted once per (tensor, target placement); a replicated activation read by an op with
   sharded weights (Megatron's column-parallel input) gets a backward all-reduce.
   Tensor-parallel collectives sit on the critical path: they run on the compute stream.
2. **Segments.** Ops are grouped into segments: each repeated block, plus what comes before
   the first block and after the last. A segment lives on one pipeline (virtual) stage.
3. **Task graph.** Per pipeline stage one representative device (all devices of a stage are
   symmetric under SPMD, so each is simulated once) with three streams: ``compute``,
   ``collective`` (data-parallel gradient all-reduce/reduce-scatter and FSDP all-gathers,
   overlapped with compute) and ``p2p`` (activations and gradients between stages). The
   pipeline schedule (GPipe, 1F1B, interleaved) fixes the compute order; the micro-batch
   whose backward ends the step is split per segment so each segment's gradient sync can
   start as soon as its backward is done (DDP buckets). FSDP gathers each segment's weights
   one segment ahead (prefetch) before its forward and backward and reduce-scatters its
   gradients after.
4. **Schedule and results.** ``cost_model.scheduler`` places every task; exposed
   communication is the step time minus the step time of the same schedule with every
   collective free. Memory is weights, gradients and optimizer states after sharding (ZeRO
   stages), the peak of activations held by in-flight micro-batches in the schedule, and
   communication buffers.

Delta simulation (for MCMC): ``Simulator.replace(node, strategy)`` re-costs only that node,
its consumers and the readers whose shared resharding moves, then re-runs the schedule
(``Simulator.assign`` re-costs without re-running, for moves of several nodes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace as dataclass_replace

from torch.distributed.tensor import Replicate, Shard

from cost_model import defaults
from cost_model.collectives import collective_time
from cost_model.compute import PRECISIONS, check_precision, op_times, optimizer_step_time
from cost_model.moe_layers import LaidOutLayer, annotated_layouts, laid_out_layers
from cost_model.summa_node import add_summa_costs
from cost_model.resharding import backward_collective, forward_collective
from cost_model.scheduler import TaskGraph
from cost_model.schedules import schedule as pipeline_schedule
from cost_model.simulation_cache import RECENTLY_COSTED, Costed, costing_key, graph_facts
from planner.graph import OpGraph, OpNode
from planner.strategy import (
    RECOMPUTE_MODES, CostParts, ExpertLayout, MemoryBreakdown, NodeStrategy, SimResult, TimelineEvent,
)

# bytes per parameter by precision: (weights, gradients, optimizer states). Mixed
# precision keeps fp16/bf16 weights and gradients and fp32 master weights plus Adam's two
# moments: 2 + 2 + 12 bytes (ZeRO, Rajbhandari et al. SC'20, section 3.1, K = 12).
_PARAM_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}
_SENT_FRACTION = {  # bytes a rank sends per byte of collective size, ring algorithms, n ranks
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


# Ops whose backward needs none of their tensor inputs, and ops whose backward reads their
# own output (PyTorch's derivatives.yaml): what decides which activations autograd keeps.
_BACKWARD_READS_NO_INPUT = (
    "aten.add.Tensor", "aten.sub.Tensor", "aten.dropout.", "aten.native_dropout.", "aten.clone.", "aten.contiguous.",
    "aten.alias.", "aten._to_copy.", "aten.neg.", "aten.sum.", "aten.mean.",
)
_BACKWARD_READS_OUTPUT = ("aten.relu.", "aten._softmax.", "aten.softmax.", "aten.tanh.", "aten.sigmoid.", "aten.exp.")
_DROPOUT = ("aten.dropout.", "aten.native_dropout.")


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
    saved_bytes: float = 0.0
    input_bytes: float = 0.0  # floating-point values it reads from other segments
    checkpoint_bytes: float = 0.0  # those of them made in other blocks: what recomputation keeps
    score_bytes: float = 0.0
    score_forward_s: float = 0.0
    params: dict[str, float] = field(default_factory=dict)  # name -> local bytes per element-size 1
    dp_synced: set[str] = field(default_factory=set)
    axis_bytes: dict[str, float] = field(default_factory=dict)
    axis_sync_s: float = 0.0  # NodeCost.axis_sync_s of its nodes
    # Weights each rank holds its own of (experts split by an MoE layout): kept out of the
    # dp flavour's sharding, gathering and gradient reduction.
    per_rank: set[str] = field(default_factory=set)

    def shardable_elements(self) -> float:
        """Local parameter elements the dp flavour shards (all but ``per_rank`` ones)."""
        return sum(count for name, count in self.params.items() if name not in self.per_rank)


@dataclass(frozen=True)
class SegmentProfile:
    """One segment's costs for one micro-batch on one device (``Simulator.segment_profiles``).

    ``time_s``, ``kept_bytes`` and ``transient_bytes`` are keyed by recomputation mode
    (``"none"``, ``"selective"``, ``"full"``): forward + backward seconds with the
    tensor-parallel collectives on the critical path; bytes kept for backward per
    micro-batch in flight; bytes alive only while the segment recomputes.
    ``param_elements`` are the local parameter elements (``synced_elements`` those whose
    gradients are reduced over ``dp``); ``input_bytes`` what it reads from earlier segments.
    """

    name: str
    block: bool
    time_s: dict[str, float]
    kept_bytes: dict[str, float]
    transient_bytes: dict[str, float]
    param_elements: float
    synced_elements: float
    input_bytes: float


def bytes_per_parameter(precision: str) -> tuple[int, int, int]:
    """Bytes per parameter element of (weights, gradients, optimizer states) before any
    sharding, for mixed-precision Adam at ``precision``."""
    check_precision(precision)
    return _PARAM_BYTES[precision]


class _Bucket:
    """DDP's gradient buckets, filled in backward order: 1 MiB for the first bucket, then
    25 MiB (torch DDP's ``_DEFAULT_FIRST_BUCKET_BYTES`` and ``bucket_cap_mb``). A bucket's
    all-reduce starts when the segment that fills it finishes its backward (segments are
    the simulator's granularity). FSDP reduce-scatters each unit (segment) on its own."""

    def __init__(self) -> None:
        self.cap = defaults.DDP_FIRST_BUCKET_BYTES
        self.pending = 0.0

    def fill(self, size: float, per_unit: bool, flush: bool) -> list[tuple[float, int]]:
        """Buckets ready to reduce after adding ``size`` bytes of gradients, as (bucket
        bytes, how many such buckets): a segment of a large model fills thousands of equal
        buckets at once, which are counted rather than listed."""
        if per_unit:
            return [(size, 1)] if size else []
        ready = []
        self.pending += size
        if self.pending >= self.cap and self.cap != defaults.DDP_BUCKET_BYTES:
            ready.append((self.cap, 1))
            self.pending -= self.cap
            self.cap = defaults.DDP_BUCKET_BYTES
        if self.pending >= self.cap:
            full = int(self.pending // self.cap)
            ready.append((self.cap, full))
            self.pending -= full * self.cap
        if flush and self.pending > 0:
            ready.append((self.pending, 1))
            self.pending = 0.0
        return ready


class Simulator:
    """Simulates one plan; keeps node costs so a one-node change re-simulates fast."""

    def __init__(self, plan, graph: OpGraph):
        check_precision(plan.precision)
        self.plan = plan
        self.graph = graph
        self.mesh = plan.mesh
        self.cluster = plan.cluster
        self.strategies: dict[str, NodeStrategy] = {s.node: s for s in plan.strategies}
        pipeline = plan.pipeline
        self.pp = self.mesh.axis_size("pp") if "pp" in self.mesh.names else 1
        self.chunks = pipeline.virtual_stages if pipeline else 1
        # Gradient accumulation without a pipeline is a one-stage 1F1B: each micro-batch's
        # forward then its backward, one micro-batch's activations held at a time.
        self.micro_batches = pipeline.micro_batches if pipeline else plan.accumulation_steps
        self.schedule_name = pipeline.schedule if pipeline else "1f1b"
        self.dp = self.mesh.axis_size("dp") if "dp" in self.mesh.names else 1
        self.device = min(
            (self.cluster.device_of(r) for r in range(self.cluster.world_size)),
            key=lambda d: d.flops_for(PRECISIONS[plan.precision][0]),
        )
        self.activation_scale = PRECISIONS[plan.precision][1] / 4
        self._groups = {axis: self._axis_group(axis) for axis in self.mesh.names}
        self._comm_cache: dict[tuple, float] = {}
        self._segment_list: list[Segment] | None = None  # until a strategy changes
        # MoE layers with a layout are priced by it (cost_model.moe_layers), not by placements.
        self.moe_layers: dict[str, LaidOutLayer] = laid_out_layers(plan, graph, self.micro_batches)
        self._moe_layer_of = {name: layer for layer in self.moe_layers.values() for name in layer.nodes}
        facts = graph_facts(graph)
        self.nodes, self.consumers, self._kept, self._signature = facts.nodes, facts.consumers, facts.kept, facts.signature
        key = costing_key(plan, graph, self.micro_batches)
        costed = RECENTLY_COSTED.get(key)
        if costed is not None:
            # A plan that differs from one simulated before only in what node costs do not
            # read (recomputation, dp flavour): its node costs and segments are the same.
            self._cache, self._first_use, self.costs = dict(costed.cache), dict(costed.first_use), dict(costed.costs)
            self._segment_list = costed.segments
            return
        self._cache: dict[tuple, NodeCost] = {}
        self._first_use: dict[tuple, str] = {}
        self._index_first_uses()
        self.costs: dict[str, NodeCost] = {node.name: self._node_cost(node) for node in graph.nodes}
        self._segment_list = self._segments()
        RECENTLY_COSTED.put(key, Costed(
            keep=(plan.strategies, graph, facts, self.cluster), cache=dict(self._cache), first_use=dict(self._first_use),
            costs=dict(self.costs), segments=self._segment_list,
        ))

    # ------------------------------------------------------------------ public

    def run(self, trace: bool = True) -> SimResult:
        """Simulate one step of the plan with the current strategies."""
        if self._segment_list is None:
            self._segment_list = self._segments()
        segments = self._segment_list
        tasks, per_device = self._task_graph(segments)
        step = tasks.run()
        timeline = tuple(
            [TimelineEvent(t.stream[0], t.stream[1], t.name, t.start, t.finish - t.start) for t in tasks.tasks]
        ) if trace else ()
        busy = {device: tasks.busy((device, "compute"), ("compute", "optimizer")) for device in per_device}
        no_comm = tasks.run(scale={"comm": 0.0, "tp_comm": 0.0, "p2p": 0.0})
        critical = max(busy, key=busy.get)
        stage_memory = tuple(self._stage_memory(segments, stage, per_device[f"stage {stage}"]) for stage in range(self.pp))
        peak = max(stage_memory, key=lambda m: m.total)
        samples = self.plan.batch_size / step if step else 0.0
        model_flops = 3.0 * self.graph.total_flops
        tflops = model_flops / step / self.cluster.world_size / 1e12 if step else 0.0
        peak_flops = self.device.flops_for(PRECISIONS[self.plan.precision][0])
        return SimResult(
            step_time_s=step,
            compute_s=busy[critical],
            communication_s=max(0.0, step - no_comm),
            memory=peak,
            device_memory_bytes=self.cluster.min_device_memory,
            method="simulator",
            stage_memory=stage_memory,
            samples_per_s=samples,
            tokens_per_s=samples * self.plan.summary.tokens_per_sample,
            model_flops=model_flops,
            tflops_per_device=tflops,
            mfu=tflops * 1e12 / peak_flops if peak_flops else 0.0,
            bytes_per_axis=self._bytes_per_axis(segments),
            bubble_fraction=max(0.0, 1 - busy[critical] / no_comm) if no_comm else 0.0,
            timeline=timeline,
        )

    def segment_profiles(self) -> list[SegmentProfile]:
        """Per-segment costs of one micro-batch on one device, in graph order, for every
        recomputation mode: what pipeline stage slicing needs, from this one simulation
        (segment costs do not depend on which stage a segment is on)."""
        profiles = []
        if self._segment_list is None:
            self._segment_list = self._segments()
        for segment in self._segment_list:
            by_mode = {mode: self._activation_bytes(segment, mode) for mode in RECOMPUTE_MODES}
            profiles.append(SegmentProfile(
                name=segment.name,
                block=segment.block,
                time_s={
                    mode: segment.forward_s + segment.forward_comm_s + self._backward_time(segment, mode)
                    + self._backward_comm(segment, mode)
                    for mode in RECOMPUTE_MODES
                },
                kept_bytes={mode: kept for mode, (kept, _) in by_mode.items()},
                transient_bytes={mode: transient for mode, (_, transient) in by_mode.items()},
                param_elements=sum(segment.params.values()),
                synced_elements=sum(segment.params[name] for name in segment.dp_synced),
                input_bytes=segment.input_bytes,
            ))
        return profiles

    def annotated_strategies(self) -> tuple[NodeStrategy, ...]:
        """The plan's strategies with each node's simulated cost parts for one step
        (all micro-batches), so reports can say where the time goes."""
        steps = self.micro_batches
        parts: dict[int, CostParts] = {}  # twins of repeated blocks share their NodeCost
        annotated = []
        for node in self.graph.nodes:
            cost = self.costs[node.name]
            if id(cost) not in parts:
                parts[id(cost)] = CostParts(
                    compute_s=(cost.forward_s + cost.backward_s) * steps,
                    communication_s=(cost.forward_comm_s + cost.backward_comm_s) * steps,
                    memory_bytes=int(cost.saved_bytes * steps),
                )
            annotated.append(self.strategies[node.name].replaced(cost=parts[id(cost)]))
        return tuple(annotated)

    def annotated_expert_layouts(self) -> tuple[ExpertLayout, ...]:
        """The plan's expert layouts with each layer's simulated cost parts for one step."""
        return annotated_layouts(self.plan.expert_layouts, self.moe_layers, self.micro_batches)

    def replace(self, node_name: str, strategy: NodeStrategy) -> SimResult:
        """Delta simulation: change one node's strategy, re-cost it and its consumers, re-run."""
        self.assign(node_name, strategy)
        return self.run(trace=False)

    def assign(self, node_name: str, strategy: NodeStrategy) -> None:
        """Change one node's strategy and re-cost what it affects, without re-running the
        schedule: a move of several nodes (or its undo) runs once, after its last change."""
        old = self.strategies[node_name]
        self.strategies[node_name] = strategy
        self._segment_list = None
        node = self.nodes[node_name]
        # Only the (tensor, placement) keys this node reads, before or after, can change
        # their first reader; readers that start or stop paying a shared resharding are
        # re-costed too.
        keys = {self._read_key(node, old, position) for position in range(len(node.inputs))}
        keys |= {self._read_key(node, strategy, position) for position in range(len(node.inputs))}
        moved = set()
        for key in keys:
            before = self._first_use.get(key)
            after = self._first_reader(key)
            if after is None:
                self._first_use.pop(key, None)
            else:
                self._first_use[key] = after
            if before != after:
                moved |= {before, after}
        for name in {node_name, *self.consumers.get(node_name, []), *(m for m in moved if m)}:
            self.costs[name] = self._node_cost(self.nodes[name])

    @staticmethod
    def _read_key(node: OpNode, strategy: NodeStrategy, position: int) -> tuple:
        """The (tensor, placement) ``node`` reads at input ``position`` under ``strategy``."""
        return (node.inputs[position], strategy.inputs[position] if position < len(strategy.inputs) else None)

    def _first_reader(self, key: tuple) -> str | None:
        """The first node, in graph order, that reads ``key``'s tensor in ``key``'s placement."""
        name = key[0]
        for reader in self.consumers.get(name, ()):
            node, strategy = self.nodes[reader], self.strategies[reader]
            if any(source == name and self._read_key(node, strategy, position) == key for position, source in enumerate(node.inputs)):
                return reader
        return None

    # ----------------------------------------------------------- node costs

    def _axis_group(self, axis: str) -> tuple[list[int], int, int]:
        """Ranks of the first group along ``axis``, how many such groups run at once, size."""
        names, shape = self.mesh.names, self.mesh.shape
        index = names.index(axis)
        stride = math.prod(shape[index + 1:])
        size = shape[index]
        ranks = [k * stride for k in range(size)]
        concurrent = self.mesh.size // size // (self.pp if axis != "pp" else 1)
        return ranks, max(1, concurrent), size

    def _collective(self, kind: str, size_bytes: float, axis: str) -> float:
        key = (kind, size_bytes, axis)
        if key not in self._comm_cache:
            ranks, concurrent, _ = self._groups[axis]
            self._comm_cache[key] = collective_time(kind, size_bytes, self.cluster, ranks, concurrent)
        return self._comm_cache[key]

    def _index_first_uses(self) -> None:
        """The first consumer of each (tensor, placement) pays its resharding; later ones reuse it."""
        self._first_use = {}
        for node in self.graph.nodes:
            strategy = self.strategies[node.name]
            for position, name in enumerate(node.inputs):
                key = (name, strategy.inputs[position] if position < len(strategy.inputs) else None)
                self._first_use.setdefault(key, node.name)

    def _node_cost(self, node: OpNode) -> NodeCost:
        layer = self._moe_layer_of.get(node.name)
        if layer is not None:
            return self._moe_node_cost(node, layer)
        strategy = self.strategies[node.name]
        edges = []
        for position, name in enumerate(node.inputs):
            if name in self._moe_layer_of:
                continue  # an MoE layer hands its tokens back split as the batch is
            producer = self.strategies.get(name)
            wanted = strategy.inputs[position] if position < len(strategy.inputs) else None
            if producer is None or not producer.outputs or wanted is None:
                continue
            if self._first_use.get((name, wanted)) != node.name:
                continue
            edges.append((position, producer.outputs[0], wanted))
        key = (
            self._signature[node.name], self._kept_for_backward(node.name),
            strategy.inputs, strategy.outputs, tuple(strategy.params.values()), tuple(edges), strategy.layout,
        )
        if key not in self._cache:
            self._cache[key] = self._compute_node_cost(node, strategy, edges)
        return self._cache[key]

    def _moe_node_cost(self, node: OpNode, layer: LaidOutLayer) -> NodeCost:
        """An op of an MoE layer run by its layout (``cost_model.moe_layers``): the layer's
        expert cost on its anchor op, nothing on the other expert ops, and the routing ops'
        traced work split over the ranks (each routes its own tokens)."""
        cost = NodeCost()
        if node.name in layer.expert_nodes:
            if node.name == layer.anchor:
                moe = layer.cost
                cost.forward_s, cost.backward_s = moe.forward_compute_s, moe.backward_compute_s
                cost.forward_comm_s = moe.forward_comm_s + layer.routing_sync_s
                cost.backward_comm_s = moe.backward_comm_s + layer.replica_sync_s / self.micro_batches
                cost.saved_bytes = layer.activation_bytes
                if moe.sent_bytes:
                    cost.axis_bytes[layer.layout.axis] = moe.sent_bytes
            return cost
        split = self.mesh.axis_size(layer.layout.axis) * self.micro_batches
        cost.forward_s, cost.backward_s = op_times(node, 1.0 / split, self.device, self.plan.precision)
        if not node.is_view and self._kept_for_backward(node.name):
            cost.saved_bytes = sum(
                meta.nbytes * self.activation_scale / split for meta in node.output_meta if meta.dtype.is_floating_point
            )
        return cost

    def _kept_for_backward(self, name: str) -> bool:
        """Whether autograd keeps the output of ``name`` until backward: unless every reader
        (through views) is an op whose backward needs none of its inputs (additions pass the
        gradient through, copies and sums too, dropout keeps only its mask, relu and softmax
        keep their output instead). An op with no reader (the loss) or whose own backward reads its
        output (relu, softmax) keeps it."""
        if name not in self._kept:
            node = self.nodes.get(name)
            readers = self.consumers.get(name, [])
            if node is not None and (not readers or node.op.startswith(_BACKWARD_READS_OUTPUT)):
                self._kept[name] = True
            else:
                self._kept[name] = any(
                    self._kept_for_backward(r)
                    if self.nodes[r].is_view
                    else not self.nodes[r].op.startswith(_BACKWARD_READS_NO_INPUT + _BACKWARD_READS_OUTPUT)
                    for r in readers
                )
        return self._kept[name]

    def _shard_factor(self, placements) -> int:
        """Ranks a tensor is split over: a Partial tensor is whole-size on every rank."""
        return math.prod(
            size for (axis, size), p in zip(self.mesh.axes, placements) if axis != "pp" and isinstance(p, Shard)
        )

    def _work_split(self, strategy: NodeStrategy) -> int:
        """Ranks an op's work is divided over: the axes on which some operand is split. An
        axis where the op only reads or makes partial sums (all operands whole-size) leaves
        every rank the whole computation (the rule registry's ``shards_work``)."""
        tensors = (*strategy.inputs, *strategy.outputs)
        return math.prod(
            size
            for index, (axis, size) in enumerate(self.mesh.axes)
            if axis != "pp" and any(isinstance(p[index], Shard) for p in tensors)
        )

    def _compute_node_cost(self, node: OpNode, strategy: NodeStrategy, edges) -> NodeCost:
        cost = NodeCost()
        work = 1.0 / (self._work_split(strategy) * self.micro_batches)
        cost.forward_s, cost.backward_s = op_times(node, work, self.device, self.plan.precision)
        if not node.is_view:
            # An op's output is what its readers keep for backward (most ops save their input).
            cost.saved_bytes = self._output_bytes(node, strategy) if self._kept_for_backward(node.name) else 0.0
            dropout_p = next((a for a in node.attrs if isinstance(a, float)), 0.0) if node.op.startswith(_DROPOUT) else 0.0
            if dropout_p > 0 and node.output_meta:  # its boolean mask, a byte per element
                meta, placements = node.output_meta[0], strategy.outputs[0]
                cost.saved_bytes += meta.numel / self._shard_factor(placements) / self.micro_batches
        if strategy.produced is not None:
            # The op's own output resharded into its planned placement (an override).
            for meta, made, planned in zip(node.output_meta, strategy.produced, strategy.outputs):
                self._charge_edge(cost, meta, made, planned)
        for position, src, dst in edges:
            self._charge_edge(cost, node.input_meta[position], src, dst)
        self._add_input_gradient_reduction(node, strategy, cost)
        # Meshes with SUMMA axes: SUMMA matmuls and block norms by their algorithms, and the
        # gradient sync of weights replicated on a non-dp axis (cost_model.summa_node).
        add_summa_costs(self, node, strategy, cost, _PARAM_BYTES[self.plan.precision][1])
        return cost

    def _charge_edge(self, cost: NodeCost, meta, src, dst) -> None:
        """Forward collective and backward dual of one placement change, per mesh axis."""
        has_grad = meta.dtype.is_floating_point
        for index, (axis, size) in enumerate(self.mesh.axes):
            if axis == "pp" or src[index] == dst[index]:
                continue
            others = math.prod(
                s for j, (a, s) in enumerate(self.mesh.axes) if j != index and a != "pp" and isinstance(dst[j], Shard)
            )
            full = meta.nbytes * self.activation_scale / others / self.micro_batches
            for kind, backward in (
                (forward_collective(src[index], dst[index]), False),
                (backward_collective(src[index], dst[index]) if has_grad else None, True),
            ):
                if kind is None:
                    continue
                size_bytes = full / size if kind == "all_to_all" else full
                seconds = self._collective(kind, size_bytes, axis)
                if backward:
                    cost.backward_comm_s += seconds
                else:
                    cost.forward_comm_s += seconds
                cost.axis_bytes[axis] = cost.axis_bytes.get(axis, 0.0) + size_bytes * _SENT_FRACTION[kind](size)

    def _add_input_gradient_reduction(self, node: OpNode, strategy: NodeStrategy, cost: NodeCost) -> None:
        """Megatron's 'f': a replicated activation read by weights split on an axis gets a
        partial gradient there, summed by an all-reduce in backward."""
        params = set(node.param_inputs)
        for index, (axis, size) in enumerate(self.mesh.axes):
            if axis in ("pp", "dp") or size == 1:
                continue
            if not any(isinstance(p[index], Shard) for p in strategy.params.values()):
                continue
            for position, name in enumerate(node.inputs):
                meta = node.input_meta[position]
                wanted = strategy.inputs[position]
                if name in params or not meta.dtype.is_floating_point or not isinstance(wanted[index], Replicate):
                    continue
                if self._first_use.get((name, wanted)) != node.name:
                    continue
                producer = self.strategies.get(name)
                gathered_here = producer is not None and producer.outputs and isinstance(producer.outputs[0][index], Shard)
                if gathered_here or self._gathered_upstream(name, index):
                    continue  # the gather's backward reduce-scatter already sums this gradient
                others = math.prod(
                    s for j, (a, s) in enumerate(self.mesh.axes) if j != index and a != "pp" and isinstance(wanted[j], Shard)
                )
                full = meta.nbytes * self.activation_scale / others / self.micro_batches
                cost.backward_comm_s += self._collective("all_reduce", full, axis)
                cost.axis_bytes[axis] = cost.axis_bytes.get(axis, 0.0) + full * _SENT_FRACTION["all_reduce"](size)

    def _gathered_upstream(self, name: str, axis_index: int, hops: int = 8) -> bool:
        """Whether tensor ``name`` was all-gathered on this axis, directly or through views
        (as under sequence parallelism): its partial gradient is then reduce-scattered by the
        gather's backward and needs no all-reduce of its own."""
        for _ in range(hops):
            producer = self.strategies.get(name)
            node = self.nodes.get(name)
            if producer is None or node is None or not producer.outputs:
                return False
            if producer.produced is not None and isinstance(producer.produced[0][axis_index], Shard):
                return True
            gathered = [
                position for position, source in enumerate(node.inputs)
                if source in self.strategies and self.strategies[source].outputs
                and isinstance(self.strategies[source].outputs[0][axis_index], Shard)
                and isinstance(producer.inputs[position][axis_index], Replicate)
            ]
            if gathered:
                return True
            if not node.is_view or not node.inputs:
                return False
            name = node.inputs[0]
        return False

    # ------------------------------------------------------------- segments

    def _segments(self) -> list[Segment]:
        segments: dict[tuple, Segment] = {}
        seen_block = False
        sequence = self.plan.summary.tokens_per_sample
        dp_index = self.mesh.names.index("dp") if "dp" in self.mesh.names else None
        for node in self.graph.nodes:
            strategy = self.strategies[node.name]
            if node.block is not None:
                seen_block = True
                key = ("block",) + node.block
                label = f"{node.block[0]}.{node.block[1]}"
            else:
                key = ("tail",) if seen_block else ("head",)
                label = "after blocks" if seen_block else "before blocks"
            segment = segments.get(key)
            if segment is None:
                segment = segments[key] = Segment(name=label, stage=strategy.stage, block=node.block is not None)
            cost = self.costs[node.name]
            segment.nodes.append(node.name)
            segment.forward_s += cost.forward_s
            segment.backward_s += cost.backward_s
            segment.forward_comm_s += cost.forward_comm_s
            segment.backward_comm_s += cost.backward_comm_s
            segment.saved_bytes += cost.saved_bytes
            segment.axis_sync_s += cost.axis_sync_s
            for axis, sent in cost.axis_bytes.items():
                segment.axis_bytes[axis] = segment.axis_bytes.get(axis, 0.0) + sent
            if sequence and node.output_meta and len(node.output_meta[0].shape) >= 2 and node.output_meta[0].shape[-2:] == (sequence, sequence):
                segment.score_bytes += cost.saved_bytes  # attention scores: dropped by selective recompute
                segment.score_forward_s += cost.forward_s
            layer = self._moe_layer_of.get(node.name)
            for name, placements in strategy.params.items():
                meta = self.graph.parameters.get(name)
                if meta is None:
                    continue
                if layer is not None and name in layer.expert_weights:
                    # The layout says which experts (or which slice of each) a device holds.
                    segment.params[name] = meta.numel * layer.param_fraction
                    if layer.gradients_synced:
                        if dp_index is not None:
                            segment.dp_synced.add(name)
                    else:
                        segment.per_rank.add(name)
                    continue
                shards = math.prod(size for (axis, size), p in zip(self.mesh.axes, placements) if isinstance(p, Shard))
                segment.params[name] = meta.numel / shards
                # The loss depends on every rank's own samples, so the gradient of every
                # weight replicated over dp is a partial sum there, whatever its op's output.
                if dp_index is not None and isinstance(placements[dp_index], Replicate):
                    segment.dp_synced.add(name)
        in_block = {name for segment in segments.values() if segment.block for name in segment.nodes}
        for segment in segments.values():
            members = set(segment.nodes)
            sources = {
                source
                for name in segment.nodes
                for position, source in enumerate(self.nodes[name].inputs)
                if source in self.nodes and source not in members and self.nodes[name].input_meta[position].dtype.is_floating_point
            }
            for source in sources:
                size = self._output_bytes(self.nodes[source], self.strategies[source])
                segment.input_bytes += size
                if source in in_block:
                    # Made inside another block, which recomputation does not keep: this
                    # block's checkpoint holds it. (Values made around the blocks are kept
                    # by their own segment already.)
                    segment.checkpoint_bytes += size
        return list(segments.values())

    def _output_bytes(self, node: OpNode, strategy: NodeStrategy) -> float:
        """Bytes of one micro-batch of ``node``'s floating-point outputs on one device."""
        return sum(
            meta.nbytes * self.activation_scale / self._shard_factor(placements) / self.micro_batches
            for meta, placements in zip(node.output_meta, strategy.outputs)
            if meta.dtype.is_floating_point
        )

    # ----------------------------------------------------------- task graph

    def _task_graph(self, segments: list[Segment]) -> tuple[TaskGraph, dict[str, list[Segment]]]:
        graph = TaskGraph()
        stages_total = self.pp * self.chunks
        chunk_segments: dict[int, list[Segment]] = {vs: [] for vs in range(stages_total)}
        for segment in segments:
            chunk_segments[min(segment.stage, stages_total - 1)].append(segment)
        fsdp = self.plan.dp_flavour == "fsdp" and self.dp > 1
        sync_every = self._syncs_every_micro_batch()
        forward_done: dict[tuple[int, int], int] = {}
        backward_done: dict[tuple[int, int], int] = {}
        per_device: dict[str, list[Segment]] = {}
        boundary = {vs: self._boundary_bytes(chunk_segments, vs) for vs in range(stages_total - 1)}
        orders = {
            stage: pipeline_schedule(self.schedule_name, stage, self.pp, self.micro_batches, self.chunks)
            for stage in range(self.pp)
        }
        positions = {stage: 0 for stage in range(self.pp)}
        sync_after: dict[str, list[int]] = {}
        # Walk the devices round-robin so a task's cross-stage dependencies exist when it is added.
        while any(positions[s] < len(orders[s]) for s in orders):
            progressed = False
            for stage, order in orders.items():
                device = f"stage {stage}"
                per_device.setdefault(device, [s for vs, segs in chunk_segments.items() if vs % self.pp == stage for s in segs])
                while positions[stage] < len(order):
                    kind, mb, chunk = order[positions[stage]]
                    vs = chunk * self.pp + stage
                    if kind == "F":
                        upstream = forward_done.get((mb, vs - 1)) if vs > 0 else None
                        if vs > 0 and upstream is None:
                            break
                        deps = [self._p2p(graph, vs - 1, upstream, boundary[vs - 1], f"send act mb{mb}")] if vs > 0 else []
                        forward_done[(mb, vs)] = self._forward(graph, device, chunk_segments[vs], mb, deps, fsdp)
                    else:
                        if vs < stages_total - 1:
                            downstream = backward_done.get((mb, vs + 1))
                            if downstream is None:
                                break
                            deps = [self._p2p(graph, vs + 1, downstream, boundary[vs], f"send grad mb{mb}")]
                        else:
                            deps = []
                        deps.append(forward_done[(mb, vs)])
                        sync = sync_every or mb == self.micro_batches - 1
                        split = fsdp or sync  # per-segment tasks feed gradient syncs
                        backward_done[(mb, vs)] = self._backward(
                            graph, device, chunk_segments[vs], mb, deps, self.plan.recompute_at(vs), fsdp, split,
                            sync_after, sync,
                        )
                    positions[stage] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError("pipeline schedule deadlocked: a stage waits for work no stage can do")
        for stage in range(self.pp):
            device = f"stage {stage}"
            state_bytes = self._optimizer_state_bytes(per_device[device])
            step = graph.add("optimizer step", (device, "compute"), optimizer_step_time(state_bytes, self.device),
                             deps=sync_after.get(device, []), kind="optimizer")
            if self.plan.dp_flavour in ("zero1", "zero2") and self.dp > 1:
                gathered = sum(s.shardable_elements() for s in per_device[device]) * _PARAM_BYTES[self.plan.precision][0]
                graph.add("all-gather updated weights", (device, "collective"), self._collective("all_gather", gathered, "dp"), deps=[step], kind="comm")
        return graph, per_device

    def _syncs_every_micro_batch(self) -> bool:
        """Whether gradients are reduced over ``dp`` after every micro-batch of an
        accumulating step (no pipeline): FSDP2 (FSDP, ZeRO-2) reduce-scatters each one into
        its sharded gradients, and graph programs (a label: searched or Megatron layouts)
        reduce in each parameter's gradient hook; DDP syncs once, after the last."""
        if self.plan.pipeline is not None or self.dp == 1:
            return False
        return self.plan.dp_flavour in ("zero2", "fsdp") or bool(self.plan.label)

    def _p2p(self, graph: TaskGraph, vs: int, after: int, size_bytes: float, name: str) -> int:
        # Activations and gradients travel on separate streams (as NCCL's send/recv on
        # separate communicators), so one never waits behind the other.
        device = f"stage {vs % self.pp}"
        stream = "p2p act" if name.startswith("send act") else "p2p grad"
        stride = self.mesh.size // self.pp
        src, dst = (vs % self.pp) * stride, ((vs + 1) % self.pp) * stride
        key = ("send_recv", size_bytes, src, dst)
        if key not in self._comm_cache:
            self._comm_cache[key] = collective_time("send_recv", size_bytes, self.cluster, [src, dst]) if src != dst else 0.0
        seconds = self._comm_cache[key]
        return graph.add(name, (device, stream), seconds, deps=[after], kind="p2p")

    def _forward(self, graph: TaskGraph, device: str, segments: list[Segment], mb: int, deps: list[int], fsdp: bool) -> int:
        last = None
        for position, segment in enumerate(segments):
            segment_deps = list(deps) if last is None else [last]
            if fsdp:
                prefetch_after = [] if position < 2 else [last]
                segment_deps.append(self._fsdp_gather(graph, device, segment, prefetch_after, f"all-gather {segment.name}"))
            compute = graph.add(f"F{mb} {segment.name}", (device, "compute"), segment.forward_s, deps=segment_deps)
            last = graph.add(f"F{mb} {segment.name} tp-comm", (device, "compute"), segment.forward_comm_s, deps=[compute], kind="tp_comm") if segment.forward_comm_s else compute
        return last if last is not None else graph.add(f"F{mb} (empty)", (device, "compute"), 0.0, deps=deps)

    def _backward(self, graph, device, segments, mb, deps, recompute, fsdp, split, sync_after, sync) -> int:
        last = None
        if not split:  # one task for the whole chunk: nothing needs per-segment timing
            duration = sum(self._backward_time(s, recompute) for s in segments)
            comm = sum(self._backward_comm(s, recompute) for s in segments)
            compute = graph.add(f"B{mb}", (device, "compute"), duration, deps=deps)
            return graph.add(f"B{mb} tp-comm", (device, "compute"), comm, deps=[compute], kind="tp_comm") if comm else compute
        bucket = _Bucket()
        for position, segment in enumerate(reversed(segments)):
            segment_deps = list(deps) if last is None else [last]
            if fsdp:
                segment_deps.append(self._fsdp_gather(graph, device, segment, [] if last is None else [last], f"all-gather {segment.name} (bwd)"))
            compute = graph.add(f"B{mb} {segment.name}", (device, "compute"), self._backward_time(segment, recompute), deps=segment_deps)
            comm = self._backward_comm(segment, recompute)
            last = graph.add(f"B{mb} {segment.name} tp-comm", (device, "compute"), comm, deps=[compute], kind="tp_comm") if comm else compute
            if segment.axis_sync_s and sync and mb == self.micro_batches - 1:
                sync_after.setdefault(device, []).append(graph.add(
                    f"all-reduce grads off dp ({segment.name})", (device, "collective"), segment.axis_sync_s, deps=[last], kind="comm"))
            if self.dp == 1 or not sync:
                continue
            grads = sum(segment.params[name] for name in segment.dp_synced) * _PARAM_BYTES[self.plan.precision][1]
            final = position == len(segments) - 1
            ready = bucket.fill(grads, per_unit=fsdp, flush=final)
            if ready:
                # The buckets a segment fills are all ready when its backward ends and run one
                # after another on the collective stream: one task of all of them.
                sync_after.setdefault(device, []).append(self._gradient_sync(graph, device, segment.name, ready, last))
        return last

    def _backward_comm(self, segment: Segment, recompute: str) -> float:
        """Tensor-parallel communication of a segment's backward; a fully recomputed block
        runs its forward collectives again."""
        if segment.block and recompute == "full":
            return segment.backward_comm_s + segment.forward_comm_s
        return segment.backward_comm_s

    def _backward_time(self, segment: Segment, recompute: str) -> float:
        if not segment.block:
            return segment.backward_s  # only repeated blocks are checkpointed (as compiled)
        if recompute == "full":
            return segment.backward_s + segment.forward_s
        if recompute == "selective":
            return segment.backward_s + segment.score_forward_s
        return segment.backward_s

    def _fsdp_gather(self, graph, device, segment, deps, name) -> int:
        size = segment.shardable_elements() * _PARAM_BYTES[self.plan.precision][0]
        return graph.add(name, (device, "collective"), self._collective("all_gather", size, "dp"), deps=deps, kind="comm")

    def _gradient_sync(self, graph, device, name: str, buckets: list[tuple[float, int]], after: int) -> int:
        """Data-parallel reduction of the gradient buckets (bytes, count) one segment's
        backward filled, once that backward is done: each bucket is its own collective."""
        kind = "reduce_scatter" if self.plan.dp_flavour in ("zero2", "fsdp") else "all_reduce"
        pieces = [(self._collective(kind, size, "dp"), count) for size, count in buckets]
        count = sum(count for _, count in buckets)
        label = f"{kind.replace('_', '-')} grads ({name}{f', {count} buckets' if count > 1 else ''})"
        return graph.add_pieces(label, (device, "collective"), pieces, deps=[after], kind="comm")

    def _boundary_bytes(self, chunk_segments: dict[int, list[Segment]], vs: int) -> float:
        """Activation bytes a micro-batch carries from virtual stage ``vs`` to ``vs + 1``."""
        following = chunk_segments.get(vs + 1, [])
        return following[0].input_bytes if following else 0.0

    # ---------------------------------------------------------------- memory

    def _optimizer_state_bytes(self, segments: list[Segment]) -> float:
        weights, grads, states = _PARAM_BYTES[self.plan.precision]
        elements = sum(sum(s.params.values()) for s in segments)
        shardable = sum(s.shardable_elements() for s in segments)
        shard = self.dp if self.plan.dp_flavour in ("zero1", "zero2", "fsdp") else 1
        return (shardable / shard + elements - shardable) * (weights + grads + states)

    def _stage_memory(self, all_segments: list[Segment], stage: int, segments: list[Segment]) -> MemoryBreakdown:
        weight_b, grad_b, state_b = _PARAM_BYTES[self.plan.precision]
        params: dict[str, float] = {}
        per_rank: set[str] = set()
        for segment in segments:
            params.update(segment.params)
            per_rank |= segment.per_rank
        elements = sum(params.values())
        own = sum(count for name, count in params.items() if name in per_rank)  # never sharded over dp
        shared = elements - own
        flavour, dp = self.plan.dp_flavour, self.dp
        weights = shared * weight_b / (dp if flavour == "fsdp" else 1) + own * weight_b
        grads = shared * grad_b / (dp if flavour in ("zero2", "fsdp") else 1) + own * grad_b
        states = shared * state_b / (dp if flavour in ("zero1", "zero2", "fsdp") else 1) + own * state_b
        buffers_state = sum(meta.nbytes for meta in self.graph.buffers.values()) if stage == 0 else 0
        activations = self._peak_activations(stage, segments)
        if flavour == "fsdp" and dp > 1:
            largest = max((s.shardable_elements() for s in segments), default=0.0)
            comm = 2 * largest * weight_b
        elif dp > 1:
            comm = min(defaults.DDP_BUCKET_BYTES, elements * grad_b)
        else:
            comm = 0.0
        if self.pp > 1:
            comm += 2 * max((s.input_bytes for s in segments), default=0.0)
        # One MoE layer dispatches at a time: the largest of their buffers.
        comm += max((layer.buffer_bytes for layer in self.moe_layers.values()), default=0.0)
        return MemoryBreakdown(
            weights=int(weights + buffers_state),
            gradients=int(grads),
            optimizer_states=int(states),
            activations=int(activations),
            communication_buffers=int(comm),
        )

    @staticmethod
    def _activation_bytes(segment: Segment, recompute: str) -> tuple[float, float]:
        """(bytes a micro-batch keeps for backward, bytes alive only while it recomputes)."""
        if not segment.block:
            return segment.saved_bytes, 0.0  # ops around the blocks keep their activations
        if recompute == "full":
            return segment.checkpoint_bytes, segment.saved_bytes
        if recompute == "selective":
            return segment.saved_bytes - segment.score_bytes, segment.score_bytes
        return segment.saved_bytes, 0.0

    def _peak_activations(self, stage: int, segments: list[Segment]) -> float:
        """Peak bytes held for backward by the micro-batches in flight on this device."""
        chunk_bytes: dict[int, float] = {}
        transient = 0.0
        for segment in segments:
            chunk = segment.stage // self.pp
            kept, recomputed = self._activation_bytes(segment, self.plan.recompute_at(segment.stage))
            transient = max(transient, recomputed)
            chunk_bytes[chunk] = chunk_bytes.get(chunk, 0.0) + kept
        held = peak = 0.0
        for kind, _, chunk in pipeline_schedule(self.schedule_name, stage, self.pp, self.micro_batches, self.chunks):
            held += chunk_bytes.get(chunk, 0.0) if kind == "F" else -chunk_bytes.get(chunk, 0.0)
            peak = max(peak, held)
        return peak + transient

    def _bytes_per_axis(self, segments: list[Segment]) -> dict[str, float]:
        """Bytes a device of the busiest stage sends per step, by mesh axis."""
        totals: dict[str, float] = {}
        by_stage: dict[int, dict[str, float]] = {}
        for segment in segments:
            stage_totals = by_stage.setdefault(segment.stage % self.pp, {})
            for axis, sent in segment.axis_bytes.items():
                stage_totals[axis] = stage_totals.get(axis, 0.0) + sent * self.micro_batches
            if self.dp > 1 and segment.dp_synced:
                grads = sum(segment.params[n] for n in segment.dp_synced) * _PARAM_BYTES[self.plan.precision][1]
                # fsdp: all-gather twice + reduce-scatter; zero1: all-reduce + all-gather of the
                # updated weights; ddp: all-reduce; zero2: reduce-scatter + all-gather. Gradient
                # accumulation (no pipeline) repeats FSDP's gathers and FSDP2's reduce-scatters
                # for every micro-batch.
                flavour = self.plan.dp_flavour
                gathers = self.micro_batches if self.plan.pipeline is None else 1  # FSDP's, per micro-batch
                reductions = self.micro_batches if self._syncs_every_micro_batch() else 1
                units = {"fsdp": 2 * gathers + reductions, "zero1": 2 * reductions + 1, "zero2": reductions + 1, "ddp": 2 * reductions}[flavour]
                factor = units * (self.dp - 1) / self.dp
                stage_totals["dp"] = stage_totals.get("dp", 0.0) + grads * factor
            if self.pp > 1:
                stage_totals["pp"] = stage_totals.get("pp", 0.0) + 2 * segment.input_bytes * self.micro_batches
        for stage_totals in by_stage.values():
            for axis, sent in stage_totals.items():
                totals[axis] = max(totals.get(axis, 0.0), sent)
        return totals


def simulate_plan(plan, graph: OpGraph) -> SimResult:
    """Simulate ``plan`` (whose strategies were built for ``graph``)."""
    return Simulator(plan, graph).run()


def simulated(plan, graph: OpGraph):
    """``plan`` with its estimate and per-node cost parts from a simulation of it."""
    simulator = Simulator(plan, graph)
    return dataclass_replace(
        plan, estimate=simulator.run(), strategies=simulator.annotated_strategies(),
        expert_layouts=simulator.annotated_expert_layouts(),
    )
