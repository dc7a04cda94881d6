"""The task graph of one training step: the pipeline schedule's passes, point-to-point sends,
the optimizer step, and what the step's contributors add (``cost_model.step_contributor``:
the data-parallel flavours' gradient reductions and FSDP gathers). ``StepTasks`` builds it
from the segments and the ``StepContext`` it is given (``cost_model.simulator`` supplies both).

Per pipeline stage one representative device, with streams ``compute`` (passes, and the
tensor-parallel collectives on the critical path), ``collective`` (data-parallel gradient
reductions, overlapped with compute), ``all_gather`` (FSDP2's weight gathers and the MoE
expert copies', on their own stream as FSDP2 runs them: ``cost_model.data_parallel_step``),
``all_reduce`` (HSDP's) and ``p2p act`` / ``p2p grad`` (activations and gradients between
stages). Interleaved schedules send at every virtual-stage boundary, so their extra
communication (``chunks`` times the sends of 1F1B) is in the graph. A blocking 1F1B pipeline (DeepSpeed's engine) follows DeepSpeed's own instruction order, each transfer a
rendezvous of the two stages (``cost_model.deepspeed_pipeline``).
"""

from __future__ import annotations

from cost_model.collectives import collective_time
from cost_model.compute import (
    gradient_accumulation_time, optimizer_implementation, optimizer_step_time, tensors_in_flat_shards,
)
from cost_model.deepspeed_checkpointing import NO_COST, CheckpointingCost, checkpointing_cost
from cost_model.deepspeed_pipeline import deepspeed_schedule, fp16_zero_step_checks_time, runs_fp16_zero_step
from cost_model.gradient_clipping import NORM_ALL_REDUCE_BYTES, clip_kernel_times
from cost_model.megatron_grad_sync import main_grad_add_time, runs_megatron_sync
from cost_model.parameter_bytes import PARAM_BYTES
from cost_model.recompute import backward_comm, backward_time
from cost_model.scheduler import TaskGraph
from cost_model.schedules import schedule as pipeline_schedule
from cost_model.segments import Segment
from cost_model.step_context import StepContext
from cost_model.step_contributor import GATHER_STREAM, REDUCE_STREAM, ParameterSharding, StepContributor, fsdp2_stream, overriding
from cost_model.step_memory import device_parameters, optimizer_state_bytes, parameter_sharding


def prefetch_after(ends: list[int], start: list[int]) -> list[int]:
    """The tasks after which FSDP2's gather of a pass's next unit may run, given ``ends``
    (the last task of each earlier segment of the pass, in pass order) and ``start`` (what
    the pass waits for): prefetch depth 1. In forward the host issues a unit's all-gather in
    its own ``pre_forward`` while the GPU still runs the unit before it (implicit prefetch);
    in backward ``FSDPParamGroup._backward_prefetch`` issues it in the previous unit's
    ``pre_backward``. The gather stream waits on a unit's copy-out
    (``_wait_all_gather_streams_on_event``), which the compute stream runs once the unit
    before that one has finished. So the gather of segment ``p`` may start when segment
    ``p - 2`` is done, overlapping segment ``p - 1``'s compute; the first two, when the pass
    may start. At most two units' gathered weights are alive: the one computing and the one
    arriving (``cost_model.data_parallel_step`` on what FSDP2 allows beyond that)."""
    return [ends[-2]] if len(ends) >= 2 else list(start)


class StepTasks:
    """Builds one step's ``TaskGraph`` (``graph``) from the segments, the context and the
    contributors, which add their tasks through the hooks ``forward``, ``backward`` and
    ``build`` call (``cost_model.step_contributor``)."""

    def __init__(self, context: StepContext, contributors: tuple[StepContributor, ...]) -> None:
        self.context = context
        self.contributors = contributors
        self.graph = TaskGraph()
        self._forward_gathers = overriding(contributors, "forward_gather")
        self._backward_gathers = overriding(contributors, "backward_gather")
        self._copy_outs = overriding(contributors, "copy_out")
        self._gradient_reductions = overriding(contributors, "gradient_reduction")
        # The micro-batch whose pass is being added, for contributors that act on one only
        # (``cost_model.megatron_grad_sync``: the weight gathers of the first forward).
        self.micro_batch = 0
        self._per_device: dict[str, list[Segment]] = {}
        self._main_grad_add_s: dict[int, float] = {}  # by id(segment): ``_main_grad_adds``
        # DeepSpeed's activation-checkpointing options, priced per block when the plan sets any.
        self._deepspeed_checkpointing = bool(context.plan.pipeline and context.plan.pipeline.deepspeed_checkpointing)

    def build(self, segments: list[Segment]) -> tuple[TaskGraph, dict[str, list[Segment]]]:
        """The step's task graph, and each device's segments (by ``"stage k"``)."""
        context, graph = self.context, self.graph
        pipeline = context.plan.pipeline
        stages_total = context.pp * context.chunks
        chunk_segments: dict[int, list[Segment]] = {vs: [] for vs in range(stages_total)}
        for segment in segments:
            chunk_segments[min(segment.stage, stages_total - 1)].append(segment)
        # Per-segment backward tasks where a contributor gathers before each, or reduces
        # gradients after this micro-batch (each segment's reduction starts when it is done).
        gathers = any(contributor.gathers_every_pass(context) for contributor in self.contributors)
        sync_every = any(contributor.reduces_every_micro_batch(context) for contributor in self.contributors)
        forward_done: dict[tuple[int, int], int] = {}
        backward_done: dict[tuple[int, int], int] = {}
        per_device: dict[str, list[Segment]] = {}
        boundary = {vs: self._boundary_bytes(chunk_segments, vs) for vs in range(stages_total - 1)}
        orders = {
            stage: pipeline_schedule(context.schedule_name, stage, context.pp, context.micro_batches, context.chunks)
            for stage in range(context.pp)
        }
        positions = {stage: 0 for stage in range(context.pp)}
        sync_after: dict[str, list[int]] = {}
        # Blocking sends (``PipelineConfig.blocking_p2p``) are added to the sender's compute
        # stream right after the pass that produced them, keyed ("act"|"grad", mb, sender vs).
        blocking = pipeline is not None and pipeline.blocking_p2p
        sent: dict[tuple[str, int, int], int] = {}
        # Partitioned sends (``PipelineConfig.partitioned_p2p``) carry 1/tp of the boundary
        # tensor; the receiver all-gathers it over tp on its compute stream before the pass.
        parts = self.p2p_parts()
        accumulation = pipeline.gradient_accumulation if pipeline is not None else "in-gemm"
        overlap = pipeline is None or pipeline.overlap_grad_reduce
        for stage in range(context.pp):
            per_device[f"stage {stage}"] = [s for vs, segs in chunk_segments.items() if vs % context.pp == stage
                                            for s in segs]
        self._per_device = per_device
        if blocking and context.chunks == 1:
            # DeepSpeed's own schedule, its sends and receives as rendezvous (cost_model.deepspeed_pipeline).
            deepspeed_schedule(self, chunk_segments, boundary, sync_after, gathers, sync_every)
            orders = {}
        # Walk the devices round-robin so a task's cross-stage dependencies exist when it is added.
        while any(positions[s] < len(orders[s]) for s in orders):
            progressed = False
            for stage, order in orders.items():
                device = f"stage {stage}"
                while positions[stage] < len(order):
                    kind, mb, chunk = order[positions[stage]]
                    vs = chunk * context.pp + stage
                    if kind == "F":
                        upstream = forward_done.get((mb, vs - 1)) if vs > 0 else None
                        if vs > 0 and upstream is None:
                            break
                        if vs == 0:
                            deps = []
                        elif blocking:  # sent from the upstream stage's compute stream already
                            deps = [sent[("act", mb, vs - 1)]]
                        else:
                            deps = [self._p2p(vs - 1, upstream, boundary[vs - 1] / parts, f"send act mb{mb}")]
                        if vs > 0 and parts > 1:
                            deps = [self.gather_parts(device, boundary[vs - 1], deps, f"gather act mb{mb}")]
                        forward_done[(mb, vs)] = self.forward(device, chunk_segments[vs], mb, deps)
                        if blocking and vs < stages_total - 1:
                            sent[("act", mb, vs)] = self._p2p(vs, forward_done[(mb, vs)], boundary[vs] / parts,
                                                              f"send act mb{mb}", blocking=True)
                    else:
                        if vs < stages_total - 1:
                            downstream = backward_done.get((mb, vs + 1))
                            if downstream is None:
                                break
                            deps = [sent[("grad", mb, vs + 1)] if blocking else
                                    self._p2p(vs + 1, downstream, boundary[vs] / parts, f"send grad mb{mb}")]
                            if parts > 1:  # the gradient's slices, then this stage's own output back
                                gathered = self.gather_parts(device, boundary[vs], deps, f"gather grad mb{mb}")
                                deps = [self.gather_parts(device, boundary[vs], [gathered], f"gather output mb{mb}")]
                        else:
                            deps = []
                        deps.append(forward_done[(mb, vs)])
                        sync = sync_every or mb == context.micro_batches - 1
                        split = gathers or sync  # per-segment tasks feed gradient syncs
                        deferred: list | None = None if overlap else []
                        backward_done[(mb, vs)] = self.backward(
                            device, chunk_segments[vs], mb, deps, context.plan.recompute_at(vs), split,
                            sync_after, sync, deferred,
                        )
                        backward_done[(mb, vs)] = self.accumulate_gradients(
                            device, chunk_segments[vs], mb, accumulation, backward_done[(mb, vs)])
                        for launch in deferred or ():  # reduced once the whole backward is done
                            sync_after.setdefault(device, []).append(launch(backward_done[(mb, vs)]))
                        if blocking and vs > 0:
                            sent[("grad", mb, vs)] = self._p2p(vs, backward_done[(mb, vs)], boundary[vs - 1] / parts,
                                                               f"send grad mb{mb}", blocking=True)
                    positions[stage] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError("pipeline schedule deadlocked: a stage waits for work no stage can do")
        # (device, optimizer step s, what it waits for, its gradient-norm task, its scale s)
        steps: list[tuple[str, float, list[int], int | None, float]] = []
        clipping = context.plan.gradient_clipping
        for stage in range(context.pp):
            device = f"stage {stage}"
            sharding = parameter_sharding(context, self.contributors)
            state_bytes = optimizer_state_bytes(context, per_device[device], sharding)
            seconds = self._optimizer_time(state_bytes, per_device[device], sharding)
            deps = sync_after.get(device, [])
            if runs_fp16_zero_step(context):  # DeepSpeed's overflow check and gradient norm first
                sizes = [size for segment in per_device[device] for size in segment.params.values()]
                deps = [graph.add("overflow check and gradient norm (fp16 ZeRO)", (device, "compute"),
                                  fp16_zero_step_checks_time(context, sizes), deps=deps,
                                  kind="optimizer")]
            norm, scale_s = None, 0.0
            if clipping:  # the gradients the optimizer steps are the ones clipped
                elements = state_bytes / sum(PARAM_BYTES[context.plan.precision])
                norm_s, scale_s = clip_kernel_times(clipping, elements, self._stepped_tensors(per_device[device], sharding),
                                                    context.device)
                norm = graph.add("gradient norm (clipping)", (device, "compute"), norm_s, deps=deps, kind="optimizer")
            steps.append((device, seconds, deps, norm, scale_s))
        norms = [norm for _, _, _, norm, _ in steps if norm is not None]
        if norms:  # one small all-reduce of the norm over every rank: a rendezvous of the stages
            ranks = list(range(min(context.mesh.size, context.cluster.world_size)))
            reduce_s = collective_time("all_reduce", NORM_ALL_REDUCE_BYTES, context.cluster, ranks)
        for device, seconds, deps, norm, scale_s in steps:
            if norm is not None:
                reduced = graph.add("all-reduce gradient norm", (device, "compute"), reduce_s, deps=[norm], kind="comm")
                for other in norms:
                    if other != norm:
                        graph.add_dependency(reduced, other)
                deps = [graph.add("scale gradients (clipping)", (device, "compute"), scale_s, deps=[reduced],
                                  kind="optimizer")]
            step = graph.add("optimizer step", (device, "compute"), seconds, deps=deps, kind="optimizer")
            for contributor in self.contributors:
                contributor.after_optimizer(self, device, per_device[device], step)
        return graph, per_device

    def _optimizer_time(self, state_bytes: float, segments: list[Segment], sharding: ParameterSharding) -> float:
        """One device's AdamW step. On gloo (CPU tensors) torch.optim runs its single-tensor
        implementation, op by op over the parameter tensors the device holds (ZeRO-1: a piece
        of each), each op dispatched on DTensors where the parameters are ones (FSDP2's FSDP
        and ZeRO-2, graph programs, but not ZeRO-1's plain pieces); elsewhere torch's default
        for CUDA tensors, foreach (``compute.optimizer_implementation``).
        A plan simulating another system's run names that run's AdamW instead
        (``Plan.optimizer_implementation``)."""
        chosen = getattr(self.context.plan, "optimizer_implementation", "")
        if chosen:  # another system's AdamW (Plan.optimizer_implementation)
            return optimizer_step_time(state_bytes, self.context.device, chosen,
                                       tensors=self._stepped_tensors(segments, sharding))
        implementation = optimizer_implementation(self.context.cluster.backend)
        if implementation != "single_tensor":
            return optimizer_step_time(state_bytes, self.context.device, implementation)
        tensors = sum(len(segment.params) for segment in segments)
        on_dtensors = (self.context.graph_program or sharding.dtensor_parameters) and not sharding.steps_local_pieces
        dispatch = (self.context.device.dtensor_op_overhead_s or 0.0) if on_dtensors else 0.0
        return optimizer_step_time(state_bytes, self.context.device, "single_tensor", tensors=tensors,
                                   dispatch_s=dispatch)

    def _stepped_tensors(self, segments: list[Segment], sharding: ParameterSharding) -> int:
        """Parameter tensors one device's optimizer steps: those it holds a piece of. Under
        FSDP these are FSDP1's flat parameters, one per repeated block and one for the rest
        (``compute.tensors_in_flat_shards``): the per-tensor optimizers priced here are other
        systems' (Composer's), whose FSDP is FSDP1. Otherwise every tensor it holds (ZeRO's
        pieces cut every tensor)."""
        if self.context.plan.dp_flavour != "fsdp" or sharding.states <= 1:
            return sum(len(segment.params) for segment in segments)
        units = [list(segment.params.values()) for segment in segments if segment.block]
        # The rest is one flat parameter holding each tensor once (a tied weight read by the
        # first and the last segment is one tensor).
        units.append(list(device_parameters([segment for segment in segments if not segment.block]).params.values()))
        return tensors_in_flat_shards(units, sharding.states)

    def _p2p(self, vs: int, after: int, size_bytes: float, name: str, blocking: bool = False) -> int:
        # A send from (virtual) stage ``vs``. Activations and gradients travel on separate
        # streams (as NCCL's send/recv on separate communicators), so one never waits behind
        # the other; a blocking send holds the sender's compute stream instead.
        device = f"stage {vs % self.context.pp}"
        stream = "compute" if blocking else "p2p act" if name.startswith("send act") else "p2p grad"
        seconds = self.context.p2p_seconds(vs, size_bytes)
        return self.graph.add(name, (device, stream), seconds, deps=[after], kind="p2p")

    def p2p_parts(self) -> int:
        """Slices a boundary tensor is sent in: the tensor-parallel degree under
        ``PipelineConfig.partitioned_p2p``, else 1."""
        pipeline = self.context.plan.pipeline
        if pipeline is None or not pipeline.partitioned_p2p or "tp" not in self.context.mesh.names:
            return 1
        return self.context.mesh.axis_size("tp")

    def gather_parts(self, device: str, size_bytes: float, deps: list[int], name: str) -> int:
        """All-gather of a partitioned boundary tensor (``size_bytes`` whole) over ``tp`` on
        ``device``'s compute stream (DeepSpeed's ``PartitionedTensor.full``: the pass that
        needs the tensor waits for it)."""
        seconds = self.context.collective("all_gather", size_bytes, "tp")
        return self.graph.add(name, (device, "compute"), seconds, deps=deps, kind="tp_comm")

    def _block_overhead(self, segment: Segment) -> tuple[float, float]:
        """(forward, backward) seconds of the pipeline's ``block_overhead_s`` for ``segment``
        (nothing for segments that are not blocks), split in proportion to the block's own
        forward and backward kernel time."""
        overhead = self.context.plan.pipeline.block_overhead_s if self.context.plan.pipeline is not None else 0.0
        if not overhead or not segment.block:
            return 0.0, 0.0
        forward, backward = segment.forward_s, segment.backward_s
        share = forward / (forward + backward) if forward + backward > 0 else 0.5
        return overhead * share, overhead * (1 - share)

    def _engine_extras(self, segment: Segment) -> CheckpointingCost:
        """What the training engine adds to ``segment`` per micro-batch beyond its kernels:
        the pipeline's ``block_overhead_s`` (``_block_overhead``), the options of DeepSpeed's
        activation checkpointing (``cost_model.deepspeed_checkpointing``) and Megatron-Core's
        DDP-hook adds into its fp32 gradient buffer (``_main_grad_adds``), as (forward,
        backward, backward all-gather over tp) seconds."""
        forward, backward = self._block_overhead(segment)
        checkpointing = checkpointing_cost(self.context, segment) if self._deepspeed_checkpointing else NO_COST
        return CheckpointingCost(forward + checkpointing.forward_s,
                                 backward + checkpointing.backward_s + self._main_grad_adds(segment),
                                 checkpointing.backward_gather_s)

    def _main_grad_adds(self, segment: Segment) -> float:
        """Seconds per micro-batch of Megatron's DDP hook adding ``segment``'s autograd
        gradients into the fp32 buffer (``cost_model.megatron_grad_sync.main_grad_add_time``),
        where the step runs Megatron-Core's distributed optimizer; remembered per segment."""
        if not runs_megatron_sync(self.context):
            return 0.0
        key = id(segment)
        if key not in self._main_grad_add_s:
            self._main_grad_add_s[key] = main_grad_add_time(self.context, segment)
        return self._main_grad_add_s[key]

    def accumulate_gradients(self, device: str, segments: list[Segment], mb: int, mode: str, after: int) -> int:
        """The task adding micro-batch ``mb``'s weight gradients into the step's gradients
        (``PipelineConfig.gradient_accumulation``) after its backward, or ``after`` itself
        when that costs nothing."""
        elements = sum(sum(segment.params.values()) for segment in segments)
        tensors = sum(len(segment.params) for segment in segments)
        seconds = gradient_accumulation_time(elements, tensors, mode, mb == 0, self.context.device)
        if not seconds:
            return after
        return self.graph.add(f"B{mb} accumulate grads", (device, "compute"), seconds, deps=[after])

    def segments_of(self, device: str) -> list[Segment]:
        """The segments ``device`` (``"stage k"``) runs, in forward order."""
        return self._per_device[device]

    def forward(self, device: str, segments: list[Segment], mb: int, deps: list[int]) -> int:
        """Tasks of micro-batch ``mb``'s forward through ``segments`` after ``deps``; returns the last."""
        self.micro_batch = mb
        last = None
        ends: list[int] = []  # each segment's last task
        for segment in segments:
            segment_deps = list(deps) if last is None else [last]
            # The host issues a pass's first gathers without waiting for what the pass's
            # compute waits for (a pipeline stage's received activations): only the gather
            # stream's order holds them.
            gathers = [forward_gather(self, device, segment, prefetch_after(ends, []))
                       for forward_gather in self._forward_gathers]
            segment_deps += self._copied_out(device, segment, False, [g for g in gathers if g is not None])
            if segment.weight_gather_s:
                segment_deps.append(self._expert_gather(device, segment, prefetch_after(ends, deps), f"F{mb}"))
            forward_s = segment.forward_s + self._engine_extras(segment).forward_s
            compute = self.graph.add(f"F{mb} {segment.name}", (device, "compute"), forward_s, deps=segment_deps)
            last = self.graph.add(f"F{mb} {segment.name} tp-comm", (device, "compute"), segment.forward_comm_s, deps=[compute], kind="tp_comm") if segment.forward_comm_s else compute
            ends.append(last)
        return last if last is not None else self.graph.add(f"F{mb} (empty)", (device, "compute"), 0.0, deps=deps)

    def backward(self, device, segments, mb, deps, recompute, split, sync_after, sync,
                 deferred: list | None = None) -> int:
        """Tasks of micro-batch ``mb``'s backward through ``segments``; returns the last.
        ``split``: a task per segment (else one for all); ``sync``: gradients are reduced
        after this micro-batch. The contributors' reductions start as each segment's backward
        is done (their task ids appended to ``sync_after[device]``), or, when ``deferred`` is
        a list, are put there as ``launch(after)`` for the caller to start after the whole
        backward (``PipelineConfig.overlap_grad_reduce`` False)."""
        last = None
        if not split:  # one task for the whole chunk: nothing needs per-segment timing
            extras = [self._engine_extras(s) for s in segments]
            duration = sum(backward_time(s, recompute) + extra.backward_s for s, extra in zip(segments, extras))
            comm = sum(backward_comm(s, recompute) + extra.backward_gather_s for s, extra in zip(segments, extras))
            comm += sum(s.weight_gather_s for s in segments)  # sharded expert copies' gathers, not overlapped here
            compute = self.graph.add(f"B{mb}", (device, "compute"), duration, deps=deps)
            last = self.graph.add(f"B{mb} tp-comm", (device, "compute"), comm, deps=[compute], kind="tp_comm") if comm else compute
            copies = sum(s.copy_reduce_s for s in segments)
            if copies:  # the sharded expert copies' reduce-scatters, after this micro-batch's backward
                sync_after.setdefault(device, []).append(self._copy_reduce(device, copies, [last], f"B{mb}"))
            return last
        reductions = [gradient_reduction(self, device, sync) for gradient_reduction in self._gradient_reductions]
        reductions = [reduction for reduction in reductions if reduction is not None]
        ends: list[int] = []  # each segment's last task, in backward order
        order = list(reversed(segments))
        # The first unit of backward (the last of forward) is gathered again as soon as
        # autograd reaches it: its gather queues behind the forward's on the gather stream.
        gathered = self._backward_gathers_of(device, order[0], mb, list(deps), []) if order else []
        for position, segment in enumerate(order):
            segment_deps = (list(deps) if last is None else [last]) + self._copied_out(device, segment, True, gathered)
            if position + 1 < len(order):
                # FSDP2's pre_backward of this unit issues the next unit's gather before this
                # unit's backward runs (``prefetch_after`` of the next one: after the end of
                # the unit before this one, or when the pass may start).
                ahead = [ends[-1]] if ends else list(deps)
                gathered = self._backward_gathers_of(device, order[position + 1], mb, ahead, ahead)
            extras = self._engine_extras(segment)
            duration = backward_time(segment, recompute) + extras.backward_s
            compute = self.graph.add(f"B{mb} {segment.name}", (device, "compute"), duration, deps=segment_deps)
            # The all-gather of DeepSpeed's partitioned checkpoint runs before the recomputation,
            # on the same in-order stream: put after it here, the segment ends at the same time.
            comm = backward_comm(segment, recompute) + extras.backward_gather_s
            last = self.graph.add(f"B{mb} {segment.name} tp-comm", (device, "compute"), comm, deps=[compute], kind="tp_comm") if comm else compute
            ends.append(last)
            if segment.copy_reduce_s:  # every micro-batch (NodeCost.copy_reduce_s)
                sync_after.setdefault(device, []).append(
                    self._copy_reduce(device, segment.copy_reduce_s, [last], f"B{mb} {segment.name}"))
            if segment.axis_sync_s and sync and mb == self.context.micro_batches - 1:
                sync_after.setdefault(device, []).append(self.graph.add(
                    f"all-reduce grads off dp ({segment.name})", (device, "collective"), segment.axis_sync_s, deps=[last], kind="comm"))
            final = position == len(segments) - 1
            for reduction in reductions:
                reduction.segment_done(segment, last, final, deferred, sync_after)
        return last

    def _copied_out(self, device: str, segment: Segment, backward: bool, gathered: list[int]) -> list[int]:
        """What a pass of ``segment`` waits for: the contributors' copies of the gathered
        weights (on the compute stream, after ``gathered``) where they add them, else
        ``gathered`` itself."""
        copies = [copy_out(self, device, segment, backward, gathered) for copy_out in self._copy_outs]
        copies = [copy for copy in copies if copy is not None]
        return copies or gathered

    def _backward_gathers_of(self, device: str, segment: Segment, mb: int, experts_after: list[int],
                             unit_after: list[int]) -> list[int]:
        """The gathers ``segment``'s backward waits for: its MoE expert copies' (after
        ``experts_after``) and the contributors' (FSDP's, after ``unit_after``)."""
        gathered = []
        if segment.weight_gather_s:
            gathered.append(self._expert_gather(device, segment, experts_after, f"B{mb}"))
        for backward_gather in self._backward_gathers:
            task = backward_gather(self, device, segment, unit_after)
            if task is not None:
                gathered.append(task)
        return gathered

    def _expert_gather(self, device, segment, issue_after: list[int], label: str) -> int:
        """The all-gather of the sharded expert copies a segment's MoE layers run
        (``Segment.weight_gather_s``): FSDP2's gather of a unit, on the gather stream, issued
        after ``issue_after`` (``prefetch_after``); on gloo it blocks the compute stream."""
        return self.graph.add(f"{label} all-gather experts {segment.name}", (device, fsdp2_stream(self.context, GATHER_STREAM)),
                              segment.weight_gather_s, deps=issue_after, kind="comm")

    def _copy_reduce(self, device: str, seconds: float, deps: list[int], label: str) -> int:
        """The reduce-scatter of sharded expert copies' gradients (``Segment.copy_reduce_s``)
        after ``deps``, on the reduce-scatter stream FSDP2 runs its own on (Megatron-FSDP: its
        side stream, ``GradReducePipeline``); on gloo it blocks the compute stream."""
        return self.graph.add(f"{label} reduce-scatter expert grads", (device, fsdp2_stream(self.context, REDUCE_STREAM)),
                              seconds, deps=deps, kind="comm")

    def _boundary_bytes(self, chunk_segments: dict[int, list[Segment]], vs: int) -> float:
        """Activation bytes a micro-batch carries from virtual stage ``vs`` to ``vs + 1``."""
        following = chunk_segments.get(vs + 1, [])
        return following[0].input_bytes if following else 0.0

