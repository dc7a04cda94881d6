"""The kernels that run an MoE layer's expert GEMMs (``Plan.expert_implementation``,
``planner.expert_kernels``): each priced as it runs (``cost_model.grouped_gemm``), the field
saved and checked, and the default the kernel the compiled program runs.

Hand-worked figures on an H100 (``cost_model.gpu_kernels``): 989.4e12 bf16 FLOP/s, 132 SMs,
K overhead 256, MAMF 80.1% at 6144 x 17920 x 2816 (shape efficiency 0.897436 there), sustained
clock 1575 / 1830, so a GEMM whose shape efficiency reaches the MAMF shape's runs at
0.801 x 1575 / 1830 = 0.689385 of peak; 5 us a launch."""

from __future__ import annotations

import dataclasses
import math

import pytest

import planner
from cost_model import defaults
from cost_model.gpu_kernels import GENERATIONS
from cost_model.grouped_gemm import ExpertShape, expert_gemm_call_time, expert_gemm_times
from cost_model.moe import MoELayer, bmm_rows, moe_layer_cost
from cost_model.expert_memory_ops import batched_gelu_times, expert_loop_times
from cost_model.moe_layers import expert_memory_op_times, laid_out_layers
from cost_model.simulator import simulated
from moe_plans import MOE_EXAMPLE, hf_moe_plan, moe_plan
from planner.api import prepare_model
from planner.cluster import Cluster
from planner.errors import PlanFileError
from planner.expert_kernels import (
    BATCHED_MATMUL,
    MODEL_EXPERTS,
    PER_EXPERT_LOOP,
    TE_GROUPED_GEMM,
    emitted_expert_kernel,
    expert_kernel,
)
from planner.model_spec import ModelSpec
from planner.moe_blocks import HF_STACKED_EXPERTS, ROUTED_GELU, MoEBlock
from planner.moe_report import moe_notes
from planner.plans import load_plan
from planner.strategy import ExpertLayout, ExpertPlacement
from search.data_parallel import data_parallel_plan
from tests.simulation_only_fields import check_choice_field

H100 = Cluster.preset("dgx-h100", nodes=1).device_of(0)
PEAK = 989.4e12
SUSTAINED = 0.801 * 1575 / 1830
MAMF_SHAPE = 0.8974359
LAUNCH = defaults.KERNEL_OVERHEAD_S
# 0.913 x 3.35 TB/s: cost_model.memory_kernels.STREAMING_EFFICIENCY of the H100's bandwidth.
STREAM = 0.913 * 3.35e12


def _call(implementation: str) -> float:
    return expert_gemm_call_time(implementation, 4, 768, 1408, 1024, H100, "bfloat16", 2, GENERATIONS["H100"])


def test_one_projection_of_four_small_experts_on_each_kernel():
    # Four experts' (768 x 1024) @ (1024 x 1408): 2 x 4 x 768 x 1408 x 1024 = 8.8584e9 FLOPs;
    # 26.5 MB moved take 9.9 us at 0.8 x 3.35 TB/s, less than the compute below.
    flops = 2 * 4 * 768 * 1408 * 1024
    # Four at once (Transformer Engine's four streams; one bmm of batch 4): 256 x 128 tiles,
    # 3 x 11 = 33 a GEMM, 132 in all: one full wave, K efficiency 1024 / (1024 + 256) = 0.8,
    # 0.8 / 0.897436 = 0.891429 of the MAMF shape's.
    together = flops / (PEAK * SUSTAINED * 0.8 / MAMF_SHAPE)
    assert together == pytest.approx(14.569e-6, rel=1e-4)
    # One at a time (the loop): 33 tiles of 256 x 128 fill a quarter of the SMs; 128 x 64 tiles
    # (relative efficiency 11/14 = 0.785714) make 6 x 22 = 132, one full wave: 0.8 x 11/14 =
    # 0.628571 (128 x 128: half a wave, 0.5 x 11/12 x 0.8 = 0.3667; 64 x 64: two full waves,
    # 0.6875 x 0.8 = 0.55), 0.700408 of the MAMF shape's.
    alone = flops / (PEAK * SUSTAINED * 0.8 * 11 / 14 / MAMF_SHAPE)
    assert alone == pytest.approx(18.542e-6, rel=1e-4)
    # Transformer Engine: four GEMMs at once, four launches: 34.57 us.
    assert _call(TE_GROUPED_GEMM) == pytest.approx(together + 4 * LAUNCH, rel=1e-6)
    # One torch.bmm: the same batch of four, one launch: 19.57 us.
    assert _call(BATCHED_MATMUL) == pytest.approx(together + LAUNCH, rel=1e-6)
    # The loop: four GEMMs one after another, each alone, four launches: 38.54 us.
    assert _call(PER_EXPERT_LOOP) == pytest.approx(alone + 4 * LAUNCH, rel=1e-6)
    assert (_call(BATCHED_MATMUL), _call(TE_GROUPED_GEMM), _call(PER_EXPERT_LOOP)) == pytest.approx(
        (19.569e-6, 34.569e-6, 38.543e-6), rel=1e-4)


def test_large_experts_differ_only_by_their_launches():
    # 4 SwiGLU experts of 8192 x 4096, 8192 rows each: every GEMM of every kernel fills its
    # waves past the MAMF shape's efficiency (one alone: 8192 x 8192 x 8192 in 256 x 128 tiles is
    # 2,048 tiles, 16 waves: 0.9697 x 8192 / 8448 = 0.9403 > 0.8974), so all run at 0.689385.
    # Forward 2 x 4 x 8192 x 3 x 8192 x 4096 FLOPs = 9.672 ms, backward twice that; launches:
    # bmm one per projection (2 forward, 4 backward), the others one per expert and projection
    # (8 forward, 16 backward).
    shape = ExpertShape(local_experts=4, rows=8192, hidden=8192, ffn=4096, matmuls=3)
    flops = 2 * 4 * 8192 * 3 * 8192 * 4096
    for implementation, launches in ((BATCHED_MATMUL, 2), (PER_EXPERT_LOOP, 8), (TE_GROUPED_GEMM, 8)):
        forward, backward = expert_gemm_times(shape, implementation, H100, "bfloat16", 2)
        assert forward == pytest.approx(flops / (PEAK * SUSTAINED) + launches * LAUNCH), implementation
        assert backward == pytest.approx(2 * flops / (PEAK * SUSTAINED) + 2 * launches * LAUNCH), implementation
    # The model's own experts module is not priced here: the caller keeps its roofline.
    assert expert_gemm_times(shape, MODEL_EXPERTS, H100, "bfloat16", 2) is None


# 4 GELU experts (8192 -> 4096 -> 8192), top-2, 16,384 tokens over 2 H100s.
LAYER = MoELayer(tokens=16384, hidden=8192, ffn=4096, experts=4, top_k=2, matmuls=2)
TWO_H100 = Cluster.parse("dgx-h100:1x2")


def _expert_parallel(implementation: str, capacity_factor: float | None):
    return moe_layer_cost(LAYER, "expert_parallel", TWO_H100, [0, 1], capacity_factor=capacity_factor,
                          implementation=implementation)


def test_the_batched_matmul_computes_the_padded_buffers():
    # Capacity 1.0: ceil(1.0 x 16384 x 2 / 4) = 8,192 slots an expert; the program's buffer
    # is each of a rank's 2 experts at that capacity. Dropless: every token of the group,
    # 16,384 slots an expert (codegen.runtime.moe.capacity_of).
    assert bmm_rows(LAYER, 1.0) == 8192
    assert bmm_rows(LAYER, 1.25) == math.ceil(1.25 * 16384 * 2 / 4) == 10240
    assert bmm_rows(LAYER, None) == 16384
    # Forward FLOPs with 8,192 rows: 2 experts x 2 matmuls x 2 x 8192 x 8192 x 4096 = 2.1990e12
    # at 0.689385 of peak (batch 2 of 8192 x 4096 x 8192: 2,048 tiles, 16 waves, 0.9403 > 0.8974)
    # = 3.2239 ms; the bmm pays 2 launches, the loop and TE 2 x 2.
    flops = 2 * 2 * 2 * 8192 * 8192 * 4096
    compute = flops / (PEAK * SUSTAINED)
    assert compute == pytest.approx(3.2239e-3, rel=1e-4)
    assert _expert_parallel(BATCHED_MATMUL, 1.0).forward_compute_s == pytest.approx(compute + 2 * LAUNCH)
    assert _expert_parallel(PER_EXPERT_LOOP, 1.0).forward_compute_s == pytest.approx(compute + 4 * LAUNCH)
    assert _expert_parallel(TE_GROUPED_GEMM, 1.0).forward_compute_s == pytest.approx(compute + 4 * LAUNCH)
    # Dropless, the bmm pads each expert to all 16,384 tokens: twice the FLOPs (batch 2 of
    # 16384 x 4096 x 8192 is at the cap too), where the routed rows alone stay near 8,192.
    assert _expert_parallel(BATCHED_MATMUL, None).forward_compute_s == pytest.approx(2 * compute + 2 * LAUNCH)
    assert _expert_parallel(PER_EXPERT_LOOP, None).forward_compute_s < 1.1 * compute + 4 * LAUNCH


def test_data_parallel_bmm_pads_to_the_ranks_fullest_expert():
    # Every rank holds all 4 experts and runs its own tokens' kept choices, each expert's
    # buffer as deep as the rank's fullest (codegen.runtime.moe_modes.DataParallelMoE): uniform
    # routing at capacity 1.0 keeps 8,192 choices an expert, 4,096 on each of the 2 ranks. One
    # bmm of 4 x (4096 x 8192) @ (8192 x 4096) and one of 4 x (4096 x 4096) @ (4096 x 8192):
    # 2 x 4 x 2 x 4096 x 8192 x 4096 = 2.1990e12 FLOPs (at the cap: batch 4 of 4096 x 4096 x 8192
    # is 2,048 tiles, 16 waves), 2 launches.
    cost = moe_layer_cost(LAYER, "data_parallel", TWO_H100, [0, 1], capacity_factor=1.0,
                          implementation=BATCHED_MATMUL)
    flops = 2 * 4 * 2 * 4096 * 8192 * 4096
    assert cost.forward_compute_s == pytest.approx(flops / (PEAK * SUSTAINED) + 2 * LAUNCH)


def test_the_default_is_the_kernel_the_compiled_program_runs():
    assert emitted_expert_kernel(ROUTED_GELU, "expert_parallel") == BATCHED_MATMUL
    assert emitted_expert_kernel(ROUTED_GELU, "data_parallel") == BATCHED_MATMUL
    assert emitted_expert_kernel(ROUTED_GELU, "expert_sliced") == BATCHED_MATMUL
    assert emitted_expert_kernel(HF_STACKED_EXPERTS, "expert_parallel") == PER_EXPERT_LOOP
    assert emitted_expert_kernel(HF_STACKED_EXPERTS, "data_parallel") == MODEL_EXPERTS
    assert expert_kernel("", HF_STACKED_EXPERTS, "expert_parallel") == PER_EXPERT_LOOP
    assert expert_kernel(TE_GROUPED_GEMM, HF_STACKED_EXPERTS, "expert_parallel") == TE_GROUPED_GEMM


def test_the_compiler_runs_the_bmm_the_field_names_for_routed_layers(tmp_path):
    routed = moe_plan(2, "expert_parallel", "round-robin")
    # examples/moe.py's layers: the program's ExpertParallelMoE runs them as one bmm
    # (codegen.runtime.moe.gelu_experts), the kernel the field names.
    named = planner.compile(dataclasses.replace(routed, expert_implementation=BATCHED_MATMUL), tmp_path / "bmm")
    source = (named / "model_spmd.py").read_text()
    assert "ExpertParallelMoE(" in source and "ExpertParallelExperts(" not in source
    with pytest.raises(PlanFileError, match="'expert_implementation' is 'per_expert_loop' but the compiled program "
                                            "runs the experts of layer 'blocks.0.moe' \\(expert parallel\\) as "
                                            "'torch_bmm'") as refused:
        planner.compile(dataclasses.replace(routed, expert_implementation=PER_EXPERT_LOOP), tmp_path / "loop")
    assert "\n" not in str(refused.value)


def test_the_compiler_runs_the_loop_the_field_names_for_huggingface_experts(tmp_path):
    # A HuggingFace block expert parallel: its experts replaced by ExpertParallelExperts' loop.
    hf = hf_moe_plan(2, "mixtral", "expert_parallel", "round-robin")
    source = (planner.compile(dataclasses.replace(hf, expert_implementation=PER_EXPERT_LOOP), tmp_path / "hf")
              / "model_spmd.py").read_text()
    assert "ExpertParallelExperts(" in source and "ExpertParallelMoE(" not in source
    with pytest.raises(PlanFileError, match="as 'per_expert_loop'; leave the field empty"):
        planner.compile(dataclasses.replace(hf, expert_implementation=BATCHED_MATMUL), tmp_path / "hf-bmm")


def test_the_field_is_validated_saved_and_grouped_gemm_is_simulation_only(tmp_path):
    routed = moe_plan(2, "expert_parallel", "round-robin")
    check_choice_field(routed, "expert_implementation", TE_GROUPED_GEMM, tmp_path)
    # The report's MoE notes say which kernels priced the experts.
    assert moe_notes(routed)[-1].startswith("expert kernels: the compiled program's (one batched matmul")
    named = dataclasses.replace(routed, expert_implementation=TE_GROUPED_GEMM)
    assert moe_notes(named)[-1] == "expert kernels: te_grouped_gemm, as the plan names them"
    for kernel in (BATCHED_MATMUL, PER_EXPERT_LOOP, MODEL_EXPERTS):
        dataclasses.replace(routed, expert_implementation=kernel).save(tmp_path / f"{kernel}.json")
        assert load_plan(tmp_path / f"{kernel}.json").expert_implementation == kernel


def test_the_plans_field_prices_its_layers_and_keys_its_simulation():
    # examples/moe.py (2 MoE layers of 4 GELU experts, 64 -> 128 -> 64, top-2, capacity 1.25)
    # expert parallel on 2 H100s in bf16, round-robin: 2 experts a rank. One bmm runs a rank's
    # 2 experts as one batch of 2, the batch Transformer Engine runs them in (min(2, 4)
    # streams), with the same shape efficiency, and the capacity gives both the same rows
    # (1.25 x 2 x 256 tokens / 4 = 160 an expert, 320 a rank). So the layers differ by the
    # launches alone: forward 2 projections x (2 - 1) = 2 launches, 10 us; backward
    # 2 x 2 x (2 - 1) = 4, 20 us.
    spec = ModelSpec(str(MOE_EXAMPLE), {"n_expert": 4, "capacity_factor": 1.25, "ffn": 128})
    graph, spec, name, cluster = prepare_model(spec, "dgx-h100:1x2")
    base = data_parallel_plan(graph, cluster, spec, name, "ddp", precision="bf16")
    layouts = tuple(ExpertLayout(module=block.module, mode="expert_parallel", experts=block.experts,
                                 top_k=block.top_k, capacity_factor=block.capacity_factor, axis="dp",
                                 placement=ExpertPlacement.round_robin(block.experts, 2))
                    for block in graph.moe_blocks)
    plan = dataclasses.replace(base, label="moe", expert_layouts=layouts)
    grouped_plan = dataclasses.replace(plan, expert_implementation=TE_GROUPED_GEMM)
    own = laid_out_layers(plan, graph, 1)["blocks.0.moe"]
    grouped = laid_out_layers(grouped_plan, graph, 1)["blocks.0.moe"]
    assert own.cost.busiest_copies == grouped.cost.busiest_copies == 320
    assert grouped.cost.forward_compute_s - own.cost.forward_compute_s == pytest.approx(2 * LAUNCH, rel=1e-6)
    assert grouped.cost.backward_compute_s - own.cost.backward_compute_s == pytest.approx(4 * LAUNCH, rel=1e-6)
    # Around the GEMMs: the program's GELU over the 2 x 160 padded slots (the buffer's fill and
    # pick-back are the layer's traced ops), Megatron-Core's fused activation and permutations.
    assert (own.memory_ops_forward_s, own.memory_ops_backward_s) == pytest.approx(
        batched_gelu_times(320, 128, 2, H100))
    assert (grouped.memory_ops_forward_s, grouped.memory_ops_backward_s) == pytest.approx(
        expert_memory_op_times(grouped.block, 320, 1, 2, H100))
    # The simulation of each plan is its own (the field is part of its cache key), the longer
    # kernels never making the step shorter.
    assert simulated(grouped_plan, graph).estimate.step_time_s > simulated(plan, graph).estimate.step_time_s


def test_the_loops_memory_kernels_copy_the_whole_output_per_expert():
    # A SwiGLU block 1024 wide, experts 512 wide, top-2: a device holding N = 2,048 tokens sends
    # S = 4,096 rows and received R = 4,096 rows for its L = 4 experts (cost_model.expert_memory_ops):
    # forward 7 S W + 3 N W + (7 + 2 L) R W + 5 R F = 29,360,128 + 6,291,456 + 62,914,560
    # + 10,485,760 = 109,051,904 elements, 218.1 MB in bf16, and 7 + 7 L = 35 kernels;
    # backward 11 S W + N W + (4 + 6 L) R W + 13 R F = 46,137,344 + 2,097,152 + 117,440,512
    # + 27,262,976 = 192,937,984 elements, 385.9 MB, and 6 + 10 L = 46 kernels.
    block = MoEBlock("moe", experts=16, top_k=2, capacity_factor=0.0, hidden=1024, ffn=512, matmuls=3,
                     router="gate.weight", expert_weights=("experts.gate_up_proj", "experts.down_proj"),
                     kind="test", runtime=HF_STACKED_EXPERTS)
    forward, backward = expert_loop_times(block, received=4096, local_experts=4, held_tokens=2048, ffn=512,
                                          element=2, device=H100)
    assert forward == pytest.approx(218_103_808 / STREAM + 35 * LAUNCH)
    assert backward == pytest.approx(385_875_968 / STREAM + 46 * LAUNCH)
    assert (forward, backward) == pytest.approx((246.3e-6, 356.2e-6), rel=1e-3)
    # Megatron-Core's fused kernels on the same rows: forward 3 R F + 4 R W, 3 kernels
    # (cost_model.moe_layers.expert_memory_op_times): 41.9 MB, 28.7 us.
    megatron_forward, _ = expert_memory_op_times(block, 4096, 1, 2, H100)
    assert megatron_forward == pytest.approx((3 * 4096 * 512 + 4 * 4096 * 1024) * 2 / STREAM + 3 * LAUNCH)
    assert megatron_forward < forward / 8


def test_the_bmm_path_runs_only_its_gelu_over_the_padded_buffer():
    # 2 local experts of 160 slots, 128 wide, bf16: forward reads and writes 320 x 128 x 2 B
    # (163,840 B), backward reads 2 and writes 1 (245,760 B); one kernel each.
    forward, backward = batched_gelu_times(2 * 160, 128, 2, H100)
    assert forward == pytest.approx(163_840 / STREAM + LAUNCH)
    assert backward == pytest.approx(245_760 / STREAM + LAUNCH)


def test_folded_bmm_runs_the_whole_groups_capacity_gathered_over_etp():
    # 4 H100s folded as dp 2 x tp 2, EP 2 x ETP 2, 4 GELU experts 8192 -> 8192 -> 8192, top-2,
    # capacity 1.0, 16,384 tokens: the program routes over all 4 ranks, so an expert's buffer
    # holds ceil(1.0 x 16384 x 2 / 4) = 8,192 slots; its ETP pair gathers both ranks' buffers on
    # the slot dim (codegen.runtime.moe_folding.SlicedExperts): 16,384 rows through a 4,096-wide
    # slice, for each of the rank's 2 experts. Forward: one bmm of 2 x (16384 x 8192) @ (8192 x
    # 4096) and one of 2 x (16384 x 4096) @ (4096 x 8192): 2 x 2 x 2 x 16384 x 8192 x 4096 =
    # 4.3980e12 FLOPs, both past the MAMF shape's efficiency (4,096 tiles of 256 x 128 in 32
    # waves: 0.9697 x 8192 / 8448 = 0.9403; 8,192 in 63: 0.9851 x 4096 / 4352 = 0.9272), so at
    # 0.689385 of peak: 6.448 ms, and 2 launches.
    from cost_model.moe_folding import folded_layer_cost

    layer = MoELayer(tokens=16384, hidden=8192, ffn=8192, experts=4, top_k=2, matmuls=2)
    layout = ExpertLayout(module="blocks.0.moe", mode="expert_parallel", experts=4, top_k=2, capacity_factor=1.0,
                          axis="dp*tp", placement=ExpertPlacement.round_robin(4, 2), tensor_parallel=2)
    cost = folded_layer_cost(layer, layout, Cluster.parse("dgx-h100:1x4"), (0, 1, 2, 3), tp=2,
                             sequence_parallel=True, precision="bf16", implementation=BATCHED_MATMUL)
    assert (cost.moe.kernels.local_experts, cost.moe.kernels.rows, cost.moe.kernels.ffn) == (2, 16384, 4096)
    flops = 2 * 2 * 2 * 16384 * 8192 * 4096
    assert flops / (PEAK * SUSTAINED) == pytest.approx(6.448e-3, rel=1e-4)
    assert cost.moe.forward_compute_s == pytest.approx(flops / (PEAK * SUSTAINED) + 2 * LAUNCH)
    assert cost.moe.backward_compute_s == pytest.approx(2 * flops / (PEAK * SUSTAINED) + 4 * LAUNCH)
