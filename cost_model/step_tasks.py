"""The task graph of one training step: the pipeline schedule's passes, point-to-point sends,
data-parallel gradient reduction, FSDP gathers and the optimizer step (a part of
``cost_model.simulator.Simulator``, which supplies the segments, mesh and collective costs).

Per pipeline stage one representative device, with streams ``compute`` (passes, and the
tensor-parallel collectives on the critical path), ``collective`` (data-parallel reduction
and FSDP gathers, overlapped with compute) and ``p2p act`` / ``p2p grad`` (activations and
gradients between stages). Interleaved schedules send at every virtual-stage boundary, so
their extra communication (``chunks`` times the sends of 1F1B) is in the graph. A blocking
1F1B pipeline (DeepSpeed's engine) follows DeepSpeed's own instruction order, each transfer a
rendezvous of the two stages (``cost_model.deepspeed_pipeline``).
"""

from __future__ import annotations

import math

from cost_model import defaults
from cost_model.collectives import collective_time
from cost_model.compute import gradient_accumulation_time, optimizer_implementation, optimizer_step_time
from cost_model.recompute import backward_comm, backward_time
from cost_model.deepspeed_pipeline import DeepSpeedPipelineTasks
from cost_model.scheduler import TaskGraph
from cost_model.schedules import schedule as pipeline_schedule
from cost_model.segments import Segment
from cost_model.step_memory import PARAM_BYTES


class GradientBuckets:
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



class StepTaskGraph(DeepSpeedPipelineTasks):
    """Builds the step's ``TaskGraph`` (uses ``Simulator``'s plan, mesh and segments)."""

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
        # Blocking sends (``PipelineConfig.blocking_p2p``) are added to the sender's compute
        # stream right after the pass that produced them, keyed ("act"|"grad", mb, sender vs).
        blocking = self.plan.pipeline is not None and self.plan.pipeline.blocking_p2p
        sent: dict[tuple[str, int, int], int] = {}
        # Partitioned sends (``PipelineConfig.partitioned_p2p``) carry 1/tp of the boundary
        # tensor; the receiver all-gathers it over tp on its compute stream before the pass.
        parts = self._p2p_parts()
        accumulation = self.plan.pipeline.gradient_accumulation if self.plan.pipeline is not None else "in-gemm"
        overlap = self.plan.pipeline is None or self.plan.pipeline.overlap_grad_reduce
        for stage in range(self.pp):
            per_device[f"stage {stage}"] = [s for vs, segs in chunk_segments.items() if vs % self.pp == stage for s in segs]
        if blocking and self.chunks == 1:
            # DeepSpeed's own schedule, its sends and receives as rendezvous (cost_model.deepspeed_pipeline).
            self._deepspeed_schedule(graph, chunk_segments, boundary, sync_after, fsdp, sync_every)
            orders = {}
        # Walk the devices round-robin so a task's cross-stage dependencies exist when it is added.
        while any(positions[s] < len(orders[s]) for s in orders):
            progressed = False
            for stage, order in orders.items():
                device = f"stage {stage}"
                while positions[stage] < len(order):
                    kind, mb, chunk = order[positions[stage]]
                    vs = chunk * self.pp + stage
                    if kind == "F":
                        upstream = forward_done.get((mb, vs - 1)) if vs > 0 else None
                        if vs > 0 and upstream is None:
                            break
                        if vs == 0:
                            deps = []
                        elif blocking:  # sent from the upstream stage's compute stream already
                            deps = [sent[("act", mb, vs - 1)]]
                        else:
                            deps = [self._p2p(graph, vs - 1, upstream, boundary[vs - 1] / parts, f"send act mb{mb}")]
                        if vs > 0 and parts > 1:
                            deps = [self._gather_parts(graph, device, boundary[vs - 1], deps, f"gather act mb{mb}")]
                        forward_done[(mb, vs)] = self._forward(graph, device, chunk_segments[vs], mb, deps, fsdp)
                        if blocking and vs < stages_total - 1:
                            sent[("act", mb, vs)] = self._p2p(graph, vs, forward_done[(mb, vs)], boundary[vs] / parts,
                                                              f"send act mb{mb}", blocking=True)
                    else:
                        if vs < stages_total - 1:
                            downstream = backward_done.get((mb, vs + 1))
                            if downstream is None:
                                break
                            deps = [sent[("grad", mb, vs + 1)] if blocking else
                                    self._p2p(graph, vs + 1, downstream, boundary[vs] / parts, f"send grad mb{mb}")]
                            if parts > 1:  # the gradient's slices, then this stage's own output back
                                gathered = self._gather_parts(graph, device, boundary[vs], deps, f"gather grad mb{mb}")
                                deps = [self._gather_parts(graph, device, boundary[vs], [gathered], f"gather output mb{mb}")]
                        else:
                            deps = []
                        deps.append(forward_done[(mb, vs)])
                        sync = sync_every or mb == self.micro_batches - 1
                        split = fsdp or sync  # per-segment tasks feed gradient syncs
                        deferred: list[tuple[str, list[tuple[float, int]]]] | None = None if overlap else []
                        backward_done[(mb, vs)] = self._backward(
                            graph, device, chunk_segments[vs], mb, deps, self.plan.recompute_at(vs), fsdp, split,
                            sync_after, sync, deferred,
                        )
                        backward_done[(mb, vs)] = self._accumulate_gradients(
                            graph, device, chunk_segments[vs], mb, accumulation, backward_done[(mb, vs)])
                        for name, ready in deferred or ():  # reduced once the whole backward is done
                            sync_after.setdefault(device, []).append(
                                self._gradient_sync(graph, device, name, ready, backward_done[(mb, vs)]))
                        if blocking and vs > 0:
                            sent[("grad", mb, vs)] = self._p2p(graph, vs, backward_done[(mb, vs)], boundary[vs - 1] / parts,
                                                               f"send grad mb{mb}", blocking=True)
                    positions[stage] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError("pipeline schedule deadlocked: a stage waits for work no stage can do")
        for stage in range(self.pp):
            device = f"stage {stage}"
            state_bytes = self._optimizer_state_bytes(per_device[device])
            step = graph.add("optimizer step", (device, "compute"), self._optimizer_time(state_bytes, per_device[device]),
                             deps=sync_after.get(device, []), kind="optimizer")
            if self.plan.dp_flavour == "zero1" and self.dp > 1:
                # torch's ZeroRedundancyOptimizer (codegen's ZeRO-1) broadcasts each updated
                # parameter from the rank that owns it: one broadcast per parameter tensor, all
                # issued asynchronously and then waited for (gloo runs them on its worker threads).
                element_bytes = PARAM_BYTES[self.plan.precision][0]
                sizes = [count * element_bytes for s in per_device[device] for name, count in s.params.items()
                         if name not in s.per_rank]
                at_once = defaults.GLOO_COLLECTIVE_THREADS if self.cluster.backend == "gloo" else 1
                pieces = [(self._collective("broadcast", size, "dp") / at_once, 1) for size in sizes if size > 0]
                graph.add_pieces(f"broadcast updated weights ({len(pieces)} parameters)", (device, "collective"), pieces,
                                 deps=[step], kind="comm")
            elif self.plan.dp_flavour == "zero2" and self.dp > 1:
                gathered = sum(s.shardable_elements() for s in per_device[device]) * PARAM_BYTES[self.plan.precision][0]
                graph.add("all-gather updated weights", (device, "collective"), self._collective("all_gather", gathered, "dp"), deps=[step], kind="comm")
        return graph, per_device

    def _optimizer_time(self, state_bytes: float, segments: list[Segment]) -> float:
        """One device's AdamW step. On gloo (CPU tensors) torch.optim runs its single-tensor
        implementation, op by op over the parameter tensors the device updates (ZeRO-1: its
        share of them), each op dispatched on DTensors where the parameters are ones (FSDP2's
        FSDP and ZeRO-2, graph programs); elsewhere the fused kernel."""
        if optimizer_implementation(self.cluster.backend) != "single_tensor":
            return optimizer_step_time(state_bytes, self.device)
        tensors = sum(len(segment.params) for segment in segments)
        sharded = self.dp > 1 and self.plan.dp_flavour in ("zero1", "zero2", "fsdp")
        if sharded and self.plan.dp_flavour == "zero1":
            tensors = math.ceil(tensors / self.dp)
        on_dtensors = self.graph_program or (sharded and self.plan.dp_flavour != "zero1")
        dispatch = (self.device.dtensor_op_overhead_s or 0.0) if on_dtensors else 0.0
        return optimizer_step_time(state_bytes, self.device, "single_tensor", tensors=tensors, dispatch_s=dispatch)

    def _syncs_every_micro_batch(self) -> bool:
        """Whether gradients are reduced over ``dp`` after every micro-batch of an
        accumulating step (no pipeline): FSDP2 (FSDP, ZeRO-2) reduce-scatters each one into
        its sharded gradients, and graph programs (a label: searched or Megatron layouts)
        reduce in each parameter's gradient hook; DDP syncs once, after the last."""
        if self.plan.pipeline is not None or self.dp == 1:
            return False
        return self.plan.dp_flavour in ("zero2", "fsdp") or bool(self.plan.label)

    def _p2p(self, graph: TaskGraph, vs: int, after: int, size_bytes: float, name: str, blocking: bool = False) -> int:
        # A send from (virtual) stage ``vs``. Activations and gradients travel on separate
        # streams (as NCCL's send/recv on separate communicators), so one never waits behind
        # the other; a blocking send holds the sender's compute stream instead.
        device = f"stage {vs % self.pp}"
        stream = "compute" if blocking else "p2p act" if name.startswith("send act") else "p2p grad"
        return graph.add(name, (device, stream), self._p2p_seconds(vs, size_bytes), deps=[after], kind="p2p")

    def _p2p_seconds(self, vs: int, size_bytes: float) -> float:
        """Seconds to send ``size_bytes`` from (virtual) stage ``vs`` to the next."""
        stride = self.mesh.size // self.pp
        src, dst = (vs % self.pp) * stride, ((vs + 1) % self.pp) * stride
        key = ("send_recv", size_bytes, src, dst)
        if key not in self._comm_cache:
            self._comm_cache[key] = collective_time("send_recv", size_bytes, self.cluster, [src, dst]) if src != dst else 0.0
        return self._comm_cache[key]

    def _p2p_parts(self) -> int:
        """Slices a boundary tensor is sent in: the tensor-parallel degree under
        ``PipelineConfig.partitioned_p2p``, else 1."""
        pipeline = self.plan.pipeline
        if pipeline is None or not pipeline.partitioned_p2p or "tp" not in self.mesh.names:
            return 1
        return self.mesh.axis_size("tp")

    def _gather_parts(self, graph: TaskGraph, device: str, size_bytes: float, deps: list[int], name: str) -> int:
        """All-gather of a partitioned boundary tensor (``size_bytes`` whole) over ``tp`` on
        ``device``'s compute stream (DeepSpeed's ``PartitionedTensor.full``: the pass that
        needs the tensor waits for it)."""
        return graph.add(name, (device, "compute"), self._collective("all_gather", size_bytes, "tp"), deps=deps,
                         kind="tp_comm")

    def _block_overhead(self, segment: Segment) -> tuple[float, float]:
        """(forward, backward) seconds of the pipeline's ``block_overhead_s`` for ``segment``
        (nothing for segments that are not blocks), split in proportion to the block's own
        forward and backward kernel time."""
        overhead = self.plan.pipeline.block_overhead_s if self.plan.pipeline is not None else 0.0
        if not overhead or not segment.block:
            return 0.0, 0.0
        forward, backward = segment.forward_s, segment.backward_s
        share = forward / (forward + backward) if forward + backward > 0 else 0.5
        return overhead * share, overhead * (1 - share)

    def _accumulate_gradients(self, graph: TaskGraph, device: str, segments: list[Segment], mb: int, mode: str,
                              after: int) -> int:
        """The task adding micro-batch ``mb``'s weight gradients into the step's gradients
        (``PipelineConfig.gradient_accumulation``) after its backward, or ``after`` itself
        when that costs nothing."""
        elements = sum(sum(segment.params.values()) for segment in segments)
        tensors = sum(len(segment.params) for segment in segments)
        seconds = gradient_accumulation_time(elements, tensors, mode, mb == 0, self.device)
        if not seconds:
            return after
        return graph.add(f"B{mb} accumulate grads", (device, "compute"), seconds, deps=[after])

    def _forward(self, graph: TaskGraph, device: str, segments: list[Segment], mb: int, deps: list[int], fsdp: bool) -> int:
        last = None
        ends: list[int] = []  # each segment's last task
        for position, segment in enumerate(segments):
            segment_deps = list(deps) if last is None else [last]
            if fsdp:
                prefetch_after = [] if position < 2 else [last]
                segment_deps.append(self._fsdp_gather(graph, device, segment, prefetch_after, f"all-gather {segment.name}"))
            if segment.weight_gather_s:
                segment_deps.append(self._expert_gather(graph, device, segment, ends, deps, f"F{mb}"))
            forward_s = segment.forward_s + self._block_overhead(segment)[0]
            compute = graph.add(f"F{mb} {segment.name}", (device, "compute"), forward_s, deps=segment_deps)
            last = graph.add(f"F{mb} {segment.name} tp-comm", (device, "compute"), segment.forward_comm_s, deps=[compute], kind="tp_comm") if segment.forward_comm_s else compute
            ends.append(last)
        return last if last is not None else graph.add(f"F{mb} (empty)", (device, "compute"), 0.0, deps=deps)

    def _backward(self, graph, device, segments, mb, deps, recompute, fsdp, split, sync_after, sync,
                  deferred: list | None = None) -> int:
        """Tasks of micro-batch ``mb``'s backward through ``segments``; returns the last.
        Gradient buckets start reducing as each segment's backward fills them, or, when
        ``deferred`` is a list, are put there (segment name, buckets) for the caller to reduce
        after the whole backward (``PipelineConfig.overlap_grad_reduce`` False)."""
        last = None
        if not split:  # one task for the whole chunk: nothing needs per-segment timing
            duration = sum(backward_time(s, recompute) + self._block_overhead(s)[1] for s in segments)
            comm = sum(backward_comm(s, recompute) for s in segments)
            comm += sum(s.weight_gather_s for s in segments)  # sharded expert copies' gathers, not overlapped here
            compute = graph.add(f"B{mb}", (device, "compute"), duration, deps=deps)
            return graph.add(f"B{mb} tp-comm", (device, "compute"), comm, deps=[compute], kind="tp_comm") if comm else compute
        bucket = GradientBuckets()
        ends: list[int] = []  # each segment's last task, in backward order
        for position, segment in enumerate(reversed(segments)):
            segment_deps = list(deps) if last is None else [last]
            if segment.weight_gather_s:
                segment_deps.append(self._expert_gather(graph, device, segment, ends, deps, f"B{mb}"))
            # FSDP gathers again for backward only what it freed after forward (fsdp_regathered_elements).
            regathered = self.fsdp_regathered_elements(segment)
            if fsdp and regathered > 0:
                segment_deps.append(self._fsdp_gather(graph, device, segment, [] if last is None else [last],
                                                      f"all-gather {segment.name} (bwd)", regathered))
            duration = backward_time(segment, recompute) + self._block_overhead(segment)[1]
            compute = graph.add(f"B{mb} {segment.name}", (device, "compute"), duration, deps=segment_deps)
            comm = backward_comm(segment, recompute)
            last = graph.add(f"B{mb} {segment.name} tp-comm", (device, "compute"), comm, deps=[compute], kind="tp_comm") if comm else compute
            ends.append(last)
            if segment.axis_sync_s and sync and mb == self.micro_batches - 1:
                sync_after.setdefault(device, []).append(graph.add(
                    f"all-reduce grads off dp ({segment.name})", (device, "collective"), segment.axis_sync_s, deps=[last], kind="comm"))
            if self.dp == 1 or not sync:
                continue
            element_bytes = self._reduced_gradient_bytes()
            if self.graph_program:
                # A graph program reduces each parameter's gradient in its own hook
                # (codegen.runtime.spmd): one collective per parameter, no buckets.
                ready = [(segment.params[name] * element_bytes, 1) for name in sorted(segment.dp_synced)
                         if segment.params[name] > 0]
            else:
                grads = sum(segment.params[name] for name in segment.dp_synced) * element_bytes
                final = position == len(segments) - 1
                ready = bucket.fill(grads, per_unit=fsdp, flush=final)
            if ready and deferred is not None:
                deferred.append((segment.name, ready))
            elif ready:
                # The buckets a segment fills are all ready when its backward ends and run one
                # after another on the collective stream: one task of all of them.
                sync_after.setdefault(device, []).append(self._gradient_sync(graph, device, segment.name, ready, last))
        return last

    def _reduced_gradient_bytes(self) -> int:
        """Bytes per gradient element that the data-parallel reduction moves: the buffer the
        micro-batches accumulated into, fp32 under ``"fp32-copy"`` (DeepSpeed's
        BF16_Optimizer all-reduces its fp32 gradients: ``_bf16_reduce_grads`` in
        deepspeed/runtime/pipe/engine.py), else the precision's gradient dtype."""
        pipeline = self.plan.pipeline
        if pipeline is not None and pipeline.gradient_accumulation == "fp32-copy":
            return 4
        return PARAM_BYTES[self.plan.precision][1]

    def _fsdp_gather(self, graph, device, segment, deps, name, elements: float | None = None) -> int:
        """All-gather of ``elements`` of ``segment``'s weights (default: all it shards)."""
        elements = segment.shardable_elements() if elements is None else elements
        size = elements * PARAM_BYTES[self.plan.precision][0]
        return graph.add(name, (device, "collective"), self._collective("all_gather", size, "dp"), deps=deps, kind="comm")

    def _expert_gather(self, graph, device, segment, ends: list[int], start: list[int], label: str) -> int:
        """The all-gather of the sharded expert copies a segment's MoE layers run
        (``Segment.weight_gather_s``), issued when the segment two before it in this pass has
        finished (``ends``, the earlier segments' last tasks; for the first two, when the pass
        may start: ``start``), so it overlaps the previous segment's compute: FSDP2 holds the
        unit running and the one it prefetches."""
        prefetch_after = [ends[-2]] if len(ends) >= 2 else list(start)
        return graph.add(f"{label} all-gather experts {segment.name}", (device, "collective"), segment.weight_gather_s,
                         deps=prefetch_after, kind="comm")

    def _gradient_sync(self, graph, device, name: str, buckets: list[tuple[float, int]], after: int) -> int:
        """Data-parallel reduction of the gradient buckets (bytes, count) one segment's
        backward filled, once that backward is done: each bucket is its own collective."""
        kind = "reduce_scatter" if self.plan.dp_flavour in ("zero2", "fsdp") else "all_reduce"
        if kind == "reduce_scatter" and self.cluster.backend == "gloo" and not self.graph_program:
            # FSDP2 (FSDP, ZeRO-2) on gloo, which has no reduce-scatter of one tensor, all-reduces
            # the whole gradient and keeps its shard (its profile shows gloo:all_reduce events).
            kind = "all_reduce"
        pieces = [(self._collective(kind, size, "dp"), count) for size, count in buckets]
        count = sum(count for _, count in buckets)
        label = f"{kind.replace('_', '-')} grads ({name}{f', {count} buckets' if count > 1 else ''})"
        return graph.add_pieces(label, (device, "collective"), pieces, deps=[after], kind="comm")

    def _boundary_bytes(self, chunk_segments: dict[int, list[Segment]], vs: int) -> float:
        """Activation bytes a micro-batch carries from virtual stage ``vs`` to ``vs + 1``."""
        following = chunk_segments.get(vs + 1, [])
        return following[0].input_bytes if following else 0.0

