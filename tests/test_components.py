"""``benchmarks/components.py``: the component table runs, and every row names its source."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.components import component_rows, main
from cost_model.gpu_kernels import generation_of, matmul_time
from planner.cluster import Cluster


def test_fast_table_has_a_sourced_row_per_component(capsys):
    main(["--fast"])
    printed = capsys.readouterr().out
    rows = component_rows(fast=True)
    assert {row.component for row in rows} == {"GEMM", "attention", "clock", "memory", "loss", "optimizer",
                                                    "collective"}
    for row in rows:
        assert row.source and row.published > 0 and row.predicted > 0
        assert row.source in printed  # each printed line carries its source
    assert "median |error|" in printed


def test_full_table_checks_gemms_against_measurements_no_constant_came_from():
    # A table of only the figures the constants were read from would check nothing.
    rows = component_rows()
    independent = [row for row in rows if not row.sets_constant]
    assert {row.component for row in independent} >= {"GEMM", "memory", "loss", "collective"}
    assert len({row.source for row in rows}) >= 8


def test_memory_row_is_the_streaming_rate_the_model_prices_by_hand():
    # A 1 GiB copy moves 2 GiB; H100 3.35e12 B/s x 0.913 (memory_kernels.STREAMING_EFFICIENCY,
    # read from Liger-Kernel's eager ReLU²) = 3.0586e12 B/s, plus one 5 us launch:
    # 2^31 B / (702.1e-6 + 5e-6 s) = 3036.9 GB/s, against the 2,903 measured (which, below the
    # 3,350 GB/s datasheet, counts read and written bytes): +4.6%. At the old 0.8: -8.3%.
    (row,) = [row for row in component_rows() if row.component == "memory" and row.case.startswith("copy")]
    moved = 2 * 2**30
    assert row.predicted == pytest.approx(moved / (moved / (3.35e12 * 0.913) + 5e-6) / 1e9)
    assert row.predicted == pytest.approx(3036.9, abs=0.1)
    assert row.error == pytest.approx(row.predicted / 2903.0 - 1) and not row.sets_constant


def test_rmsnorm_rows_price_hugging_faces_eight_kernels_by_kind_by_hand():
    # Hugging Face's LlamaRMSNorm forward on 2048 x 16384 bf16 (N = 33.55M elements) on A100
    # (2.039e12 B/s), each kernel its traced bytes at its kind's efficiency plus a 5 us launch:
    #   x.float()            cast, default 0.8:        (2 + 4) N = 201.33 MB -> 123.42 us
    #   .pow(2)              contiguous, 0.913:        (4 + 4) N = 268.44 MB -> 144.20 us
    #   .mean(-1)            reduction, default 0.8:    4 N + 4 x 2048       -> 82.30 us
    #   + eps, rsqrt         per row (2048 x 8 B each)                       -> ~0 us
    #   x * rsqrt(...)       broadcast, 0.539:        (4 + 4) N + 4 x 2048   -> 244.26 us
    #   .to(bfloat16)        cast, default 0.8:        (4 + 2) N             -> 123.42 us
    #   weight * x           broadcast, 0.539:        (2 + 4) N + 4 x 16384  -> 183.25 us
    # = 900.9 us + 8 x 5 us = 940.9 us: 33.55e6 / 940.9e-6 = 35.66 G elem/s against the 34.04
    # measured (0.9856 ms): +4.8%. At one 0.8 for all it was +19.9%; no RMSNorm row set a constant.
    n, rows, hidden = 2048 * 16384, 2048, 16384
    default, streaming, broadcast = 2.039e12 * 0.8, 2.039e12 * 0.913, 2.039e12 * 0.539
    seconds = (2 * 6 * n / default + 8 * n / streaming + (4 * n + 4 * rows) / default
               + 2 * 8 * rows / default + (8 * n + 4 * rows) / broadcast + (6 * n + 4 * hidden) / broadcast
               + 8 * 5e-6)
    (row,) = [row for row in component_rows() if row.case.startswith("RMSNorm fwd, 2048 x 16384")]
    assert row.predicted == pytest.approx(n / seconds / 1e9, rel=1e-4)
    assert row.predicted == pytest.approx(35.66, abs=0.01) and not row.sets_constant
    assert row.error == pytest.approx(35.66 / (n / 0.9856320023536682e-3 / 1e9) - 1, abs=1e-3)


def test_relu_squared_backward_row_by_its_gradient_formulas_by_hand():
    # Liger-Kernel's eager ReLU² backward on H100, 4096 x 16384 bf16 (N = 67.11M elements,
    # 2N = 134.2 MB a tensor), contiguous kernels at 3.35e12 x 0.913 = 3.0586e12 B/s: relu's
    # backward 1.5 x its forward's 4N = 6N B, square's pow_backward 3.5 x 4N = 14N B (copy,
    # multiply by 2, multiply by the gradient): 20N = 1342.2 MB / 3.0586e12 = 438.8 us, plus one
    # launch each, 448.8 us, against 452.7 us measured: +0.9%. With square's backward at twice
    # its forward's bytes (the default before) it was 317.2 us, +42.7%.
    n = 4096 * 16384
    seconds = 20 * n / (3.35e12 * 0.913) + 2 * 5e-6
    (row,) = [row for row in component_rows() if row.case.startswith("ReLU² bwd")]
    assert row.predicted == pytest.approx(n / seconds / 1e9)
    assert seconds == pytest.approx(448.8e-6, rel=1e-3)
    assert row.error == pytest.approx(0.4527e-3 / seconds - 1) and not row.sets_constant


def test_each_memory_kernel_constant_is_its_rows_measured_rate():
    # The rows the constants were read from come out at their published figure (within the
    # rounding of the constant), and every other memory row is a check.
    rows = [row for row in component_rows() if row.component == "memory"]
    setting = {row.case for row in rows if row.sets_constant}
    assert setting == {"ReLU² fwd, 4096 x 16384 bf16, 2 kernels", "LayerNorm fwd, 4096 x 16384 fp32, 1 kernel",
                       "SwiGLU over chunk views fwd, 8192 x 32768 bf16"}
    for row in rows:
        if row.sets_constant:
            assert abs(row.error) < 0.002, row.case
    assert len(rows) - len(setting) >= 7


def test_loss_rows_price_the_soft_capped_cross_entropy_by_hand():
    # Gemma 2 shapes on A100: 8192 x 256000 = 2^21 x 1000 bf16 logits. Forward: the classifier
    # GEMM (the shape model), three soft-cap kernels (divide, tanh, multiply by a constant: each
    # contiguous, 2.039e12 x 0.913 = 1.8616e12 B/s, memory_kernels.STREAMING_EFFICIENCY)
    # reading and writing 2 bytes per logit (4 B), and cross entropy's 22 B per logit over 3
    # kernels (the fp32 cast, log_softmax's three reads and a write, nll_loss) at the default
    # 2.039e12 x 0.8 = 1.6312e12 B/s.
    device = Cluster.preset("dgx-a100-80g").device_of(0)
    logits = 8192 * 256000
    stream, contiguous = 2.039e12 * 0.8, 2.039e12 * 0.913
    gemm = matmul_time(1, 8192, 256000, 2304, device, "bfloat16", 2, generation_of(device))
    forward = gemm + 3 * (4 * logits / contiguous + 5e-6) + 22 * logits / stream + 3 * 5e-6
    (row, _) = [row for row in component_rows() if row.component == "loss"]
    assert row.predicted == pytest.approx(logits / 1e9 / forward)
    assert row.published == pytest.approx(logits / 1e9 / 81.9e-3)


def test_power_limit_line_prices_the_mamf_gemm_at_the_capped_peak():
    from benchmarks.components import power_limit_lines
    # By hand: peak at 500 W = 989.4 x 0.90335 = 893.77 TFLOP/s (tests/test_power_limit.py);
    # sustained MAMF ceiling 893.77 x 0.801 x 1575/1830 = 616.15 TFLOP/s (the H100's sustained
    # clock, assumed to hold the same fraction of the clock the limit allows); the
    # 6144x17920x2816 GEMM (620.086 GFLOP) takes 620.086e9 / 616.15e12 = 1006.4 us + 5 us
    # launch = 1011.4 us, 620.086e9 / 1011.4e-6 = 613.1 TFLOP/s.
    (line,) = power_limit_lines(500.0)
    assert "peak 893.8 TFLOP/s" in line and "835.5 at 400 W, 989.4 at 700 W" in line
    assert "6144x17920x2816 GEMM 613.1 TFLOP/s" in line


def test_clock_rows_are_the_sustained_ratio_times_the_datasheet_clock():
    # By hand: A100 1305/1410 x 1410 = 1305 MHz against NVIDIA's HPL clock (0.0%); H100
    # 1575/1830 x 1830 = 1575 MHz against DeepGEMM#120's reading (0.0%, the constant's source);
    # the H200 (same die, same ratio) 1575 MHz against TileOPs' 1500 MHz target: +5.0%.
    rows = {row.preset: row for row in component_rows() if row.component == "clock"}
    assert rows["A100"].predicted == pytest.approx(1305.0) and rows["A100"].sets_constant
    assert rows["H100"].predicted == pytest.approx(1575.0) and rows["H100"].sets_constant
    assert rows["H200"].predicted == pytest.approx(1575.0) and not rows["H200"].sets_constant
    assert rows["H200"].error == pytest.approx(1575 / 1500 - 1)


def test_cudnn_attention_rows_are_the_models_time_ratio_against_transformer_engines_table():
    # The model prices cuDNN's kernel time on H100 at 0.53122 of FlashAttention-2's forward and
    # 0.55571 backward without the mask (gpu_kernels.CUDNN_OVER_FLASH_ATTENTION_2_HOPPER, from
    # cuDNN's published speed); with the mask each kernel takes its own causal factor, so the
    # ratio to FlashAttention-2's causal time is 0.53122 x FA2's factor / cuDNN's forward and
    # 0.55571 x FA2's / cuDNN's backward. FlashAttention-2's (its forward's, FA3 paper fig. 5,
    # for both directions): 298 / 362 at 2k, 333 / 370 at 8k. cuDNN's forward (fig. 5): 484 /
    # 617 at 2k, 529 / 600 at 8k; backward (cudnn-frontend, H200): 443.6 / 517.3 held below 4k,
    # at 8k halfway in log2(seq) between that and 497.7 / 538.5 at 16k: 0.890882. Launches
    # (2 x 5 us) unchanged: the speed-up is (F + B + 10 us) / (f F + b B + 10 us).
    from cost_model.gpu_kernels import attention_times
    device = Cluster.preset("dgx-h100").device_of(0)
    rows = [row for row in component_rows() if row.case.startswith("cuDNN speed-up")]
    assert [row.published for row in rows] == pytest.approx([0.0858 / 0.0638, 0.7496 / 0.5415, 19.0716 / 12.0122])
    assert not any(row.sets_constant for row in rows)
    multipliers = [(0.53122, 0.55571),
                   (0.53122 * (298 / 362) / (484 / 617), 0.55571 * (298 / 362) / (443.6 / 517.3)),
                   (0.53122 * (333 / 370) / (529 / 600), 0.55571 * (333 / 370) / 0.890882)]
    for row, (heads, seq, head_dim, causal), (f, b) in zip(rows, [(32, 512, 64, False), (32, 2048, 128, True),
                                                                  (64, 8192, 128, True)], multipliers):
        forward, backward = (time - 5e-6 for time in attention_times(heads, seq, seq, head_dim, causal, device,
                                                                     "bfloat16", generation_of(device)))
        assert row.predicted == pytest.approx((forward + backward + 10e-6) / (f * forward + b * backward + 10e-6),
                                              rel=1e-4)
    # With cuDNN exact at its published non-causal speed and the model's FlashAttention-2 on
    # H100 below figure 5's at 4k (the fraction 0.35 read at 16k), the PCIe notebook's ratios
    # are overstated: 8k row +13.1% (+1.1% with the diagonal-block factor), 2k +32.1% (+14.8%).
    assert rows[2].error == pytest.approx(0.131, abs=0.002)
    assert rows[1].error == pytest.approx(0.321, abs=0.002)


def test_cudnn_speed_rows_by_hand():
    # The reading shape on the dgx-h100 preset: 4 x 16 heads x 4096 x d128, causal. Forward
    # 274.878 GFLOP at the published 518 TFLOP/s x the sustained clock 0.860656 = 445.82e12
    # -> 616.57 us, + 5 us launch = 621.57 us: 442.23 TFLOP/s (-14.6%). Backward 2.5 x that at
    # 427.907 x 0.860656 = 368.28e12 -> 1865.95 us + 5 us: 367.30 TFLOP/s against the H200's
    # 443.6 (-17.2%). At the loop's clock (no sustained clock) the forward is 518 less its launch:
    # 274.878e9 / (530.65 + 5 us) = 513.17 TFLOP/s (-0.9%).
    from benchmarks.components import cudnn_loop_clock_lines, cudnn_speed
    rows = {(row.preset, row.case): row for row in component_rows()}
    forward = rows[("dgx-h100", "cuDNN 64 heads x 4096 x d128 causal fwd")]
    backward = rows[("h200", "cuDNN 64 heads x 4096 x d128 causal bwd")]
    flops = 4 * 64 * 4096**2 * 128 / 2
    assert forward.sets_constant and backward.sets_constant
    assert forward.predicted == pytest.approx(flops / (flops / (518e12 * 1575 / 1830) + 5e-6) / 1e12, rel=1e-4)
    assert forward.predicted == pytest.approx(442.23, abs=0.05)
    assert backward.predicted == pytest.approx(2.5 * flops / (2.5 * flops / (427.907e12 * 1575 / 1830) + 5e-6) / 1e12,
                                               rel=1e-4)
    assert backward.predicted == pytest.approx(367.30, abs=0.05)
    assert cudnn_speed("dgx-h100", 64, 4096, 128, True, "fwd", sustained=False) == pytest.approx(513.17, abs=0.05)
    assert "published  518.0  model at the loop's clock  513.2 TFLOP/s  -0.9%" in cudnn_loop_clock_lines()[0]
    # An independent check: the paper's backward without the mask at 16k (16 heads x 16384 x
    # d128, 516 TFLOP/s). With cuDNN's own causal factor (443.6 / 517.3 at the reading) the
    # model without the mask is within 0.3% of it at the loop's clock (it was 11.3% below with
    # the 32/33 diagonal-block factor), so in a step it is the sustained clock's 13.9% below,
    # less the launch: -13.6%.
    free = rows[("dgx-h100", "cuDNN 16 heads x 16384 x d128 bwd")]
    assert not free.sets_constant and free.published == 516.0 and free.error == pytest.approx(-0.1365, abs=5e-4)
    assert "published  516.0  model at the loop's clock  517.7 TFLOP/s  +0.3%" in cudnn_loop_clock_lines()[6]


def test_optimizer_row_is_foreach_minus_fused_by_hand():
    # Llama 3 8B over 8 A100s: 8.03e9 / 8 = 1.00375e9 elements per GPU, 16 bytes each of fp32
    # weight, gradient and two states. Foreach streams 20 accesses of 4 bytes per element at
    # the 0.304 of 2.039e12 B/s read from this very measurement (compute.
    # FOREACH_ADAMW_MEMORY_EFFICIENCY): 80.3e9 B / 6.199e11 B/s = 129.5 ms, plus 8 kernels on
    # each of 48 chunks of 320 x 65,536 elements, 384 x 5 us = 1.92 ms; fused 7 accesses at
    # 0.8: 17.23 ms + 48 x 5 us: 114.0 ms more. Published: 8192 / 2631 - 8192 / 2731 = 114.0 ms
    # more (at 0.8 for both, foreach's extra was 33.68 ms: under a third).
    (row,) = [row for row in component_rows() if row.component == "optimizer"]
    elements = 8.03e9 / 8
    foreach = elements * 20 * 4 / (2.039e12 * 0.304) + 384 * 5e-6
    fused = elements * 7 * 4 / (2.039e12 * 0.8) + 48 * 5e-6
    assert foreach - fused == pytest.approx(114.1e-3, rel=1e-3)
    assert row.predicted == pytest.approx(1 / (foreach - fused))
    assert row.published == pytest.approx(1 / (8192 / 2631 - 8192 / 2731))
    assert 1 / row.published == pytest.approx(0.1140, rel=1e-3)
    assert row.sets_constant and abs(row.error) < 0.01  # the constant's source, not a check


def test_layer_shape_gemm_row_is_the_shape_model_by_hand():
    # A100 (108 SMs, K overhead 192), the cookbook's attention-out GEMM 8192 x 4096 x 4096.
    # The MAMF shape 6912 x 16384 x 2048 in 256 x 128 tiles: 27 x 128 = 3456 tiles, exactly 32
    # waves, so its shape efficiency is K / (K + 192) = 2048 / 2240 = 0.914286. The layer shape:
    # 32 x 32 = 1024 tiles in ceil(1024 / 108) = 10 waves, 1024 / 1080 x 4096 / 4288 = 0.905693
    # (128 x 128 tiles: 2048 in 19 waves x 0.91667 tile efficiency = 0.8739, slower). Ceiling:
    # MAMF 0.859 x sustained clock 1305 / 1410 = 0.795032; times 0.905693 / 0.914286 = 0.787560.
    # 2 x 8192 x 4096 x 4096 = 2.748779e11 FLOP / (312e12 x 0.787560) = 1.118669 ms + 5 us
    # launch = 1.123669 ms: 244.62 TFLOP/s against the 234.852 published, +4.2%.
    rows = [row for row in component_rows() if row.component == "GEMM" and row.case.startswith("8192x4096x4096")]
    (row,) = rows
    efficiency = 0.859 * 1305 / 1410 * (1024 / 1080 * 4096 / 4288) / (2048 / 2240)
    seconds = 2 * 8192 * 4096**2 / (312e12 * efficiency) + 5e-6
    assert row.predicted == pytest.approx(2 * 8192 * 4096**2 / seconds / 1e12, rel=1e-6)
    assert row.predicted == pytest.approx(244.62, abs=0.01)
    assert row.error == pytest.approx(244.62 / 234.852 - 1, abs=1e-4)
    assert not row.sets_constant


def test_shape_model_lines_remove_only_the_sustained_clock():
    # The one-wave H100 shape 2048 x 2048 x 13312: 16 x 8 = 128 tiles of 128 x 256 on 132 SMs,
    # one wave, 128 / 132 x 13312 / 13568 = 0.951418 of the ceiling, above the MAMF shape's
    # (6144 x 17920 x 2816: 3360 tiles in 26 waves, 3360 / 3432 x 2816 / 3072 = 0.897436), so
    # capped at MAMF itself: 0.801 of 989.4 TFLOP/s at the loop's clock. 2 x 2048^2 x 13312 =
    # 1.116691e11 FLOP / 792.51e12 = 140.905 us + 5 us launch = 145.905 us: 765.4 TFLOP/s,
    # -3.7% against the 794.5 published. In a step (x 1575 / 1830): 168.72 us, 661.9 TFLOP/s.
    from benchmarks.components import shape_model_lines
    (line,) = [line for line in shape_model_lines() if "2048x2048x13312" in line]
    flops = 2 * 2048**2 * 13312
    assert f"{flops / (flops / (989.4e12 * 0.801) + 5e-6) / 1e12:>6.1f} TFLOP/s" in line
    assert "765.4 TFLOP/s" in line and "-3.7%" in line
    (row,) = [row for row in component_rows() if row.case.startswith("2048x2048x13312")]
    assert row.predicted == pytest.approx(flops / (flops / (989.4e12 * 0.801 * 1575 / 1830) + 5e-6) / 1e12)


def test_tilelang_k_sweep_row_by_hand():
    # TileLang's 8192x8192x2048 on the dgx-h100 preset. Tiles of 256 x 128: 32 x 64 = 2048
    # tiles in ceil(2048 / 132) = 16 waves, each tile 2048 + 256 K iterations: shape efficiency
    # 8192^2 x 2048 / (16 x 256 x 128 x 2304 x 132) = 0.86197; at MAMF's shape 6144x17920x2816,
    # 24 x 140 = 3360 tiles in 26 waves of 2816 + 256: 6144 x 17920 x 2816 / (26 x 32768 x 3072
    # x 132) = 0.89735. So 0.801 x (1575 / 1830) x 0.86197 / 0.89735 of 989.4 TFLOP/s =
    # 655.2 TFLOP/s; the GEMM's 274.88 GFLOP take 419.5 us, plus a 5 us launch: 647.4 TFLOP/s.
    row = next(row for row in component_rows() if row.case == "8192x8192x2048 bf16")
    efficiency = 0.801 * (1575 / 1830) * (8192**2 * 2048 / (16 * 256 * 128 * 2304 * 132)) / (
        6144 * 17920 * 2816 / (26 * 32768 * 3072 * 132))
    flops = 2 * 8192**2 * 2048
    seconds = flops / (989.4e12 * efficiency) + 5e-6
    assert row.published == 705.0 and not row.sets_constant
    assert row.predicted == pytest.approx(flops / seconds / 1e12, rel=1e-3)
    assert row.predicted == pytest.approx(647.4, abs=0.1)


def test_xla_width_2048_gemm_row_by_hand():
    # XLA's sm_90 table, 4 x (4096 x 2048) @ (2048 x 2048): 4 x 16 x 16 = 1024 tiles of 256 x 128
    # in ceil(1024 / 132) = 8 waves, each 2048 + 256 K iterations: shape efficiency 4 x 4096 x
    # 2048^2 / (8 x 256 x 128 x 2304 x 132) = 0.86197, the TileLang 8192x8192x2048 row's (same
    # tiles and waves), so 655.2 TFLOP/s in a step; 2 x 4 x 4096 x 2048^2 = 137.44 GFLOP take
    # 209.77 us, + 5 us launch = 214.77 us: 639.9 TFLOP/s against the 759.3 measured.
    row = next(row for row in component_rows() if row.case == "4 x 4096x2048x2048 bf16")
    efficiency = 0.801 * (1575 / 1830) * (4 * 4096 * 2048**2 / (8 * 256 * 128 * 2304 * 132)) / (
        6144 * 17920 * 2816 / (26 * 32768 * 3072 * 132))
    flops = 2 * 4 * 4096 * 2048**2
    assert row.published == 759.3 and not row.sets_constant
    assert row.predicted == pytest.approx(flops / (flops / (989.4e12 * efficiency) + 5e-6) / 1e12, rel=1e-6)
    assert row.predicted == pytest.approx(639.9, abs=0.1)


def test_cudnn_dropout_row_is_the_kernel_time_ratio_by_hand():
    # Dropout multiplies cuDNN's kernel times by 0.614 / 0.594 = 1.03367 and leaves the two 5 us
    # launches: (1.03367 K + 10 us) / (K + 10 us) for the kernel time K without dropout.
    from cost_model.gpu_kernels import attention_times
    device = dataclasses.replace(Cluster.preset("h200").device_of(0), attention_kernel="cudnn-fused-attention")
    (row,) = [row for row in component_rows() if row.case.startswith("cuDNN dropout")]
    kernels = sum(attention_times(64, 1024, 1024, 128, True, device, "bfloat16", generation_of(device))) - 10e-6
    assert row.sets_constant and row.published == pytest.approx(0.614 / 0.594)
    assert row.predicted == pytest.approx((0.614 / 0.594 * kernels + 10e-6) / (kernels + 10e-6))


def test_cudnn_forward_row_by_hand():
    # cuDNN forward on the dgx-h100 preset, 4 x 16 heads x 4096 x d128, no causal mask: 4 x 64 x
    # 4096^2 x 128 = 549.76 GFLOP. FlashAttention-2's fraction 0.35 of 989.4 TFLOP/s at the
    # sustained clock 0.86066, times the shape: sequence 4096 / 4306 x 16594 / 16384 = 0.963425,
    # 64 x 32 = 2048 thread blocks on 16 waves of 132 = 0.969697: 278.44 TFLOP/s, 1.97443 ms;
    # cuDNN's forward ratio 0.53122 (``gpu_kernels.CUDNN_OVER_FLASH_ATTENTION_2_HOPPER``, from
    # its published causal forward 518 over its causal factor 518 / 609) of that is 1.04886
    # ms, + 5 us launch = 1.05386 ms: 521.7 TFLOP/s against the paper's 609, i.e. 609 x the
    # sustained clock less the launch (457.8 with the diagonal-block factor).
    (row,) = [row for row in component_rows()
              if row.case == "cuDNN 64 heads x 4096 x d128 fwd" and row.preset == "dgx-h100"]
    flops = 4 * 64 * 4096**2 * 128
    shape = (4096 / 4306) * (16594 / 16384) * (2048 / 2112)
    seconds = 0.53122 * flops / (989.4e12 * (1575 / 1830) * 0.35 * shape) + 5e-6
    assert row.published == 609.0 and not row.sets_constant
    assert row.predicted == pytest.approx(flops / seconds / 1e12, rel=1e-4)
    assert row.predicted == pytest.approx(flops / (flops / (609e12 * 1575 / 1830) + 5e-6) / 1e12, rel=1e-4)
    assert row.predicted == pytest.approx(521.7, abs=0.1)


def test_flash2_causal_rows_by_hand():
    # FlashAttention-2 on the dgx-a100-80g preset, 4 x 16 heads x 4096 x d128, causal, forward +
    # backward: forward FLOPs 4 x 64 x 4096^2 x 128 / 2 = 274.878e9. Shape: sequence 4096 /
    # 4306 x 16594 / 16384 = 0.963423; 64 x 32 = 2048 thread blocks on 19 waves of 108 =
    # 0.998051; causal 173 / 196 = 0.882653 (FlashAttention-2 paper fig. 4, the row itself):
    # 0.848711. At 312e12 x 1305/1410 = 288.77e12: forward 274.878e9 / (288.77e12 x 0.73 x
    # 0.848711) = 1.53642 ms + 5 us, backward 2.5 x that FLOP count at 0.60 = 4.67329 ms + 5 us;
    # 3.5 x 274.878e9 / 6.21971 ms = 154.68 TFLOP/s against 173 (-10.6%), the same error as the
    # row without the mask (175.4 against 196, -10.5%): the causal factor is the figure's ratio.
    rows = {(row.preset, row.case): row for row in component_rows()}
    causal = rows[("dgx-a100-80g", "FA2 64 heads x 4096 x d128 causal fwd+bwd")]
    full = rows[("dgx-a100-80g", "FA2 64 heads x 4096 x d128 fwd+bwd")]
    assert causal.published == 173.0 and full.published == 196.0
    assert causal.predicted == pytest.approx(154.68, abs=0.01)
    assert causal.error == pytest.approx(full.error, abs=0.002)
    # On H100 the forward at 4k: 319 with the mask, 368 without (FlashAttention-3 paper fig. 5);
    # the model's ratio of the two rows is 319 / 368 up to the 5 us launches.
    h100_causal = rows[("dgx-h100", "FA2 64 heads x 4096 x d128 causal fwd")]
    h100_full = rows[("dgx-h100", "FA2 64 heads x 4096 x d128 fwd")]
    assert h100_causal.predicted / h100_full.predicted == pytest.approx(319 / 368, rel=0.01)
