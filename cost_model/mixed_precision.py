"""What a bf16 plan's program holds and moves, by dtype: the bytes of its weight gathers and
gradient reductions, and the casts autocast makes of its fp32 weights.

The simulator prices what the compiled program runs (``codegen.runtime.precision``):

- **FSDP2 units** (zero2, fsdp, HSDP; ``planner.program_shape.wraps_bf16_fsdp_units``) are
  sharded under ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)``, as
  torchtitan shards them (``apply_fsdp``, torchtitan/models/llama3/infra/parallelize.py at
  81c12433). The shards stay fp32; FSDP2 casts a shard to bf16 before gathering it
  (``FSDPParam.all_gather_inputs``), so the all-gather and its copy-out move 2 bytes per
  element; the unsharded weights a unit computes with are bf16, so autocast casts none of
  them for its matmuls (it still takes a layer norm's bf16 weight up to fp32 for its fp32
  kernel: one hidden-size vector per norm, not priced);
  each unit's bf16 gradients are cast to fp32 and reduce-scattered in fp32
  (``foreach_reduce``: ``reduce_dtype``): 4 bytes per element.
- **Every other weight** of a bf16 program stays fp32 (DDP, ZeRO-1, a graph program's
  DTensors, pipeline stages, the units of a plan with MoE layers): each op autocast runs in
  bf16 (``AUTOCAST_BF16_OPS``) casts its fp32 weight for every forward pass (``_to_copy``:
  4 bytes read, 2 written per element) and its backward casts the bf16 weight gradient back
  to fp32 (2 read, 4 written), a memory-bound kernel each way per weight and micro-batch
  (``add_autocast_weight_casts``). Its gradients are fp32, so DDP's all-reduce, a graph
  program's gradient hooks and ZeRO-1's gathers of updated fp32 slices move 4 bytes per
  element: no program registers a bf16 compression hook unless its plan is of the
  gradient-compression family, which prices its own.
- **Other systems' runs** (``Plan.half_precision_weights``: Megatron-LM's ``Float16Module``,
  DeepSpeed's 16-bit engines, Composer's FSDP with ``mixed_precision: DEFAULT``; also a plan
  with ``megatron_distributed_optimizer``, which is Megatron's) hold 16-bit weights and
  gradients (so does a plan with ``tp_comm_overlap``, Transformer Engine's): they move 2
  bytes, cast nothing, and reduce in fp32 only where their own fields say so
  (``StepContext.reduced_gradient_bytes``).

fp32 plans move 4 bytes and cast nothing; fp16 plans (never compiled) are priced as 16-bit
weights and gradients.
"""

from __future__ import annotations

import math

from torch.distributed.tensor import Shard

from cost_model.compute import PRECISIONS, roofline_time
from cost_model.parameter_bytes import FP32_GRADIENT_BYTES, PARAM_BYTES
from planner.program_shape import wraps_bf16_fsdp_units

# ATen ops autocast runs in bf16 on CUDA, casting their fp32 inputs, weights included (the
# ``lower_precision_fp`` list of aten/src/ATen/autocast_mode.cpp in pytorch/pytorch). Ops
# outside it (embedding lookups, the norms' weight multiplies, additions of a bias) read the
# fp32 weight as it is.
AUTOCAST_BF16_OPS = frozenset((
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linear",
    "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "scaled_dot_product_attention",
))
# Bytes per weight element of one cast: fp32 read and bf16 written in forward; the gradient's
# bf16 read and fp32 written in backward.
CAST_BYTES_PER_ELEMENT = FP32_GRADIENT_BYTES + 2


def holds_fp32_weights(plan) -> bool:
    """Whether ``plan``'s program keeps fp32 weights and gradients under bf16 autocast: a
    bf16 plan of the planner's own programs, not one simulating another system's 16-bit
    weights (``Plan.half_precision_weights``, or Megatron-Core's own settings
    ``Plan.megatron_distributed_optimizer`` and ``Plan.tp_comm_overlap``)."""
    return (plan.precision == "bf16" and not getattr(plan, "half_precision_weights", False)
            and not getattr(plan, "megatron_distributed_optimizer", False) and not getattr(plan, "tp_comm_overlap", False))


def gathered_weight_bytes(plan) -> int:
    """Bytes per element that an all-gather of weights moves: bf16 under FSDP2's policy, fp32
    where the program gathers fp32 weights (a graph program's DTensors, ZeRO-1's updated
    slices, the units of an MoE plan), else the precision's weight bytes."""
    if wraps_bf16_fsdp_units(plan):
        return PARAM_BYTES["bf16"][0]
    if holds_fp32_weights(plan):
        return PARAM_BYTES["fp32"][0]
    return PARAM_BYTES[plan.precision][0]


def unwrapped_collective_bytes(precision: str) -> tuple[int, int]:
    """(weight-gather bytes, gradient-reduction bytes) per element for a program of the
    planner's own whose weights sit in no FSDP2 unit (pipeline stages, graph programs), by
    precision alone, for estimates made before a plan exists (``search.pipeline_step``):
    fp32 both in bf16, as ``gathered_weight_bytes`` and ``reduced_gradient_bytes`` price
    such a plan, else the precision's own."""
    if precision == "bf16":
        return PARAM_BYTES["fp32"][0], FP32_GRADIENT_BYTES
    return PARAM_BYTES[precision][0], PARAM_BYTES[precision][1]


def reduced_gradient_bytes(plan) -> int:
    """Bytes per element that a gradient reduction moves, before what a pipeline's or
    Megatron's own buffers decide (``StepContext.reduced_gradient_bytes``): fp32 for every
    bf16 program (fp32 gradients, or FSDP2's fp32 ``reduce_dtype``), else the precision's
    gradient bytes."""
    if holds_fp32_weights(plan):
        return FP32_GRADIENT_BYTES
    return PARAM_BYTES[plan.precision][1]


def autocast_casts_weights(plan) -> bool:
    """Whether autocast casts ``plan``'s weights op by op: fp32 weights not inside FSDP2 units
    under the bf16 policy."""
    return holds_fp32_weights(plan) and not wraps_bf16_fsdp_units(plan)


def add_autocast_weight_casts(context, node, strategy, cost) -> None:
    """Charge ``cost`` (one micro-batch of ``node``) autocast's casts of the fp32 weights the
    op reads, when autocast runs it in bf16: one memory-bound kernel per weight in forward
    (also when a recomputed block replays it) and one in backward, each moving
    ``CAST_BYTES_PER_ELEMENT`` per element of the weight as the op reads it (whole over
    ``dp``: a graph program's FSDP gathers the fp32 weight before the op casts it).

    A weight two such ops read in one forward is cast once (autocast caches the casts of
    leaf tensors) and charged twice here; none of the example models has one."""
    if not autocast_casts_weights(context.plan) or aten_name(node.op) not in AUTOCAST_BF16_OPS:
        return
    dtype = PRECISIONS[context.plan.precision][0]
    for name in node.params:
        meta = context.graph.parameters.get(name)
        placements = strategy.params.get(name)
        if meta is None or placements is None or not meta.dtype.is_floating_point:
            continue
        shards = math.prod(size for (axis, size), placement in zip(context.mesh.axes, placements)
                           if axis != "dp" and isinstance(placement, Shard))
        seconds = roofline_time(0.0, meta.numel / shards * CAST_BYTES_PER_ELEMENT, context.device, dtype)
        cost.forward_s += seconds
        cost.backward_s += seconds
        if context.host is not None:  # one more op for the host to issue each way (cost_model.host_dispatch)
            cost.host_forward_s += context.host.forward_s
            cost.host_backward_s += context.host.backward_s


def aten_name(op: str) -> str:
    """``"aten.linear.default"`` -> ``"linear"`` (the op's name without namespace and overload)."""
    parts = op.split(".")
    return parts[1] if len(parts) > 2 else parts[-1]
