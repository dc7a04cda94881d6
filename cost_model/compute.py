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
instead of the default efficiency. fp32 keeps the roofline.
"""

from __future__ import annotations

from cost_model import defaults, gpu_kernels
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


def roofline_time(flops: float, num_bytes: float, device: DeviceSpec, dtype: str) -> float:
    """Seconds for one kernel doing ``flops`` and moving ``num_bytes`` on ``device``."""
    matmul, memory, overhead = efficiencies(device, dtype)
    return max(flops / (device.flops_for(dtype) * matmul), num_bytes / (device.memory_bandwidth * memory)) + overhead


def op_times(node: OpNode, work_fraction: float, device: DeviceSpec, precision: str) -> tuple[float, float]:
    """(forward, backward) seconds of ``node`` doing ``work_fraction`` of its traced work.

    ``work_fraction`` is 1 / (ranks sharing the op's work x micro-batches). Activations are
    stored in the precision's dtype, so bytes scale from the traced dtype.
    """
    if node.is_view:
        return 0.0, 0.0
    dtype, element_bytes = PRECISIONS[precision]
    traced_bytes = max((meta.dtype.itemsize for meta in node.output_meta if meta.dtype.is_floating_point), default=4)
    shaped = gpu_kernels.kernel_op_times(node, work_fraction, device, dtype, element_bytes)
    if shaped is not None:
        return shaped
    flops = node.flops * work_fraction
    num_bytes = node.bytes_moved * work_fraction * min(1.0, element_bytes / traced_bytes)
    forward = roofline_time(flops, num_bytes, device, dtype)
    has_gradient = any(meta.dtype.is_floating_point for meta in node.output_meta)
    backward = roofline_time(
        defaults.BACKWARD_TO_FORWARD * flops, defaults.BACKWARD_TO_FORWARD * num_bytes, device, dtype
    ) if has_gradient else 0.0
    return forward, backward


def optimizer_step_time(state_bytes: float, device: DeviceSpec) -> float:
    """AdamW step over ``state_bytes`` of (sharded) weights + gradients + states: memory-bound."""
    _, memory, overhead = efficiencies(device)
    return state_bytes * defaults.ADAM_BYTES_ACCESSED_PER_PARAM_BYTE / 4 / (device.memory_bandwidth * memory) + overhead
