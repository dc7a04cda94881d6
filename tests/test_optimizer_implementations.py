"""AdamW as other systems' programs step it (``Plan.optimizer_implementation``): Composer's
per-parameter ``DecoupledAdamW`` priced by hand, the tensors an FSDP1 rank's flat-parameter
shard holds counted by hand, and the plan field validated, saved, refused by ``compile``
and used by the simulated step."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest

from cost_model import defaults
from cost_model.compute import optimizer_step_time, tensors_in_flat_shards
from cost_model.simulator import simulated
from planner.api import prepare_model
from planner.cluster import Cluster
from planner.model_spec import ModelSpec
from search.data_parallel import fsdp_units
from search.megatron import megatron_plan
from tests.simulation_only_fields import check_choice_field

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
A100 = Cluster.preset("dgx-a100-80g").device_of(0)


def test_composer_per_parameter_adamw_by_hand():
    # 1e9 bytes of fp32 weight + gradient + two states = 62.5e6 elements. Composer's loop
    # without weight decay streams 20 fp32 accesses per element: 1e9 * 20 / 4 = 5e9 bytes at
    # 0.8 x 2.039e12 B/s = 3.0652 ms; 100 tensors x 10 launches (step += 1, .item()'s copy,
    # 8 ops) x 5 us = 5 ms. Fused: 7 accesses, 1.0728 ms + 3 chunk launches.
    streamed = 1e9 * 20 / 4 / (2.039e12 * defaults.MEMORY_EFFICIENCY)
    assert streamed == pytest.approx(3.0652e-3, rel=1e-4)
    per_parameter = optimizer_step_time(1e9, A100, "per_parameter", tensors=100)
    assert per_parameter == pytest.approx(streamed + 100 * 10 * defaults.KERNEL_OVERHEAD_S)
    assert per_parameter == pytest.approx(8.0652e-3, rel=1e-4)
    assert optimizer_step_time(1e9, A100, "foreach") > optimizer_step_time(1e9, A100)


def test_foreach_adamw_reproduces_torchtitans_measured_gap():
    # torchtitan PR #355: Llama-3-8B (8.03e9 parameters) with FSDP2 on 8 A100-80GB, foreach
    # AdamW at 2,632 tokens/s/GPU, fused "+ ~100": 8192/2632 - 8192/2732 = 113.9 ms per step.
    # Each GPU steps 1.004e9 fp32 parameters, 16 bytes each (weight, gradient, two states).
    measured = 8192 / 2632 - 8192 / 2732
    assert measured == pytest.approx(0.1139, rel=1e-3)
    state_bytes = 16 * 8.03e9 / 8
    # Fused: 28 B x 1.004e9 / (2.039e12 x 0.8) = 17.23 ms + 48 chunk launches x 5 us = 17.47 ms.
    fused = optimizer_step_time(state_bytes, A100)
    assert fused == pytest.approx(17.47e-3, rel=2e-3)
    # Foreach: 80 B x 1.004e9 / (2.039e12 x 0.304) = 129.5 ms + 384 launches x 5 us = 131.5 ms.
    foreach = optimizer_step_time(state_bytes, A100, "foreach")
    assert foreach == pytest.approx(131.5e-3, rel=2e-3)
    assert foreach - fused == pytest.approx(measured, rel=0.01)


def test_compiled_programs_step_torchs_default_adamw():
    # A compiled program builds torch.optim.AdamW(params, lr=...): torch picks foreach for
    # CUDA tensors and DTensors and the single-tensor loop on CPU tensors, and so does the
    # simulator (cost_model.compute.optimizer_implementation).
    import torch
    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import _default_to_fused_or_foreach, _foreach_supported_types

    from cost_model.compute import optimizer_implementation
    assert DTensor in _foreach_supported_types
    on_cpu = _default_to_fused_or_foreach([torch.zeros(2)], differentiable=False, use_fused=False)
    assert on_cpu == (False, False)  # the single-tensor loop
    assert optimizer_implementation("gloo") == "single_tensor"
    assert optimizer_implementation("nccl") == "foreach"


def test_flat_shards_hold_the_tensors_their_ranges_cross():
    # One unit of tensors of 6, 2 and 8 elements (16) over 4 ranks: shards [0,4) [4,8) [8,12)
    # [12,16). Rank 0 holds the first tensor; rank 1 its end and all of the second (2); rank 2
    # and rank 3 the third. Busiest: 2.
    assert tensors_in_flat_shards([[6, 2, 8]], 4) == 2
    # Two such units: the same rank is busiest in each, 2 + 2.
    assert tensors_in_flat_shards([[6, 2, 8], [6, 2, 8]], 4) == 4
    # 15 elements over 4 ranks are padded to 16 (shards of 4); an empty tensor is held by none.
    assert tensors_in_flat_shards([[1, 1, 1, 0, 12]], 4) == 4
    # One rank holds everything.
    assert tensors_in_flat_shards([[3, 4], [5]], 1) == 3


@functools.cache
def _fsdp_plan():
    """examples/gpt.py (width 256, 2 layers) as FSDP units over the 8 GPUs of one DGX-A100."""
    graph, spec, name, cluster = prepare_model(ModelSpec(GPT, {"batch_size": 8, "n_layer": 2, "n_embd": 256,
                                                               "n_head": 4, "seq_len": 128, "vocab_size": 512}),
                                               "dgx-a100-80g:1")
    plan = megatron_plan(graph, cluster, spec, name, precision="bf16", dp_flavour="fsdp")
    return simulated(dataclasses.replace(plan, fsdp_units=fsdp_units(graph)), graph), graph


def _optimizer_s(plan) -> float:
    return max(event.duration_s for event in plan.estimate.timeline if event.name == "optimizer step")


# examples/gpt.py at width 256, vocabulary 512, sequence 128, as the trace orders each unit's
# tensors: a block's ln_1 (w, b), c_attn (w, b), c_proj (w, b), ln_2 (w, b), c_fc (w, b), mlp
# c_proj (w, b); the root's wte, wpe, ln_f (w, b), lm_head.
BLOCK = [256, 256, 768 * 256, 768, 256 * 256, 256, 256, 256, 1024 * 256, 1024, 256 * 1024, 256]
ROOT = [512 * 256, 128 * 256, 256, 256, 512 * 256]


def test_the_simulated_step_prices_the_plans_optimizer():
    # By hand, over 8 ranks: a block is 789,760 elements, shards of 98,720; rank 2's
    # [197,440, 296,160) crosses c_attn's bias, c_proj (w, b), ln_2 (w, b) and c_fc's weight:
    # 6 tensors (the most; rank 0: 3, rank 5: 3, the others 1-2). The root's 295,424 elements
    # in shards of 36,928 give rank 2 a piece of wte only. Rank 2 steps 6 + 6 + 1 = 13.
    assert tensors_in_flat_shards([BLOCK, BLOCK, ROOT], 8) == 13
    own, graph = _fsdp_plan()
    fused = simulated(dataclasses.replace(own, optimizer_implementation="fused"), graph)
    composer = simulated(dataclasses.replace(own, optimizer_implementation="per_parameter"), graph)
    # Each rank's fp32 weight, gradient and two states: 16 bytes x (2 x 789,760 + 295,424) / 8.
    state_bytes = 16 * (2 * sum(BLOCK) + sum(ROOT)) / 8
    # The compiled program's own: torch's default on CUDA, foreach.
    assert _optimizer_s(own) == pytest.approx(optimizer_step_time(state_bytes, A100, "foreach"))
    assert _optimizer_s(fused) == pytest.approx(optimizer_step_time(state_bytes, A100))
    assert _optimizer_s(composer) == pytest.approx(optimizer_step_time(state_bytes, A100, "per_parameter", tensors=13))
    # Nothing overlaps the optimizer step: the step is longer by exactly the difference.
    extra = _optimizer_s(composer) - _optimizer_s(fused)
    assert composer.estimate.step_time_s == pytest.approx(fused.estimate.step_time_s + extra, rel=1e-6)


def test_the_field_is_validated_saved_and_refused_by_compile(tmp_path):
    # A plan written without the field is the compiled program's own optimizer, and the field
    # is not written where it is unset.
    fused, _ = _fsdp_plan()
    check_choice_field(fused, "optimizer_implementation", "per_parameter", tmp_path)
