"""Compute cost of one op on one device: a roofline with efficiencies and a launch overhead.

    time = max(FLOPs / (peak(dtype) * e_matmul), bytes / (bandwidth * e_memory)) + overhead

Efficiencies come from the device's calibration (``python -m planner profile``) when it has
one, else from the documented defaults in ``cost_model.defaults``. Backward costs twice the
forward for every op with a gradient: two matmuls (input and weight gradient) for
matmul-like ops, about twice the bytes (gradient in, saved input in, gradient out) for
elementwise and normalisation ops.

On a GPU of known generation (V100, A100, H100, H200) without a calibration profile, matmul
and attention ops are timed by the shape-aware kernel model of ``cost_model.gpu_kernels``
(tiles and waves, FlashAttention) in 16-bit precisions (the measurements behind it are bf16),
and 16-bit work of unknown shape uses that generation's measured best-shape matmul fraction
instead of the default efficiency. fp32 keeps the roofline. There, a language model's
cross entropy is priced as the memory-bound kernels eager PyTorch runs over fp32 logits
(``cost_model.loss_kernels``), not as one pass over its input, and a memory-bound op's
backward moves the bytes its gradient formula reads and writes
(``cost_model.elementwise_backward``), not twice its forward's; and a memory-bound op streams
at the share of the bandwidth its kind of eager kernel sustains (``cost_model.memory_kernels``:
contiguous pointwise, broadcasting pointwise, fused norm), not at one share for all.
"""

from __future__ import annotations

import math

from cost_model import defaults, gpu_kernels
from cost_model.elementwise_backward import backward_bytes_ratio
from cost_model.gradient_copies import view_backward_time
from cost_model.loss_kernels import cross_entropy_times
from cost_model.loss_parallel import CROSS_ENTROPY
from cost_model.memory_kernels import kernel_memory_efficiency
from planner.cluster import DeviceSpec
from planner.graph import OpNode

# precision -> (compute dtype, bytes per activation element)
PRECISIONS = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2), "fp16": ("float16", 2)}


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got '{precision}'")


def efficiencies(device: DeviceSpec, dtype: str | None = None) -> tuple[float, float, float]:
    """(matmul efficiency, memory efficiency, kernel overhead s): calibrated, else measured
    for the GPU generation and 16-bit ``dtype`` (``gpu_kernels``), else default."""
    matmul = (getattr(device, "matmul_efficiency", None) or gpu_kernels.large_matmul_efficiency(device, dtype)
              or defaults.MATMUL_EFFICIENCY)
    memory = getattr(device, "memory_efficiency", None) or defaults.MEMORY_EFFICIENCY
    overhead = getattr(device, "kernel_overhead_s", None)
    return matmul, memory, defaults.KERNEL_OVERHEAD_S if overhead is None else overhead


def roofline_time(flops: float, num_bytes: float, device: DeviceSpec, dtype: str,
                  memory_efficiency: float | None = None) -> float:
    """Seconds for one kernel doing ``flops`` and moving ``num_bytes`` on ``device``; its bytes
    stream at ``memory_efficiency`` of the bandwidth when given (the kernel's kind,
    ``cost_model.memory_kernels``), else at the device's memory efficiency."""
    matmul, memory, overhead = efficiencies(device, dtype)
    memory = memory_efficiency or memory
    return max(flops / (device.flops_for(dtype) * matmul), num_bytes / (device.memory_bandwidth * memory)) + overhead


def runs_no_kernel(node: OpNode) -> bool:
    """Whether ``node`` launches nothing on the device: ``aten.dropout`` with p = 0, which
    ATen returns as its input (``dropout`` in aten/src/ATen/native/Dropout.cpp takes the fused
    ``native_dropout`` kernel only for 0 < p < 1, and ``_dropout_impl`` returns the input when
    p == 0) and which, being CompositeImplicitAutograd, adds no backward node either. The
    traced op's first float argument is p (its memory is counted the same way in
    ``cost_model.node_costs``)."""
    if not node.op.startswith("aten.dropout."):
        return False
    return next((a for a in node.attrs if isinstance(a, float)), 0.0) == 0.0


def op_times(node: OpNode, work_fraction: float, device: DeviceSpec, precision: str,
             loss_implementation: str = "", metric_cross_entropies: int = 0) -> tuple[float, float]:
    """(forward, backward) seconds of ``node`` doing ``work_fraction`` of its traced work.

    ``work_fraction`` is 1 / (ranks sharing the op's work x micro-batches). Activations are
    stored in the precision's dtype, so bytes scale from the traced dtype. A cross entropy
    is priced as ``loss_implementation`` computes it, with ``metric_cross_entropies`` more
    forward passes (``Plan.loss_implementation``, ``Plan.metric_cross_entropies``;
    ``cost_model.loss_kernels``).
    """
    if runs_no_kernel(node):
        return 0.0, 0.0
    dtype, element_bytes = PRECISIONS[precision]
    if node.is_view:  # no kernel forward; a split's backward concatenates (cost_model.gradient_copies)
        measured = gpu_kernels.generation_of(device) is not None
        return 0.0, view_backward_time(node, work_fraction, device, element_bytes) if measured else 0.0
    traced_bytes = max((meta.dtype.itemsize for meta in node.output_meta if meta.dtype.is_floating_point), default=4)
    shaped = gpu_kernels.kernel_op_times(node, work_fraction, device, dtype, element_bytes)
    if shaped is not None:
        return shaped
    if node.op == CROSS_ENTROPY and gpu_kernels.generation_of(device) is not None and node.input_meta:
        _, memory, overhead = efficiencies(device, dtype)
        return cross_entropy_times(node, work_fraction, device, element_bytes, memory, overhead,
                                   loss_implementation, metric_cross_entropies)
    flops = node.flops * work_fraction
    num_bytes = node.bytes_moved * work_fraction * min(1.0, element_bytes / traced_bytes)
    kind_efficiency = kernel_memory_efficiency(node, device)
    forward = roofline_time(flops, num_bytes, device, dtype, kind_efficiency)
    has_gradient = any(meta.dtype.is_floating_point for meta in node.output_meta)
    backward = roofline_time(
        defaults.BACKWARD_TO_FORWARD * flops, backward_bytes_ratio_on(node, device) * num_bytes, device, dtype,
        kind_efficiency,
    ) if has_gradient else 0.0
    return forward, backward


def backward_bytes_ratio_on(node: OpNode, device: DeviceSpec) -> float:
    """Backward bytes over forward bytes of ``node`` on ``device``: read from the op's gradient
    formula on GPUs of a known generation (``cost_model.elementwise_backward``), else the
    default ``defaults.BACKWARD_TO_FORWARD``."""
    ratio = backward_bytes_ratio(node) if gpu_kernels.generation_of(device) is not None else None
    return defaults.BACKWARD_TO_FORWARD if ratio is None else ratio


# Element accesses per parameter of one AdamW step, by implementation (fp32 param, grad and
# both states). Fused (``torch.optim.AdamW(fused=True)``, Apex/Megatron FusedAdam): one pass
# reading param, grad, exp_avg, exp_avg_sq and writing param and both states = 7
# (``defaults.ADAM_BYTES_ACCESSED_PER_PARAM_BYTE``). Foreach (PyTorch's default on CUDA,
# ``_multi_tensor_adam`` in torch/optim/adam.py, decoupled weight decay, not capturable): eight
# multi-tensor kernels, each streaming its operands: param *= 1 - lr*wd (2), lerp_ exp_avg
# toward grad (3), exp_avg_sq *= beta2 (2), addcmul_ grad^2 into it (3), sqrt into a new
# tensor (2), div_ and add_ eps on it (2 + 2), addcdiv_ into param (4) = 20.
# Per parameter (Composer's ``DecoupledAdamW``, composer/optim/decoupled_weight_decay.py at
# mosaicml/composer 18f2d3c33, the release llm-foundry's October 2023 benchmarks ran: a Python
# loop over the parameters, ``DecoupledAdamW.adamw``), with no weight decay (llm-foundry's MPT
# yamls: ``weight_decay: 0.0``, which skips its ``param.mul_``): exp_avg.mul_ (2), .add_(grad)
# (3), exp_avg_sq.mul_ (2), .addcmul_(grad, grad) (3), sqrt into a new tensor (2), division
# by sqrt(bias_correction2) into another (2), add_ eps (2), param.addcdiv_ (4) = 20.
ADAMW_ACCESSES = {"fused": defaults.ADAM_BYTES_ACCESSED_PER_PARAM_BYTE, "foreach": 20, "single_tensor": 7,
                  "per_parameter": 20}
# Kernels per step: foreach launches each of its 8 ops once per chunk of at most
# ``MULTI_TENSOR_ELEMENTS`` elements (multi_tensor_apply: 320 blocks x 65,536-element chunks,
# ATen/native/cuda/MultiTensorApply.cuh); fused launches one kernel per chunk.
ADAMW_KERNELS_PER_CHUNK = {"fused": 1, "foreach": 8}
MULTI_TENSOR_ELEMENTS = 320 * 65536
# The share of HBM bandwidth foreach AdamW's 20 accesses sustain, from the one public
# measurement of it against the fused kernel in the configuration compiled programs run
# (FSDP2's DTensor parameters, torch.optim.AdamW): pytorch/torchtitan PR #355 (2024-06),
# Llama-3-8B on 8 A100-80GB, 1.004e9 fp32 parameters per GPU, fused=True "wps + ~100" over
# foreach's 2,632 tokens/s/GPU at 8,192 tokens per step: 8192/2632 - 8192/2732 = 114 ms more
# per step. Fused at the streaming efficiency: 28 B x 1.004e9 / (2.039e12 x 0.8) = 17.2 ms
# + 48 launches x 5 us = 17.5 ms; so foreach = 131.5 ms, less its 384 launches (1.9 ms):
# 80 B x 1.004e9 / 129.6 ms = 620 GB/s = 0.304 of 2.039 TB/s. What holds the multi-tensor
# kernels that far below a plain copy's 0.8 is not identified here (their 65,536-element
# chunks per block, the 4 GB ``_foreach_sqrt`` temporary, DTensor's dispatch of each
# foreach op are candidates); the figure is the measured step, not a roofline.
FOREACH_ADAMW_MEMORY_EFFICIENCY = 0.304
# The single-tensor AdamW (``_single_tensor_adam`` in torch/optim/adam.py; torch.optim's
# choice for CPU tensors and DTensors on CPU) runs ops per parameter tensor: the step count's
# add_, mul_ (weight decay), lerp_, mul_ and addcmul_ (second moment), its ``.item()``, sqrt,
# div, add_ (eps) and addcdiv_: 10 (a CPU profile shows each once per parameter per step).
# Its traffic is priced as the fused kernel's 7 accesses, not the 20 its ops stream: each
# op's operands are one parameter's tensors, which the next op finds in the CPU's caches.
ADAMW_SINGLE_TENSOR_OPS = 10
# Composer's loop launches, per parameter tensor: ``state['step'] += 1`` on the step count
# (a 0-d CUDA tensor: ``torch.zeros((), device=p.device)`` in ``DecoupledAdamW.step``), the
# device-to-host copy of ``state_steps[i].item()`` - a sync, so the host cannot run ahead
# and every launch is paid in full - and the 8 ops above: 10.
ADAMW_PER_PARAMETER_LAUNCHES = 10


def optimizer_step_time(state_bytes: float, device: DeviceSpec, implementation: str = "fused", tensors: int = 1,
                        dispatch_s: float = 0.0) -> float:
    """AdamW step over ``state_bytes`` of (sharded) weights + gradients + states: memory-bound.

    ``implementation`` is ``"fused"`` (one pass, 7 accesses per element), ``"foreach"``
    (PyTorch's default on CUDA: 20 accesses over 8 kernels, at the measured
    ``FOREACH_ADAMW_MEMORY_EFFICIENCY``; see ``ADAMW_ACCESSES``) or
    ``"single_tensor"`` (PyTorch's choice on CPU: ``ADAMW_SINGLE_TENSOR_OPS`` ops on each of
    ``tensors`` parameter tensors, each paying ``dispatch_s`` more when the parameters are
    DTensors) or ``"per_parameter"`` (Composer's ``DecoupledAdamW``: 20 accesses, and
    ``ADAMW_PER_PARAMETER_LAUNCHES`` launches on each of ``tensors`` tensors).
    """
    if implementation not in ADAMW_ACCESSES:
        raise ValueError(f"implementation must be one of {', '.join(ADAMW_ACCESSES)}, got '{implementation}'")
    _, memory, overhead = efficiencies(device)
    elements = state_bytes / (defaults.ADAM_STATES_PER_PARAM * 4 + 4 + 4)  # fp32 param, grad, 2 states
    accessed = state_bytes * ADAMW_ACCESSES[implementation] / 4
    if implementation == "single_tensor":
        return accessed / (device.memory_bandwidth * memory) + ADAMW_SINGLE_TENSOR_OPS * tensors * (overhead + dispatch_s)
    if implementation == "per_parameter":
        return accessed / (device.memory_bandwidth * memory) + ADAMW_PER_PARAMETER_LAUNCHES * tensors * overhead
    launches = ADAMW_KERNELS_PER_CHUNK[implementation] * max(1, math.ceil(elements / MULTI_TENSOR_ELEMENTS))
    if implementation == "foreach":
        memory = FOREACH_ADAMW_MEMORY_EFFICIENCY
    return accessed / (device.memory_bandwidth * memory) + launches * overhead


# Bytes moved per parameter element when a micro-batch's 16-bit weight gradient joins the
# step's gradient, and kernels per parameter tensor, by ``PipelineConfig.gradient_accumulation``
# (the first micro-batch of a step, then every later one):
#   * "in-gemm": the weight-gradient GEMM accumulates into its output (Megatron-LM's
#     --gradient-accumulation-fusion): nothing more.
#   * "autograd": PyTorch's AccumulateGrad (torch/csrc/autograd/functions/accumulate_grad.h)
#     steals the first gradient into ``param.grad`` (no copy) and adds every later one in
#     place, ``variable_grad += new_grad``: read both, write one = 3 x 2 bytes, one kernel.
#   * "fp32-copy": DeepSpeed's BF16_Optimizer (deepspeed/runtime/bf16_optimizer.py,
#     ``update_hp_grads``, added in PR #1801, April 2022, and called by the pipeline engine
#     after every micro-batch's backward, deepspeed/runtime/pipe/engine.py
#     ``_exec_backward_pass``) runs ``hp_grad.add_(lp.grad.to(float32))`` for every
#     parameter: the cast reads 2 and writes 4 bytes, the add reads 4 + 4 and writes 4 = 18
#     bytes, two kernels; the same for the first micro-batch (the fp32 buffer starts at zero).
GRADIENT_ACCUMULATION_BYTES = {"in-gemm": (0, 0), "autograd": (0, 3 * 2), "fp32-copy": (18, 18)}
GRADIENT_ACCUMULATION_KERNELS = {"in-gemm": (0, 0), "autograd": (0, 1), "fp32-copy": (2, 2)}


def gradient_accumulation_time(elements: float, tensors: int, mode: str, first: bool, device: DeviceSpec) -> float:
    """Seconds to add one micro-batch's weight gradients (``elements`` parameter elements in
    ``tensors`` tensors on this device) into the step's gradients, as ``mode`` does it
    (``GRADIENT_ACCUMULATION_BYTES``); ``first``: the step's first micro-batch. Memory-bound
    kernels at the device's memory efficiency, each paying the launch overhead."""
    if mode not in GRADIENT_ACCUMULATION_BYTES:
        raise ValueError(f"gradient accumulation must be one of {', '.join(GRADIENT_ACCUMULATION_BYTES)}, got '{mode}'")
    which = 0 if first else 1
    moved = GRADIENT_ACCUMULATION_BYTES[mode][which] * elements
    launches = GRADIENT_ACCUMULATION_KERNELS[mode][which] * tensors
    if not moved and not launches:
        return 0.0
    _, memory, overhead = efficiencies(device)
    return moved / (device.memory_bandwidth * memory) + launches * overhead


def tensors_in_flat_shards(units: list[list[float]], ranks: int) -> int:
    """Parameter tensors the busiest of ``ranks`` holds a piece of, when each unit's tensors
    (``units``: each unit's tensor sizes in elements, in order) are flattened into one flat
    parameter, padded to a multiple of ``ranks`` and split evenly (FSDP1's ``FlatParameter``,
    torch/distributed/fsdp/_flat_param.py ``FlatParamHandle._get_shard``; with
    ``use_orig_params`` a tensor outside a rank's shard has no gradient there,
    ``FlatParamHandle._use_sharded_grad_views``, and the optimizer skips it)."""
    held = [0] * ranks
    for sizes in units:
        shard = math.ceil(sum(sizes) / ranks)
        start = 0.0
        for size in sizes:
            end = start + size
            if size > 0:
                first, last = int(start // shard), int(math.ceil(end / shard)) - 1
                for rank in range(first, min(last, ranks - 1) + 1):
                    held[rank] += 1
            start = end
    return max(held, default=0)


def optimizer_implementation(backend: str) -> str:
    """The AdamW implementation a compiled program runs on a cluster: it builds
    ``torch.optim.AdamW(params, lr=...)`` with neither ``foreach`` nor ``fused`` set, so torch
    picks (``_default_to_fused_or_foreach`` in torch/optim/optimizer.py, called with
    ``use_fused=False`` by torch/optim/adam.py: "we want to give the fused impl bake-in time
    before making it the default"): the single-tensor loop on CPU tensors (the gloo backend),
    foreach on CUDA tensors and DTensors (both in ``_foreach_supported_types``)."""
    return "single_tensor" if backend == "gloo" else "foreach"
