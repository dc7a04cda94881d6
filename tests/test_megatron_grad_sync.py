"""Megatron-Core's distributed optimizer in the simulated step
(``Plan.megatron_distributed_optimizer``, ``cost_model.megatron_grad_sync``): gradients
reduced once per step, in fp32, by reduce-scatter, during the last micro-batch's backward;
weights gathered during the first forward; Megatron's bucket sizes; the bytes worked by hand;
and the field refused where it does not apply."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from cost_model.megatron_grad_sync import (
    bucket_cap_bytes, bucket_checks_time, hook_added_parameters, main_grad_add_time, zero_buffer_time,
)
from cost_model.simulator import Simulator, simulated
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan
from tests.simulation_only_fields import check_field_is_validated, check_simulation_only_field

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
DP = 8


def _model(batch: int = 32):
    """examples/gpt.py (width 256, 4 heads, 2 layers, 128 positions, vocabulary 512) on one
    DGX-H100: every weight has a dimension 8 divides, so ZeRO-1 slices all of them."""
    return prepare_model(ModelSpec(GPT, {"batch_size": batch, "n_layer": 2, "n_embd": 256, "n_head": 4,
                                         "seq_len": 128, "vocab_size": 512}), "dgx-h100:1")


def _accumulating(megatron: bool):
    """dp = 8 ZeRO-1 (Megatron's layout, no tp), 4 micro-batches of one sample per rank."""
    graph, spec, name, cluster = _model()
    plan = megatron_plan(graph, cluster, spec, name, precision="bf16", dp_flavour="zero1")
    plan = simulated(dataclasses.replace(plan, accumulation_steps=4, megatron_distributed_optimizer=megatron), graph)
    return graph, plan


def _tasks(plan, device: str, prefix: str):
    return [event for event in plan.estimate.timeline if event.device == device and event.name.startswith(prefix)]


def test_bucket_sizes_are_megatrons() -> None:
    """max(40M, 1M x dp) parameters of 4-byte gradients on the first stage: dp 8 -> 40M x 4 =
    160 MB; dp 48 -> 48M x 4 = 192 MB; a later stage's gradients are one bucket."""
    assert bucket_cap_bytes(SimpleNamespace(dp=8), 0) == 160e6
    assert bucket_cap_bytes(SimpleNamespace(dp=48), 0) == 192e6
    assert bucket_cap_bytes(SimpleNamespace(dp=48), 1) == float("inf")


def test_gradients_are_reduce_scattered_once_after_the_last_backward() -> None:
    """Four micro-batches: the planner's ZeRO-1 graph program all-reduces each segment's
    gradients after every micro-batch's backward; Megatron's gradients (P of them, fp32: 4P
    bytes, under one 160 MB bucket) fill one bucket, checked and scaled on the compute stream
    when the last micro-batch's backward (B3) ends, then reduce-scattered once."""
    _, planner_zero1 = _accumulating(megatron=False)
    graph, megatron = _accumulating(megatron=True)
    segments = [segment for segment in Simulator(megatron, graph).segments() if segment.dp_synced]
    assert len(_tasks(planner_zero1, "stage 0", "all-reduce grads (")) == 4 * len(segments)
    reductions = _tasks(megatron, "stage 0", "reduce-scatter grads")
    assert len(reductions) == 1 and not _tasks(megatron, "stage 0", "all-reduce grads (")
    last_backward_end = max(event.start_s + event.duration_s for event in _tasks(megatron, "stage 0", "B3 "))
    checks = _tasks(megatron, "stage 0", "check and scale grads")
    assert len(checks) == 1 and checks[0].start_s == pytest.approx(last_backward_end)
    assert reductions[0].start_s == pytest.approx(checks[0].start_s + checks[0].duration_s)
    context = Simulator(megatron, graph).context
    fp32_bytes = 4 * megatron.summary.parameters
    assert reductions[0].duration_s == pytest.approx(context.collective("reduce_scatter", fp32_bytes, "dp"))


def test_full_buckets_are_reduced_during_the_last_backward(monkeypatch) -> None:
    """With buckets smaller than a segment (Megatron's minimum lowered to one parameter: 8 x
    4 = 32-byte buckets), each segment's buckets are reduced once its backward of the last
    micro-batch ends and they are checked and scaled (queued behind the ones before on the
    collective stream), the first while the segments after it still run backward; none in an
    earlier micro-batch."""
    monkeypatch.setattr("cost_model.megatron_grad_sync.BUCKET_MIN_PARAMETERS", 1)
    monkeypatch.setattr("cost_model.megatron_grad_sync.BUCKET_PARAMETERS_PER_DP_RANK", 1)
    graph, megatron = _accumulating(megatron=True)
    segments = [segment for segment in Simulator(megatron, graph).segments() if segment.dp_synced]
    reductions = _tasks(megatron, "stage 0", "reduce-scatter grads")
    assert len(reductions) == len(segments)
    last_backward = {event.name.removeprefix("B3 "): event for event in _tasks(megatron, "stage 0", "B3 ")}
    for reduction in reductions:  # queued one after another on the collective stream
        backward = last_backward[reduction.name.split("(")[1].split(",")[0].rstrip(")")]
        assert reduction.start_s >= backward.start_s + backward.duration_s - 1e-12
    first = min(reductions, key=lambda reduction: reduction.start_s)
    segment = first.name.split("(")[1].split(",")[0].rstrip(")")
    backward = last_backward[segment]
    check = next(event for event in _tasks(megatron, "stage 0", f"check and scale grads ({segment}"))
    assert check.start_s == pytest.approx(backward.start_s + backward.duration_s)
    assert first.start_s == pytest.approx(check.start_s + check.duration_s)
    assert first.start_s < max(event.start_s + event.duration_s for event in last_backward.values())


def test_weights_are_gathered_during_the_first_forward_not_after_the_step() -> None:
    """Each segment's updated bf16 weights arrive before its first forward (F0) starts, and
    nothing is gathered after the optimizer step (the planner's ZeRO-1 gathers there)."""
    _, planner_zero1 = _accumulating(megatron=False)
    _, megatron = _accumulating(megatron=True)
    assert _tasks(planner_zero1, "stage 0", "all-gather updated slices")
    assert not _tasks(megatron, "stage 0", "all-gather updated slices")
    gathers = {event.name.removeprefix("all-gather updated weights "): event
               for event in _tasks(megatron, "stage 0", "all-gather updated weights")}
    forwards = {event.name.removeprefix("F0 "): event for event in _tasks(megatron, "stage 0", "F0 ")}
    assert gathers and set(gathers) <= set(forwards)
    for segment, gather in gathers.items():
        assert gather.start_s + gather.duration_s <= forwards[segment].start_s + 1e-12


def test_data_parallel_bytes_by_hand() -> None:
    """P parameters, dp = 8, 4 micro-batches. Megatron: one fp32 reduce-scatter (4P) and one
    bf16 all-gather (2P), each moving 7/8 of its bytes: 6P x 7/8. The planner's ZeRO-1 graph
    program, whose bf16 autocast keeps fp32 weights and gradients (cost_model.mixed_precision):
    an fp32 all-reduce (2 x 4P) after each of the 4 micro-batches and an fp32 all-gather of
    the updated slices (4P): (32P + 4P) x 7/8 = 36P x 7/8, six times as much."""
    graph, megatron = _accumulating(megatron=True)
    _, planner_zero1 = _accumulating(megatron=False)
    parameters = megatron.summary.parameters
    assert megatron.estimate.bytes_per_axis["dp"] == pytest.approx(6 * parameters * 7 / 8)
    assert planner_zero1.estimate.bytes_per_axis["dp"] == pytest.approx(36 * parameters * 7 / 8)


def test_a_later_pipeline_stage_reduces_and_gathers_in_one_bucket() -> None:
    """pp = 2 x dp = 4, 1F1B over 8 micro-batches: stage 1's gradients are one bucket, checked
    and scaled once after its last backward ends, then reduced; its weights one gather, before
    its first forward."""
    graph, spec, name, cluster = _model()
    plan = megatron_plan(graph, cluster, spec, name, pp=2, precision="bf16", dp_flavour="zero1")
    plan = simulated(dataclasses.replace(plan, megatron_distributed_optimizer=True), graph)
    reductions = _tasks(plan, "stage 1", "reduce-scatter grads")
    checks = _tasks(plan, "stage 1", "check and scale grads")
    assert len(reductions) == 1 and len(checks) == 1
    backward_end = max(event.start_s + event.duration_s for event in _tasks(plan, "stage 1", "B"))
    assert checks[0].start_s == pytest.approx(backward_end)
    assert reductions[0].start_s == pytest.approx(checks[0].start_s + checks[0].duration_s)
    gathers = _tasks(plan, "stage 1", "all-gather updated weights")
    first_forward = min(event.start_s for event in _tasks(plan, "stage 1", "F0 "))
    assert len(gathers) == 1 and gathers[0].start_s + gathers[0].duration_s <= first_forward + 1e-12


def test_the_field_needs_zero1_and_is_refused_by_compile(tmp_path) -> None:
    """Megatron's distributed optimizer is ZeRO-1: on another flavour the plan says so in one
    line; set, it survives the plan file and ``compile`` refuses it."""
    graph, megatron = _accumulating(megatron=True)
    check_field_is_validated(megatron, "megatron_distributed_optimizer", {"dp_flavour": "ddp"},
                             "'megatron_distributed_optimizer' is true but dp_flavour is 'ddp'")
    check_simulation_only_field(megatron, "megatron_distributed_optimizer", tmp_path)


H100_BANDWIDTH = 3.35e12  # the dgx-h100 preset's HBM3, bytes/s
LAUNCH = 5e-6  # cost_model.defaults.KERNEL_OVERHEAD_S


def test_bucket_checks_and_buffer_fill_by_hand() -> None:
    """A 192 MB bucket (48M fp32 gradients: dp 48's size) on an H100: the NaN check's norm reads
    it at 0.8 of 3.35 TB/s, 192e6 / 2.68e12 = 71.64 us, plus a 5 us launch; the 1/dp scaling
    reads and writes it, 384e6 / (0.913 x 3.35e12) = 125.55 us, plus 5 us: 207.19 us. Two such
    buckets, 414.38 us. Zeroing 1.75B fp32 gradients (MCore-GPT-1.7B's buffer) writes 7.0 GB:
    7.0e9 / (0.913 x 3.35e12) = 2.2887 ms, plus 5 us."""
    context = SimpleNamespace(device=_model()[3].device_of(0))
    one = 192e6 / (0.8 * H100_BANDWIDTH) + LAUNCH + 384e6 / (0.913 * H100_BANDWIDTH) + LAUNCH
    assert one == pytest.approx(207.19e-6, rel=1e-4)
    assert bucket_checks_time(context, 192e6) == pytest.approx(one)
    assert bucket_checks_time(context, 192e6, buckets=2) == pytest.approx(2 * one)
    assert bucket_checks_time(context, 0.0) == 0.0
    assert zero_buffer_time(context, 1.75e9) == pytest.approx(7.0e9 / (0.913 * H100_BANDWIDTH) + LAUNCH)
    assert zero_buffer_time(context, 1.75e9) == pytest.approx(2.2937e-3, rel=1e-4)


def test_the_gradient_buffer_is_zeroed_after_the_optimizer_step() -> None:
    """Megatron's ``zero_grad_buffer`` fills the whole fp32 buffer, 4 bytes for each of the P
    local parameters (dp does not divide it), on the compute stream after the update, and the
    step ends with it; the planner's own ZeRO-1 (torch's zero_grad sets gradients to None) has
    neither it nor the buckets' checks."""
    graph, megatron = _accumulating(megatron=True)
    _, planner_zero1 = _accumulating(megatron=False)
    context = Simulator(megatron, graph).context
    step = _tasks(megatron, "stage 0", "optimizer step")
    fills = _tasks(megatron, "stage 0", "zero fp32 gradient buffer")
    assert len(step) == 1 and len(fills) == 1
    assert fills[0].start_s == pytest.approx(step[0].start_s + step[0].duration_s)
    assert fills[0].duration_s == pytest.approx(zero_buffer_time(context, megatron.summary.parameters))
    assert fills[0].duration_s == pytest.approx(4 * megatron.summary.parameters / (0.913 * H100_BANDWIDTH) + LAUNCH)
    assert megatron.estimate.step_time_s == pytest.approx(fills[0].start_s + fills[0].duration_s)
    assert not _tasks(planner_zero1, "stage 0", "zero fp32 gradient buffer")
    assert not _tasks(planner_zero1, "stage 0", "check and scale grads")


def test_the_ddp_hook_adds_autograds_gradients_into_main_grad_every_micro_batch(monkeypatch) -> None:
    """Megatron's DDP hook adds every gradient the weight-gradient GEMMs did not accumulate
    themselves into the fp32 main_grad, on each micro-batch: the embeddings (wte 512 x 256 =
    131,072 and wpe 128 x 256 = 32,768 elements), each block's norm weights and biases and
    linear biases (768 + 256 + 4 x 256 + 1024 + 256 = 3,328 elements in 8 tensors), ln_f's two;
    no 2-D matmul weight. Each add reads 4 + 2 bytes and writes 4 per element at 0.913 of
    3.35 TB/s, plus a 5 us launch: before the blocks 1,310,720 B / 3.0586e12 = 0.4286 us and
    327,680 B -> 0.1071 us, + 10 us = 10.536 us; a block 33,280 B -> 0.0109 us + 40 us =
    40.011 us. Each of the 4 micro-batches' backward is longer by exactly its segments' adds
    than the same step with the adds priced at zero: the first three (one task each, no
    reduction after them) by 10.536 + 2 x 40.011 + ln_f's, the last segment by segment."""
    graph, megatron = _accumulating(megatron=True)
    simulator = Simulator(megatron, graph)
    segments = {segment.name: segment for segment in simulator.segments()}
    context = simulator.context
    assert hook_added_parameters(context, segments["before blocks"]) == ["wpe.weight", "wte.weight"]
    assert hook_added_parameters(context, segments["blocks.0"]) == sorted(
        f"blocks.0.{name}" for name in ("attn.c_attn.bias", "attn.c_proj.bias", "ln_1.bias", "ln_1.weight",
                                        "ln_2.bias", "ln_2.weight", "mlp.c_fc.bias", "mlp.c_proj.bias"))
    assert hook_added_parameters(context, segments["after blocks"]) == ["ln_f.bias", "ln_f.weight"]
    streaming = 0.913 * H100_BANDWIDTH
    embeddings = 131072 * 10 / streaming + 32768 * 10 / streaming + 2 * LAUNCH
    block = 3328 * 10 / streaming + 8 * LAUNCH
    assert embeddings == pytest.approx(10.536e-6, rel=1e-4) and block == pytest.approx(40.011e-6, rel=1e-4)
    assert main_grad_add_time(context, segments["before blocks"]) == pytest.approx(embeddings)
    assert main_grad_add_time(context, segments["blocks.0"]) == pytest.approx(block)
    monkeypatch.setattr("cost_model.step_tasks.main_grad_add_time", lambda context, segment: 0.0)
    without = simulated(dataclasses.replace(megatron, estimate=None), graph)
    final_norm = 2 * 256 * 10 / streaming + 2 * LAUNCH
    for name, added in (("B0", embeddings + 2 * block + final_norm), ("B1", embeddings + 2 * block + final_norm),
                        ("B2", embeddings + 2 * block + final_norm), ("B3 before blocks", embeddings),
                        ("B3 blocks.1", block), ("B3 after blocks", final_norm)):
        (priced,) = [event for event in _tasks(megatron, "stage 0", name) if event.name == name]
        (free,) = [event for event in _tasks(without, "stage 0", name) if event.name == name]
        assert priced.duration_s - free.duration_s == pytest.approx(added, rel=1e-6)
