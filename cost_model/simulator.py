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
its consumers, the readers whose shared resharding moves and those that look past views at
it (``NodeCosts.reassign``), rebuilds only the segments holding them, keeps what crosses the
pipeline's stage boundaries unless a stage or output placement changed, then re-runs the
schedule (``Simulator.assign`` re-costs without re-running, for moves of several nodes). It
gives exactly what a fresh simulation gives (tests/test_delta_simulation.py).

The parts live in their own modules and share no state: ``Simulator`` builds one
``StepContext`` (``cost_model.step_context``: the plan's facts, the current strategies) and
hands it, with the results of the parts before, to each: ``cost_model.node_costs`` (node
costs), ``cost_model.segments`` (grouping them into segments), ``cost_model.step_tasks`` (the
step's task graph; ``cost_model.deepspeed_pipeline`` for DeepSpeed's engine),
``cost_model.step_memory`` (memory and bytes per axis), ``cost_model.recompute``
(Megatron-LM's recomputation modes). What a parallelism family adds to the step (its tasks,
op costs and memory terms: the data-parallel flavours' gathers and gradient reductions, for
one) it adds as a step contributor (``cost_model.step_contributor``), listed in
``cost_model.contributor_registry``.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import replace as dataclass_replace

from cost_model.compute import PRECISIONS
from cost_model.contributor_registry import step_contributors
from cost_model.dualpipe_step import dualpipe_result
from cost_model.moe_layers import annotated_layouts
from cost_model.node_costs import NodeCost, NodeCosts
from cost_model.parameter_bytes import bytes_per_parameter
from cost_model.recompute import activation_bytes, backward_comm, backward_time
from cost_model.segments import Segment, SegmentMembers, SegmentProfile, build_segments, refresh_segments, segment_members
from cost_model.simulation_cache import RECENTLY_COSTED, Costed, costing_key, graph_facts
from cost_model.step_context import StepContext
from cost_model.step_memory import bytes_per_axis, fullest_rank_memory, pipeline_boundary_bytes, stage_memory
from cost_model.step_tasks import StepTasks
from planner.errors import PlanningError
from planner.graph import OpGraph
from planner.strategy import DUALPIPE, RECOMPUTE_MODES, CostParts, ExpertLayout, NodeStrategy, SimResult, TimelineEvent

__all__ = ["NodeCost", "Segment", "SegmentProfile", "Simulator", "estimated", "simulate_plan", "simulated"]


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


class Simulator:
    """Simulates one plan; keeps node costs so a one-node change re-simulates fast.

    ``context`` (``StepContext``) holds the plan's facts and current strategies,
    ``node_costs`` (``NodeCosts``) every node's cost, ``contributors`` the families that add
    to the step: the registry's (``cost_model.contributor_registry``) unless ``contributors``
    names others (then no node costs are shared with plans simulated before).
    """

    def __init__(self, plan, graph: OpGraph, contributors=None):
        with _collector_paused():
            self._set_up(plan, graph, contributors)

    def _set_up(self, plan, graph: OpGraph, contributors) -> None:
        for section in plan.sections.values():
            # A plan this step model cannot price (pipeline stages of different widths) says
            # why in one line, rather than as a schedule that never ends.
            blocker = getattr(section, "simulation_blocker", None)
            reason = blocker(plan) if blocker is not None else None
            if reason:
                raise PlanningError(reason)
        facts = graph_facts(graph)
        self.context = StepContext.build(plan, graph, facts.nodes, facts.consumers)
        self.contributors = step_contributors(plan) if contributors is None else tuple(contributors)
        self.node_costs = NodeCosts(self.context, facts.kept, facts.signature, self.contributors)
        self._layout: SegmentMembers | None = None  # which nodes form which segment, once asked
        self._segment_list: list[Segment] | None = None  # until a strategy changes
        # Forward and backward FLOPs of the model: the graph's, whatever the strategies (summed
        # once here, not on every delta re-simulation).
        self.model_flops = 3.0 * graph.total_flops
        # What each pipeline boundary carries (step_memory.pipeline_boundary_bytes, which reads
        # every node): kept until a node's stage or output placements change.
        self._boundary_bytes: list[tuple[float, float]] | None = None
        key = costing_key(plan, graph, self.context.micro_batches) if contributors is None else None
        costed = RECENTLY_COSTED.get(key) if key is not None else None
        if costed is not None:
            # A plan that differs from one simulated before only in what node costs do not
            # read (recomputation, dp flavour): its node costs and segments are the same.
            self.node_costs.adopt(costed.cache, costed.first_use, costed.costs)
            self._segment_list = costed.segments
            return
        similar = RECENTLY_COSTED.get_but_layouts(key) if key is not None else None
        if similar is not None:
            # The same plan with other MoE layouts (an MoE search's next candidate): only the
            # ops of the layers laid out otherwise are costed again (delta simulation).
            self.node_costs.adopt(similar.cache, similar.first_use, similar.costs)
            changed = {layout[0] for layout, before in zip(key[-1], similar.layouts) if layout != before}
            # An expert op's cost is its layer's layout's; the routing ops around the experts
            # cost the same under any layout over the same axis (cost_model.node_costs).
            recosted = {name for layer in self.context.moe_layers.values() if layer.layout.module in changed
                        for name in layer.expert_nodes}
            for name in recosted:
                self.node_costs.costs[name] = self.node_costs.cost_of(self.context.nodes[name])
            self._segment_list = refresh_segments(self.context, self.costs, self._segment_layout(), similar.segments,
                                                  recosted)
        else:
            self.node_costs.cost_all()
            self._segment_list = self.segments()
        if key is None:
            return
        RECENTLY_COSTED.put(key, Costed(
            keep=(plan.strategies, graph, facts, plan.cluster), cache=dict(self.node_costs.cache),
            first_use=dict(self.node_costs.first_use), costs=dict(self.node_costs.costs), segments=self._segment_list,
            layouts=key[-1],
        ))

    @property
    def costs(self) -> dict[str, NodeCost]:
        """Every node's cost (one micro-batch on one device) under the current strategies."""
        return self.node_costs.costs

    # ------------------------------------------------------------------ public

    def run(self, trace: bool = True) -> SimResult:
        """Simulate one step of the plan with the current strategies."""
        with _collector_paused():
            return self._run(trace)

    def _run(self, trace: bool) -> SimResult:
        context, plan = self.context, self.context.plan
        segments = self.segments()
        tasks, per_device = StepTasks(context, self.contributors).build(segments)
        step = tasks.run()
        if context.overlap_slowdown:
            # Compute beside the data-parallel collectives runs slower (cost_model.nccl).
            tasks.contend(context.overlap_slowdown)
            step = tasks.run()
        timeline = tuple(
            [TimelineEvent(t.stream[0], t.stream[1], t.name, t.start, t.finish - t.start) for t in tasks.tasks]
        ) if trace else ()
        busy = {device: tasks.busy((device, "compute"), ("compute", "optimizer")) for device in per_device}
        no_comm = tasks.run(scale={"comm": 0.0, "tp_comm": 0.0, "p2p": 0.0})
        critical = max(busy, key=busy.get)
        stage_memories = tuple(
            stage_memory(context, self.contributors, stage, per_device[f"stage {stage}"])
            for stage in range(context.pp)
        )
        peak = max(stage_memories, key=lambda m: m.total)
        capacity = context.cluster.min_device_memory
        by_rank = fullest_rank_memory(context, self.contributors, self.costs, peak) if context.pp == 1 else None
        if by_rank is not None:  # ranks holding uneven shares: the one nearest its own capacity
            peak, capacity = by_rank
            stage_memories = (peak,)
        samples = plan.batch_size / step if step else 0.0
        model_flops = self.model_flops
        tflops = model_flops / step / context.cluster.world_size / 1e12 if step else 0.0
        peak_flops = context.device.flops_for(PRECISIONS[plan.precision][0])
        result = SimResult(
            step_time_s=step,
            compute_s=busy[critical],
            communication_s=max(0.0, step - no_comm),
            memory=peak,
            device_memory_bytes=capacity,
            method="simulator",
            stage_memory=stage_memories,
            samples_per_s=samples,
            tokens_per_s=samples * plan.summary.tokens_per_sample,
            model_flops=model_flops,
            tflops_per_device=tflops,
            mfu=tflops * 1e12 / peak_flops if peak_flops else 0.0,
            bytes_per_axis=bytes_per_axis(context, self.contributors, segments, self._pipeline_boundary_bytes()),
            bubble_fraction=max(0.0, 1 - busy[critical] / no_comm) if no_comm else 0.0,
            host_wait_s=sum(segment.host_wait_s for segment in per_device[critical]) * context.micro_batches,
            timeline=timeline,
        )
        if plan.pipeline is not None and plan.pipeline.schedule == DUALPIPE:
            result = self._as_dualpipe(result, segments)
        return result

    def _as_dualpipe(self, twin: SimResult, segments: list[Segment]) -> SimResult:
        """A DualPipe plan's result from its 1F1B twin's, simulated above (``cost_model.dualpipe_step``)."""
        context, plan = self.context, self.context.plan
        passes = {stage: [0.0, 0.0] for stage in range(context.pp)}
        synced = [0.0] * context.pp
        gradient_bytes = bytes_per_parameter(plan.precision)[1]
        for segment in segments:
            mode = plan.recompute_at(segment.stage)
            passes[segment.stage][0] += segment.forward_s + segment.forward_comm_s
            passes[segment.stage][1] += backward_time(segment, mode) + backward_comm(segment, mode)
            synced[segment.stage] += sum(segment.params[name] for name in segment.dp_synced) * gradient_bytes
        forward, backward = max(passes.values(), key=sum)
        dp = "dp" in context.mesh.names and context.mesh.axis_size("dp") > 1

        def reduce_gradients(size: float) -> float:
            return context.collective("all_reduce", size, "dp") if dp else 0.0

        return dualpipe_result(twin, forward, backward, context.micro_batches, synced, context.device, reduce_gradients)

    def _pipeline_boundary_bytes(self) -> list[tuple[float, float]] | None:
        """``pipeline_boundary_bytes`` of the current strategies (None without a pipeline)."""
        if self.context.pp == 1:
            return None
        if self._boundary_bytes is None:
            self._boundary_bytes = pipeline_boundary_bytes(self.context)
        return self._boundary_bytes

    def step_lower_bound(self) -> float:
        """Seconds the step takes at least, before scheduling it: the busiest (virtual)
        stage's work on its compute stream (forward, backward and the collectives that run
        on that stream, e.g. an MoE layer's all-to-alls, for every micro-batch). One stream
        runs one task at a time, and scheduling only adds to it (waits, recomputation, the
        optimizer step, slowdown beside collectives). What a search prunes by: a candidate
        whose bound is no faster than the best plan found need not be scheduled."""
        per_stage: dict[int, float] = {}
        for segment in self.segments():
            work = segment.forward_s + segment.forward_comm_s + segment.backward_s + segment.backward_comm_s
            per_stage[segment.stage] = per_stage.get(segment.stage, 0.0) + work
        return max(per_stage.values(), default=0.0) * self.context.micro_batches

    def segments(self) -> list[Segment]:
        """The segments of the current strategies (built once, then kept up to date)."""
        if self._segment_list is None:
            self._segment_list = build_segments(self.context, self.costs, self._segment_layout())
        return self._segment_list

    def _segment_layout(self) -> SegmentMembers:
        if self._layout is None:
            facts = graph_facts(self.context.graph)  # the grouping depends on the graph alone
            if facts.segment_members is None:
                facts.segment_members = segment_members(self.context.graph)
            self._layout = facts.segment_members
        return self._layout

    def segment_profiles(self) -> list[SegmentProfile]:
        """Per-segment costs of one micro-batch on one device, in graph order, for every
        recomputation mode: what pipeline stage slicing needs, from this one simulation
        (segment costs do not depend on which stage a segment is on)."""
        profiles = []
        for segment in self.segments():
            by_mode = {mode: activation_bytes(segment, mode) for mode in RECOMPUTE_MODES}
            synced = [name for name in sorted(segment.dp_synced) if segment.params[name] > 0]
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
                synced_tensors=tuple(segment.params[name] for name in synced),
                param_tensors=len(segment.params),
                synced_shapes=tuple(segment.shapes.get(name) for name in synced),
                per_rank_elements=sum(segment.params[name] for name in segment.per_rank),
                exchange_bytes=segment.kept_exchange_bytes,
                forward_s=segment.forward_s + segment.forward_comm_s,
            ))
        return profiles

    def annotated_strategies(self) -> tuple[NodeStrategy, ...]:
        """The plan's strategies with each node's simulated cost parts for one step
        (all micro-batches), so reports can say where the time goes."""
        steps = self.context.micro_batches
        parts: dict[int, CostParts] = {}  # twins of repeated blocks share their NodeCost
        annotated = []
        for node in self.context.graph.nodes:
            cost = self.costs[node.name]
            if id(cost) not in parts:
                parts[id(cost)] = CostParts(
                    compute_s=(cost.forward_s + cost.backward_s) * steps,
                    communication_s=(cost.forward_comm_s + cost.backward_comm_s) * steps,
                    memory_bytes=int(cost.saved_bytes * steps),
                )
            annotated.append(self.context.strategies[node.name].replaced(cost=parts[id(cost)]))
        return tuple(annotated)

    def annotated_expert_layouts(self) -> tuple[ExpertLayout, ...]:
        """The plan's expert layouts with each layer's simulated cost parts for one step, and
        the all-to-all time its anchor op leaves on the critical path (``exposed_all_to_all_s``:
        its forward and backward communication less the routing's all-gather and the copies'
        gradient sum, over the step's micro-batches)."""
        steps = self.context.micro_batches
        layouts = annotated_layouts(self.context.plan.expert_layouts, self.context.moe_layers, steps)
        exposed = {}
        for module, layer in self.context.moe_layers.items():
            anchor = self.costs[layer.anchor]
            exposed[module] = max(0.0, (anchor.forward_comm_s - layer.routing_sync_s + anchor.backward_comm_s
                                        - layer.replica_sync_s / steps) * steps)
        return tuple(dataclass_replace(layout, exposed_all_to_all_s=exposed[layout.module]) for layout in layouts)

    def replace(self, node_name: str, strategy: NodeStrategy) -> SimResult:
        """Delta simulation: change one node's strategy, re-cost it and its consumers, re-run."""
        self.assign(node_name, strategy)
        return self.run(trace=False)

    def assign(self, node_name: str, strategy: NodeStrategy) -> None:
        """Change one node's strategy and re-cost what it affects, without re-running the
        schedule: a move of several nodes (or its undo) runs once, after its last change."""
        old = self.context.strategies[node_name]
        self.context.strategies[node_name] = strategy
        if old.stage != strategy.stage or old.outputs != strategy.outputs:
            # The boundaries carry this node's output, or its inputs now cross another one.
            self._boundary_bytes = None
        recosted = self.node_costs.reassign(node_name, old)
        if self._segment_list is not None:
            # Only the segments holding a re-costed node, or reading the changed node's
            # output, change: the rest are kept (the delta simulation's saving).
            self._segment_list = refresh_segments(self.context, self.costs, self._segment_layout(),
                                                  self._segment_list, recosted)


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


def estimated(plan, graph: OpGraph):
    """``plan`` with its simulated estimate only (no timeline, strategies and layouts not
    annotated): what a search compares candidates by. Annotating every node's cost parts takes
    a quarter of a large model's simulation, and only the plans a search keeps are reported
    (``simulated`` them)."""
    return dataclass_replace(plan, estimate=Simulator(plan, graph).run(trace=False))
