"""Execution simulator: predict the step time, memory and timeline of any plan.

How a plan becomes a simulated step (FlexFlow's simulator, Daydream's task graph):

1. **Node costs.** For every op, its share of work on one device is ``1 / (ranks splitting
   it x micro-batches)`` (an axis splits an op when the op's output is ``Shard`` or
   ``Partial`` on it); forward/backward times come from the roofline in
   ``cost_model.compute``. Each input edge whose producer placement differs from what the op
   reads costs a collective (``cost_model.resharding``) on that axis's process group,
   counted once per (tensor, target placement); a replicated activation read by an op with
   sharded weights (Megatron's column-parallel input) gets a backward all-reduce; a cross
   entropy on logits split over the classes sends three values per row
   (``cost_model.loss_parallel``), and a split of a dim its input holds split gathers it
   (``cost_model.split_gather``). Tensor-parallel collectives sit on the critical path:
   they run on the compute stream.
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
4. **Schedule and results.** ``cost_model.scheduler`` places every task; on GPU presets a
   compute task that ran beside data-parallel collectives is then slowed by the measured
   contention (``cost_model.nccl.OVERLAP_COMPUTE_SLOWDOWN`` × the overlapped time) and the
   schedule re-run once; exposed
   communication is the step time minus the step time of the same schedule with every
   collective free. Memory is weights, gradients and optimizer states after sharding (ZeRO
   stages), the peak of activations held by in-flight micro-batches in the schedule, and
   communication buffers.

Delta simulation (for MCMC): ``Simulator.replace(node, strategy)`` re-costs only that node,
its consumers and the readers whose shared resharding moves, rebuilds only the segments
holding them, then re-runs the schedule (``Simulator.assign`` re-costs without re-running, for
moves of several nodes).

The parts live in their own modules: ``cost_model.segments`` (grouping node costs into
segments), ``cost_model.recompute`` (Megatron-LM's recomputation modes),
``cost_model.step_tasks`` (the step's task graph), ``cost_model.step_memory`` (memory and
bytes per axis); ``Simulator`` combines them with the node costs defined here.
"""

from __future__ import annotations

import contextlib
import gc
import math
from dataclasses import dataclass, field, replace as dataclass_replace

from torch.distributed.tensor import Partial, Replicate, Shard

from cost_model.collectives import collective_time
from cost_model.compute import PRECISIONS, check_precision, op_times
from cost_model.host_dispatch import host_dispatch
from cost_model.loss_parallel import add_vocabulary_parallel_loss
from cost_model.moe_layers import LaidOutLayer, annotated_layouts, laid_out_layers, routing_sync_bytes
from cost_model.summa_node import add_summa_costs
from cost_model.nccl import nccl_profile
from cost_model.recompute import activation_bytes, backward_comm, backward_time
from cost_model.replica_gradients import add_replica_gradient_sync
from cost_model.resharding import backward_collective, forward_collective
from cost_model.segments import Segment, SegmentBuilder, SegmentProfile
from cost_model.split_gather import add_split_gather
from cost_model.simulation_cache import RECENTLY_COSTED, Costed, costing_key, graph_facts
from cost_model.step_memory import PARAM_BYTES, StepMemory, bytes_per_parameter
from cost_model.step_tasks import StepTaskGraph
from planner.graph import OpGraph, OpNode
from planner.program_shape import is_data_parallel
from planner.strategy import (
    EXPERT_COPIES_AXIS,
    RECOMPUTE_MODES,
    CostParts,
    ExpertLayout,
    NodeStrategy,
    SimResult,
    TimelineEvent,
)

__all__ = ["NodeCost", "Segment", "SegmentProfile", "Simulator", "bytes_per_parameter", "simulate_plan",
           "simulated"]

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
    # Per pass (forward, and again backward), on the collective stream before the op's
    # segment runs, prefetched as FSDP's gathers are: an MoE layer's experts all-gathered
    # over their copies (``ExpertLayout.sharded_copies``).
    weight_gather_s: float = 0.0
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
)
_BACKWARD_READS_OUTPUT = ("aten.relu.", "aten._softmax.", "aten.softmax.", "aten.tanh.", "aten.sigmoid.", "aten.exp.")
_DROPOUT = ("aten.dropout.", "aten.native_dropout.")


@contextlib.contextmanager
def _collector_paused():
    """Pause Python's cyclic garbage collector while a step is scheduled: building tens of
    thousands of tasks triggers collections that scan every object alive (a traced model of
    millions), which cost GPT-3 175B's simulation more than the scheduling itself. The
    collector's state is restored after; reference counting still frees everything."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Simulator(SegmentBuilder, StepTaskGraph, StepMemory):
    """Simulates one plan; keeps node costs so a one-node change re-simulates fast."""

    def __init__(self, plan, graph: OpGraph):
        with _collector_paused():
            self._set_up(plan, graph)

    def _set_up(self, plan, graph: OpGraph) -> None:
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
        # A program that replays the traced graph on DTensors pays DTensor's dispatch on every
        # op (planner.cluster: dtensor_op_overhead_s); a plain data-parallel module does not.
        self.graph_program = not is_data_parallel(plan)
        self.dtensor_op_overhead_s = (self.device.dtensor_op_overhead_s or 0.0) if self.graph_program else 0.0
        # On GPUs the host issues ops ahead of the kernels (its time bounds a segment's from
        # below); on CPUs it runs them, and DTensor's dispatch adds to each op.
        self.host = host_dispatch(self.cluster, self.device, self.graph_program)
        # ... and pays DTensor's redistribute machinery on every collective it issues in line.
        self.redistribute_overhead_s = (self.device.redistribute_overhead_s or 0.0) if self.graph_program else 0.0
        self._groups = {axis: self._axis_group(axis) for axis in self.mesh.names}
        self._comm_cache: dict[tuple, float] = {}
        profile = nccl_profile(self.cluster)
        self._overlap_slowdown = profile.overlap_slowdown if profile is not None else 0.0
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
        with _collector_paused():
            return self._run(trace)

    def _run(self, trace: bool) -> SimResult:
        if self._segment_list is None:
            self._segment_list = self._segments()
        segments = self._segment_list
        tasks, per_device = self._task_graph(segments)
        step = tasks.run()
        if self._overlap_slowdown:
            # Compute beside the data-parallel collectives runs slower (cost_model.nccl).
            tasks.contend(self._overlap_slowdown)
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
            host_wait_s=sum(segment.host_wait_s for segment in per_device[critical]) * self.micro_batches,
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
            by_mode = {mode: activation_bytes(segment, mode) for mode in RECOMPUTE_MODES}
            profiles.append(SegmentProfile(
                name=segment.name,
                block=segment.block,
                time_s={
                    mode: segment.forward_s + segment.forward_comm_s + backward_time(segment, mode)
                    + backward_comm(segment, mode)
                    for mode in RECOMPUTE_MODES
                },
                kept_bytes={mode: kept for mode, (kept, _) in by_mode.items()},
                transient_bytes={mode: transient for mode, (_, transient) in by_mode.items()},
                param_elements=sum(segment.params.values()),
                synced_elements=sum(segment.params[name] for name in segment.dp_synced),
                input_bytes=segment.input_bytes,
                synced_tensors=tuple(segment.params[name] for name in sorted(segment.dp_synced) if segment.params[name] > 0),
                param_tensors=len(segment.params),
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
        recosted = {node_name, *self.consumers.get(node_name, []), *(m for m in moved if m)}
        for name in recosted:
            self.costs[name] = self._node_cost(self.nodes[name])
        if self._segment_list is not None:
            # Only the segments holding a re-costed node, or reading the changed node's
            # output, change: the rest are kept (the delta simulation's saving).
            self._segment_list = self._refresh_segments(self._segment_list, recosted)

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
        # Groups share a node's network only where they have members on that node: at most as
        # many as the groups of this axis that touch any one node (the axes inside this one may
        # span nodes, e.g. a SUMMA grid on single-GPU nodes, where every node holds one rank of
        # one group), as cost_model.summa's _Pricer counts them.
        touching: dict[int, set[int]] = {}
        for rank in range(min(self.mesh.size, self.cluster.world_size)):
            group = rank - (rank // stride) % size * stride
            touching.setdefault(self.cluster.node_of(rank), set()).add(group)
        concurrent = min(concurrent, max((len(groups) for groups in touching.values()), default=1))
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
                cost.weight_gather_s = layer.copy_gather_s
                cost.axis_sync_s = layer.copy_reduce_s  # sharded copies' reduce-scatter, overlapped
                cost.saved_bytes = layer.activation_bytes
                routing = routing_sync_bytes(layer.block, self.mesh.axis_size(layer.layout.axis))  # the routing all-gather
                if moe.sent_bytes or routing:
                    cost.axis_bytes[layer.layout.axis] = moe.sent_bytes + routing
                if layer.copy_sent_bytes:  # over the copy groups, sub-groups of the layout's axis
                    cost.axis_bytes[EXPERT_COPIES_AXIS] = layer.copy_sent_bytes / self.micro_batches
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
        # Every line of a graph program is a DTensor op, views included; so is its backward.
        has_backward = any(meta.dtype.is_floating_point for meta in node.output_meta)
        if self.host is not None:
            cost.host_forward_s = self.host.forward_s
            cost.host_backward_s = self.host.backward_s if has_backward else 0.0
        elif self.dtensor_op_overhead_s:
            cost.forward_s += self.dtensor_op_overhead_s
            if has_backward:
                cost.backward_s += self.dtensor_op_overhead_s
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
        # Meshes with SUMMA axes: SUMMA matmuls and block norms by their algorithms
        # (cost_model.summa_node); any mesh: the gradient sync of weights replicated on a
        # non-dp axis whose ranks saw other rows (cost_model.replica_gradients).
        add_summa_costs(self, node, strategy, cost)
        add_vocabulary_parallel_loss(self, node, strategy, cost)
        add_split_gather(self, node, strategy, cost)
        add_replica_gradient_sync(self, node, strategy, cost, PARAM_BYTES[self.plan.precision][1])
        return cost

    def _charge_edge(self, cost: NodeCost, meta, src, dst) -> None:
        """Forward collective and backward dual of one placement change, per mesh axis."""
        has_grad = meta.dtype.is_floating_point
        for index, (axis, size) in enumerate(self.mesh.axes):
            if axis == "pp" or src[index] == dst[index]:
                continue
            # The tensor this axis's collective moves: split by the other axes that hold it
            # split by then. Reduce-scatters (Partial -> Shard) run one axis after another, in
            # mesh order: the later ones see a tensor the earlier ones already split, but an
            # earlier one still carries the whole partial tensor of the later axes.
            others = math.prod(
                s for j, (a, s) in enumerate(self.mesh.axes)
                if j != index and a != "pp" and isinstance(dst[j], Shard)
                and not (isinstance(src[j], Partial) and j > index)
            )
            full = meta.nbytes * self.activation_scale / others / self.micro_batches
            for kind, backward in (
                (forward_collective(src[index], dst[index]), False),
                (backward_collective(src[index], dst[index]) if has_grad else None, True),
            ):
                if kind is None:
                    continue
                size_bytes = full / size if kind == "all_to_all" else full
                seconds = self._collective(kind, size_bytes, axis) + self.redistribute_overhead_s
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
                cost.backward_comm_s += self._collective("all_reduce", full, axis) + self.redistribute_overhead_s
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

