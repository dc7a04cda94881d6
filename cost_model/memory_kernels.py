"""The share of HBM bandwidth an eager memory-bound kernel sustains, by the kind of kernel ATen
launches for the op, read from public measurements of eager PyTorch.

One efficiency for every memory-bound op (``defaults.MEMORY_EFFICIENCY``, 0.8) is right on
average and wrong for each kind. ATen runs a pointwise op through ``gpu_kernel_impl``
(pytorch/pytorch aten/src/ATen/native/cuda/CUDALoops.cuh at 002a5676): when every operand is
contiguous (``iter.is_contiguous()``) it launches ``launch_vectorized_kernel`` (16-byte loads
and stores); otherwise, and so whenever an input broadcasts against the output (a stride of
0), it launches ``launch_legacy_kernel``, which computes each element's offsets with an
``OffsetCalculator`` and loads one element at a time. The fused norms (``layer_norm``,
``rms_norm``) are one kernel that reduces each row and then writes it. The kinds:

* ``streaming``: a pointwise op whose inputs all have the output's size (the vectorized path),
  at ``STREAMING_EFFICIENCY``;
* ``broadcast``: a pointwise op with an input smaller than its output (an RMSNorm's multiply
  by the per-row ``rsqrt`` or by its weight, rotary embeddings' ``q * cos``, a bias or mask
  add): the legacy path, at ``BROADCAST_EFFICIENCY``;
* ``fused norm``: ``layer_norm`` and ``rms_norm`` as one ATen op, at ``FUSED_NORM_EFFICIENCY``;
* every other memory-bound op (reductions such as ``mean``, casts, ``cat``, dropout, softmax,
  embedding) keeps ``defaults.MEMORY_EFFICIENCY``: the one public eager reduction we have,
  Hugging Face's cross entropy on A100 (``log_softmax`` over 131,072 fp32 classes, Liger-Kernel's
  data below), streams at 0.81 of the bandwidth counted as ``cost_model.loss_kernels`` counts
  its bytes, so 0.8 stands for it.

A view the trace cannot see the strides of (``torch.chunk``'s halves, a transposed ``q``) also
takes the legacy path in ATen but is priced as ``streaming`` here: the trace records shapes,
not strides.

Each efficiency is the value that makes the model (each kernel's traced bytes at that share of
the datasheet bandwidth, plus ``defaults.KERNEL_OVERHEAD_S``) equal the measured time; the
measurements are Liger-Kernel's eager PyTorch baselines (linkedin/Liger-Kernel,
benchmark/data/all_benchmark_data.csv at ead96b61; triton ``do_bench`` medians).
``benchmarks/components.py`` prints each beside the model, with rows of the same data that set
no constant. Applied on GPUs of a known generation (``gpu_kernels.generation_of``) without a
calibration profile; a calibrated ``memory_efficiency`` replaces them all.
"""

from __future__ import annotations

import math

from cost_model.gpu_kernels import generation_of
from planner.cluster import DeviceSpec
from planner.graph import OpNode

# Pointwise ops (``OpNode.op`` up to its overload): one output element from the same element
# of each input, launched through ATen's ``gpu_kernel`` (CUDALoops.cuh).
POINTWISE_OPS = (
    "aten.add", "aten.sub", "aten.mul", "aten.div", "aten.neg", "aten.pow", "aten.square", "aten.sqrt",
    "aten.rsqrt", "aten.reciprocal", "aten.exp", "aten.log", "aten.silu", "aten.gelu", "aten.relu", "aten.tanh",
    "aten.sigmoid", "aten.abs", "aten.clamp", "aten.where", "aten.masked_fill", "aten.maximum", "aten.minimum",
    "aten.sin", "aten.cos",
)
FUSED_NORM_OPS = ("aten.layer_norm", "aten.native_layer_norm", "aten.rms_norm", "aten._fused_rms_norm")

# Liger-Kernel's eager ``torch.square(F.relu(x))`` (benchmark/scripts/benchmark_relu_squared.py,
# provider "torch"; "NVIDIA H100 80GB HBM3", liger 0.7.0, 2026-03-27): x of 4096 x 16384 bf16,
# forward 0.1855 ms. Two contiguous kernels, each reading and writing 2 bytes per element:
# 2 x 4096 x 16384 x 4 B = 536.9 MB; less two launches of 5 us, 0.1755 ms:
# 536.9e6 / 0.1755e-3 = 3.059 TB/s = 0.913 of the H100 SXM's 3.35 TB/s.
STREAMING_EFFICIENCY = 0.913
# Liger-Kernel's eager SwiGLU on Megatron's fused gate-up output
# (benchmark/scripts/benchmark_megatron_swiglu.py, provider "torch": ``y1, y2 = torch.chunk(y,
# 2, -1); F.silu(y1) * y2``; H100 80GB HBM3, liger 0.8.1, 2026-07-26): y of 2048 x 4 x 65536
# bf16, forward 1.4953 ms. Both kernels read chunk views (non-contiguous: the legacy path);
# silu reads and writes 32768 columns (2 x 1073.7 MB / 2), the multiply reads two and writes
# one: 2684.4 MB; less two launches, 1.4853 ms: 2684.4e6 / 1.4853e-3 = 1.807 TB/s = 0.539.
BROADCAST_EFFICIENCY = 0.539
# Liger-Kernel's ``torch.nn.LayerNorm`` (benchmark/scripts/benchmark_layer_norm.py, provider
# "huggingface"; A100-SXM4-80GB, liger 0.2.1, 2024-09-03): x of 4096 x 16384 fp32, forward
# 0.5067 ms. One kernel; the trace counts its input and output (4 + 4 B per element) and the
# weight and bias: 537.0 MB; less one launch, 0.5017 ms: 537.0e6 / 0.5017e-3 = 1.070 TB/s =
# 0.525 of 2.039 TB/s. (ATen's vectorized layer norm reads each row twice, once for its
# statistics and once to normalise it; whether the second read reaches HBM is not known here,
# so the figure is the rate against the bytes the trace counts.)
FUSED_NORM_EFFICIENCY = 0.525


def memory_kind(node: OpNode) -> str:
    """``"streaming"``, ``"broadcast"``, ``"fused norm"`` or ``"other"``: the kind of ATen kernel
    ``node`` launches (module docstring)."""
    base = node.op.rsplit(".", 1)[0] if node.op.count(".") >= 2 else node.op
    if base in FUSED_NORM_OPS:
        return "fused norm"
    if base not in POINTWISE_OPS or not node.output_meta:
        return "other"
    output_elements = max(math.prod(meta.shape) for meta in node.output_meta)
    if any(math.prod(meta.shape) < output_elements for meta in node.input_meta):
        return "broadcast"
    return "streaming"


KIND_EFFICIENCY = {"streaming": STREAMING_EFFICIENCY, "broadcast": BROADCAST_EFFICIENCY,
                   "fused norm": FUSED_NORM_EFFICIENCY}


def kind_memory_efficiency(kind: str, device: DeviceSpec) -> float | None:
    """The share of ``device``'s HBM bandwidth an eager kernel of ``kind`` (``memory_kind``'s
    names) sustains; None where the caller's efficiency stands: a device with a calibrated
    ``memory_efficiency``, a device of no known GPU generation, or a kind not measured."""
    if getattr(device, "memory_efficiency", None) or generation_of(device) is None:
        return None
    return KIND_EFFICIENCY.get(kind)


def kernel_memory_efficiency(node: OpNode, device: DeviceSpec) -> float | None:
    """The share of ``device``'s HBM bandwidth ``node``'s eager kernel sustains, by its kind
    (``kind_memory_efficiency``)."""
    return kind_memory_efficiency(memory_kind(node), device)
