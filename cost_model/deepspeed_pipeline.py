"""DeepSpeed's pipeline engine as it runs: its ``TrainSchedule`` instruction by instruction,
every send and receive a rendezvous (``deepspeed_schedule``, called by
``cost_model.step_tasks.StepTasks`` with itself: it adds the passes through its ``forward``
and ``backward``).

DeepSpeed's pipeline sends are synchronous (deepspeed/runtime/pipe/p2p.py: ``send`` asserts
``async_op == False``; a ``dist.send``/``recv`` pair, or a two-rank ``dist.broadcast``, on
the default stream): a send cannot start before the receiving stage has reached the matching
receive, and both stages' compute streams hold until the transfer ends. Which receive matches
which send, and what each stage does before it, is fixed by ``TrainSchedule``
(``cost_model.schedules.deepspeed_train_steps``).

In the task graph each exchange is, on each of the two stages' compute streams, a
zero-length "ready" task followed by the transfer; each side's transfer also waits for the
other side's ready task, so both start when the later of the two stages arrives:

    start(transfer) = max(sender ready, receiver ready);  both end at start + seconds

The passes, their tensor-parallel gathers of partitioned tensors, gradient accumulation and
the contributors' gradient reductions are the step graph's own (``StepTasks.forward`` etc.).

Tied weights: a parameter that more than one stage holds (the token embedding that is also
the LM head: Megatron-DeepSpeed's ``GPTModelPipe`` builds both ends from
``TiedLayerSpec('embed', ...)``, megatron/model/gpt_model.py) has its gradients all-reduced
between those stages after the schedule's last backward and before the data-parallel
reduction: ``TrainSchedule`` issues ``ReduceTiedGrads`` then ``ReduceGrads`` at its last step
(deepspeed/runtime/pipe/schedule.py), and ``_exec_reduce_tied_grads`` runs one blocking
``dist.all_reduce`` per tied weight over the group of its stages (engine.py; module.py
``allreduce_tied_weight_gradients`` in DeepSpeed 0.5, the fp32 ``_hp_grad`` under bf16 from
0.6). Each holder's compute stream runs it once both have arrived.

The fp16 engine's ZeRO-1 step (``runs_fp16_zero_step``): before Adam, DeepSpeed's
``FP16_DeepSpeedZeroOptimizer.step`` checks the partition's gradients for overflow, takes
their norm in fp64, copies them to fp32 and unscales them, and after Adam copies the updated
weights back to fp16: memory-bound passes over the partition (``fp16_zero_step_checks_time``,
added by ``StepTasks`` before the optimizer step).
"""

from __future__ import annotations

import math

from cost_model.collectives import collective_time
from cost_model.compute import efficiencies, tensors_in_flat_shards
from cost_model.schedules import deepspeed_train_steps
from cost_model.segments import Segment
from cost_model.step_context import StepContext

# DeepSpeed's fp16 ZeRO stage 1 step before Adam (``FP16_DeepSpeedZeroOptimizer.step`` in
# deepspeed/runtime/zero/stage2.py at microsoft/DeepSpeed 2c5bba6dc, 2021-10-31, which stage 1
# runs unless ``legacy_stage1``): bytes moved per element of the rank's partition.
#   * overflow check, ``_has_inf_or_nan``: ``float(x.float().sum())`` per partition gradient:
#     the cast reads 2 and writes 4 bytes, the sum reads 4 = 10;
#   * gradient norm, ``get_grad_norm_direct``: ``g.data.double().norm(2)`` per tensor, then
#     ``.item()``: the cast reads 2 and writes 8, the norm reads 8 = 18;
#   * the fp32 gradient, ``self.flatten(averaged_gradients).to(fp32)``: 2 + 2, then 2 + 4 = 10;
#   * ``unscale_and_clip_grads``: ``grad.data.mul_(1 / combined_scale)`` in fp32: 4 + 4 = 8;
#   * the updated fp16 weights, ``fp16_partitions[partition_id].data.copy_(fp32_partition)``:
#     4 + 2 = 6.
FP16_ZERO_STEP_BYTES_PER_ELEMENT = 10 + 18 + 10 + 8 + 6
# Kernels (each followed by a host sync, ``float()`` or ``.item()``) per partition tensor: the
# overflow check's cast and sum, the norm's cast and norm; and once per step the flatten, the
# cast, the unscale and the copy.
FP16_ZERO_STEP_KERNELS_PER_TENSOR = 4
FP16_ZERO_STEP_KERNELS = 4

# Which side of a stage boundary each instruction is on: the boundary below (between the
# previous stage and this one) or above (this one and the next).
_BOUNDARY_BELOW = ("recv act", "send grad")


def deepspeed_schedule(tasks, chunk_segments: dict[int, list[Segment]], boundary: dict[int, float],
                       sync_after: dict[str, list[int]], gathers: bool, sync_every: bool) -> None:
    """Add every stage's instructions in order to ``tasks`` (a ``StepTasks``), then link the
    exchanges once all exist. ``boundary``: bytes sent at each stage boundary per
    micro-batch; ``sync_after``: the tasks each device's optimizer step waits for (gradient
    reductions are added there); ``gathers``/``sync_every``: whether contributors gather
    before every pass / reduce gradients after every micro-batch."""
    context, graph = tasks.context, tasks.graph
    parts = tasks.p2p_parts()
    pipeline = context.plan.pipeline
    # (stages, seconds) of each tied weight; its stages -> {stage: (ready id, all-reduce id)}
    tied = _tied_gradient_groups(context, chunk_segments)
    tied_tasks: dict[tuple[int, ...], dict[int, tuple[int, int]]] = {}
    # (tensor, micro-batch, lower stage of the boundary) -> {stage: (ready id, transfer id)}
    exchanges: dict[tuple[str, int, int], dict[int, tuple[int, int]]] = {}
    for stage in range(context.pp):
        device = f"stage {stage}"
        segments = chunk_segments[stage]
        reductions: list[tuple[object, int]] = []  # ReduceGrads': (launch(after), after)
        for what, mb in deepspeed_train_steps(stage, context.pp, context.micro_batches):
            if what == "F":
                deps = []
                if stage > 0 and parts > 1:  # PartitionedTensor.full() of the received slice
                    deps = [tasks.gather_parts(device, boundary[stage - 1], [], f"gather act mb{mb}")]
                tasks.forward(device, segments, mb, deps)
            elif what == "B":
                deps = []
                if stage < context.pp - 1 and parts > 1:  # the gradient's slices, then its own output
                    gathered = tasks.gather_parts(device, boundary[stage], [], f"gather grad mb{mb}")
                    deps = [tasks.gather_parts(device, boundary[stage], [gathered], f"gather output mb{mb}")]
                sync = sync_every or mb == context.micro_batches - 1
                deferred = None if pipeline.overlap_grad_reduce else []
                done = tasks.backward(device, segments, mb, deps, context.plan.recompute_at(stage), gathers or sync,
                                      sync_after, sync, deferred)
                done = tasks.accumulate_gradients(device, segments, mb, pipeline.gradient_accumulation, done)
                reductions.extend((launch, done) for launch in deferred or ())
            else:
                lower = stage - 1 if what in _BOUNDARY_BELOW else stage
                seconds = context.p2p_seconds(lower, boundary[lower] / parts)
                ready = graph.add(f"ready to {what} mb{mb}", (device, "compute"), 0.0, kind="p2p")
                transfer = graph.add(f"{what} mb{mb}", (device, "compute"), seconds, kind="p2p")
                exchanges.setdefault((what.split(" ")[1], mb, lower), {})[stage] = (ready, transfer)
        # The last step ends with ReduceTiedGrads, then ReduceGrads (after its sends).
        for stages, seconds in tied:
            if stage in stages:
                ready = graph.add("ready to all-reduce tied grads", (device, "compute"), 0.0, kind="comm")
                reduced = graph.add(f"all-reduce tied grads (stages {', '.join(map(str, stages))})",
                                    (device, "compute"), seconds, deps=[ready], kind="comm")
                tied_tasks.setdefault(stages, {})[stage] = (ready, reduced)
                reductions = [(launch, reduced) for launch, _ in reductions]
        for launch, after in reductions:
            sync_after.setdefault(device, []).append(launch(after))
    for key, sides in exchanges.items():
        if len(sides) != 2:
            raise RuntimeError(f"DeepSpeed schedule: exchange {key} has no partner")
        (_, (ready_a, transfer_a)), (_, (ready_b, transfer_b)) = sides.items()
        graph.add_dependency(transfer_a, ready_b)
        graph.add_dependency(transfer_b, ready_a)
    for sides in tied_tasks.values():  # each holder's all-reduce starts when all have arrived
        for stage, (_, reduce) in sides.items():
            for other, (ready, _) in sides.items():
                if other != stage:
                    graph.add_dependency(reduce, ready)


def _tied_gradient_groups(context: StepContext,
                          chunk_segments: dict[int, list[Segment]]) -> list[tuple[tuple[int, ...], float]]:
    """The weights more than one stage holds, by the stages holding them: (stages, seconds
    of the all-reduce of their gradients between those stages). Gradients are all-reduced
    in the dtype the step accumulated them in (``StepContext.reduced_gradient_bytes``: fp16
    ``param.grad`` in DeepSpeed 0.5; BF16_Optimizer's fp32 ``_hp_grad``)."""
    holders: dict[str, dict[int, float]] = {}
    for stage, segments in chunk_segments.items():
        for segment in segments:
            for name, count in segment.params.items():
                holders.setdefault(name, {})[stage] = count
    elements: dict[tuple[int, ...], float] = {}
    for by_stage in holders.values():
        if len(by_stage) > 1:
            stages = tuple(sorted(by_stage))
            elements[stages] = elements.get(stages, 0.0) + max(by_stage.values())
    stride = context.mesh.size // context.pp
    return [(stages, collective_time("all_reduce", count * context.reduced_gradient_bytes(), context.cluster,
                                     [stage * stride for stage in stages]))
            for stages, count in sorted(elements.items())]


def runs_fp16_zero_step(context: StepContext) -> bool:
    """Whether DeepSpeed's fp16 ZeRO stage 1 optimizer steps the plan: its fp16 pipeline
    engine (gradients accumulated in 16-bit ``param.grad`` by autograd,
    ``PipelineConfig.gradient_accumulation == "autograd"``) with ZeRO-1 over dp > 1."""
    pipeline = context.plan.pipeline
    return (pipeline is not None and pipeline.gradient_accumulation == "autograd"
            and context.plan.dp_flavour == "zero1" and context.dp > 1)


def fp16_zero_step_checks_time(context: StepContext, tensor_sizes: list[float]) -> float:
    """Seconds of DeepSpeed's fp16 ZeRO-1 step before Adam on one device (its overflow check,
    gradient norm, fp32 gradient, unscale and fp16 copy-back; the constants above), which
    holds ``tensor_sizes`` (elements, in order). DeepSpeed flattens them into one group and
    gives each dp rank an even contiguous partition (``get_data_parallel_partitions``), so
    each rank's passes cover 1/dp of the elements, whatever the tensors' shapes (unlike the
    planner's own ZeRO-1, which slices each tensor and steps some whole), and its per-tensor
    kernels run on the tensors its partition crosses. The flag and norm all-reduces (a few
    bytes, over dp and the model-parallel group) are left out."""
    elements = math.ceil(sum(tensor_sizes) / context.dp)
    _, memory, overhead = efficiencies(context.device)
    tensors = tensors_in_flat_shards([tensor_sizes], context.dp)
    kernels = FP16_ZERO_STEP_KERNELS_PER_TENSOR * tensors + FP16_ZERO_STEP_KERNELS
    return elements * FP16_ZERO_STEP_BYTES_PER_ELEMENT / (context.device.memory_bandwidth * memory) + kernels * overhead
