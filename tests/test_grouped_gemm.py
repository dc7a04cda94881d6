"""The experts' kernels: Transformer Engine's grouped GEMM as ``cost_model.grouped_gemm`` prices
it, and the memory-bound kernels around it (``cost_model.moe_layers.expert_memory_op_times``),
against figures worked out by hand (H100: 989.4e12 bf16 FLOP/s, 132 SMs, K overhead 256, MAMF 80.1% at
6144 x 17920 x 2816, sustained clock 1575 / 1830; ``cost_model.gpu_kernels``)."""

import pytest

from cost_model import defaults
from cost_model.gpu_kernels import GENERATIONS
from cost_model.grouped_gemm import GROUPED_GEMM_STREAMS, ExpertShape, expert_gemm_call_time, expert_gemm_launches
from cost_model.grouped_gemm import expert_gemm_times
from cost_model.moe import MoELayer, moe_layer_cost
from cost_model.moe_folding import folded_layer_cost
from cost_model.moe_layers import expert_memory_op_times
from planner.cluster import Cluster
from planner.expert_kernels import TE_GROUPED_GEMM
from planner.moe_blocks import MoEBlock
from planner.strategy import ExpertLayout, ExpertPlacement

H100 = Cluster.preset("dgx-h100", nodes=1).device_of(0)
PEAK = 989.4e12
# MAMF at the sustained clock: 0.801 x 1575 / 1830 = 0.689385.
SUSTAINED = 0.801 * 1575 / 1830
LAUNCH = defaults.KERNEL_OVERHEAD_S


def test_weight_gradient_of_512_rows_pays_wave_quantisation():
    # Four expert weight gradients (4096 x 512) @ (512 x 3072), one per stream, sharing the SMs.
    # Best tile 256 x 128 (tile efficiency 1): 16 x 24 = 384 tiles a GEMM, 1,536 in all,
    # ceil(1536 / 132) = 12 waves of 256 x 128 x (512 + 256) MACs on 132 SMs:
    # 4 x 4096 x 3072 x 512 / (12 x 256 x 128 x 768 x 132) = 0.64646.
    # The MAMF shape 6144 x 17920 x 2816: 24 x 140 = 3,360 tiles, 26 waves:
    # 6144 x 17920 x 2816 / (26 x 256 x 128 x 3072 x 132) = 0.89744.
    # Efficiency 0.689385 x 0.64646 / 0.89744 = 0.49659; 2 x 4 x 4096 x 3072 x 512 = 5.1540e10 FLOPs
    # at 989.4e12 x 0.49659 = 104.9 us (its 130 MB at 0.8 x 3.35 TB/s take 48.5 us), + 4 launches.
    efficiency = SUSTAINED * 0.6464646 / 0.8974359
    expected = 2 * 4 * 4096 * 3072 * 512 / (PEAK * efficiency) + 4 * LAUNCH
    time = expert_gemm_call_time(TE_GROUPED_GEMM, 4, 4096, 3072, 512, H100, "bfloat16", 2, GENERATIONS["H100"])
    assert time == pytest.approx(expected, rel=1e-4)
    assert time == pytest.approx(104.9e-6 + 20e-6, rel=2e-3)


def test_more_experts_than_streams_run_four_at_a_time():
    # 16 GEMMs on 4 streams: four rounds of the 4-GEMM batch above, and 16 launches.
    four = expert_gemm_call_time(TE_GROUPED_GEMM, 4, 4096, 3072, 512, H100, "bfloat16", 2, GENERATIONS["H100"])
    sixteen = expert_gemm_call_time(TE_GROUPED_GEMM, 16, 4096, 3072, 512, H100, "bfloat16", 2, GENERATIONS["H100"])
    assert GROUPED_GEMM_STREAMS == 4
    assert sixteen == pytest.approx(4 * (four - 4 * LAUNCH) + 16 * LAUNCH)


def test_large_experts_run_at_the_sustained_fraction_plus_one_launch_per_expert_gemm():
    # 4 SwiGLU experts of 8192 x 4096 with 8192 rows each: every GEMM (8192 x 8192 x 8192,
    # 8192 x 8192 x 4096 and their transposes) fills whole waves, so each runs at 0.689385.
    # Forward FLOPs 2 x 4 x 8192 x 3 x 8192 x 4096 = 6.5970e12 -> 9.672 ms; backward twice that.
    # Launches: forward 2 projections x 4 experts, backward 2 x (input + weight gradient) x 4.
    shape = ExpertShape(local_experts=4, rows=8192, hidden=8192, ffn=4096, matmuls=3)
    forward, backward = expert_gemm_times(shape, TE_GROUPED_GEMM, H100, "bfloat16", 2)
    flops = 2 * 4 * 8192 * 3 * 8192 * 4096
    assert forward == pytest.approx(flops / (PEAK * SUSTAINED) + 8 * LAUNCH)
    assert backward == pytest.approx(2 * flops / (PEAK * SUSTAINED) + 16 * LAUNCH)
    assert forward == pytest.approx(9.672e-3 + 40e-6, rel=1e-3)


def test_shape_model_applies_only_where_measured():
    shape = ExpertShape(local_experts=4, rows=512, hidden=1024, ffn=512, matmuls=3)
    assert expert_gemm_times(shape, TE_GROUPED_GEMM, H100, "float32", 4) is None
    cpu = Cluster.preset("cpu", 1, 8).device_of(0)
    assert expert_gemm_times(shape, TE_GROUPED_GEMM, cpu, "bfloat16", 2) is None


def test_expert_parallel_layer_on_h100_prices_its_local_experts_as_a_grouped_gemm():
    # 128 experts on 8 devices: 16 local experts a device. 8 x 1024 tokens, top-8: 65,536 copies,
    # 8,192 a device expected, plus the busiest device's chance excess (cost_model.expert_load);
    # the grouped GEMM runs the busiest device's copies over its 16 experts.
    cluster = Cluster.preset("dgx-h100", nodes=1)
    layer = MoELayer(tokens=8 * 1024, hidden=4096, ffn=1536, experts=128, top_k=8)
    cost = moe_layer_cost(layer, "expert_parallel", cluster, list(range(8)))
    assert cost.busiest_copies > 8192
    shape = ExpertShape(16, cost.busiest_copies / 16, 4096, 1536, 3)
    forward, backward = expert_gemm_times(shape, TE_GROUPED_GEMM, cluster.device_of(0), "bfloat16", 2)
    assert (cost.forward_compute_s, cost.backward_compute_s) == pytest.approx((forward, backward))
    # 96 launches a pass (16 experts x 2 projections x forward, input and weight gradient).
    launches = 96 * LAUNCH
    flops = cost.busiest_copies * 2 * 3 * 4096 * 1536
    assert forward + backward > 3 * flops / (PEAK * SUSTAINED) + launches


def test_expert_tensor_parallel_ranks_run_their_slices_as_a_grouped_gemm():
    # One DGX H100 folded as dp 4 x tp 2, EP 4 x ETP 2: each ETP pair holds 32 of the 128 experts
    # and splits their hidden width 1536 in two. The rows the EP rank receives are gathered over
    # its ETP pair (2 x the busiest EP rank's copies), and each rank runs 32 GEMMs per projection
    # of those rows by a 768-wide slice.
    cluster = Cluster.preset("dgx-h100", nodes=1)
    layer = MoELayer(tokens=8 * 1024, hidden=4096, ffn=1536, experts=128, top_k=8)
    layout = ExpertLayout(module="model.layers.0.mlp", mode="expert_parallel", experts=128, top_k=8,
                          capacity_factor=0.0, axis="dp*tp", placement=ExpertPlacement.round_robin(128, 4),
                          tensor_parallel=2)
    cost = folded_layer_cost(layer, layout, cluster, tuple(range(8)), tp=2, sequence_parallel=True,
                             precision="bf16")
    rows = cost.moe.busiest_copies  # already the ETP pair's gathered rows
    forward, backward = expert_gemm_times(ExpertShape(32, rows / 32, 4096, 768, 3), TE_GROUPED_GEMM,
                                          cluster.device_of(0), "bfloat16", 2)
    assert (cost.moe.forward_compute_s, cost.moe.backward_compute_s) == pytest.approx((forward, backward))


def test_activation_function_and_permutations_stream_their_bytes():
    # 8,192 bf16 copies through SwiGLU experts of 1,536 (model width 4,096), at 0.913 x 3.35e12 B/s:
    # forward: SwiGLU reads gate|up (2 x 1536) and writes 1536: 8192 x 2 x 3 x 1536 = 75.50 MB;
    #   the permutation and the unpermutation each read and write 8192 x 4096 x 2 B:
    #   2 x 2 x 67.11 MB = 268.44 MB; 343.93 MB / 3.0586e12 = 112.45 us, + 3 launches of 5 us.
    # backward: SwiGLU reads the output's gradient (1536) and gate|up (2 x 1536), writes their
    #   gradient (2 x 1536): 8192 x 2 x 5 x 1536 = 125.83 MB, + 268.44 MB = 394.26 MB -> 128.90 us + 15 us.
    block = MoEBlock(module="m", experts=128, top_k=8, capacity_factor=0.0, hidden=4096, ffn=1536, matmuls=3,
                     router="m.gate.weight", expert_weights=("w1", "w2"), kind="test")
    forward, backward = expert_memory_op_times(block, 8192, 1, 2, H100)
    bandwidth = 0.913 * 3.35e12
    assert forward == pytest.approx((8192 * 2 * 3 * 1536 + 4 * 8192 * 4096 * 2) / bandwidth + 3 * LAUNCH)
    assert backward == pytest.approx((8192 * 2 * 5 * 1536 + 4 * 8192 * 4096 * 2) / bandwidth + 3 * LAUNCH)
    assert forward == pytest.approx(112.45e-6 + 15e-6, rel=1e-3)
    assert backward == pytest.approx(128.90e-6 + 15e-6, rel=1e-3)
    # Expert tensor parallelism halves the activation function's width, not the permuted rows.
    half_forward, _ = expert_memory_op_times(block, 8192, 2, 2, H100)
    assert forward - half_forward == pytest.approx(8192 * 2 * 3 * 768 / bandwidth)


def test_the_host_launches_each_expert_gemm_the_device_runs():
    # 16 local experts, two grouped projections (SwiGLU's gate|up, then down): forward one call
    # per projection, 16 GEMMs each = 32; backward two calls per projection (input and weight
    # gradient) = 64. 96 a pass, the launches the device already pays (test above).
    assert expert_gemm_launches(ExpertShape(16, 512, 4096, 1536, 3), TE_GROUPED_GEMM) == (32, 64)
    cluster = Cluster.preset("dgx-h100", nodes=1)
    layer = MoELayer(tokens=8 * 1024, hidden=4096, ffn=1536, experts=128, top_k=8)
    assert moe_layer_cost(layer, "expert_parallel", cluster, list(range(8))).gemm_launches == (32, 64)
    # EP 4 x ETP 2 folded over one DGX: 32 experts a rank, sliced: 64 and 128.
    layout = ExpertLayout(module="model.layers.0.mlp", mode="expert_parallel", experts=128, top_k=8,
                          capacity_factor=0.0, axis="dp*tp", placement=ExpertPlacement.round_robin(128, 4),
                          tensor_parallel=2)
    folded = folded_layer_cost(layer, layout, cluster, tuple(range(8)), tp=2, sequence_parallel=True,
                               precision="bf16")
    assert folded.moe.gemm_launches == (64, 128)
    # In fp32 the experts stay one roofline kernel: no per-expert launch to issue.
    assert moe_layer_cost(layer, "expert_parallel", cluster, list(range(8)), precision="fp32").gemm_launches == (0, 0)
