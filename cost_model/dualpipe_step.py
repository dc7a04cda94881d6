"""A DualPipe plan's step (``PipelineConfig.schedule == "dualpipe"``): its 1F1B twin simulated
op by op, then the schedule's difference priced by ``cost_model.dualpipe``.

DualPipe (DeepSeek-V3 technical report, arXiv 2412.19437, section 3.2.1, table 2) runs the
same passes as 1F1B, one stage-pass per micro-batch on every device, so the work, the
collectives inside the passes and the all-to-alls they hide (``Plan.moe_a2a_overlap``,
``cost_model.moe_overlap``) are those of the twin: the same plan with a 1F1B schedule. What
differs, and is added to the twin's simulated step here:

- **The schedule.** Both schedules are timed on the slowest stage's passes (forward ``F``;
  backward split into input-gradient ``B`` and weight-gradient ``W`` halves, as zero-bubble
  pipelines split it, Qi et al., arXiv 2401.10241: each half is one of the backward's two
  matmuls per weight): 1F1B takes ``(m + pp - 1)(F + B + W)``, DualPipe what
  ``cost_model.dualpipe.simulate`` gives; the step moves by the difference.
- **Two stages per device.** Device ``d`` holds stage ``d`` of the pipeline fed from device 0
  and stage ``pp - 1 - d`` of the copy fed from the last device ("2x" parameters, table 2):
  their weights, gradients and optimizer states, and at most ``pp + 1`` micro-batches of
  activations in flight (table 2; 1F1B's first stage holds ``pp``), each as large as the larger
  of its two stages' per micro-batch. The second stage's gradients are reduced over dp (with
  its copy's: a ring all-reduce over ``2 dp`` ranks sends what one over ``dp`` does) and
  stepped by the optimizer after the twin's: counted exposed, an upper bound (the reference
  overlaps the first with its last weight passes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from cost_model.compute import optimizer_step_time
from cost_model.dualpipe import PassTimes, simulate
from planner.strategy import MemoryBreakdown, SimResult


@dataclass(frozen=True)
class ScheduleTimes:
    """The compute of one step's schedule on the slowest stage's passes: 1F1B's, DualPipe's,
    and DualPipe's idle time on its busiest device (its bubble)."""

    one_f_one_b_s: float
    dualpipe_s: float
    dualpipe_bubble_s: float


def schedule_times(stages: int, micro_batches: int, forward: float, backward: float) -> ScheduleTimes:
    """Both schedules on passes of ``forward`` and ``backward`` seconds per micro-batch (the
    backward split in equal input- and weight-gradient halves; module docstring)."""
    times = PassTimes.serial(forward, backward / 2, backward / 2)
    timeline = simulate(stages, micro_batches, times)
    bubble = max(timeline.bubble(rank) for rank in range(stages))
    return ScheduleTimes((micro_batches + stages - 1) * (forward + backward), timeline.step_s, bubble)


def paired_stage(device: int, stages: int) -> int:
    """The stage a DualPipe device holds besides its own: the copy's, fed from the other end."""
    return stages - 1 - device


def dualpipe_device_memory(per_stage: Sequence[MemoryBreakdown], stages: int, micro_batches: int
                           ) -> tuple[MemoryBreakdown, ...]:
    """Each device's bytes under DualPipe from the 1F1B twin's per stage (``per_stage``, stage
    ``s`` holding ``min(stages - s, micro_batches)`` micro-batches): both stages' weights,
    gradients and states, ``pp + 1`` micro-batches of the larger stage's activations, the
    larger communication buffers."""
    devices = []
    for device in range(stages):
        mine, other = per_stage[device], per_stage[paired_stage(device, stages)]
        per_micro_batch = max(
            memory.activations / min(stages - stage, micro_batches)
            for stage, memory in ((device, mine), (paired_stage(device, stages), other))
        )
        devices.append(MemoryBreakdown(
            weights=mine.weights + other.weights,
            gradients=mine.gradients + other.gradients,
            optimizer_states=mine.optimizer_states + other.optimizer_states,
            activations=int(min(stages + 1, micro_batches) * per_micro_batch),
            communication_buffers=max(mine.communication_buffers, other.communication_buffers),
        ))
    return tuple(devices)


def second_stage_tail(synced_gradient_bytes: float, state_bytes: float, device, reduce_gradients) -> float:
    """Seconds after the twin's step that a device's second stage adds: the reduction over dp of
    its ``synced_gradient_bytes`` (``reduce_gradients(bytes)``) and its optimizer step over
    ``state_bytes`` of weights, gradients and states (module docstring)."""
    reduce = reduce_gradients(synced_gradient_bytes) if synced_gradient_bytes else 0.0
    return reduce + (optimizer_step_time(state_bytes, device) if state_bytes else 0.0)


def dualpipe_result(twin: SimResult, forward: float, backward: float, micro_batches: int,
                    synced_gradient_bytes: Sequence[float], device, reduce_gradients) -> SimResult:
    """The DualPipe plan's result from its 1F1B ``twin``'s (one ``stage_memory`` per stage):
    ``forward`` and ``backward`` are the slowest stage's seconds per micro-batch,
    ``synced_gradient_bytes`` each stage's gradients reduced over dp, ``device`` the devices'
    spec, ``reduce_gradients`` the seconds to all-reduce so many bytes over one dp group."""
    stages = len(twin.stage_memory)
    times = schedule_times(stages, micro_batches, forward, backward)
    devices = dualpipe_device_memory(twin.stage_memory, stages, micro_batches)
    tail = reduction = 0.0  # the busiest device's, and the reduction's part of it
    for device_index in range(stages):
        other = paired_stage(device_index, stages)
        memory = twin.stage_memory[other]
        state = memory.weights + memory.gradients + memory.optimizer_states
        seconds = second_stage_tail(synced_gradient_bytes[other], state, device, reduce_gradients)
        if seconds > tail:
            tail, reduction = seconds, reduce_gradients(synced_gradient_bytes[other]) if synced_gradient_bytes[other] else 0.0
    step = twin.step_time_s - times.one_f_one_b_s + times.dualpipe_s + tail
    scale = twin.step_time_s / step if step else 0.0
    return replace(
        twin,
        step_time_s=step,
        communication_s=twin.communication_s + reduction,
        memory=max(devices, key=lambda memory: memory.total),
        stage_memory=devices,
        method="simulator (1F1B twin) + DualPipe schedule",
        samples_per_s=twin.samples_per_s * scale,
        tokens_per_s=twin.tokens_per_s * scale,
        tflops_per_device=twin.tflops_per_device * scale,
        mfu=twin.mfu * scale,
        bubble_fraction=times.dualpipe_bubble_s / times.dualpipe_s if times.dualpipe_s else 0.0,
    )
