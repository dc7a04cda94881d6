"""The shape-aware GPU kernel model (``cost_model.gpu_kernels``) against hand-worked cases.

Each expected figure is worked out in the test from the model's definition (tiles, waves, K
overhead, the MAMF measurement, FlashAttention's FLOPs and efficiencies) and the A100's
datasheet numbers: 108 SMs, 312e12 bf16 FLOP/s, 2.039e12 B/s. Tensor-core work runs at the
clock the A100 sustains under its 400 W cap, 1305 of the 1410 MHz the benchmarks ran at.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cost_model import defaults, gpu_kernels
from cost_model.causal_attention import causal_rate_factor
from cost_model.compute import op_times
from cost_model.gpu_kernels import GENERATIONS, generation_of, matmul_time, shape_efficiency, tile_efficiency
from planner.cluster import Cluster
from planner.graph import OpNode, TensorMeta

A100_DEVICE = Cluster.preset("dgx-a100-80g").device_of(0)
A100 = GENERATIONS["A100"]
BF16 = torch.bfloat16
OVERHEAD = defaults.KERNEL_OVERHEAD_S
SUSTAINED = 1305 / 1410  # A100's sustained over its boost clock (gpu_kernels.SUSTAINED_CLOCK)
# H100's: the 1575 MHz a 700 W GH100 board holds under GEMMs overlapped with communication,
# over the 1830 MHz its 989.4 TFLOP/s datasheet peak is counted at (528 x 1024 x 1.83e9).
H100_SUSTAINED = 1575 / 1830


def test_generation_from_device_name():
    assert generation_of(A100_DEVICE) is A100
    assert generation_of(Cluster.preset("dgx-h100").device_of(0)).name == "H100"
    assert generation_of(Cluster.preset("p3.16xlarge").device_of(0)).name == "V100"
    # CPUs and calibrated devices keep the roofline.
    assert generation_of(Cluster.preset("cpu").device_of(0)) is None
    assert generation_of(dataclasses.replace(A100_DEVICE, matmul_efficiency=0.7)) is None


def test_export_variants_are_priced_as_their_die():
    """DeepSeek-V3's H800s are GH100s: before, the name matched no generation and their
    GEMMs kept the roofline's one efficiency, so the hgx-h800 preset priced a layer's GEMM
    differently from the same GEMM on dgx-h100, whose peak and HBM are the same."""
    h800 = Cluster.preset("hgx-h800").device_of(0)
    h100 = Cluster.preset("dgx-h100").device_of(0)
    assert generation_of(h800) is GENERATIONS["H100"]
    assert generation_of(dataclasses.replace(A100_DEVICE, name="A800-SXM4-80GB")) is GENERATIONS["A100"]
    shape = (1, 8192, 7168, 2048)
    assert matmul_time(*shape, h800, "bfloat16", 2, generation_of(h800)) == matmul_time(
        *shape, h100, "bfloat16", 2, generation_of(h100))


def test_tile_efficiency_follows_data_reuse():
    # reuse = tm*tn/(tm+tn); efficiency = reuse/(reuse+32), relative to 256x128 (reuse 85.33).
    largest = (256 * 128 / 384) / (256 * 128 / 384 + 32)  # 0.72727
    assert tile_efficiency(256, 128) == pytest.approx(1.0)
    assert tile_efficiency(128, 128) == pytest.approx((64 / 96) / largest)  # 0.9167
    assert tile_efficiency(64, 64) == pytest.approx((32 / 64) / largest)  # 0.6875


def test_mamf_shape_reproduces_the_measurement():
    # 6912 x 16384 x 2048 on 108 SMs with 256x128 tiles: 27 x 128 = 3456 tiles = 32 full
    # waves; each tile costs K + 192 = 2240 K-steps for 2048 useful: 2048 / 2240 = 0.9143.
    assert shape_efficiency(1, 6912, 16384, 2048, 108, 192) == pytest.approx(2048 / 2240)
    # There the model gives the measurement at the sustained clock: 0.859 x 0.9255 = 0.795.
    assert A100.matmul_efficiency(1, 6912, 16384, 2048) == pytest.approx(0.859 * SUSTAINED)
    assert A100.matmul_efficiency(1, 6912, 16384, 2048) == pytest.approx(0.7950, rel=1e-3)
    # No shape beats the measured best: a longer K is capped at the measurement.
    assert A100.matmul_efficiency(1, 6912, 16384, 8192) == pytest.approx(0.859 * SUSTAINED)


def test_wave_quantisation():
    k = 4096
    # 108 tiles of 256x128 fill the 108 SMs once: only the K overhead is lost.
    one_wave = shape_efficiency(1, 256 * 108, 128, k, 108, 192)
    assert one_wave == pytest.approx(k / (k + 192))  # 0.9552
    # 109 rows of 256-row tiles: 256x128 tiles need 2 waves (109/216 useful). The fastest
    # tile is 64x128: 436 x 1 = 436 tiles = 5 waves (of 540 slots) of tiles at efficiency
    # (42.67/74.67)/0.72727 = 0.7857, against 128x128 (218 tiles, 3 waves, 0.9167) and 64x64
    # (872 tiles, 9 waves, 0.6875): per SM 5 x 8192 / 0.7857 < 3 x 16384 / 0.9167 < 2 x 32768.
    useful = 256 * 109 * 128 * k
    two_waves_big = 2 * 108 * 256 * 128 * (k + 192)
    five_waves_narrow = 5 * 108 * 64 * 128 * (k + 192) / tile_efficiency(64, 128)
    assert tile_efficiency(64, 128) == pytest.approx((64 * 128 / 192) / (64 * 128 / 192 + 32) / 0.72727, rel=1e-4)
    assert five_waves_narrow < two_waves_big
    assert shape_efficiency(1, 256 * 109, 128, k, 108, 192) == pytest.approx(useful / five_waves_narrow)
    assert useful / five_waves_narrow == pytest.approx(0.6060, rel=1e-3)  # one row past a wave costs 37%


def test_compute_bound_matmul_time():
    # MAMF shape, bf16: 2 x 6912 x 16384 x 2048 = 4.638e11 FLOPs at 0.859 x 0.9255 x 312e12
    # = 1.8698 ms: the 1.7306 ms the benchmark measured, at the sustained clock.
    flops = 2 * 6912 * 16384 * 2048
    expected = flops / (312e12 * 0.859 * SUSTAINED) + OVERHEAD
    assert matmul_time(1, 6912, 16384, 2048, A100_DEVICE, "bfloat16", 2, A100) == pytest.approx(expected)
    assert expected == pytest.approx(1.8748e-3, rel=1e-3)


def test_matrix_vector_product_is_memory_bound():
    # One row times 8192 x 8192 in bf16: 2 x (8192 + 8192^2 + 8192) bytes = 134.25 MB at
    # 0.8 x 2.039e12 B/s = 82.3 µs; its 1.3e8 FLOPs on one wave of 64x64 tiles take less.
    moved = 2 * (8192 + 8192 * 8192 + 8192)
    expected = moved / (2.039e12 * defaults.MEMORY_EFFICIENCY) + OVERHEAD
    assert matmul_time(1, 1, 8192, 8192, A100_DEVICE, "bfloat16", 2, A100) == pytest.approx(expected)
    assert expected == pytest.approx(87.3e-6, rel=1e-3)


def attention_node(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> OpNode:
    q = TensorMeta((batch, heads, seq, head_dim), BF16)
    return OpNode(
        name="sdpa", op="aten.scaled_dot_product_attention.default", inputs=("q", "k", "v"),
        input_meta=(q, q, q), output_meta=(q,), attrs=(None, None, None, None, 0.0, causal),
        flops=4 * batch * heads * seq * seq * head_dim, bytes_moved=4 * q.nbytes,
    )


def test_causal_flash_attention():
    # B=1, H=32, S=4096, D=128, causal, on A100. Forward FLOPs 4 x 32 x 4096^2 x 128 / 2.
    forward_flops = 4 * 32 * 4096**2 * 128 / 2  # 1.374e11
    sequence = 4096 / (4096 + 210) * (16384 + 210) / 16384  # 0.96343
    # FlashAttention-2 on A100 runs causal at 173 TFLOP/s against 196 without the mask at 4k,
    # head dim 128 (FlashAttention-2 paper, fig. 4, fwd+bwd): 0.88265, forward and backward
    # alike - below the 32/33 = 0.9697 of the diagonal blocks alone.
    causal = 173 / 196
    waves = 1024 / (10 * 108)  # 32 heads x 32 blocks = 1024 thread blocks over 10 waves
    shape = sequence * causal * waves  # 0.80628
    assert shape == pytest.approx(0.80628, abs=1e-5)
    forward, backward = op_times(attention_node(1, 32, 4096, 128, True), 1.0, A100_DEVICE, "bf16")
    peak = 312e12 * SUSTAINED
    assert forward == pytest.approx(forward_flops / (peak * 0.73 * shape) + OVERHEAD)
    assert backward == pytest.approx(2.5 * forward_flops / (peak * 0.60 * shape) + OVERHEAD)
    # 1.374e11 / (312e12 x 0.92553 x 0.73 x 0.80628) = 0.80864 ms, + 5 us (0.7410 ms with 32/33)
    assert forward == pytest.approx(0.81364e-3, rel=1e-4)
    # Without the mask the kernel does twice the FLOPs at the full rate.
    full, _ = op_times(attention_node(1, 32, 4096, 128, False), 1.0, A100_DEVICE, "bf16")
    assert full == pytest.approx(2 * forward_flops / (peak * 0.73 * sequence * waves) + OVERHEAD)


def test_causal_factor_is_read_from_each_kernels_published_bars():
    # Causal over non-causal TFLOP/s, per kernel, generation and direction:
    # FlashAttention-2 on H100 (FlashAttention-3 paper, fig. 5): 319 / 368 at 4k, head dim 128;
    # between readings linear in log2(seq): 3k lies 0.58496 of the way from 2k (298 / 362 =
    # 0.82320) to 4k (0.86685): 0.84874.
    assert causal_rate_factor("flash-attention-2", "H100", 4096, 128, "forward") == pytest.approx(319 / 368)
    assert causal_rate_factor("flash-attention-2", "H100", 3072, 128, "forward") == pytest.approx(0.84874, abs=1e-5)
    # cuDNN on Hopper: forward 518 / 609 (fig. 5), backward 443.6 / 517.3 (cudnn-frontend, H200).
    assert causal_rate_factor("cudnn-fused-attention", "H100", 4096, 128, "forward") == pytest.approx(518 / 609)
    assert causal_rate_factor("cudnn-fused-attention", "H200", 4096, 128, "backward") == pytest.approx(443.6 / 517.3)
    # Head dim 96 is halfway between 64 (284 / 321 = 0.88474) and 128 (0.86685): 0.87579.
    assert causal_rate_factor("flash-attention-2", "H100", 4096, 96, "forward") == pytest.approx(0.87579, abs=1e-5)
    # Outside the readings the nearest holds: A100 head dim 128 is read from 2k (155 / 187).
    assert causal_rate_factor("flash-attention-2", "A100", 512, 128, "backward") == pytest.approx(155 / 187)
    # The Triton kernel takes FlashAttention-2's; V100 has no reading, and the model keeps the
    # diagonal blocks there: 32 blocks per row -> 32/33.
    assert causal_rate_factor("flash-attention-triton", "A100", 4096, 128, "forward") == pytest.approx(173 / 196)
    assert causal_rate_factor("flash-attention-2", "V100", 4096, 128, "forward") is None
    v100 = GENERATIONS["V100"]
    assert gpu_kernels.attention_efficiency(1, 4096, 4096, 128, True, v100) == pytest.approx(
        gpu_kernels.attention_efficiency(1, 4096, 4096, 128, False, v100) * 32 / 33)


def test_triton_flash_attention_is_slower_by_the_published_ratios():
    # The same causal call as above on a device running the Triton FlashAttention kernel:
    # forward 1.4x and backward 2.0x FlashAttention-2's kernel time (FlashAttention-2 paper,
    # section 4.1), the launch overhead unchanged.
    node = attention_node(1, 32, 4096, 128, True)
    triton = dataclasses.replace(A100_DEVICE, attention_kernel="flash-attention-triton")
    flash2_forward, flash2_backward = op_times(node, 1.0, A100_DEVICE, "bf16")
    forward, backward = op_times(node, 1.0, triton, "bf16")
    assert forward - OVERHEAD == pytest.approx(1.4 * (flash2_forward - OVERHEAD))
    assert backward - OVERHEAD == pytest.approx(2.0 * (flash2_backward - OVERHEAD))
    assert forward == pytest.approx(1.4 * 0.80864e-3 + OVERHEAD, rel=1e-4)  # 0.81364 ms above less 5 µs


def test_cudnn_attention_on_hopper_is_priced_from_its_published_speed():
    # cuDNN on H100 is read at 4 x 16 heads x 4096 x d128, causal: forward 518 TFLOP/s
    # (FlashAttention-3 paper, fig. 5d), backward 499 x 443.6 / 517.3 = 427.907 TFLOP/s (fig. 6
    # without the mask, times cudnn-frontend's causal / non-causal backward on H200). The
    # model's cuDNN there at the loop's clock before the ratio: 989.4e12 x 0.35 (forward) or 0.30
    # (backward) x shape (sequence 4096/4306 x 16594/16384 = 0.963423; 64 x 32 = 2048 thread
    # blocks on 16 waves of 132 = 2048/2112; together 0.934228) x cuDNN's own causal factor
    # (518 / 609 forward, 443.6 / 517.3 backward), so cuDNN's time is
    # 989.4 x 0.35 x 0.934228 x 0.850575 / 518 = 0.53122 and
    # 989.4 x 0.30 x 0.934228 / 499 = 0.55571 of FlashAttention-2's without the mask
    # (0.60562 and 0.62839 over its causal time with the diagonal-block factor 32/33 before).
    shape = (4096 / 4306) * (16594 / 16384) * (2048 / 2112)
    assert shape == pytest.approx(0.934228, abs=1e-6)
    forward_ratio = 989.4e12 * 0.35 * shape * (518 / 609) / 518e12
    backward_ratio = 989.4e12 * 0.30 * shape * (443.6 / 517.3) / (499 * 443.6 / 517.3 * 1e12)
    assert (forward_ratio, backward_ratio) == pytest.approx((0.53122, 0.55571), abs=1e-5)
    assert gpu_kernels.CUDNN_OVER_FLASH_ATTENTION_2_HOPPER == pytest.approx((forward_ratio, backward_ratio))
    h100 = Cluster.preset("dgx-h100").device_of(0)
    cudnn = dataclasses.replace(h100, attention_kernel="cudnn-fused-attention")
    node = attention_node(4, 16, 4096, 128, True)
    flash2_forward, flash2_backward = op_times(node, 1.0, h100, "bf16")
    forward, backward = op_times(node, 1.0, cudnn, "bf16")
    # Over FlashAttention-2's causal time the kernels differ in their causal factor too:
    # FlashAttention-2's is 319 / 368 forward (fig. 5), and its backward takes the same.
    flash2_causal = 319 / 368
    assert forward - OVERHEAD == pytest.approx(
        forward_ratio * flash2_causal / (518 / 609) * (flash2_forward - OVERHEAD), rel=1e-6)
    assert backward - OVERHEAD == pytest.approx(
        backward_ratio * flash2_causal / (443.6 / 517.3) * (flash2_backward - OVERHEAD), rel=1e-6)
    # So at the reading shape the kernel runs at the published speed times the sustained clock
    # 1575/1830 = 0.860656: causal forward FLOPs 4 x 64 x 4096^2 x 128 / 2 = 274.878e9 at
    # 518e12 x 0.860656 = 445.82e12 FLOP/s -> 616.57 us, + 5 us launch = 621.57 us; backward
    # 2.5 x 274.878e9 at 427.907e12 x 0.860656 = 368.28e12 -> 1865.95 us, + 5 us = 1870.95 us.
    assert forward == pytest.approx(621.57e-6, rel=1e-4)
    assert backward == pytest.approx(1870.95e-6, rel=1e-4)
    # Transformer Engine's shape (2 x 16 heads x 2048, causal): cuDNN's forward is 0.53122 x
    # 4 x 32 x 2048^2 x 128 / 2 FLOPs over 989.4e12 x 0.860656 x 0.35 x shape (sequence
    # 2048/2258 x 16594/16384 = 0.918623; 512 thread blocks on 4 waves of 132 = 0.969697;
    # cuDNN's causal factor at 2k 484 / 617 = 0.784441): 87.64 us, + 5 us = 92.64 us
    # (88.28 us before, with the 32/33 diagonal-block factor).
    forward_2k, _ = op_times(attention_node(2, 16, 2048, 128, True), 1.0, cudnn, "bf16")
    assert forward_2k == pytest.approx(92.64e-6, rel=1e-4)
    # The H200 is the same die and takes the same ratios; on Ampere, where Transformer Engine
    # measured flash-attention faster and gave no figure, cuDNN is priced as FlashAttention-2
    # (assumed).
    assert gpu_kernels.attention_kernel_slowdown("cudnn-fused-attention", "H200") == pytest.approx(
        (forward_ratio, backward_ratio))
    a100_node = attention_node(2, 16, 2048, 128, True)
    assert op_times(a100_node, 1.0, dataclasses.replace(A100_DEVICE, attention_kernel="cudnn-fused-attention"),
                    "bf16") == op_times(a100_node, 1.0, A100_DEVICE, "bf16")


def test_attention_dropout_slows_cudnn_attention_on_hopper_by_transformer_engines_measurement():
    # NVIDIA/TransformerEngine#3312 (H200, sm90, fused backend, sbhd, 16 heads x d128): forward
    # + backward 0.594 ms at dropout 0.0 and 0.614 ms at 0.1, so the kernels take 0.614 / 0.594
    # = 1.03367x as long with dropout, forward and backward; the launch overhead stays.
    h100 = Cluster.preset("dgx-h100").device_of(0)
    cudnn = dataclasses.replace(h100, attention_kernel="cudnn-fused-attention")
    plain = attention_node(2, 16, 2048, 128, True)
    dropped = dataclasses.replace(plain, attrs=(None, None, None, None, 0.1, True))
    assert gpu_kernels.attention_dropout_p(dropped) == 0.1 and gpu_kernels.attention_dropout_p(plain) == 0.0
    plain_forward, plain_backward = op_times(plain, 1.0, cudnn, "bf16")
    forward, backward = op_times(dropped, 1.0, cudnn, "bf16")
    assert 0.614 / 0.594 == pytest.approx(1.03367, abs=1e-5)
    assert forward - OVERHEAD == pytest.approx(1.03367 * (plain_forward - OVERHEAD), rel=1e-5)
    assert backward - OVERHEAD == pytest.approx(1.03367 * (plain_backward - OVERHEAD), rel=1e-5)
    # By hand (the cuDNN test above): the causal forward's kernel time 87.64 us x 1.03367 =
    # 90.60 us, + 5 us launch = 95.60 us.
    assert forward == pytest.approx(95.60e-6, rel=1e-4)
    # No measurement of dropout in FlashAttention-2 on Hopper, nor of cuDNN's on Ampere: unpriced.
    assert op_times(dropped, 1.0, h100, "bf16") == op_times(plain, 1.0, h100, "bf16")
    a100_cudnn = dataclasses.replace(A100_DEVICE, attention_kernel="cudnn-fused-attention")
    assert op_times(dropped, 1.0, a100_cudnn, "bf16") == op_times(plain, 1.0, a100_cudnn, "bf16")
    # The private ATen ops carry dropout_p at their own positions (flash: 3, cuDNN: 5).
    flash_op = dataclasses.replace(plain, op="aten._scaled_dot_product_flash_attention.default",
                                   attrs=(None, None, None, 0.1, True))
    assert gpu_kernels.attention_dropout_p(flash_op) == 0.1


def test_attention_kernel_is_checked_and_round_trips_through_cluster_files():
    from planner.cluster import ATTENTION_KERNELS, ClusterError
    assert set(gpu_kernels.ATTENTION_KERNEL_SLOWDOWN) == set(ATTENTION_KERNELS)
    with pytest.raises(ClusterError, match="attention_kernel must be one of"):
        dataclasses.replace(A100_DEVICE, attention_kernel="flash-attention-9")
    cluster = Cluster.preset("dgx-a100-80g")
    triton = dataclasses.replace(cluster, nodes=tuple(
        dataclasses.replace(node, device=dataclasses.replace(node.device, attention_kernel="flash-attention-triton"))
        for node in cluster.nodes))
    assert "attention_kernel" not in cluster.to_dict()["nodes"][0]["device"]  # the default is left out
    assert Cluster.from_dict(triton.to_dict()) == triton
    assert Cluster.from_dict(cluster.to_dict()) == cluster


def test_split_attention_shrinks_batch_then_heads():
    # 1/16 of (B=4, H=32): batch 4 -> 1, then heads 32 -> 8.
    split = op_times(attention_node(4, 32, 2048, 128, True), 1 / 16, A100_DEVICE, "bf16")
    assert split == pytest.approx(op_times(attention_node(1, 8, 2048, 128, True), 1.0, A100_DEVICE, "bf16"))


def linear_node(batch: int, seq: int, width: int, out: int) -> OpNode:
    x, w, y = TensorMeta((batch, seq, width), BF16), TensorMeta((out, width), BF16), TensorMeta((batch, seq, out), BF16)
    return OpNode(name="fc", op="aten.linear.default", inputs=("x", "w"), input_meta=(x, w), output_meta=(y,),
                  flops=2 * batch * seq * width * out, bytes_moved=x.nbytes + w.nbytes + y.nbytes)


def test_linear_split_over_samples_then_weight():
    # (8, 2048, 4096) x (16384, 4096)ᵀ at 1/16 of the work (dp 8 x tp 2): samples 8 -> 1, then
    # the weight's larger dim 16384 -> 8192: a 2048 x 8192 x 4096 GEMM forward, and backward
    # the input gradient (2048 x 4096, reducing 8192) and weight gradient (4096 x 8192,
    # reducing 2048).
    forward, backward = op_times(linear_node(8, 2048, 4096, 16384), 1 / 16, A100_DEVICE, "bf16")
    assert forward == pytest.approx(matmul_time(1, 2048, 8192, 4096, A100_DEVICE, "bfloat16", 2, A100))
    assert backward == pytest.approx(matmul_time(1, 2048, 4096, 8192, A100_DEVICE, "bfloat16", 2, A100)
                                     + matmul_time(1, 4096, 8192, 2048, A100_DEVICE, "bfloat16", 2, A100))


def test_large_layers_beat_the_old_flat_efficiency_and_small_ones_do_not():
    big = A100.matmul_efficiency(1, 8192, 12288 * 4, 12288)  # a GPT-3 MLP GEMM
    small = A100.matmul_efficiency(1, 128, 128, 128)
    assert big == pytest.approx(A100.sustained_matmul_fraction)  # the ceiling: MAMF at the sustained clock
    assert big > 0.75 > defaults.MATMUL_EFFICIENCY > small
    # 128^3: four 64x64 tiles on 4 of 108 SMs, K 128 + 192, relative to the MAMF shape's 0.9143:
    # 128^3 / (108 x 64 x 64 x 320 / 0.6875) x 0.859 x 0.9255 / 0.9143.
    assert small == pytest.approx(128**3 / (108 * 64 * 64 * 320 / 0.6875) * 0.859 * SUSTAINED / (2048 / 2240))


def test_cpu_devices_keep_the_roofline():
    cpu = Cluster.preset("cpu").device_of(0)
    assert gpu_kernels.kernel_op_times(linear_node(2, 16, 32, 64), 1.0, cpu, "float32", 4) is None


def test_fp32_keeps_the_roofline():
    # The measurements behind the model are 16-bit: fp32 work is the roofline's.
    node = linear_node(2, 16, 32, 64)
    assert gpu_kernels.kernel_op_times(node, 1.0, A100_DEVICE, "float32", 4) is None
    assert gpu_kernels.kernel_op_times(node, 1.0, A100_DEVICE, "bfloat16", 2) is not None


def test_work_of_unknown_shape_gets_the_sustained_ceiling_too():
    # SUMMA's and MoE experts' roofline work (no shape) takes the best-shaped GEMM's sustained
    # fraction, never the MAMF benchmark's: 0.859 x 1305/1410 = 0.795 on A100, 0.801 x
    # 1575/1830 = 0.689 on H100 (its own sustained clock over the clock of its datasheet peak).
    assert gpu_kernels.large_matmul_efficiency(A100_DEVICE, "bfloat16") == pytest.approx(0.859 * SUSTAINED)
    h100 = Cluster.preset("dgx-h100").device_of(0)
    assert gpu_kernels.large_matmul_efficiency(h100, "bfloat16") == pytest.approx(0.801 * H100_SUSTAINED)
    assert 0.801 * H100_SUSTAINED == pytest.approx(0.6894, abs=1e-4)
    assert gpu_kernels.large_matmul_efficiency(A100_DEVICE, "float32") is None


def test_h100_prices_tensor_work_at_its_own_sustained_clock():
    # The H100 generation (and the H200, the same die at the same 700 W) takes 1575/1830 =
    # 0.8607 of its datasheet clock, not the A100's 1305/1410 = 0.9255.
    h100, h200 = GENERATIONS["H100"], GENERATIONS["H200"]
    assert 528 * 1024 * 1.83e9 == pytest.approx(989.4e12, rel=1e-4)  # the peak's clock is 1830 MHz
    assert h100.sustained_clock == pytest.approx(0.86066, abs=1e-5)
    assert h200.sustained_clock == h100.sustained_clock
    assert GENERATIONS["A100"].sustained_clock == pytest.approx(SUSTAINED)  # the A100 is unchanged
    # The MAMF GEMM on H100 (6144 x 17920 x 2816, 620.086 GFLOP): at the measured shape the
    # model's efficiency is the MAMF fraction at the sustained clock, 0.801 x 0.86066 = 0.68939,
    # so 989.4e12 x 0.68939 = 682.08 TFLOP/s; 620.086e9 / 682.08e12 = 909.11 us, plus one 5 us
    # launch = 914.11 us.
    device = Cluster.preset("dgx-h100").device_of(0)
    flops = 2 * 6144 * 17920 * 2816
    assert flops == pytest.approx(620.086e9, rel=1e-6)
    seconds = matmul_time(1, 6144, 17920, 2816, device, "bfloat16", 2, h100)
    assert seconds == pytest.approx(914.11e-6, rel=1e-4)
    # FlashAttention-2's forward at 16 heads x 16k x d128 (not causal): 4 x 16 x 16384^2 x 128
    # = 2.1990e12 FLOPs at 989.4e12 x 0.86066 x 0.35 x the shape factor (16k keys: sequence
    # factor 1; 16 x 128 = 2048 thread blocks on 132 SMs: 2048 / (16 x 132) = 0.9697), i.e.
    # 289.01 TFLOP/s -> 7.6089 ms + 5 us.
    forward, _ = gpu_kernels.attention_times(16, 16384, 16384, 128, False, device, "bfloat16", h100)
    assert forward == pytest.approx(4 * 16 * 16384**2 * 128 / (989.4e12 * 0.86066 * 0.35 * 2048 / 2112) + 5e-6,
                                    rel=1e-4)
    assert forward == pytest.approx(7.6139e-3, rel=1e-3)
