"""Pipeline schedules: the order in which one device runs forward (F) and backward (B)
passes of micro-batches through its stage chunks.

Each function returns, for pipeline rank ``stage`` of ``stages``, a list of
``(kind, micro_batch, chunk)`` with ``kind`` in ``{"F", "B"}``; ``chunk`` is the virtual
stage index on this device (0 unless interleaved). The simulator supplies the timing.

- GPipe (Huang et al. 2019): all forwards, then all backwards.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): ``stages - stage - 1`` warm-up forwards,
  then one forward / one backward, then the remaining backwards; at most ``stages - stage``
  micro-batches in flight.
- Interleaved 1F1B (Megatron-LM, Narayanan et al. SC'21): each device holds ``chunks``
  virtual stages; micro-batches advance in groups of ``stages``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

Step = tuple[str, int, int]


def gpipe(stage: int, stages: int, micro_batches: int) -> list[Step]:
    del stage, stages
    return [("F", mb, 0) for mb in range(micro_batches)] + [("B", mb, 0) for mb in range(micro_batches)]


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Step]:
    warmup = min(stages - stage - 1, micro_batches)
    order: list[Step] = [("F", mb, 0) for mb in range(warmup)]
    forward, backward = warmup, 0
    while forward < micro_batches:
        order.append(("F", forward, 0))
        forward += 1
        order.append(("B", backward, 0))
        backward += 1
    order += [("B", mb, 0) for mb in range(backward, micro_batches)]
    return order


def interleaved(stage: int, stages: int, micro_batches: int, chunks: int) -> list[Step]:
    """Megatron's interleaved schedule; needs ``micro_batches % stages == 0``."""
    if chunks == 1:
        return one_f_one_b(stage, stages, micro_batches)
    if micro_batches % stages:
        raise ValueError(
            f"the interleaved schedule needs micro-batches ({micro_batches}) to be a multiple of the stages ({stages})"
        )
    total = micro_batches * chunks

    def forward_step(k: int) -> Step:
        group, within = divmod(k, stages * chunks)
        chunk = within // stages
        return ("F", group * stages + within % stages, chunk)

    def backward_step(k: int) -> Step:
        group, within = divmod(k, stages * chunks)
        chunk = chunks - 1 - within // stages
        return ("B", group * stages + within % stages, chunk)

    warmup = min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
    order = [forward_step(k) for k in range(warmup)]
    forward, backward = warmup, 0
    while forward < total:
        order.append(forward_step(forward))
        forward += 1
        order.append(backward_step(backward))
        backward += 1
    order += [backward_step(k) for k in range(backward, total)]
    return order


def schedule(name: str, stage: int, stages: int, micro_batches: int, chunks: int = 1) -> list[Step]:
    """The step order of ``name`` (``gpipe``, ``1f1b``, ``interleaved``) for one device."""
    if name == "gpipe":
        return gpipe(stage, stages, micro_batches)
    if name == "1f1b":
        return one_f_one_b(stage, stages, micro_batches)
    if name == "interleaved":
        return interleaved(stage, stages, micro_batches, chunks)
    raise ValueError(f"unknown pipeline schedule '{name}' (gpipe, 1f1b, interleaved)")


# A pass in dependency order: (device, is forward, virtual stage, index of the pass it waits
# for in the same list, or -1).
_Pass = tuple[int, bool, int, int]


@lru_cache(maxsize=256)
def _passes_in_dependency_order(name: str, stages: int, micro_batches: int, chunks: int) -> tuple[_Pass, ...]:
    """Every device's passes, each after the one it waits for: a forward of virtual stage
    ``vs`` waits for the forward of ``vs - 1`` (same micro-batch), a backward of ``vs`` for
    the backward of ``vs + 1`` (its own forward, on the same device, is earlier in the
    device's order). The devices are walked round-robin as ``cost_model.step_tasks`` walks
    them."""
    orders = [schedule(name, device, stages, micro_batches, chunks) for device in range(stages)]
    last = stages * chunks - 1
    index: dict[tuple[str, int, int], int] = {}
    passes: list[_Pass] = []
    positions = [0] * stages
    while any(positions[d] < len(orders[d]) for d in range(stages)):
        progressed = False
        for device, order in enumerate(orders):
            while positions[device] < len(order):
                kind, mb, chunk = order[positions[device]]
                vs = chunk * stages + device
                if kind == "F":
                    upstream = ("F", mb, vs - 1) if vs > 0 else None
                else:
                    upstream = ("B", mb, vs + 1) if vs < last else None
                if upstream is not None and upstream not in index:
                    break
                index[(kind, mb, vs)] = len(passes)
                passes.append((device, kind == "F", vs, index[upstream] if upstream is not None else -1))
                positions[device] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"the {name} schedule deadlocks on {stages} stages and {micro_batches} micro-batches")
    return tuple(passes)


def schedule_makespan(name: str, stages: int, micro_batches: int, chunks: int, forward_s: Sequence[float],
                      backward_s: Sequence[float], hop_s: float = 0.0) -> float:
    """Seconds from the first forward to the last backward of ``name``'s schedule on
    ``stages`` devices, given each virtual stage's forward and backward seconds per
    micro-batch (virtual stage ``chunk * stages + device``, as ``schedule`` numbers them) and
    ``hop_s`` for each activation or gradient sent to another virtual stage.

    Each device runs its passes in the schedule's order; a pass starts when the device is
    free and the pass it depends on has ended, plus the hop. This is the critical path the
    simulator's task graph has (``cost_model.step_tasks``) with the point-to-point streams
    never busy: no closed form such as ``m x busiest device + (pp - 1) x slowest stage``,
    which is exact only when the stages are even and overestimates a schedule whose
    stages are not (its fill and drain wait on the slowest stage only where it lies on
    the path)."""
    finished = []
    free = [0.0] * stages
    for device, forward, vs, upstream in _passes_in_dependency_order(name, stages, micro_batches, chunks):
        ready = finished[upstream] + hop_s if upstream >= 0 else 0.0
        end = max(free[device], ready) + (forward_s[vs] if forward else backward_s[vs])
        free[device] = end
        finished.append(end)
    return max(free)


# One instruction of DeepSpeed's pipeline engine: (what, micro-batch), ``what`` in
# ``DEEPSPEED_INSTRUCTIONS``; "recv act" / "send grad" talk to the previous stage, "send act" /
# "recv grad" to the next.
DEEPSPEED_INSTRUCTIONS = ("recv act", "send grad", "send act", "recv grad", "F", "B")
Instruction = tuple[str, int]


def deepspeed_train_steps(stage: int, stages: int, micro_batches: int) -> list[Instruction]:
    """The instructions DeepSpeed's ``TrainSchedule`` gives pipeline rank ``stage``, in order
    (deepspeed/runtime/pipe/schedule.py, 2021-22; the same passes as 1F1B).

    The schedule has ``2 (micro_batches + stages - 1)`` steps; at each step a stage runs one
    forward or one backward (or nothing): even stages forward on even steps, odd stages on odd
    steps. A forward step first receives its activations from the previous stage, then sends
    that stage the gradients of the backward it ran the step before; a backward step first
    sends the next stage the activations of the forward it ran the step before, then receives
    its gradients from that stage. Each send or receive blocks until its partner posts the
    matching one. (That is the order of the runs priced with it: MT-NLG of 2021, BLOOM of
    2022. DeepSpeed reversed both pairs in March 2023, microsoft/DeepSpeed b528f50e3, PR
    #2862: a forward step now sends the gradients first, a backward step receives first.)"""
    def valid(mb: int) -> bool:
        return 0 <= mb < micro_batches

    def step_micro_batch(step: int) -> tuple[int, bool]:
        forward = step % 2 == stage % 2
        if forward:
            return (step if step % 2 == 0 else step - 1) // 2 - stage // 2, True
        if step % 2 == 0:  # an odd stage's backward
            return step // 2 - stages + (stage + 1) // 2, False
        return (step - 1) // 2 - stages + 1 + stage // 2, False

    order: list[Instruction] = []
    previous = -1
    for step in range(2 * (micro_batches + stages - 1)):
        mb, forward = step_micro_batch(step)
        if forward and stage > 0:
            if valid(mb):
                order.append(("recv act", mb))
            if valid(previous):
                order.append(("send grad", previous))
        elif not forward and stage < stages - 1:
            if valid(previous):
                order.append(("send act", previous))
            if valid(mb):
                order.append(("recv grad", mb))
        if valid(mb):
            order.append(("F" if forward else "B", mb))
        previous = mb
    return order
