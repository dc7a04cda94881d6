"""Gradient clipping by the global norm as other systems' loops run it
(``Plan.gradient_clipping``, ``cost_model.gradient_clipping``): the kernels priced by hand,
the simulated step's norm, all-reduce and scale before the optimizer step, the stages'
rendezvous at the norm's all-reduce, and the plan field validated, saved and refused by
``compile``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from benchmarks.fidelity_runs import runs
from cost_model import defaults
from cost_model.collectives import collective_time
from cost_model.compute import tensors_in_flat_shards
from cost_model.gradient_clipping import clip_kernel_times
from cost_model.simulator import simulated
from planner.api import prepare_model
from planner.cluster import Cluster
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan
from tests.simulation_only_fields import check_choice_field
from tests.test_optimizer_implementations import _fsdp_plan

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
A100 = Cluster.preset("dgx-a100-80g").device_of(0)
US = 1e-6


def test_clipping_kernels_by_hand():
    # 100e6 fp32 gradient elements on an A100 (2.039e12 B/s at 0.8 = 1.6312e12 B/s, 5 us a launch).
    assert defaults.MEMORY_EFFICIENCY == 0.8 and defaults.KERNEL_OVERHEAD_S == pytest.approx(5 * US)
    # The norm reads 4 B each: 4e8 / 1.6312e12 = 245.22 us; the scale reads and writes 8 B:
    # 490.44 us. Multi-tensor launches: ceil(100e6 / (320 x 65,536 = 20,971,520)) = 5 chunks.
    # Megatron: norm 5 chunks + l2norm cleanup + ** p = 7 launches = 35 us -> 280.22 us;
    # scale 5 launches = 25 us -> 515.44 us.
    norm, scale = clip_kernel_times("multi_tensor", 100e6, 300, A100)
    assert norm == pytest.approx(280.22 * US, rel=1e-4)
    assert scale == pytest.approx(515.44 * US, rel=1e-4)
    # torch's foreach: 5 chunks + stack, vector_norm, + eps, divide, clamp = 10 launches -> 295.22 us.
    norm, scale = clip_kernel_times("foreach", 100e6, 300, A100)
    assert norm == pytest.approx(295.22 * US, rel=1e-4)
    assert scale == pytest.approx(515.44 * US, rel=1e-4)
    # FSDP1, 300 tensors: a vector_norm each + 7 small = 307 launches = 1,535 us -> 1,780.22 us;
    # a mul_ each, 300 launches = 1,500 us -> 1,990.44 us.
    norm, scale = clip_kernel_times("per_tensor", 100e6, 300, A100)
    assert norm == pytest.approx(1780.22 * US, rel=1e-4)
    assert scale == pytest.approx(1990.44 * US, rel=1e-4)
    assert clip_kernel_times("", 100e6, 300, A100) == (0.0, 0.0)
    with pytest.raises(ValueError, match="gradient clipping must be one of"):
        clip_kernel_times("apex", 100e6, 300, A100)


def _events(plan, name: str) -> list:
    return [event for event in plan.estimate.timeline if event.name == name]


# examples/gpt.py at width 256, vocabulary 512, sequence 128, as the trace orders each unit's
# tensors (the same as tests/test_optimizer_implementations.py): a block's ln_1, c_attn,
# c_proj, ln_2, c_fc, mlp c_proj (weight, bias each); the root's wte, wpe, ln_f (w, b), lm_head.
BLOCK = [256, 256, 768 * 256, 768, 256 * 256, 256, 256, 256, 1024 * 256, 1024, 256 * 1024, 256]
ROOT = [512 * 256, 128 * 256, 256, 256, 512 * 256]


def test_the_simulated_step_clips_before_the_optimizer():
    own, graph = _fsdp_plan()
    assert not _events(own, "gradient norm (clipping)")  # a plan without the field clips nothing
    clipped = simulated(dataclasses.replace(own, gradient_clipping="per_tensor"), graph)
    # Each rank's fp32 gradient shard: (2 x 789,760 + 295,424) / 8 = 234,368 elements, in the
    # 13 tensors the busiest rank's flat shards cross (tests/test_optimizer_implementations.py).
    elements = (2 * sum(BLOCK) + sum(ROOT)) / 8
    assert elements == 234_368
    assert tensors_in_flat_shards([BLOCK, BLOCK, ROOT], 8) == 13
    # By hand: norm 234,368 x 4 B / 1.6312e12 = 0.5747 us + (13 + 7) launches x 5 us = 100.57 us;
    # scale 234,368 x 8 B / 1.6312e12 = 1.1494 us + 13 x 5 us = 66.15 us.
    norm_s, scale_s = clip_kernel_times("per_tensor", elements, 13, A100)
    assert norm_s == pytest.approx(100.57 * US, rel=1e-3)
    assert scale_s == pytest.approx(66.15 * US, rel=1e-3)
    [norm] = _events(clipped, "gradient norm (clipping)")
    [reduce] = _events(clipped, "all-reduce gradient norm")
    [scale] = _events(clipped, "scale gradients (clipping)")
    [step] = _events(clipped, "optimizer step")
    assert norm.duration_s == pytest.approx(norm_s)
    assert scale.duration_s == pytest.approx(scale_s)
    assert reduce.duration_s == pytest.approx(collective_time("all_reduce", 4, own.cluster, range(8)))
    # In order on the compute stream, the optimizer step last.
    assert norm.start_s + norm.duration_s <= reduce.start_s + 1e-12
    assert reduce.start_s + reduce.duration_s <= scale.start_s + 1e-12
    assert scale.start_s + scale.duration_s <= step.start_s + 1e-12
    # Nothing overlaps the clipping: the step is longer by exactly its three parts.
    added = norm.duration_s + reduce.duration_s + scale.duration_s
    assert clipped.estimate.step_time_s == pytest.approx(own.estimate.step_time_s + added, rel=1e-6)


def test_pipeline_stages_meet_at_the_norms_all_reduce():
    # Megatron all-reduces the squared norm over every stage, so no stage scales its gradients
    # (or steps) before the last stage to finish its backward has taken its norm.
    graph, spec, name, cluster = prepare_model(ModelSpec(GPT, {"batch_size": 8, "n_layer": 4, "n_embd": 256,
                                                               "n_head": 4, "seq_len": 128, "vocab_size": 512}),
                                               "dgx-a100-80g:1")
    plan = megatron_plan(graph, cluster, spec, name, precision="bf16", pp=2, micro_batch=1, schedule="1f1b")
    clipped = simulated(dataclasses.replace(plan, gradient_clipping="multi_tensor"), graph)
    norms = _events(clipped, "gradient norm (clipping)")
    reduces = _events(clipped, "all-reduce gradient norm")
    assert {event.device for event in norms} == {"stage 0", "stage 1"}
    last_norm_end = max(event.start_s + event.duration_s for event in norms)
    assert len(reduces) == 2
    assert all(event.start_s >= last_norm_end - 1e-12 for event in reduces)
    # The stages' norms end at different times (stage 0 runs the schedule's last backward),
    # so the rendezvous makes the earlier one wait.
    assert max(event.start_s for event in norms) > min(event.start_s for event in norms)


def test_the_field_is_validated_saved_and_refused_by_compile(tmp_path):
    own, _ = _fsdp_plan()
    check_choice_field(own, "gradient_clipping", "foreach", tmp_path)


def test_each_fidelity_row_clips_as_its_framework_does():
    by_name = {run.name: run.gradient_clipping for run in runs()}
    assert by_name["MPT-7B@8xA100"] == "per_tensor"  # Composer: FSDP1's clip_grad_norm_
    assert by_name["Llama2-13B@64xA100"] == "foreach"  # torchtitan: torch.nn.utils.clip_grad_norm_
    assert by_name["Llama3.1-405B@128xH100"] == "foreach"
    assert by_name["MCore-GPT-1.7B@48xH100"] == "multi_tensor"  # Megatron-Core's clip_grad_norm_fp32
    assert by_name["Qwen3-235B-EP32@256xH100"] == "multi_tensor"
    assert by_name["MT-NLG-530B@2240xA100"] == ""  # priced in DeepSpeed's fp16 ZeRO-1 step


def test_a_fidelity_row_carries_its_clipping_into_the_step():
    from benchmarks.fidelity import simulate
    run = next(run for run in runs() if run.name == "MPT-7B@8xH100")
    clipped, _ = simulate(run)
    without, _ = simulate(dataclasses.replace(run, gradient_clipping=""))  # fidelity.py --no-clipping
    assert clipped.gradient_clipping == "per_tensor" and without.gradient_clipping == ""
    assert not _events(without, "gradient norm (clipping)")
    [norm] = _events(clipped, "gradient norm (clipping)")
    [reduce] = _events(clipped, "all-reduce gradient norm")
    [scale] = _events(clipped, "scale gradients (clipping)")
    # One pipeline stage, nothing overlapping the step's end: longer by exactly the three parts.
    added = norm.duration_s + reduce.duration_s + scale.duration_s
    assert clipped.estimate.step_time_s == pytest.approx(without.estimate.step_time_s + added, rel=1e-9)
