"""The simulator's components against the public measurements behind them: GEMM, attention,
memory-bound kernels, a language model's loss, collectives, each predicted figure beside the published one, its
source and the signed error.

    python benchmarks/components.py          # every row
    python benchmarks/components.py --fast   # the first row of each component (a smoke run)

A step's prediction is only as good as its parts; this table shows each part on its own.
Rows marked ``[constant read from it]`` are the measurements a constant of the model was read
from: there the error is what the model adds on purpose. The GEMM and attention ceilings are
GEMM-only or attention-only benchmarks, and the model prices tensor-core work at the clock a
training step sustains under the power cap (``cost_model.gpu_kernels.SUSTAINED_CLOCK``), so it
predicts below them by design: about 7% on A100, 14% on H100. The clock rows show that ratio
as the clock it stands for, beside the public readings of a sustained clock. The other rows are
independent checks.

The memory rows (``benchmarks/component_memory.py``) price eager PyTorch's memory-bound kernels
as the simulator does, each by the kind of kernel ATen launches (``cost_model.memory_kernels``):
contiguous pointwise at 0.913 of HBM bandwidth (read from Liger-Kernel's eager ReLU² on H100),
broadcasting pointwise at 0.539 (ATen's non-vectorized path, read from its SwiGLU over
``torch.chunk`` views on H100), fused norms at 0.525 (read from ``nn.LayerNorm`` on A100), and
the rest (reductions, casts, softmax) at the default 0.8. The checks: Hugging Face's RMSNorm
forward (eight kernels) on A100, which one 0.8 for all priced 19-20% fast at 8-34M elements,
now comes out 4.8-5.6% fast (and 19% slow at 2M elements: eight 5 us launches where the GPU
runs them back to back); LayerNorm on H100, forward -1.1% and backward +4.3%; ``nn.RMSNorm`` on
H100 -5.4%; a smaller ReLU² -1.3%; an H100 device-to-device copy +4.6% (it was -8.3% at 0.8);
and Hugging Face's cross entropy on A100, at the default, -1.6%. Backwards: ReLU² on H100
+0.9% (square's backward by its gradient formula, ``cost_model.elementwise_backward``: +42.7%
at twice its forward's bytes), Hugging Face's RMSNorm on A100 +24.9% (+60% at one 0.8 for all;
its other ops' backwards keep the default of twice their forward's bytes, which is short of
what autograd runs for them). One check fails: Hugging Face's
rotary embedding on A100 is predicted +56.8% fast in forward (+79% at one 0.8) and +6.5% in
backward (+27%). Every one of its forward kernels runs on ATen's non-vectorized path (q and k
are transposed views, the halves slices, the final add joins two layouts), but the trace
records shapes, not strides, so only its four broadcasting multiplies are priced so.

The loss rows time a language model's classifier GEMM, Gemma 2's logit soft-cap and the
cross entropy, op by op as the simulator prices them (the soft-cap's backward by its gradient
formulas, ``cost_model.elementwise_backward``: with the old rule of twice the forward bytes
the backward came out 14.6% slow, then 6.2%; with the soft-cap's three contiguous kernels at
0.913 of HBM bandwidth, ``cost_model.memory_kernels``, forward +1.4% and backward -4.6%).

The optimizer row holds AdamW's foreach implementation against its fused one inside a
torchtitan step. By bytes and launches alone (20 fp32 accesses per element against 7, both at
0.8 of HBM bandwidth) the model priced the difference at a third of what the step measured;
foreach, as torchtitan's rows ran it on DTensors, costs more than its bytes say. The
bandwidth share foreach sustains (``compute.FOREACH_ADAMW_MEMORY_EFFICIENCY``) is now read
from this row, which therefore sets a constant and checks nothing.

The GEMM rows at a transformer layer's shapes (hidden 4096, 8192 tokens: the quick start's)
are the A100 sizing sample of Anthony et al. 2024; the model, at the clock a training step
sustains, lands within 4.2% of each, on both sides. Below the table, the shape model alone:
each GEMM row's prediction at the benchmark's own clock (``SUSTAINED_CLOCK`` removed) against
the same figure. There the layer shapes come out 4.9-12.5% above the sample (whose figure is
the slowest of 10 iterations: a floor of the loop, not a mean) and Horace He's 8192^3 +4.2%,
while the shapes the 2026 MAMF search found (a 3-wave small-M GEMM on A100, a one-wave one on
H100, neither used to set a constant) come out 2.4% and 3.7% below. So layer shapes may run a
few percent below the best shape in a loop, more than tiles and waves say; the sustained clock
(-7.4% on A100) covers it in a step, and no mechanism was changed on a floor statistic from a
board the file does not name. One H100 row (ml-engineering's SwiGLU sizing run of 2024, board
not stated) measured half of what every other H100 source does: printed as published, and
left unexplained.

A K sweep on the GH100 die (TileLang's autotuned GEMM at M = N = 8192 on an H800, not cuBLAS)
checks how throughput falls with the reduction length, the short K = 2048 of a width-2048
layer among them: at the loop's clock the model is 6.5% above it at K = 2048 and 3.3% above at
K = 16384 (750.8 / 791.1 = 0.949 of the long reduction's throughput at K = 2048, the sweep
705 / 766 = 0.920), so relative to long reductions the model prices K = 2048 3.1% faster than
this kernel runs it (the model's 256-iteration tile prologue alone would give 0.903, but
MAMF's cap at its K = 2816 shape flattens every longer K). On a width-2048 layer, about half
of whose GEMM time reduces over 2048, that is 1-2% of the GEMMs: not the 12% Megatron-Core's
1.7B row is predicted fast by.

At the layer shapes of widths 2048 and 4096 over 16,384 tokens (Megatron-Core's 1.7B and 7.1B
weak-scaling rows), XLA's measured sm_90 GEMM table (OpenXLA, 2025) is the only public per-shape
H100 figure found: the shape model at the loop's clock is 0.8-3.4% below each of its five rows
(K = 2048 at 0.939-0.964 of K = 4096 measured, 0.948-0.954 modelled), so it does not price
width-2048 GEMMs optimistically against that table; in a step (the sustained clock) it prices
them 14.5-16.7% below it by design. The one attention-dropout row (Transformer Engine#3312 on
an H200) is the ratio ``gpu_kernels``' cuDNN dropout slowdown was read from.
cuDNN's fused attention on Hopper (the kernel Transformer Engine runs for Megatron-Core on
H100) is priced from its own published speed at 4 x 16 heads x 4096 x d128 with the causal mask:
forward 518 TFLOP/s (the FlashAttention-3 paper's figure 5d), backward 427.9 (its figure 6's 499
without the mask times cudnn-frontend's causal / non-causal 443.6 / 517.3 on an H200). At the
loop's clock the model is within 1% of the paper's causal forward at 4k (6% above at 16k) and
0.2-3.3% above its backward without the mask (each kernel's causal factor is its own published
causal / non-causal ratio, ``cost_model.causal_attention``); head dim 64 forward is 23-28% above
the paper (cuDNN loses more at head dim 64 than FlashAttention-2, whose head-dim factor the model
shares). cudnn-frontend's H200 table, at a clock locked at 1980 MHz, comes out 1.7-7.4% above the
model at the loop's clock. FlashAttention-2's rows with and without the causal mask (A100 fwd+bwd,
H100 forward) are the figures the causal factors were read from: on A100 every such row has the
same error (-10.3% to -11.5%, the sustained clock), on H100 -22% to -27% (FlashAttention-2's
0.35 of peak, read at 16k, is below figure 5 at 2k-4k).

The layer shapes of 7B, 13B and 70B models (Llama-2/3 widths, one 8192-token micro-batch) are
printed with the model's efficiency and no error: beyond the A100 rows above we found no
public per-shape measurement of them to compare with.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from dataclasses import dataclass

import torch

try:  # imported as benchmarks.components, or run as a script (its folder on sys.path instead)
    from benchmarks.attention_measurements import (
        ATTENTION_MEASUREMENTS, CUDNN_ATTENTION_MEASUREMENTS, CUDNN_ATTENTION_SOURCE, CUDNN_DROPOUT_MEASUREMENTS,
        CUDNN_DROPOUT_SOURCE, CUDNN_FORWARD_MEASUREMENTS, CUDNN_FORWARD_SOURCE, CUDNN_SPEED_MEASUREMENTS,
        FLASH2_CAUSAL_MEASUREMENTS)
    from benchmarks.component_memory import memory_rows
    from benchmarks.nccl_fidelity import GIB, PUBLISHED as NCCL_PUBLISHED, predicted as nccl_predicted
except ModuleNotFoundError:  # pragma: no cover
    from attention_measurements import (
        ATTENTION_MEASUREMENTS, CUDNN_ATTENTION_MEASUREMENTS, CUDNN_ATTENTION_SOURCE, CUDNN_DROPOUT_MEASUREMENTS,
        CUDNN_DROPOUT_SOURCE, CUDNN_FORWARD_MEASUREMENTS, CUDNN_FORWARD_SOURCE, CUDNN_SPEED_MEASUREMENTS,
        FLASH2_CAUSAL_MEASUREMENTS)
    from component_memory import memory_rows
    from nccl_fidelity import GIB, PUBLISHED as NCCL_PUBLISHED, predicted as nccl_predicted

from cost_model.compute import op_times, optimizer_step_time, roofline_time
from cost_model.gpu_kernels import (ATTENTION_BACKWARD_TO_FORWARD, GENERATIONS, attention_times, generation_of,
                                    matmul_time)
from planner.cluster import Cluster
from planner.cluster_edits import with_power_limit
from planner.graph import OpNode, TensorMeta
from planner.power_limit import H100_POWER_POINTS


@dataclass(frozen=True)
class Row:
    """One component's prediction beside one public measurement."""

    component: str
    preset: str
    case: str
    published: float
    predicted: float
    unit: str
    source: str
    sets_constant: bool

    @property
    def error(self) -> float:
        """Signed relative error: positive when the model predicts more throughput."""
        return self.predicted / self.published - 1


# (preset, (batch, M, N, K), published 16-bit TFLOP/s, source, a constant was read from it)
GEMM_MEASUREMENTS = [
    ("dgx-a100-80g", (1, 6912, 16384, 2048), 267.9,
     "ml-engineering MAMF table, A100 SXM, CUDA 12.1, best of 100 iterations", True),
    ("dgx-a100-80g", (1, 8192, 8192, 8192), 257.0,
     "Horace He, 'Strangely, Matrix Multiplications...' 2024: cuBLAS, randn inputs", False),
    ("dgx-h100", (1, 6144, 17920, 2816), 792.1,
     "ml-engineering MAMF table, H100 SXM, CUDA 12.1, best of 100 iterations", True),
    ("dgx-h100", (1, 4224, 2048, 8192), 780.2,
     "Horace He, gist 'H100 peak matmul FLOPS': CUTLASS max-autotune, vboost 1", False),
    # The same MAMF table re-measured (ml-engineering at 744d01e, 2026-08, compute/accelerator/
    # README.md: "a mean of 100 iterations after 50 warmup iterations"), whose search now found
    # its best at other shapes: a 3-wave small-M shape on A100 and a one-wave shape on H100
    # (16 x 8 = 128 tiles of 128 x 256 on 132 SMs), both away from the shapes the constants
    # were read from, so they check the tile and wave model rather than set it.
    ("dgx-a100-80g", (1, 1024, 10240, 5120), 271.2,
     "ml-engineering MAMF table (2026), A100 SXM, torch 2.6.0+cu126, mean of 100 iterations", False),
    ("dgx-h100", (1, 2048, 2048, 13312), 794.5,
     "ml-engineering MAMF table (2026), H100 SXM, torch 2.7.0+cu126, mean of 100 iterations", False),
    # A transformer layer's GEMMs at hidden 4096, micro-batch 4 x 2048 tokens (M = 8192), the
    # quick start's shapes: Anthony et al. 2024 ("The Case for Co-Designing Model Architectures
    # with Hardware", arXiv:2401.14489), their sizing benchmark's sample output (EleutherAI/
    # cookbook, benchmarks/sizing/sample_results/transformer.out at 0f810f8, made by
    # transformer_flops.py: fp16 ``F.linear`` on randn inputs, 10 iterations after 5 warm-up,
    # each synchronised and timed alone, the SLOWEST reported: utils.benchmark_mm_b's
    # ``np.amax(times)``, so a floor of the loop's throughput). The file does not name its GPU;
    # its figures (235-255 TFLOP/s) exceed a V100's 125 TFLOP/s peak and sit at 75-82% of an
    # A100's 312, the GPU of the paper's experiments, so the rows are the A100's.
    ("dgx-a100-80g", (1, 8192, 12288, 4096), 241.616,
     "EleutherAI/cookbook sizing sample (Anthony et al. 2024): qkv, h 4096, slowest of 10", False),
    ("dgx-a100-80g", (1, 8192, 4096, 4096), 234.852,
     "EleutherAI/cookbook sizing sample (Anthony et al. 2024): attention out, slowest of 10", False),
    ("dgx-a100-80g", (1, 8192, 16384, 4096), 241.128,
     "EleutherAI/cookbook sizing sample (Anthony et al. 2024): MLP h->4h, slowest of 10", False),
    ("dgx-a100-80g", (1, 8192, 4096, 16384), 252.764,
     "EleutherAI/cookbook sizing sample (Anthony et al. 2024): MLP 4h->h, slowest of 10", False),
    ("dgx-a100-80g", (1, 8192, 51200, 4096), 255.380,
     "EleutherAI/cookbook sizing sample (Anthony et al. 2024): logits, vocab 51200, slowest of 10", False),
    # A K sweep on the GH100 die: TileLang's autotuned fp16 GEMM at M = N = 8192 on an "NVIDIA
    # H800 SXM" (the H100 SXM5's 132 SMs and tensor cores: ``gpu_kernels.EXPORT_VARIANTS``),
    # driver 560.35.05, tile-ai/tilelang at 17bd0a6c (benchmark/matmul/README.md, read in the
    # xwhzz/tilelang fork at b2acfc37): 705, 736, 758, 766 TFLOP/s at K = 2048, 4096, 8192,
    # 16384, the reductions of layers of width 2048-8192 and of weight gradients over 16k
    # tokens. Not cuBLAS (its best, 766, is 3.6% under the MAMF table's 794.5), so it checks how
    # throughput falls with K, not the ceiling; no constant was read from it.
    ("dgx-h100", (1, 8192, 8192, 2048), 705.0,
     "TileLang benchmark/matmul (H800 SXM, fp16, autotuned, not cuBLAS): M=N=8192, K sweep", False),
    ("dgx-h100", (1, 8192, 8192, 4096), 736.0,
     "TileLang benchmark/matmul (H800 SXM, fp16, autotuned, not cuBLAS): M=N=8192, K sweep", False),
    ("dgx-h100", (1, 8192, 8192, 8192), 758.0,
     "TileLang benchmark/matmul (H800 SXM, fp16, autotuned, not cuBLAS): M=N=8192, K sweep", False),
    ("dgx-h100", (1, 8192, 8192, 16384), 766.0,
     "TileLang benchmark/matmul (H800 SXM, fp16, autotuned, not cuBLAS): M=N=8192, K sweep", False),
    # H100 GEMMs at the layer shapes of widths 2048 and 4096 (16,384 tokens: 4 x 4096 rows),
    # the layers of Megatron-Core's 1.7B and 7.1B weak-scaling rows: XLA's measured GEMM
    # throughput table for sm_90 (tensorflow/tensorflow at 372d578b, third_party/xla/xla/service/
    # gpu/model/matmul_interpolator_data.h, "Copyright 2025 The OpenXLA Authors", the
    # ``kDefaultMatmulPTable`` entries under key "sm_90", "bf16xbf16->bf16", as FLOP/s). The file
    # states neither the board (SXM or PCIe), the GEMM library (XLA's cuBLAS or Triton GEMMs) nor
    # how it timed them: loops of one GEMM, compared at the loop's clock like MAMF. Batched
    # (b x m x n x k): the same tiles and waves as one GEMM of b x m rows. No constant was read
    # from them.
    ("dgx-h100", (4, 4096, 2048, 2048), 759.3,
     "XLA matmul_interpolator_data.h (OpenXLA 2025), sm_90 bf16: width 2048, K 2048", False),
    ("dgx-h100", (4, 4096, 4096, 2048), 764.6,
     "XLA matmul_interpolator_data.h (OpenXLA 2025), sm_90 bf16: width 2048, N 4096", False),
    ("dgx-h100", (4, 4096, 2048, 4096), 808.7,
     "XLA matmul_interpolator_data.h (OpenXLA 2025), sm_90 bf16: K 4096, N 2048", False),
    ("dgx-h100", (4, 4096, 4096, 4096), 793.1,
     "XLA matmul_interpolator_data.h (OpenXLA 2025), sm_90 bf16: width 4096", False),
    ("dgx-h100", (1, 4096, 4096, 2048), 738.7,
     "XLA matmul_interpolator_data.h (OpenXLA 2025), sm_90 bf16: 4096 rows, K 2048", False),
    # ml-engineering's SwiGLU sizing run "on H100" (training/performance/README.md, "SwiGLU-based
    # MLP", 2024-02; benchmarks/matrix-shape/swiglu-maf-bench.py: fp16 ``torch.bmm`` of
    # 4 x (4096 x 11008) @ (11008 x 4096), mean of 100 iterations after 50): 395.0 TFLOP/s at
    # d_ff 11008. The board (SXM or PCIe), clocks and software are not stated, and the figure is
    # half of every other H100 row here (MAMF 794.5 at a one-wave shape); the model has no
    # mechanism that halves a 16-wave, K-aligned GEMM, so the row stays as published and unexplained.
    ("dgx-h100", (4, 4096, 4096, 11008), 395.01,
     "ml-engineering SwiGLU sizing (2024-02), 'H100' (board not stated), fp16 bmm, mean of 100", False),
]

# The attention kernels' published speeds are in ``benchmarks/attention_measurements.py``.

# (GPU generation, MHz its datasheet's dense 16-bit peak is counted at, published sustained
# MHz, source, sets): the clock the model's sustained ratio stands for is the ratio times the
# datasheet clock (A100: 1410 MHz, 312e12 = 432 tensor cores x 512 FLOPs x 1410e6; H100 and
# H200: 1830 MHz, 989.4e12 = 528 x 1024 x 1830e6).
CLOCK_MEASUREMENTS = [
    ("A100", 1410, 1305,
     "Glenn Lockwood, 'Peak FLOPS', Rpeak: NVIDIA's HPL clock at the A100's 400 W limit", True),
    ("H100", 1830, 1575,
     "deepseek-ai/DeepGEMM#120: 700 W GH100 (H800), FP8 GEMMs overlapped with communication", True),
    ("H200", 1830, 1500,
     "tile-ai/TileOPs#1588: H200 at 700 W, CI's sustained locked-clock target under full load", False),
]

# A language model's loss on its own: Wijmans et al., "Cut Your Losses in Large-Vocabulary
# Language Models" (ICLR 2025), their PyTorch baseline (apple/ml-cross-entropy, README
# "Benchmarking", A100 SXM4, PyTorch 2.4.1, CUDA 12.4; benchmark/__main__.py ``baseline``):
# logits = e @ c.T in bf16, Gemma 2's soft-cap tanh(logits / 30) * 30 (its config's
# final_logit_softcapping), then F.cross_entropy(logits.float(), targets); 8,192 tokens, width
# 2,304, vocabulary 256,000. Forward 81.9 ms, backward 122.4 ms.
# (preset, tokens, width, vocabulary, published forward ms, published backward ms, source)
LOSS_MEASUREMENTS = [
    ("dgx-a100-80g", 8192, 2304, 256000, 81.9, 122.4,
     "Wijmans et al. 2025 (Cut Your Losses), apple/ml-cross-entropy README: PyTorch baseline, Gemma 2 shapes"),
]

# AdamW's foreach implementation against its fused one inside a training step: torchtitan's
# pull request #355 (pytorch/torchtitan, 2024-06, "Add fused as an option in train config"):
# Llama 3 8B (8.03e9 parameters), FSDP2 over 8 A100 80GB, local batch 1 of 8,192 tokens;
# foreach logs 2,631 words (tokens) per second per GPU, and fused "wps is + ~100" (rounded
# as the PR states it). Per step: 8192 / 2631 - 8192 / 2731 = 114 ms more with foreach. The
# model's difference is the two optimizer steps over each GPU's 1/8 of the parameters
# (fp32 weight, gradient and two states: 16 bytes each), compared as 1 / seconds so that a
# positive error means the model predicts foreach cheaper than measured, as elsewhere.
# (preset, parameters, GPUs, tokens per GPU per step, foreach wps, fused wps, source)
OPTIMIZER_MEASUREMENTS = [
    ("dgx-a100-80g", 8.03e9, 8, 8192, 2631.0, 2631.0 + 100.0,
     "pytorch/torchtitan#355: Llama 3 8B, FSDP2, 8 A100 80GB, AdamW foreach vs fused ('wps + ~100')"),
]

# (model, layer, M, N, K) of one 8192-token micro-batch on one GPU, no tensor parallelism.
LAYER_SHAPES = [
    ("7B", "attention qkv", 8192, 3 * 4096, 4096),
    ("7B", "MLP up (SwiGLU, 11008)", 8192, 11008, 4096),
    ("7B", "MLP down", 8192, 4096, 11008),
    ("13B", "attention qkv", 8192, 3 * 5120, 5120),
    ("13B", "MLP down", 8192, 5120, 13824),
    ("70B", "MLP up, tp=8 (28672 / 8)", 8192, 3584, 8192),
    ("70B", "attention out, tp=8 (8192 / 8)", 8192, 8192, 1024),
]


def gemm_tflops(preset: str, m: int, n: int, k: int, batch: int = 1) -> float:
    """The model's bf16 TFLOP/s for ``batch`` (M, N, K) GEMMs on the preset's device."""
    device = Cluster.preset(preset).device_of(0)
    seconds = matmul_time(batch, m, n, k, device, "bfloat16", 2, generation_of(device))
    return 2 * batch * m * n * k / seconds / 1e12


def gemm_rows() -> list[Row]:
    """GEMM throughput, predicted against the published measurements."""
    return [Row("GEMM", preset, f"{f'{batch} x ' if batch > 1 else ''}{m}x{n}x{k} bf16", published,
                gemm_tflops(preset, m, n, k, batch), "TFLOP/s", source, sets)
            for preset, (batch, m, n, k), published, source, sets in GEMM_MEASUREMENTS]


def attention_rows() -> list[Row]:
    """FlashAttention forward throughput, predicted against the published measurements."""
    rows = []
    for preset, batch_heads, seq, head_dim, causal, published, source, sets in ATTENTION_MEASUREMENTS:
        device = Cluster.preset(preset).device_of(0)
        forward, _ = attention_times(batch_heads, seq, seq, head_dim, causal, device, "bfloat16",
                                     generation_of(device))
        flops = 4 * batch_heads * seq * seq * head_dim * (0.5 if causal else 1.0)
        case = f"{batch_heads} heads x {seq} x d{head_dim}{' causal' if causal else ''} fwd"
        rows.append(Row("attention", preset, case, published, flops / forward / 1e12, "TFLOP/s", source, sets))
    return rows


def attention_speed(kernel: str, preset: str, batch_heads: int, seq: int, head_dim: int, causal: bool,
                    direction: str, sustained: bool = True) -> float:
    """The model's TFLOP/s for one call of attention ``kernel`` on the preset's GPU: forward
    ("fwd"), backward ("bwd", 2.5x the forward FLOPs) or both ("fwd+bwd", 3.5x over both times);
    ``sustained=False``: at the benchmark loop's clock, ``SUSTAINED_CLOCK`` removed."""
    device = dataclasses.replace(Cluster.preset(preset).device_of(0), attention_kernel=kernel)
    generation = generation_of(device)
    if not sustained:
        generation = dataclasses.replace(generation, sustained_clock=1.0)
    forward, backward = attention_times(batch_heads, seq, seq, head_dim, causal, device, "bfloat16", generation)
    forward_flops = 4 * batch_heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    if direction == "fwd":
        return forward_flops / forward / 1e12
    if direction == "bwd":
        return ATTENTION_BACKWARD_TO_FORWARD * forward_flops / backward / 1e12
    return (1 + ATTENTION_BACKWARD_TO_FORWARD) * forward_flops / (forward + backward) / 1e12


def attention_speed_rows(label: str, kernel: str, measurements) -> list[Row]:
    """One row per (preset, batch x heads, sequence, head dim, causal, direction, published
    TFLOP/s, source, sets) measurement of ``kernel``, predicted by ``attention_speed``."""
    rows = []
    for preset, batch_heads, seq, head_dim, causal, direction, published, source, sets in measurements:
        case = f"{label} {batch_heads} heads x {seq} x d{head_dim}{' causal' if causal else ''} {direction}"
        rows.append(Row("attention", preset, case, published,
                        attention_speed(kernel, preset, batch_heads, seq, head_dim, causal, direction), "TFLOP/s",
                        source, sets))
    return rows


def flash2_causal_rows() -> list[Row]:
    """FlashAttention-2 with and without the causal mask, predicted against its published speeds."""
    return attention_speed_rows("FA2", "flash-attention-2", FLASH2_CAUSAL_MEASUREMENTS)


def cudnn_attention_rows() -> list[Row]:
    """cuDNN's fused attention over FlashAttention-2 on H100 (forward + backward time ratio),
    predicted against Transformer Engine's published benchmark."""
    flash2 = Cluster.preset("dgx-h100").device_of(0)
    cudnn = dataclasses.replace(flash2, attention_kernel="cudnn-fused-attention")
    rows = []
    for batch_heads, seq, head_dim, causal, published, sets in CUDNN_ATTENTION_MEASUREMENTS:
        times = [sum(attention_times(batch_heads, seq, seq, head_dim, causal, device, "bfloat16",
                                     generation_of(device)))
                 for device in (flash2, cudnn)]
        case = f"cuDNN speed-up, {batch_heads} heads x {seq} x d{head_dim}{' causal' if causal else ''}"
        rows.append(Row("attention", "dgx-h100", case, published, times[0] / times[1], "x", CUDNN_ATTENTION_SOURCE,
                        sets))
    return rows


def cudnn_forward_rows() -> list[Row]:
    """cuDNN's fused attention forward throughput on H100, predicted against the FlashAttention-3
    paper's figure."""
    device = dataclasses.replace(Cluster.preset("dgx-h100").device_of(0), attention_kernel="cudnn-fused-attention")
    rows = []
    for batch_heads, seq, head_dim, causal, published, sets in CUDNN_FORWARD_MEASUREMENTS:
        forward, _ = attention_times(batch_heads, seq, seq, head_dim, causal, device, "bfloat16", generation_of(device))
        flops = 4 * batch_heads * seq * seq * head_dim * (0.5 if causal else 1.0)
        case = f"cuDNN {batch_heads} heads x {seq} x d{head_dim}{' causal' if causal else ''} fwd"
        rows.append(Row("attention", "dgx-h100", case, published, flops / forward / 1e12, "TFLOP/s",
                        CUDNN_FORWARD_SOURCE, sets))
    return rows


def cudnn_dropout_rows() -> list[Row]:
    """cuDNN's fused attention with attention dropout over without it on an H200 (forward +
    backward time ratio), predicted against Transformer Engine's published figures."""
    device = dataclasses.replace(Cluster.preset("h200").device_of(0), attention_kernel="cudnn-fused-attention")
    rows = []
    for batch_heads, seq, head_dim, causal, published, sets in CUDNN_DROPOUT_MEASUREMENTS:
        times = [sum(attention_times(batch_heads, seq, seq, head_dim, causal, device, "bfloat16",
                                     generation_of(device), dropout_p=dropout_p))
                 for dropout_p in (0.1, 0.0)]
        case = f"cuDNN dropout 0.1, {batch_heads} heads x {seq} x d{head_dim}{' causal' if causal else ''}"
        rows.append(Row("attention", "h200", case, published, times[0] / times[1], "x", CUDNN_DROPOUT_SOURCE,
                        sets))
    return rows


def cudnn_speed(preset: str, batch_heads: int, seq: int, head_dim: int, causal: bool, direction: str,
                sustained: bool = True) -> float:
    """The model's cuDNN fused attention TFLOP/s for one call on the preset's GPU (``attention_speed``)."""
    return attention_speed("cudnn-fused-attention", preset, batch_heads, seq, head_dim, causal, direction, sustained)


def cudnn_speed_rows() -> list[Row]:
    """cuDNN's fused attention throughput on Hopper, forward with the causal mask and backward,
    predicted against the FlashAttention-3 paper's and cudnn-frontend's published figures."""
    return attention_speed_rows("cuDNN", "cudnn-fused-attention", CUDNN_SPEED_MEASUREMENTS)


def cudnn_loop_clock_lines() -> list[str]:
    """The cuDNN speed rows with the model at the benchmark loop's clock (``SUSTAINED_CLOCK``
    removed), the clock the published figures were measured at."""
    lines = []
    for preset, batch_heads, seq, head_dim, causal, direction, published, _source, _sets in CUDNN_SPEED_MEASUREMENTS:
        tflops = cudnn_speed(preset, batch_heads, seq, head_dim, causal, direction, sustained=False)
        case = f"{batch_heads} x {seq} x d{head_dim}{' causal' if causal else ''} {direction}"
        lines.append(f"{preset:<13} {case:<30} published {published:>6.1f}  model at the loop's clock "
                     f"{tflops:>6.1f} TFLOP/s  {tflops / published - 1:+.1%}")
    return lines


def clock_rows() -> list[Row]:
    """The tensor-core clock a training step sustains, as the model's ratio implies it, against
    the published readings of a sustained clock."""
    return [Row("clock", name, "sustained tensor-core clock", published,
                GENERATIONS[name].sustained_clock * datasheet, "MHz", source, sets)
            for name, datasheet, published, source, sets in CLOCK_MEASUREMENTS]


def loss_nodes(tokens: int, width: int, vocabulary: int) -> list[OpNode]:
    """The ops of the loss benchmark as the trace records them (bf16): the classifier GEMM,
    the soft-cap's divide, tanh and multiply, and the cross entropy."""
    bf16 = torch.bfloat16
    embeddings, classifier = TensorMeta((tokens, width), bf16), TensorMeta((vocabulary, width), bf16)
    logits, targets = TensorMeta((tokens, vocabulary), bf16), TensorMeta((tokens,), torch.int64)
    nodes = [OpNode(name="logits", op="aten.linear.default", inputs=("e", "c"), input_meta=(embeddings, classifier),
                    output_meta=(logits,), flops=2 * tokens * width * vocabulary,
                    bytes_moved=embeddings.nbytes + classifier.nbytes + logits.nbytes)]
    for name, op in (("scaled", "aten.div.Tensor"), ("capped", "aten.tanh.default"), ("softcap", "aten.mul.Tensor")):
        nodes.append(OpNode(name=name, op=op, inputs=(nodes[-1].name,), input_meta=(logits,), output_meta=(logits,),
                            bytes_moved=2 * logits.nbytes))
    nodes.append(OpNode(name="loss", op="aten.cross_entropy_loss.default", inputs=("softcap", "targets"),
                        input_meta=(logits, targets), output_meta=(TensorMeta((), torch.float32),), attrs=(None, None),
                        bytes_moved=logits.nbytes + targets.nbytes + 4))
    return nodes


def loss_rows() -> list[Row]:
    """A language model's loss (classifier GEMM, soft-cap, cross entropy), forward and
    backward, as the simulator prices each op, against the published baseline; as
    throughput (logits per second) so that positive errors mean predicted fast, as elsewhere."""
    rows = []
    for preset, tokens, width, vocabulary, forward_ms, backward_ms, source in LOSS_MEASUREMENTS:
        device = Cluster.preset(preset).device_of(0)
        times = [op_times(node, 1.0, device, "bf16") for node in loss_nodes(tokens, width, vocabulary)]
        logits = tokens * vocabulary / 1e9
        for kind, published_ms, index in (("forward", forward_ms, 0), ("backward", backward_ms, 1)):
            seconds = sum(time[index] for time in times)
            rows.append(Row("loss", preset, f"{tokens} x {vocabulary} logits, d{width}, soft-cap, {kind}",
                            logits / (published_ms / 1e3), logits / seconds, "G logits/s", source, False))
    return rows


def optimizer_rows() -> list[Row]:
    """AdamW foreach over fused: the extra seconds per step, predicted (``compute.
    optimizer_step_time``) against the published step times, as 1 / seconds."""
    rows = []
    for preset, parameters, gpus, tokens, foreach_wps, fused_wps, source in OPTIMIZER_MEASUREMENTS:
        device = Cluster.preset(preset).device_of(0)
        state_bytes = 16 * parameters / gpus
        predicted = optimizer_step_time(state_bytes, device, "foreach") - optimizer_step_time(state_bytes, device)
        published = tokens / foreach_wps - tokens / fused_wps
        rows.append(Row("optimizer", preset, f"AdamW foreach - fused, {parameters / gpus:.2g} params/GPU",
                        1 / published, 1 / predicted, "1/s", source, True))
    return rows


def collective_rows() -> list[Row]:
    """NCCL collectives (bus bandwidth or latency), from ``benchmarks/nccl_fidelity.py``'s rows."""
    rows = []
    for kind, preset, nodes, ranks, size, published, unit, source, sets in NCCL_PUBLISHED:
        value = nccl_predicted(kind, Cluster.preset(preset, nodes=nodes), ranks, size, unit)
        size_text = f"{size / GIB:.0f} GiB" if size >= GIB else f"{size} B"
        if unit == "us":  # a latency: higher is slower, so compare as throughput (1 / time)
            published, value, unit = 1e6 / published, 1e6 / value, "ops/s"
        rows.append(Row("collective", preset, f"{kind} {ranks} ranks / {nodes} node(s), {size_text}", published, value,
                        unit, source, sets))
    return rows


def component_rows(fast: bool = False) -> list[Row]:
    """Every component's rows; ``fast``: the first of each component only."""
    groups = [gemm_rows(), attention_rows() + flash2_causal_rows() + cudnn_attention_rows() + cudnn_forward_rows() + cudnn_dropout_rows()
              + cudnn_speed_rows(), clock_rows(),
              memory_rows(Row), loss_rows(),
              optimizer_rows(), collective_rows()]
    return [row for group in groups for row in (group[:1] if fast else group)]


def shape_model_lines() -> list[str]:
    """The GEMM rows' shape model alone: the model with the generation's ``SUSTAINED_CLOCK``
    set to 1 (the clock of the benchmark's own loop) against the published figure."""
    lines = []
    for preset, (batch, m, n, k), published, _source, _sets in GEMM_MEASUREMENTS:
        device = Cluster.preset(preset).device_of(0)
        at_loop_clock = dataclasses.replace(generation_of(device), sustained_clock=1.0)
        seconds = matmul_time(batch, m, n, k, device, "bfloat16", 2, at_loop_clock)
        tflops = 2 * batch * m * n * k / seconds / 1e12
        case = f"{f'{batch} x ' if batch > 1 else ''}{m}x{n}x{k}"
        lines.append(f"{preset:<13} {case:<26} published {published:>6.1f}  model at the loop's clock "
                     f"{tflops:>6.1f} TFLOP/s  {tflops / published - 1:+.1%}")
    return lines


def layer_shape_lines() -> list[str]:
    """The model's efficiency on the layer shapes of 7B/13B/70B models (no published figure)."""
    lines = []
    for preset in ("dgx-a100-80g", "dgx-h100"):
        peak = Cluster.preset(preset).device_of(0).flops_for("bfloat16") / 1e12
        for model, layer, m, n, k in LAYER_SHAPES:
            tflops = gemm_tflops(preset, m, n, k)
            lines.append(f"{preset:<13} {model:>4} {layer:<32} {m}x{n}x{k:<6} {tflops:>7.1f} TFLOP/s "
                         f"({tflops / peak:.1%} of peak)")
    return lines


def power_limit_lines(watts: float = 500.0) -> list[str]:
    """The H100's peak and the MAMF-shape GEMM at a board power limit (``planner.power_limit``),
    beside the datasheet figures that bound it (no public measurement at the limit)."""
    capped = with_power_limit(Cluster.preset("dgx-h100"), watts)
    device = capped.device_of(0)
    m, n, k = generation_of(device).mamf_shape
    seconds = matmul_time(1, m, n, k, device, "bfloat16", 2, generation_of(device))
    (low_watts, low_peak), (high_watts, high_peak) = H100_POWER_POINTS
    return [f"H100 at {watts:.0f} W: peak {device.flops_for('bfloat16') / 1e12:.1f} TFLOP/s (datasheet: "
            f"{low_peak / 1e12:.1f} at {low_watts:.0f} W, {high_peak / 1e12:.1f} at {high_watts:.0f} W); "
            f"{m}x{n}x{k} GEMM {2 * m * n * k / seconds / 1e12:.1f} TFLOP/s"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="only the first row of each component")
    args = parser.parse_args(argv)
    rows = component_rows(fast=args.fast)
    header = f"{'component':<10} {'preset':<13} {'case':<44} {'published':>10} {'model':>9} {'error':>7}  source"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row.component:<10} {row.preset:<13} {row.case:<44} {row.published:>10.1f} {row.predicted:>9.1f} "
              f"{row.error:>+7.1%}  {row.unit}; {row.source}{' [constant read from it]' if row.sets_constant else ''}")
    independent = [abs(row.error) for row in rows if not row.sets_constant]
    print(f"median |error|: all rows {statistics.median(abs(row.error) for row in rows):.1%}"
          + (f", rows not used to set a constant {statistics.median(independent):.1%}" if independent else ""))
    if not args.fast:
        print("\nThe GEMM shape model alone (SUSTAINED_CLOCK removed), against the same measurements")
        print("\n".join(shape_model_lines()))
        print("\ncuDNN attention on Hopper at the benchmark loop's clock (SUSTAINED_CLOCK removed)")
        print("\n".join(cudnn_loop_clock_lines()))
        print("\nModel only (no public per-shape measurement found): layer GEMMs of one 8192-token micro-batch")
        print("\n".join(layer_shape_lines()))
        print("\nModel only (datasheet bounds, no measurement at the limit): a board power limit")
        print("\n".join(power_limit_lines()))


if __name__ == "__main__":
    main()
