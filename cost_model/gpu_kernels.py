"""Shape-aware GPU kernel times: GEMMs by tiles and waves, attention as FlashAttention.

The roofline of ``cost_model.compute`` charges every matmul one efficiency. On a GPU the
achieved fraction of peak depends on the shape: cuBLAS splits the output into tiles, one
thread block per tile, and runs them in waves over the streaming multiprocessors (SMs), so a
GEMM pays for whole tiles (tile quantisation) and whole waves (wave quantisation); each tile
also pays a fixed prologue/epilogue that short reductions (small K) cannot hide (NVIDIA,
"Matrix Multiplication Background User's Guide", DU-09799-001, 2023, chapters 2.3 and 3:
https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/).

GEMM of (batch, M, N, K) on a device with ``S`` SMs, for each candidate tile ``(tm, tn)``:

    tiles  = batch * ceil(M / tm) * ceil(N / tn)
    waves  = ceil(tiles / S)
    time   = waves * 2 * tm * tn * (K + K0) / (peak / S * ceiling * tile_efficiency(tm, tn))

and the kernel takes the fastest tile (cuBLAS's heuristics pick among these shapes; the
guide's section 2.3 lists them), never faster than its bytes at the memory bandwidth.
``K0`` (the per-tile prologue and epilogue, as K iterations) is the pipeline depth of the
CUTLASS kernels cuBLAS ships: stages x K-tile. ``ceiling`` is the Maximum Achievable Matmul
FLOPS (MAMF) measured on each GPU, divided by the model's shape efficiency at the shape where
it was measured, so the model reproduces the measurement there; since MAMF is the best of a
search over shapes, no shape's efficiency may exceed it. MAMF is timed on loops of GEMMs
alone; a training step, whose communication and other kernels draw power beside its GEMMs,
sustains a lower clock under the board's power cap (``SUSTAINED_CLOCK``), so the ceiling is
MAMF at that clock, and attention's likewise.

Attention runs as FlashAttention-2 (PyTorch's ``scaled_dot_product_attention`` flash
backend; a device whose ``attention_kernel`` is the Triton FlashAttention kernel runs slower,
cuDNN's fused attention on Hopper faster, ``attention_kernel_slowdown``, and cuDNN's on Hopper
slower with attention dropout, ``attention_dropout_slowdown``): forward 4·B·H·Sq·Sk·D FLOPs (halved when causal), backward 2.5x the forward
(it recomputes Q·Kᵀ: five matmuls against two; Tri Dao,
https://github.com/Dao-AILab/flash-attention/issues/1525), each at the fraction of peak the
FlashAttention papers measure at long sequences, lowered for short sequences, for thread blocks
that do not fill the SMs, and when causal by the kernel's own published causal / non-causal
speed ratio (``causal_factor``, ``cost_model.causal_attention``: the diagonal tiles' masking and
the load imbalance, beyond the skipped blocks).

Elementwise and normalisation ops are memory-bound kernels (eager PyTorch: one kernel per
ATen op, nothing fused), and every kernel pays the launch overhead of ``cost_model.defaults``.

The model applies to bf16/fp16 work on GPUs of a known generation (``generation_of``: V100,
A100, H100, H200 by device name, and the export variants H800 and A800 as the die they
share) without a measured calibration; fp32, CPUs, unknown devices
and devices with a calibration profile keep the roofline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_model import defaults
from cost_model.causal_attention import causal_rate_factor
from cost_model.gradient_copies import bias_gradient_time, bias_length
from planner.attention_masks import ATTENTION_OPS, CAUSAL_ARGUMENT, DROPOUT_ARGUMENT, is_causal_kind
from planner.cluster import DeviceSpec
from planner.graph import OpNode

# Output-tile shapes cuBLAS picks among (rows x columns of C per thread block), largest first
# (Matrix Multiplication Background guide, section 2.3, "Typical Tile Dimensions In cuBLAS").
TILES = ((256, 128), (128, 256), (128, 128), (256, 64), (64, 256), (128, 64), (64, 128), (64, 64))

# Tile efficiency: a tm x tn tile loads (tm + tn) * k elements to do tm * tn * k MACs, so its
# data reuse is tm*tn/(tm+tn) (section 2.3 of the guide: "larger tiles have more data reuse").
# Efficiency rises with reuse as reuse / (reuse + TILE_REUSE_HALF), normalised to the largest
# tile: 256x128 -> 1.0, 128x128 -> 0.92, 128x64 -> 0.79, 64x64 -> 0.69. TILE_REUSE_HALF is an
# ESTIMATE (not a measurement) chosen so that 64x64 tiles run at about 2/3 of the largest, the
# size of the gap between tile sizes in the guide's section 2.3 comparison; it only decides
# which tile wins for small or awkward shapes (the MAMF measurement fixes the large ones).
TILE_REUSE_HALF = 32.0

# The dtypes the measurements below are for (bf16 MAMF, FlashAttention in fp16/bf16); fp32
# and others keep the roofline.
SIXTEEN_BIT = ("bfloat16", "float16")
MATMUL_OPS = ("aten.linear", "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul")

# FlashAttention's thread blocks each take 128 query rows (FlashAttention-2 paper, Dao 2023,
# arXiv:2307.08691, section 3.3: block sizes {64, 128} x {64, 128}; 128 for head dim 128).
ATTENTION_BLOCK = 128
# Sequence length at which attention reaches half its long-sequence efficiency before the
# causal-diagonal effect: FlashAttention-2 paper, figure 4 (A100, head dim 128, not causal,
# forward+backward): about 0.7 of its 16k-token throughput at 512 tokens -> 512/(512+s) =
# 0.7 * 16384/(16384+s) gives s ~ 210.
ATTENTION_SEQUENCE_HALF = 210.0
# Head dimension effect, d / (d + 24) normalised to d = 128: head dim 64 runs at 0.86 of head
# dim 128 (FlashAttention-2 paper, figures 4-5: ~150-170 vs ~190-200 TFLOP/s on A100).
ATTENTION_HEAD_DIM_HALF = 24.0
# Attention backward FLOPs over forward FLOPs: 5 matmuls against 2 (Tri Dao, flash-attention
# issue #1525: "the backward pass of attn is 2.5 x fwd, since we recompute Q @ K.T").
ATTENTION_BACKWARD_TO_FORWARD = 2.5
# Time of each fused attention kernel (``planner.cluster.ATTENTION_KERNELS``, the device's
# ``attention_kernel``) over FlashAttention-2's, (forward, backward). FlashAttention in Triton:
# FlashAttention-2 paper (Dao 2023, arXiv:2307.08691), section 4.1, measured on A100 80GB:
# "FlashAttention-2 is around 1.3-1.5x faster than FlashAttention in Triton in the forward pass
# and around 2x faster in the backward pass" -> 1.4 (the middle of the range) and 2.0. The
# paper measured A100 only; we ASSUME the same ratios on other GPUs.
# cuDNN's fused flash attention (Transformer Engine's ``FusedAttention``, sub-backend 1, bf16):
# Transformer Engine prefers it to flash-attention on Hopper ("Select FusedAttention on sm90
# and FlashAttention on others for performance", transformer_engine/pytorch/attention.py since
# TE v1.2, NVIDIA/TransformerEngine commit 32db392, 2023-12), so Megatron-Core's runs on H100
# take it. On Hopper (the GH100 die: H100, H200) its speed is read from its own published
# figures, forward and backward, at the shape nearest a Megatron-Core layer's: 16 heads of 128,
# 4,096 tokens, causal, 16k tokens per call (``CUDNN_HOPPER_READING``). Forward: 518 TFLOP/s,
# the FlashAttention-3 paper's forward-speed figure on an H100 80GB SXM5 (Shah et al. 2024,
# arXiv:2407.08608, figure 5d, "with causal mask, head dim 128", cuDNN's bar at 4k; the same
# image is Dao-AILab/flash-attention assets/flash3_fp16_fwd.png, added in 7ef24848). Backward:
# the paper plots it without the causal mask only (figure 6, head dim 128: cuDNN 499 TFLOP/s at
# 4k, 516 at 16k; the bar labels, as in the PDF's text layer), so the mask's effect is cuDNN's
# own, from NVIDIA's benchmark of the same kernel at the same shape (NVIDIA/cudnn-frontend
# 505fcfe, benchmark/benchmark_results.csv, cuDNN 9.1 on an H200 locked at 1980 MHz and 700 W
# per benchmark/README.md: backward 443.6 TFLOP/s causal against 517.3 without):
# 499 x 443.6 / 517.3 = 427.9. Both sources count FLOPs as the model does (4·B·H·S²·D, halved
# when causal; backward 2.5x). The figures are kernel loops at the loop's clock; the model
# keeps its sustained clock on top, as for FlashAttention-2 (``SUSTAINED_CLOCK``). Each is
# expressed as a time ratio to the model's FlashAttention-2 fractions at the reading shape with
# cuDNN's own causal factor (518 / 609 forward, FA3 paper fig. 5; 443.6 / 517.3 backward,
# cudnn-frontend; ``cost_model.causal_attention``) (``published_attention_slowdown``), so the
# model reproduces it there at the loop's clock and its figures without the mask follow from
# the causal factor (forward 609 at 4k exactly; backward 499 at 4k within 0.2%).
# This replaces one ratio for forward and backward together read from Transformer Engine's
# notebook (docs/examples/attention/attention.ipynb, TE v1.8, H100 PCIe, cuDNN 9.0 against
# flash-attn 2.4.2, 2 x 16 heads x 2048 tokens, causal: 0.5415 / 0.7496 = 0.722), which priced
# cuDNN at the loop's clock 17% below the FlashAttention-3 paper's causal forward and 23% below
# its backward (4k, head dim 128) on the SXM5 board the presets are (``benchmarks/
# components.py``). Caveats: the reading is one shape (causal forward at 16k: 6% above the
# paper at the loop's clock, backward without the mask 0.3-3.3% above); at head dim 64 cuDNN
# loses more than the model's head-dim factor (read from FlashAttention-2) says: its causal
# forward is priced 23-28% fast there. The same notebook: flash-attention is faster than cuDNN on Ampere, by an
# amount it does not state; generations without a measurement (A100, V100) are ASSUMED to run
# it as fast as FlashAttention-2 (optimistic there).
ATTENTION_KERNEL_SLOWDOWN = {"flash-attention-2": (1.0, 1.0), "flash-attention-triton": (1.4, 2.0),
                             "cudnn-fused-attention": (1.0, 1.0)}
# (batch x heads, sequence, head dim, causal) of the Hopper cuDNN readings: the paper's 16k
# tokens per call as 4 sequences of 4,096 with 16 heads (hidden 2048), cudnn-frontend's 4 x 16.
CUDNN_HOPPER_READING = (4 * 16, 4096, 128, True)
CUDNN_HOPPER_FORWARD_TFLOPS = 518.0
CUDNN_HOPPER_BACKWARD_TFLOPS = 499.0 * 443.6 / 517.3
# The dense 16-bit peak the FlashAttention fractions below are fractions of on the GH100 die:
# the H100 SXM5 datasheet's 989.4e12 (528 tensor cores x 1024 FLOPs x 1830 MHz; ``SUSTAINED_CLOCK``),
# the figure the H100 and H200 presets carry.
GH100_DENSE_16BIT_PEAK = 989.4e12


def attention_dropout_slowdown(kernel: str, generation_name: str, dropout_p: float) -> float:
    """Time of ``kernel`` with attention dropout ``dropout_p`` over its time without, forward and
    backward alike (``ATTENTION_DROPOUT_SLOWDOWN_BY_GENERATION``; 1.0 where unmeasured or p = 0)."""
    if dropout_p <= 0.0:
        return 1.0
    return ATTENTION_DROPOUT_SLOWDOWN_BY_GENERATION.get((kernel, generation_name), 1.0)


@dataclass(frozen=True)
class GpuGeneration:
    """What the kernel model knows about one GPU generation (sources next to each preset).

    Attributes:
        name: "V100", "A100", "H100" or "H200".
        sms: streaming multiprocessors.
        mamf_fraction: measured best-shape matmul throughput over the dense 16-bit peak.
        mamf_shape: (M, N, K) at which ``mamf_fraction`` was measured.
        k_overhead: per-tile prologue/epilogue in K iterations (pipeline stages x K tile).
        attention_forward: FlashAttention forward fraction of peak at long sequences, head dim 128.
        attention_backward: the same for its backward.
        sustained_clock: the clock a training step's tensor-core work sustains under the
            board's power cap over the clock of those short benchmarks (``SUSTAINED_CLOCK``).
    """

    name: str
    sms: int
    mamf_fraction: float
    mamf_shape: tuple[int, int, int]
    k_overhead: int
    attention_forward: float
    attention_backward: float
    sustained_clock: float

    @property
    def sustained_matmul_fraction(self) -> float:
        """Fraction of peak the best-shaped GEMM sustains in training: MAMF at the sustained clock."""
        return self.mamf_fraction * self.sustained_clock

    def matmul_efficiency(self, batch: float, m: float, n: float, k: float) -> float:
        """Fraction of peak a (batch, m, n, k) GEMM sustains in training: the MAMF measurement
        at the sustained clock, scaled by the model's shape efficiency relative to the measured
        shape, capped there (MAMF is the best over a search of shapes, so no shape may beat it)."""
        measured = shape_efficiency(1, *self.mamf_shape, self.sms, self.k_overhead)
        relative = shape_efficiency(batch, m, n, k, self.sms, self.k_overhead) / measured
        return self.sustained_matmul_fraction * min(1.0, relative)


# The clock tensor-core work sustains through a training step, over the clock the kernel
# benchmarks above ran at. MAMF is the fastest of 100 timed iterations after 50 warm-up ones
# (ml-engineering, compute/accelerator/benchmarks/README.md, "Examples of usage"), and the
# FlashAttention papers time short loops too: loops of one kernel, without the communication
# and other kernels a training step runs beside its GEMMs (not a warm-up effect: see the H100
# paragraph below). A100-SXM4: 1305 MHz is the clock an A100 sustains at its 400 W power limit running a
# dense-matmul benchmark for minutes (HPL; NVIDIA computes its TOP500 Rpeak from it), against
# the 1410 MHz boost clock: 1305 / 1410 = 0.926 (Glenn Lockwood, "Peak FLOPS",
# https://glennklockwood.com/garden/peak-FLOPS, section "Rpeak"). The power governor does
# throttle bf16 GEMMs on ordinary data: an A100 8192^3 cuBLAS bf16 GEMM runs at 295 TFLOP/s
# on zeros and 257 on randn inputs, 13% slower, because random bits switch more transistors
# under the same 400 W (Horace He, "Strangely, Matrix Multiplications on GPUs Run Faster When
# Given 'Predictable' Data", 2024, https://www.thonking.ai/p/strangely-matrix-multiplications).
# A short loop may already run below the boost clock, so the ratio can count part of the
# throttling twice: with it, that 8192^3 GEMM is predicted 3.6% under the 257 TFLOP/s of his
# short loop (``benchmarks/components.py``), the direction a sustained clock should move it.
# The ratio is the sustained clock over the clock the datasheet peak is counted at, the peak
# both MAMF and the FlashAttention fractions are fractions of; on the A100 that clock is the
# 1410 MHz boost (312 TFLOP/s = 432 tensor cores x 512 FLOPs x 1410 MHz).
# H100-SXM5 (and H200, the same GH100 die at the same 700 W limit): NVIDIA counts the 989.4
# TFLOP/s dense bf16 peak at 1830 MHz, not at the 1980 MHz maximum SM clock (528 tensor cores x
# 1024 FLOPs x 1830 MHz = 989.4e12; ml-engineering, compute/accelerator/README.md, "How to
# calculate theoretical TFLOPS", and its clock table's note 12; Glenn Lockwood's H100 page:
# "1.83 GHz (low precision), 1.98 GHz (high precision)"). Under a training-like load - GEMMs
# with communication overlapped, as every data- and tensor-parallel step runs them - a 700 W
# GH100 board (H800 SXM) exceeds its power limit and falls from 1980 to 1575 MHz (deepseek-ai/
# DeepGEMM issue #120, 2025-06-25; the DeepGEMM maintainer: "It is expected", and it varies
# from board to board), so the ratio is 1575 / 1830 = 0.861. Those GEMMs were FP8 (DeepGEMM's
# kernels), twice bf16's FLOPs per clock, so a bf16 step may hold a little more clock: the
# figure bounds the drop from below rather than measuring it. A second reading agrees: H200
# runners at 700 W "cannot reliably sustain a locked 1830 MHz graphics/SM clock under full
# load", 1500 MHz being "a more realistic sustained locked-clock target" (tile-ai/TileOPs pull
# request #1588, 2026-06; a CI setting, not a measurement, so not the figure used). The
# H100's ratio is lower than the A100's, as Horace He's post argues it should be ("matmuls on
# the H100 are primarily not compute or bandwidth limited, they are power limited"). Not a
# measurement of any run in ``benchmarks/fidelity.py``: no row was used to choose it. What the
# ratio stands for is not a warm-up effect: ml-engineering's MAMF finder gained a 30-second
# warm-up in 2025 and its H100 figure barely moved (792.1 -> 794.5 TFLOP/s; A100 267.9 ->
# 271.2), so a GEMM-only loop is already at its own steady clock; what a training step adds is
# the power its communication, HBM traffic and other kernels draw beside the GEMMs.
# The V100 has no published sustained clock under training load and keeps the A100's ratio:
# an ASSUMPTION, to be replaced by a profile. A check, not a source: Glenn Lockwood's H100 page
# (https://glennklockwood.com/garden/processors/h100) lists TOP500's H100 and H200 systems at
# 55.0-59.0 TFLOP/s per GPU against the 66.9 FP64 matrix peak at 1980 MHz: HPL, a dense-GEMM
# stream without a training step's communication, holds 1628-1746 MHz if those are Rpeak
# counted at the sustained clock (NVIDIA's convention above), above the 1575 MHz of a GEMM
# stream overlapped with communication, as the extra power of the links would have it.
# A board run below its datasheet power limit (torchtitan's Grand Teton H100s at 500 W) is a
# cluster property, not a generation's: its peak FLOP/s is lowered by ``planner.power_limit``
# (``cluster_edits.with_power_limit``), and this ratio applies on top of it (ASSUMED: the
# same sustained fraction of the clock the limit allows).
SUSTAINED_CLOCK = {"A100": 1305 / 1410, "H100": 1575 / 1830}

GENERATIONS = {
    # V100-SXM2: 80 SMs (NVIDIA Tesla V100 GPU Architecture whitepaper, 2017, table 1). No
    # published MAMF measurement: we assume the A100 PCIe's 82.2% (ml-engineering MAMF table,
    # below) - an assumption, to be replaced by a profile. K overhead: CUTLASS's Volta tensor-op
    # GEMM is 2 stages x K tile 32 = 64 (cutlass/gemm/device/default_gemm_configuration.h, Sm70).
    # FlashAttention-2 does not run on Volta (its README: Ampere or newer); PyTorch's SDPA falls
    # back to the memory-efficient (xformers/CUTLASS) kernel. Its V100 throughput is not in the
    # sources we have: 40% forward, 30% backward of the fp16 peak is an ESTIMATE (below
    # FlashAttention-2 on A100, as FlashAttention-1 reached 25-40% there: FlashAttention-2
    # paper, section 1), to be replaced by a profile.
    "V100": GpuGeneration("V100", 80, 0.822, (6912, 16384, 2048), 64, 0.40, 0.30, SUSTAINED_CLOCK["A100"]),
    # A100-SXM4: 108 SMs (NVIDIA A100 Tensor Core GPU Architecture whitepaper, 2020, table 1).
    # MAMF 267.9 of 312 TFLOP/s = 85.9% at 6912x16384x2048, CUDA 12.1 (Stas Bekman,
    # "Machine Learning Engineering", compute/accelerator/README.md, "Maximum Achievable
    # Matmul FLOPS comparison table", https://github.com/stas00/ml-engineering). K overhead:
    # CUTLASS's SM80 bf16 GEMM default, 3 stages x K tile 64 = 192. FlashAttention-2 on A100:
    # forward up to 73% of peak (FlashAttention-2 paper, abstract and figure 4: "reaching
    # 50-73% of the theoretical maximum FLOPs/s"); backward ~ 60% (figure 4's backward panel,
    # ~ 185-190 TFLOP/s at head dim 128, 16k tokens).
    "A100": GpuGeneration("A100", 108, 0.859, (6912, 16384, 2048), 192, 0.73, 0.60, SUSTAINED_CLOCK["A100"]),
    # H100-SXM5: 132 SMs (NVIDIA H100 Tensor Core GPU Architecture whitepaper, 2022, table 2).
    # MAMF 792.1 of 989 TFLOP/s = 80.1% at 6144x17920x2816, CUDA 12.1 (same table). K
    # overhead: CUTLASS's SM90 warp-specialised GEMM, 4 stages x K tile 64 = 256. PyTorch's
    # flash backend is FlashAttention-2, which reaches ~ 35% of H100 peak forward and ~ 30%
    # backward (FlashAttention-3 paper, Shah et al. 2024, arXiv:2407.08608, figures 5-6:
    # FlashAttention-2 ~ 330-370 TFLOP/s forward, ~ 280-310 backward, head dim 128, 16k).
    "H100": GpuGeneration("H100", 132, 0.801, (6144, 17920, 2816), 256, 0.35, 0.30, SUSTAINED_CLOCK["H100"]),
    # H200-SXM: the same GH100 die, 132 SMs (NVIDIA H200 datasheet); its matmul measurement is
    # the GH200's (same die, HBM3e): 821.0 of 989 = 83.0% at 11264x19712x1536 (same table).
    "H200": GpuGeneration("H200", 132, 0.830, (11264, 19712, 1536), 256, 0.35, 0.30, SUSTAINED_CLOCK["H100"]),
}


# Export variants of a generation: the same die, SMs and tensor cores, with the chip-to-chip
# links cut (which the cluster's links price, not the kernels). The H800 SXM5 is a GH100 with
# 132 SMs and the H100 SXM5's dense tensor-core figures (NVIDIA H800 datasheet; DeepSeek-V3
# technical report, arXiv 2412.19437, section 3.1), its NVLink 400 GB/s instead of 900; the
# A800 an A100 with NVLink 400 GB/s instead of 600 (NVIDIA A800 datasheet). Its sustained clock
# under load is the reading ``SUSTAINED_CLOCK["H100"]`` was taken from (DeepGEMM#120 is an H800).
EXPORT_VARIANTS = {"H800": "H100", "A800": "A100"}


def generation_of(device: DeviceSpec) -> GpuGeneration | None:
    """The GPU generation named in ``device.name`` (e.g. "A100-SXM4-80GB" -> A100), or None
    for CPUs, unknown devices and devices with a measured calibration (which keep the
    roofline with their measured efficiencies)."""
    if device.calibration:
        return None
    name = device.name.upper()
    for key in ("H200", "H100", "A100", "V100"):
        if key in name:
            return GENERATIONS[key]
    for export_variant, die in EXPORT_VARIANTS.items():
        if export_variant in name:
            return GENERATIONS[die]
    return None


def tile_efficiency(rows: int, columns: int) -> float:
    """Relative efficiency of a ``rows x columns`` output tile (1.0 for the largest)."""
    def rising(reuse: float) -> float:
        return reuse / (reuse + TILE_REUSE_HALF)
    largest = max(TILES, key=lambda t: t[0] * t[1] / (t[0] + t[1]))
    return rising(rows * columns / (rows + columns)) / rising(largest[0] * largest[1] / sum(largest))


def _tile_cycles(batch: float, m: float, n: float, k: float, sms: int, k_overhead: int, tile) -> float:
    """Work-units (tile MACs at full speed over one SM) the GEMM takes with ``tile``."""
    rows, columns = tile
    tiles = math.ceil(batch) * math.ceil(m / rows) * math.ceil(n / columns)
    waves = math.ceil(tiles / sms)
    return waves * rows * columns * (k + k_overhead) / tile_efficiency(rows, columns)


def shape_efficiency(batch: float, m: float, n: float, k: float, sms: int, k_overhead: int) -> float:
    """Fraction of the ceiling that a (batch, m, n, k) GEMM reaches: useful MACs over the
    MACs-worth of time the best tile takes (tile, wave and K quantisation)."""
    useful = batch * m * n * k
    best = min(_tile_cycles(batch, m, n, k, sms, k_overhead, tile) for tile in TILES)
    return useful / (best * sms)


def matmul_time(batch: float, m: float, n: float, k: float, device: DeviceSpec, dtype: str,
                element_bytes: int, generation: GpuGeneration) -> float:
    """Seconds for ``batch`` GEMMs of (m x k) @ (k x n) on ``device`` (launch included)."""
    if min(batch, m, n, k) <= 0:
        return 0.0
    flops = 2.0 * batch * m * n * k
    efficiency = generation.matmul_efficiency(batch, m, n, k)
    compute = flops / (device.flops_for(dtype) * efficiency)
    moved = element_bytes * batch * (m * k + k * n + m * n)
    memory = moved / (device.memory_bandwidth * defaults.MEMORY_EFFICIENCY)
    return max(compute, memory) + defaults.KERNEL_OVERHEAD_S


def attention_efficiency(batch_heads: float, q_len: float, kv_len: float, head_dim: int, causal: bool,
                         generation: GpuGeneration, kernel: str = "flash-attention-2",
                         direction: str = "forward") -> float:
    """Fraction of the long-sequence FlashAttention throughput that this call reaches, for
    ``kernel``'s ``direction`` ("forward" or "backward"; they differ only when causal)."""
    sequence = kv_len / (kv_len + ATTENTION_SEQUENCE_HALF) * (16384 + ATTENTION_SEQUENCE_HALF) / 16384
    head = head_dim / (head_dim + ATTENTION_HEAD_DIM_HALF) / (128 / (128 + ATTENTION_HEAD_DIM_HALF))
    thread_blocks = math.ceil(batch_heads) * math.ceil(q_len / ATTENTION_BLOCK)
    waves = thread_blocks / (math.ceil(thread_blocks / generation.sms) * generation.sms)
    return min(1.0, sequence) * min(1.0, head) * causal_factor(q_len, kv_len, head_dim, causal, generation,
                                                               kernel, direction) * waves


def causal_factor(q_len: float, kv_len: float, head_dim: int, causal: bool, generation: GpuGeneration,
                  kernel: str, direction: str) -> float:
    """Causal over non-causal throughput of ``kernel`` (1.0 when not causal): the published
    ratio where one was read (``cost_model.causal_attention``), else the diagonal-block count:
    of n x n key/query blocks the kernel computes the n(n+1)/2 on or below the diagonal, where
    n(n)/2 are useful."""
    if not causal:
        return 1.0
    measured = causal_rate_factor(kernel, generation.name, kv_len, head_dim, direction)
    if measured is not None:
        return measured
    blocks_per_row = max(1.0, q_len / ATTENTION_BLOCK)
    return blocks_per_row / (blocks_per_row + 1)


def published_attention_slowdown(forward_tflops: float, backward_tflops: float,
                                 reading: tuple[int, int, int, bool], generation: GpuGeneration,
                                 peak: float, kernel: str) -> tuple[float, float]:
    """(forward, backward) time of ``kernel`` published at ``forward_tflops`` / ``backward_tflops``
    at the ``reading`` shape (batch x heads, sequence, head dim, causal) over the model's
    FlashAttention-2 fractions there with ``kernel``'s own causal factor (``causal_factor``),
    both at the loop's clock on a GPU of ``peak`` FLOP/s: so the model reproduces the published
    figures at the reading shape, and ``kernel``'s causal factor sets it elsewhere."""
    batch_heads, seq, head_dim, causal = reading
    ratios = []
    for direction, fraction, published in (("forward", generation.attention_forward, forward_tflops),
                                           ("backward", generation.attention_backward, backward_tflops)):
        shape = attention_efficiency(batch_heads, seq, seq, head_dim, causal, generation, kernel, direction)
        ratios.append(peak * fraction * shape / 1e12 / published)
    return ratios[0], ratios[1]


CUDNN_OVER_FLASH_ATTENTION_2_HOPPER = published_attention_slowdown(
    CUDNN_HOPPER_FORWARD_TFLOPS, CUDNN_HOPPER_BACKWARD_TFLOPS, CUDNN_HOPPER_READING, GENERATIONS["H100"],
    GH100_DENSE_16BIT_PEAK, "cudnn-fused-attention")
# (kernel, generation) pairs measured against FlashAttention-2 on that generation; the
# kernel's ``ATTENTION_KERNEL_SLOWDOWN`` entry holds elsewhere. The H200 is the same die, with
# the H100's attention fractions.
ATTENTION_KERNEL_SLOWDOWN_BY_GENERATION = {
    ("cudnn-fused-attention", "H100"): CUDNN_OVER_FLASH_ATTENTION_2_HOPPER,
    ("cudnn-fused-attention", "H200"): CUDNN_OVER_FLASH_ATTENTION_2_HOPPER,
}


def attention_kernel_slowdown(kernel: str, generation_name: str) -> tuple[float, float]:
    """(forward, backward) time of ``kernel`` over FlashAttention-2's on a GPU generation."""
    return ATTENTION_KERNEL_SLOWDOWN_BY_GENERATION.get((kernel, generation_name), ATTENTION_KERNEL_SLOWDOWN[kernel])


# Attention dropout inside the fused kernel (``dropout_p`` > 0: the kernel draws Philox random
# numbers for every attention weight in the forward and draws them again in the backward), as
# the time with dropout over the time without, forward and backward together, for the (kernel,
# generation) pairs where it was measured. cuDNN's fused attention on Hopper: Transformer
# Engine's ``DotProductAttention`` with the fused (cuDNN) backend forced, bf16, ``sbhd``
# layout, 16 heads of head dim 128, 4096 tokens in 4 sequences, forward + backward, median of
# 50 iterations after 20 warm-up ones, on an H200 (sm90, the GH100 die) with TE 2.15.0:
# 0.594 ms at p = 0.0 and 0.614 ms at p = 0.1, 1.034x (NVIDIA/TransformerEngine issue #3312,
# 2026-08-04, its table's last row). Two caveats, both stated, neither corrected: the
# measurement is a 2026 TE and cuDNN, not the mid-2024 ones of Megatron-Core r0.8's runs; and
# its sequences are short (fwd + bwd at ~100-200 TFLOP/s, far from the kernel's peak), so if the
# random numbers cost a fixed time per attention weight, the share dropout adds at 4,096-token
# sequences, where the kernel runs two to three times as fast, is larger (up to ~3x the 3.4%).
# Applied at any p > 0 (the measurement is Megatron's default p = 0.1). Everywhere else
# (FlashAttention-2, Triton, other generations) no measurement on that generation was found and
# dropout is not priced (the only others are Blackwell's: issue #3312's B300 sbhd 1.09x,
# flash-attention 2 on a GB200 1.05x in TE pull request #3313).
ATTENTION_DROPOUT_SLOWDOWN_BY_GENERATION = {
    ("cudnn-fused-attention", "H100"): 0.614 / 0.594,
    ("cudnn-fused-attention", "H200"): 0.614 / 0.594,
}


def attention_times(batch_heads: float, q_len: float, kv_len: float, head_dim: int, causal: bool,
                    device: DeviceSpec, dtype: str, generation: GpuGeneration,
                    dropout_p: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds of fused attention over ``batch_heads`` (batch x heads):
    FlashAttention-2 at the sustained clock, scaled by ``attention_kernel_slowdown`` for the
    device's ``attention_kernel`` and by ``attention_dropout_slowdown`` when the kernel drops
    attention weights with probability ``dropout_p``."""
    forward_flops = 4.0 * batch_heads * q_len * kv_len * head_dim * (0.5 if causal else 1.0)
    kernel = device.attention_kernel
    shape_forward, shape_backward = (
        attention_efficiency(batch_heads, q_len, kv_len, head_dim, causal, generation, kernel, direction)
        for direction in ("forward", "backward"))
    peak = device.flops_for(dtype)
    slow_forward, slow_backward = attention_kernel_slowdown(device.attention_kernel, generation.name)
    dropout = attention_dropout_slowdown(device.attention_kernel, generation.name, dropout_p)
    slow_forward, slow_backward = slow_forward * dropout, slow_backward * dropout
    peak *= generation.sustained_clock  # the papers' loops are short too (SUSTAINED_CLOCK)
    forward = slow_forward * forward_flops / (peak * generation.attention_forward * shape_forward)
    backward = slow_backward * ATTENTION_BACKWARD_TO_FORWARD * forward_flops / (
        peak * generation.attention_backward * shape_backward)
    return forward + defaults.KERNEL_OVERHEAD_S, backward + defaults.KERNEL_OVERHEAD_S


def _split(dims: list[float], fraction: float, order: list[int]) -> list[float]:
    """Divide the work of ``dims`` by 1/``fraction``: the dims in ``order`` shrink in turn,
    each down to 1 at most (data parallelism and micro-batches split samples first, tensor
    parallelism the rest)."""
    dims, left = list(dims), 1.0 / fraction
    for index in order:
        if left <= 1.0:
            break
        take = min(left, dims[index])
        dims[index] /= take
        left /= take
    if left > 1.0:
        dims[order[-1]] /= left
    return dims


def _matmul_shape(node: OpNode) -> tuple[list[int], list[int], int, int] | None:
    """(batch dims, row dims, n, k) of a matmul-like op's forward GEMM(s), or None: ``batch``
    independent GEMMs of (rows x k) @ (k x n), rows the product of the row dims."""
    metas = [m.shape for m in node.input_meta]
    op = node.op.rsplit(".", 1)[0]
    if op == "aten.linear" and len(metas) >= 2 and len(metas[1]) == 2 and len(metas[0]) >= 1:
        (n, k) = metas[1]
        return [], list(metas[0][:-1]) or [1], n, k
    if op == "aten.addmm" and len(metas) >= 3 and len(metas[1]) == 2 and len(metas[2]) == 2:
        (m, k), (_, n) = metas[1], metas[2]
        return [], [m], n, k
    if op in ("aten.mm", "aten.matmul") and len(metas) >= 2 and len(metas[0]) >= 1 and len(metas[1]) == 2:
        (k, n) = metas[1]
        return [], list(metas[0][:-1]) or [1], n, k
    if op in ("aten.bmm", "aten.matmul", "aten.baddbmm") and len(metas) >= 2:
        a, b = metas[-2], metas[-1]
        if len(a) >= 3 and len(b) >= 3:
            return list(a[:-2]), [a[-2]], b[-1], a[-1]
    return None


def matmul_op_times(node: OpNode, fraction: float, device: DeviceSpec, dtype: str, element_bytes: int,
                    generation: GpuGeneration) -> tuple[float, float] | None:
    """(forward, backward) of a matmul-like op doing ``fraction`` of its traced work, or None
    when its shape is not one the model reads.

    The traced shape is the global one; the rank's share shrinks the batch dims first, then
    the first row dim (samples: data parallelism and micro-batches split them), then the
    weight's larger dim (tensor parallelism), then the other row dims. Backward is two GEMMs: the
    input gradient (rows x n) @ (n x k) and the weight gradient (k x rows) @ (rows x n), and
    with a bias the reduction of its gradient (``cost_model.gradient_copies``)."""
    shape = _matmul_shape(node)
    if shape is None:
        return None
    batch_dims, row_dims, n, k = shape
    dims = [*batch_dims, *row_dims, n, k]
    first_row = len(batch_dims)
    weight_dim = len(dims) - 2 if n >= k else len(dims) - 1
    split_order = [*range(first_row + 1), weight_dim, *range(first_row + 1, len(dims) - 2)]
    dims = _split(dims, fraction, split_order)
    batch = math.prod(dims[:len(batch_dims)])
    rows = math.prod(dims[len(batch_dims):-2])
    n, k = dims[-2], dims[-1]
    forward = matmul_time(batch, rows, n, k, device, dtype, element_bytes, generation)
    backward = (matmul_time(batch, rows, k, n, device, dtype, element_bytes, generation)
                + matmul_time(batch, k, n, rows, device, dtype, element_bytes, generation))
    if bias_length(node):  # and the bias's gradient, a reduction over the rows
        backward += bias_gradient_time(batch * rows, n, element_bytes, device)
    return forward, backward


def attention_op_times(node: OpNode, fraction: float, device: DeviceSpec, dtype: str,
                       generation: GpuGeneration) -> tuple[float, float] | None:
    """(forward, backward) of a fused attention op doing ``fraction`` of its traced work.

    Causal when ``is_causal`` is set or the trace proved its mask causal
    (``OpNode.attention_mask_kind``): the kernel a real run takes, and the one graph programs
    call. A sliding-window mask runs as the explicit mask it is (PyTorch's fused kernels take no
    window), so it is priced as full attention."""
    op = node.op.rsplit(".", 1)[0]
    if len(node.input_meta) < 3 or len(node.input_meta[0].shape) != 4:
        return None
    batch, heads, q_len, head_dim = node.input_meta[0].shape
    kv_len = node.input_meta[1].shape[-2]
    index = CAUSAL_ARGUMENT.get(op)
    flagged = index is not None and len(node.attrs) > index and node.attrs[index] is True
    causal = flagged or is_causal_kind(node.attention_mask_kind)
    batch, heads = _split([batch, heads], fraction, [0, 1])
    return attention_times(batch * heads, q_len, kv_len, head_dim, causal, device, dtype, generation,
                           dropout_p=attention_dropout_p(node))


def attention_dropout_p(node: OpNode) -> float:
    """The ``dropout_p`` a traced fused attention op was called with (0.0 when not given)."""
    index = DROPOUT_ARGUMENT.get(node.op.rsplit(".", 1)[0])
    value = node.attrs[index] if index is not None and len(node.attrs) > index else 0.0
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def kernel_op_times(node: OpNode, fraction: float, device: DeviceSpec, dtype: str,
                    element_bytes: int) -> tuple[float, float] | None:
    """(forward, backward) seconds of a matmul or attention op by the shape-aware model, or
    None when the device is not a known GPU generation or the op is neither (the caller then
    uses the roofline, which for elementwise ops is the memory-bound kernel)."""
    generation = generation_of(device)
    if generation is None or dtype not in SIXTEEN_BIT:
        return None
    if node.op.startswith(ATTENTION_OPS):
        return attention_op_times(node, fraction, device, dtype, generation)
    if node.op.startswith(MATMUL_OPS):
        return matmul_op_times(node, fraction, device, dtype, element_bytes, generation)
    return None


def large_matmul_efficiency(device: DeviceSpec, dtype: str | None) -> float | None:
    """The fraction of peak the best-shaped 16-bit matmul sustains in training (MAMF at the
    sustained clock), for matmul work whose shape is unknown (roofline callers such as SUMMA and
    MoE experts outside expert parallelism, which ``cost_model.grouped_gemm`` prices by shape) on
    a known GPU generation; None elsewhere."""
    generation = generation_of(device)
    return None if generation is None or dtype not in SIXTEEN_BIT else generation.sustained_matmul_fraction
