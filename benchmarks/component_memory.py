"""The memory-bound rows of ``benchmarks/components.py``: eager PyTorch kernels between GEMMs,
each priced as the simulator prices it, against Liger-Kernel's published eager baselines
(linkedin/Liger-Kernel, benchmark/data/all_benchmark_data.csv at ead96b61: triton ``do_bench``
medians) and a plain device-to-device copy.

Where the model can price a module as a step does, the row traces it on the meta device
(``planner.trace``) and sums ``cost_model.compute.op_times`` over its ops, so it checks the
kernel kinds of ``cost_model.memory_kernels`` (contiguous pointwise, broadcasting pointwise,
fused norm) and the default for the rest together with the bytes the trace counts. The rows
that set a constant of ``memory_kernels`` are marked; the others are checks. Every row is
compared as throughput (elements or bytes per second), so a positive error means the model
predicts the kernels faster than measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cost_model.compute import efficiencies, op_times, roofline_time
from cost_model.loss_kernels import cross_entropy_times
from cost_model.memory_kernels import BROADCAST_EFFICIENCY, STREAMING_EFFICIENCY
from planner.cluster import Cluster
from planner.graph import OpNode, TensorMeta
from planner.trace import trace

LIGER = "Liger-Kernel benchmark data"
GIB = 2**30


class EagerRMSNorm(nn.Module):
    """The op sequence of Hugging Face's ``LlamaRMSNorm`` (transformers, models/llama/
    modeling_llama.py), as Liger-Kernel benchmarks it: cast to fp32, mean of squares per row,
    multiply by its ``rsqrt``, cast back, multiply by an fp32 weight of ones."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        scaled = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * scaled.to(x.dtype)


class ReluSquared(nn.Module):
    """Liger-Kernel's eager reference for ReLU²: ``torch.square(F.relu(x))``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(x))


class EagerRotary(nn.Module):
    """The op sequence of Hugging Face's ``apply_rotary_pos_emb`` (transformers, models/llama/
    modeling_llama.py) as Liger-Kernel benchmarks it: q and k laid out (batch, sequence, heads,
    head dim) and transposed to (batch, heads, sequence, head dim), cos and sin broadcast over
    the heads; each rotated as ``x * cos + cat(-x2, x1) * sin`` for x's two halves x1, x2."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

        def rotated(x: torch.Tensor) -> torch.Tensor:
            half = x.shape[-1] // 2
            return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

        return rotated(q.transpose(1, 2)), rotated(k.transpose(1, 2))


@dataclass(frozen=True)
class TracedCase:
    """One eager module on one input shape, and Liger-Kernel's measured time for it."""

    case: str
    preset: str
    build: type
    module_args: tuple
    shape: tuple[int, ...]  # of the input; with ``inputs``, the shapes of several
    dtype: torch.dtype
    direction: str  # "forward" or "backward"
    published_ms: float
    source: str
    sets_constant: bool
    inputs: tuple[tuple[int, ...], ...] = ()


A100, H100 = "A100-SXM4-80GB", "H100 80GB HBM3"
TRACED_CASES = [
    # Pointwise, contiguous: the row STREAMING_EFFICIENCY was read from, and a smaller size of
    # the same benchmark (where launches weigh more) as a check.
    TracedCase("ReLU² fwd, 4096 x 16384 bf16, 2 kernels", "dgx-h100", ReluSquared, (), (4096, 16384), torch.bfloat16,
               "forward", 0.1855, f"{LIGER} ({H100}, liger 0.7.0): torch.square(F.relu(x))", True),
    TracedCase("ReLU² fwd, 4096 x 4096 bf16, 2 kernels", "dgx-h100", ReluSquared, (), (4096, 4096), torch.bfloat16,
               "forward", 0.0532, f"{LIGER} ({H100}, liger 0.7.0): torch.square(F.relu(x))", False),
    # Its backward: relu's (1.5x its forward's bytes) and square's pow_backward (3.5x,
    # cost_model.elementwise_backward), contiguous.
    TracedCase("ReLU² bwd, 4096 x 16384 bf16", "dgx-h100", ReluSquared, (), (4096, 16384), torch.bfloat16,
               "backward", 0.4527, f"{LIGER} ({H100}, liger 0.7.0): torch.square(F.relu(x))", False),
    # Hugging Face's RMSNorm: casts and a row mean at the default, pow contiguous, the two
    # multiplies broadcasting (by the per-row rsqrt, by the weight).
    *[TracedCase(f"RMSNorm fwd, 2048 x {hidden} bf16, 8 kernels", "dgx-a100-80g", EagerRMSNorm, (hidden,),
                 (2048, hidden), torch.bfloat16, "forward", ms,
                 f"{LIGER} ({A100}, liger 0.2.1): Hugging Face LlamaRMSNorm", False)
      for hidden, ms in ((1024, 0.07820799946784973), (4096, 0.27990400791168213), (16384, 0.9856320023536682))],
    # Its backward (autograd through the eight ops; every op but pow at the default of twice its
    # forward's bytes).
    TracedCase("RMSNorm bwd, 2048 x 16384 bf16", "dgx-a100-80g", EagerRMSNorm, (16384,), (2048, 16384),
               torch.bfloat16, "backward", 2.5696,
               f"{LIGER} ({A100}, liger 0.2.1): Hugging Face LlamaRMSNorm", False),
    # Fused norms: the row FUSED_NORM_EFFICIENCY was read from, then the same kernel on H100,
    # its backward (the model's default of twice the forward's bytes), and nn.RMSNorm.
    TracedCase("LayerNorm fwd, 4096 x 16384 fp32, 1 kernel", "dgx-a100-80g", nn.LayerNorm, (16384, 1e-6),
               (4096, 16384), torch.float32, "forward", 0.5067, f"{LIGER} ({A100}, liger 0.2.1): torch.nn.LayerNorm",
               True),
    TracedCase("LayerNorm fwd, 4096 x 16384 fp32, 1 kernel", "dgx-h100", nn.LayerNorm, (16384, 1e-6),
               (4096, 16384), torch.float32, "forward", 0.3068, f"{LIGER} ({H100}, liger 0.6.0): torch.nn.LayerNorm",
               False),
    TracedCase("LayerNorm bwd, 4096 x 16384 fp32", "dgx-h100", nn.LayerNorm, (16384, 1e-6), (4096, 16384),
               torch.float32, "backward", 0.6424, f"{LIGER} ({H100}, liger 0.6.0): torch.nn.LayerNorm", False),
    TracedCase("nn.RMSNorm fwd, 4096 x 16384 bf16, 1 kernel", "dgx-h100", nn.RMSNorm, (16384, 1e-6),
               (4096, 1, 16384), torch.bfloat16, "forward", 0.1492,
               f"{LIGER} ({H100}, liger 0.8.0): megatron_rms_norm 'torch' (nn.RMSNorm)", False),
    # Rotary embeddings (Liger-Kernel benchmark_rope.py at b5672a15, provider "huggingface"):
    # 16384 tokens, 32 query and 8 key heads of 256 (hidden 8192). Every kernel of its forward
    # takes ATen's non-vectorized path (q and k transposed views, cos and sin broadcast, the
    # halves' slices, an add of two layouts), but the trace sees only the four broadcasting
    # multiplies: the model is fast here by what strides it cannot see.
    TracedCase("RoPE fwd, 16384 tokens, 32 + 8 heads x 256 bf16", "dgx-a100-80g", EagerRotary, (),
               (1, 16384, 40, 256), torch.bfloat16, "forward", 3.8169920444488525,
               f"{LIGER} ({A100}, liger 0.2.1): Hugging Face apply_rotary_pos_emb", False,
               ((1, 16384, 32, 256), (1, 16384, 8, 256), (1, 16384, 256), (1, 16384, 256))),
    TracedCase("RoPE bwd, 16384 tokens, 32 + 8 heads x 256 bf16", "dgx-a100-80g", EagerRotary, (),
               (1, 16384, 40, 256), torch.bfloat16, "backward", 4.557248115539551,
               f"{LIGER} ({A100}, liger 0.2.1): Hugging Face apply_rotary_pos_emb", False,
               ((1, 16384, 32, 256), (1, 16384, 8, 256), (1, 16384, 256), (1, 16384, 256))),
]

# SwiGLU on a fused gate-up output, Megatron's layout (Liger-Kernel benchmark_megatron_swiglu.py,
# provider "torch", H100 80GB HBM3, liger 0.8.1): ``F.silu(y1) * y2`` over ``torch.chunk(y, 2,
# -1)`` of a 2048 x 4 x 65536 bf16 y, forward 1.4953 ms. Both kernels read chunk views, which
# ATen runs on its non-vectorized path, the path of a broadcasting op: the row
# BROADCAST_EFFICIENCY was read from. The trace records no strides, so the row prices the two
# kernels' bytes (silu 2 + 2, multiply 2 + 2 + 2 per output element) at that efficiency itself.
SWIGLU_CHUNKED = (2048 * 4, 32768, 1.4953, f"{LIGER} ({H100}, liger 0.8.1): F.silu(y1) * y2 over torch.chunk")

# Hugging Face's cross entropy (torch.nn.CrossEntropyLoss on fp32 logits, Liger-Kernel
# benchmark_cross_entropy.py at b5672a15; A100-SXM4-80GB, liger 0.2.1): 8 x 2048 rows of
# 131,072 classes, forward 20.7264 ms; priced by ``cost_model.loss_kernels`` at the default
# efficiency (no constant of memory_kernels applies to it).
CROSS_ENTROPY_FORWARD = (8 * 2048, 131072, 20.726400375366211,
                         f"{LIGER} ({A100}, liger 0.2.1): torch.nn.CrossEntropyLoss, fp32")

# (preset, bytes copied, published device-to-device copy GB/s (read + written), source, sets)
STREAM_MEASUREMENTS = [
    ("dgx-h100", GIB, 2903.0,
     "aigatech/vpbenchmarking README (Voltage Park, 8x H100 SXM5, CUDA 12.6): GPU D2D (HBM3), nvbench", False),
]


def traced_seconds(case: TracedCase) -> float:
    """The model's seconds for ``case``'s module: traced on meta, each op priced by ``op_times``
    at the traced dtypes (precision fp32: no op's bytes are rescaled)."""
    with torch.device("meta"):
        module = case.build(*case.module_args)
        if case.build is nn.RMSNorm:
            module = module.to(case.dtype)
        shapes = case.inputs or (case.shape,)
        graph = trace(module, tuple(torch.randn(shape, dtype=case.dtype) for shape in shapes))
    device = Cluster.preset(case.preset).device_of(0)
    index = 0 if case.direction == "forward" else 1
    return sum(op_times(node, 1.0, device, "fp32")[index] for node in graph.nodes)


def memory_rows(row_type) -> list:
    """Every memory-bound row as ``row_type`` (``components.Row``)."""
    rows = []
    for preset, size, published, source, sets in STREAM_MEASUREMENTS:
        device = Cluster.preset(preset).device_of(0)
        moved = 2 * size  # read once, written once: a contiguous stream
        seconds = roofline_time(0.0, moved, device, "bfloat16", STREAMING_EFFICIENCY)
        rows.append(row_type("memory", preset, f"copy {size / GIB:.0f} GiB on one GPU", published,
                             moved / seconds / 1e9, "GB/s", source, sets))
    for case in TRACED_CASES:
        elements = 1
        for dim in case.shape:
            elements *= dim
        giga = elements / 1e9
        rows.append(row_type("memory", case.preset, case.case, giga / (case.published_ms / 1e3),
                             giga / traced_seconds(case), "G elem/s", case.source, case.sets_constant))
    tokens, columns, published_ms, source = SWIGLU_CHUNKED
    device = Cluster.preset("dgx-h100").device_of(0)
    elements = tokens * columns
    seconds = (roofline_time(0.0, 4 * elements, device, "bfloat16", BROADCAST_EFFICIENCY)
               + roofline_time(0.0, 6 * elements, device, "bfloat16", BROADCAST_EFFICIENCY))
    rows.append(row_type("memory", "dgx-h100", f"SwiGLU over chunk views fwd, {tokens} x {columns} bf16",
                         elements / 1e9 / (published_ms / 1e3), elements / 1e9 / seconds, "G elem/s", source, True))
    rows_count, classes, published_ms, source = CROSS_ENTROPY_FORWARD
    device = Cluster.preset("dgx-a100-80g").device_of(0)
    logits = TensorMeta((rows_count, classes), torch.float32)
    node = OpNode(name="loss", op="aten.cross_entropy_loss.default", inputs=("x", "t"),
                  input_meta=(logits, TensorMeta((rows_count,), torch.int64)),
                  output_meta=(TensorMeta((), torch.float32),), bytes_moved=logits.nbytes)
    _, memory, overhead = efficiencies(device)
    forward, _ = cross_entropy_times(node, 1.0, device, 4, memory, overhead)
    giga = rows_count * classes / 1e9
    rows.append(row_type("memory", "dgx-a100-80g", f"cross entropy fwd, {rows_count} x {classes} fp32",
                         giga / (published_ms / 1e3), giga / forward, "G logits/s", source, False))
    return rows
