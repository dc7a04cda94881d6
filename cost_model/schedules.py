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
