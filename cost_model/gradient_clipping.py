"""Gradient clipping by the global L2 norm, as another system's training loop runs it
(``Plan.gradient_clipping``), once per step between the gradient reductions and the
optimizer step.

Every framework behind ``benchmarks/fidelity.py`` clips at 1.0, and each does it in three
parts: the norm of the gradients this rank holds (a read of every fp32 gradient element),
a small all-reduce of the squared norm over the ranks that hold the other parts, and the
scale of every gradient by ``max_norm / (norm + 1e-6)`` clamped to 1 (a read and a write).
They differ in how many kernels the passes take and where the host waits:

  * ``"foreach"``: ``torch.nn.utils.clip_grad_norm_`` (pytorch/pytorch
    torch/nn/utils/clip_grad.py, read at v2.13.0 as installed here): ``_get_total_norm``
    runs ``torch._foreach_norm`` per (device, dtype) group, ``torch.stack`` and
    ``vector_norm`` of the per-tensor norms; ``_clip_grads_with_norm_`` computes the
    clamped coefficient on the device ("avoids a `if clip_coef < 1:` conditional which can
    require a CPU <=> device synchronization") and runs ``torch._foreach_mul_``. Both
    foreach kernels are multi_tensor_apply launches, one per ``MULTI_TENSOR_ELEMENTS``
    chunk (``cost_model.compute``). Over DTensor gradients (torchtitan's FSDP2) the total
    norm is a partial sum that ``full_tensor()`` all-reduces over the mesh. No host sync.
  * ``"per_tensor"``: FSDP1's ``FullyShardedDataParallel.clip_grad_norm_``
    (torch/distributed/fsdp/fully_sharded_data_parallel.py, same version; Composer calls it
    on the root module for ``gradient_clipping``): ``_get_grad_norm`` takes
    ``vector_norm`` of each gradient tensor, stacks them and takes their norm, then
    ``dist.all_reduce`` of the norm to the power p over the process group, and a
    ``grad.mul_`` per gradient tensor by the on-device clamped coefficient. Two launches per
    tensor. No host sync.
  * ``"multi_tensor"``: Megatron's ``get_grad_norm_fp32`` and ``clip_grad_by_total_norm_fp32``
    (NVIDIA/Megatron-LM megatron/core/optimizer/clip_grads.py, read at 0293807e5; the same
    three steps as megatron/optimizer/clip_grads.py ``clip_grad_norm_fp32`` of Megatron-LM's
    older releases): apex/TE ``multi_tensor_l2norm`` over the fp32 main gradients (one launch
    per chunk and a cleanup kernel), the power, ``all_reduce`` over the gradient-statistics
    group (the model-parallel group; every rank under the distributed optimizer), then
    ``total_norm.item()``, a host sync, and ``multi_tensor_scale`` when the coefficient is
    below 1. The scale is priced as always run: early in training, where throughput
    benchmarks are taken, gradient norms are above 1.0, and pricing it keeps the estimate on
    the safe side when they are not. The host sync's round trip is not priced (the rule in
    ``cost_model.host_syncs``).

DeepSpeed's fp16 ZeRO-1 step clips inside its unscale (``fp16_zero_step_checks_time`` in
``cost_model.deepspeed_pipeline`` prices its norm and its ``unscale_and_clip_grads``), so a
plan priced that way names no clipping here.
"""

from __future__ import annotations

import math

from cost_model.compute import MULTI_TENSOR_ELEMENTS, efficiencies
from planner.cluster import DeviceSpec
from planner.run_settings import GRADIENT_CLIPPINGS
# Bytes moved per fp32 gradient element: the norm reads it (4), the scale reads and writes
# it (4 + 4). Every style above clips the fp32 gradients the optimizer steps (FSDP's
# sharded fp32 gradients, Megatron's fp32 main gradients).
NORM_BYTES_PER_ELEMENT = 4
SCALE_BYTES_PER_ELEMENT = 4 + 4
# Small kernels once per step around the norm, by style (read from the sources above):
#   foreach: stack, vector_norm of the stacked norms, + 1e-6, max_norm / ..., clamp = 5;
#   per_tensor: stack, vector_norm, ** p before the all-reduce, ** (1/p) after, + 1e-6,
#     max_norm / ..., clamp = 7;
#   multi_tensor: multi_tensor_l2norm's cleanup kernel, ** p = 2 (the coefficient is a
#     Python float after ``.item()``).
NORM_FIXED_KERNELS = {"foreach": 5, "per_tensor": 7, "multi_tensor": 2}
# The all-reduced norm: one fp32 scalar.
NORM_ALL_REDUCE_BYTES = 4


def clip_kernel_times(style: str, elements: float, tensors: int, device: DeviceSpec) -> tuple[float, float]:
    """Seconds of one rank's (norm, scale) kernels, the norm's all-reduce apart, over
    ``elements`` fp32 gradient elements in ``tensors`` tensors, as ``style`` runs them
    (module docstring): memory-bound passes at the device's memory efficiency, each launch
    paying the kernel overhead. The norm and the scale each take one launch per gradient
    tensor ("per_tensor") or per ``MULTI_TENSOR_ELEMENTS`` chunk (the multi-tensor styles).
    (0, 0) for "" (no clipping)."""
    if style not in GRADIENT_CLIPPINGS:
        raise ValueError(f"gradient clipping must be one of {', '.join(GRADIENT_CLIPPINGS[1:])} or empty, got '{style}'")
    if not style:
        return 0.0, 0.0
    _, memory, overhead = efficiencies(device)
    bandwidth = device.memory_bandwidth * memory
    launches = tensors if style == "per_tensor" else max(1, math.ceil(elements / MULTI_TENSOR_ELEMENTS))
    norm = elements * NORM_BYTES_PER_ELEMENT / bandwidth + (launches + NORM_FIXED_KERNELS[style]) * overhead
    scale = elements * SCALE_BYTES_PER_ELEMENT / bandwidth + launches * overhead
    return norm, scale


__all__ = ["NORM_BYTES_PER_ELEMENT", "SCALE_BYTES_PER_ELEMENT", "NORM_FIXED_KERNELS", "NORM_ALL_REDUCE_BYTES",
           "clip_kernel_times"]
