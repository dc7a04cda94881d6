"""What DeepSpeed's activation checkpointing costs a recomputed block per micro-batch beyond
its kernels, for the options a run turned on (``PipelineConfig.deepspeed_checkpointing``).

DeepSpeed's ``PipelineModule`` runs each recomputed layer through
``deepspeed.checkpointing.checkpoint`` (deepspeed/runtime/pipe/module.py,
``activation_checkpoint_func``; Megatron-DeepSpeed's ``GPTModelPipe`` checkpoints every
``--checkpoint-num-layers`` transformer layers and configures the options from
``--partition-activations``, ``--contigious-checkpointing``, ``--synchronize-each-layer`` and
``--profile-backward``: megatron/initialize.py ``setup_deepspeed_random_and_activation_
checkpointing``, microsoft/Megatron-DeepSpeed 54884b5f, 2021-10-29). Its ``CheckpointFunction``
(deepspeed/runtime/activation_checkpointing/checkpointing.py, microsoft/DeepSpeed 2c5bba6dc,
2021-10-31) does, per call, with the options off, nothing that reaches the GPU but the layer's
own kernels: the RNG states are copied on the host (``torch.cuda.get_rng_state``, and
``_set_cuda_rng_state`` through ``_lazy_call``: no device sync). With them on, for a layer
input of ``B`` bytes (the hidden state, whole on each of the ``tp`` ranks: Megatron-DeepSpeed
of 2021 has no sequence parallelism) and ``P = B / tp``:

* ``partition_activations``: forward, ``partition_activations`` keeps this rank's ``1/tp``:
  ``item.detach().contiguous().view(-1).narrow(...).clone()``, one copy of ``P`` bytes (read
  and write: ``2 P``); backward, ``gather_partitioned_activations`` before the recomputation:
  ``torch.zeros`` of the whole tensor (writes ``B``), ``copy_`` of the kept part into it
  (``2 P``) and ``dist.all_gather`` of ``B`` over the tensor-parallel group, on the compute
  stream (the recomputation needs it): three kernels and one collective;
* ``contiguous_memory_optimization`` (needs the first): forward, the kept part is copied
  again into a preallocated per-layer buffer (``2 P``), after an indexed write of zeros that
  touches one element per page (``P / 4096`` bytes: left out) through a Python ``range``,
  whose index tensor is made on the host and copied to the device by a blocking copy
  (PyTorch's ``copy_kernel_cuda``, aten/src/ATen/native/cuda/Copy.cu of that time:
  ``cudaMemcpyAsync`` then ``cudaStreamSynchronize`` unless ``non_blocking``): two kernels
  and one sync;
* ``synchronize_checkpoint_boundary``: ``torch.cuda.synchronize()`` at the start and end of
  the forward and of the backward, four per block per micro-batch;
* ``profile``: ``SynchronizedWallClockTimer`` (deepspeed/utils/timer.py: ``start`` and
  ``stop`` each call ``torch.cuda.synchronize()``) around the forward and the backward, four
  more.

A ``torch.cuda.synchronize()`` drains the device's queue: the host waits for the last kernel,
and the device then waits for the host to issue the next one. That wait is priced as one
kernel launch gap (the device's ``kernel_overhead_s``, ``defaults.KERNEL_OVERHEAD_S``): the
least it costs (the Python between the sync and the next launch adds to it, unmeasured here).
The copies stream at the device's memory efficiency (``compute.efficiencies``); the
all-gather is the simulator's own collective over ``tp``.

Only blocks recomputed whole are checkpointed (``planner.strategy.WHOLE_BLOCK_RECOMPUTE``);
the layers around them (embedding, head) are not (DeepSpeed's ``PipelineModule._is_
checkpointable`` takes only ``ParallelTransformerLayerPipe`` layers for ``GPTModelPipe``).
With ``partition_activations`` a recomputed block keeps ``1/tp`` of the input it reads from
another block until its backward (``kept_checkpoint_bytes``, used by ``cost_model.step_memory``);
the whole input lives again only while that block recomputes.
"""

from __future__ import annotations

from typing import NamedTuple

from cost_model.compute import efficiencies
from cost_model.segments import Segment
from cost_model.step_context import StepContext
from planner.strategy import CONTIGUOUS_CHECKPOINTING, PARTITION_ACTIVATIONS, WHOLE_BLOCK_RECOMPUTE

# torch.cuda.synchronize() calls per block per micro-batch, forward and backward, by option.
SYNCS_PER_PASS = {"synchronize_checkpoint_boundary": 2, "profile": 2}


class CheckpointingCost(NamedTuple):
    """Seconds a checkpointed block adds per micro-batch: on the compute stream in its forward
    and in its backward, and the backward's all-gather of its partitioned input over tp."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    backward_gather_s: float = 0.0


NO_COST = CheckpointingCost()


def _options(context: StepContext, segment: Segment) -> tuple[str, ...]:
    """The plan's options where they act on ``segment`` (a block its stage recomputes whole), else ()."""
    pipeline = context.plan.pipeline
    options = pipeline.deepspeed_checkpointing if pipeline is not None else ()
    if not options or not segment.block or context.plan.recompute_at(segment.stage) not in WHOLE_BLOCK_RECOMPUTE:
        return ()
    return options


def kept_checkpoint_bytes(context: StepContext, segment: Segment) -> float:
    """Of ``segment``'s checkpoint (``Segment.checkpoint_bytes``, the input it keeps for its
    recomputation), the bytes a rank keeps: 1/tp of it under ``partition_activations``."""
    if PARTITION_ACTIVATIONS not in _options(context, segment):
        return segment.checkpoint_bytes
    return segment.checkpoint_bytes / (context.mesh.axis_size("tp") if "tp" in context.mesh.names else 1)


def checkpointing_cost(context: StepContext, segment: Segment) -> CheckpointingCost:
    """What DeepSpeed's activation checkpointing, with the plan's options, adds to ``segment``
    per micro-batch (nothing where the plan sets none, the segment is not a block, or its
    stage does not recompute whole blocks)."""
    options = _options(context, segment)
    if not options:
        return NO_COST
    tp = context.mesh.axis_size("tp") if "tp" in context.mesh.names else 1
    _, memory_efficiency, launch_s = efficiencies(context.device)
    streaming = context.device.memory_bandwidth * memory_efficiency  # bytes/s a copy moves
    whole = segment.input_bytes
    part = whole / tp
    syncs = sum(SYNCS_PER_PASS.get(option, 0) for option in options)
    forward = backward = syncs * launch_s
    gather = 0.0
    if PARTITION_ACTIVATIONS in options:
        forward += 2 * part / streaming + launch_s  # the clone of this rank's part
        backward += (whole + 2 * part) / streaming + 2 * launch_s  # torch.zeros, copy_ of the part
        gather = context.collective("all_gather", whole, "tp") if tp > 1 else 0.0
    if CONTIGUOUS_CHECKPOINTING in options:
        # the page-touching write, its index's blocking copy (a sync), the copy into the buffer
        forward += 2 * part / streaming + 3 * launch_s
    return CheckpointingCost(forward, backward, gather)
