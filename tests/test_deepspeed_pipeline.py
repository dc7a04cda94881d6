"""DeepSpeed's pipeline engine as the simulator prices it: partitioned boundary sends, the
per-micro-batch gradient accumulation, and gradient reduction after the schedule. Costs are
worked by hand on a toy α–β cluster (1e9 B/s, 1 µs links; memory 1e11 B/s at the default
0.8 efficiency, 5 µs per kernel)."""

from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import pytest

from cost_model.compute import gradient_accumulation_time
from cost_model.schedules import deepspeed_train_steps, one_f_one_b
from cost_model.simulator import Simulator
from planner.api import prepare_model
from planner.cluster import Cluster, DeviceSpec, LinkSpec, NodeSpec
from planner.model_spec import ModelSpec
from planner.plans import load_plan
from planner.strategy import PipelineConfig
from search.megatron import megatron_plan

GPT = str(Path(__file__).resolve().parent.parent / "examples" / "gpt.py")
LINK = LinkSpec(bandwidth=1e9, latency=1e-6)
DEVICE = DeviceSpec(name="toy", peak_flops={"float32": 1e12}, memory_bytes=10**10, memory_bandwidth=1e11)
TOY = {"n_layer": 4, "n_embd": 64, "n_head": 4, "seq_len": 32, "vocab_size": 32, "batch_size": 8}
STREAMING = 1e11 * 0.8  # bytes/s a memory-bound kernel moves on DEVICE (defaults.MEMORY_EFFICIENCY)
LAUNCH = 5e-6  # defaults.KERNEL_OVERHEAD_S


def _toy(devices: int, **overrides):
    cluster = Cluster(name="toy", nodes=(NodeSpec(DEVICE, devices, LINK),), inter_link=LINK, backend="gloo")
    graph, spec, name, _ = prepare_model(ModelSpec(GPT, {**TOY, **overrides}), cluster)
    return cluster, graph, spec, name


def test_gradient_accumulation_costs_worked_by_hand():
    # One million elements in 4 tensors.
    # autograd: the first micro-batch's gradient is stolen into param.grad (free); a later one
    # is added in place, reading 2 + 2 bytes and writing 2: 6e6 B / 8e10 B/s + 4 launches.
    assert gradient_accumulation_time(1e6, 4, "autograd", True, DEVICE) == 0.0
    assert gradient_accumulation_time(1e6, 4, "autograd", False, DEVICE) == pytest.approx(6e6 / STREAMING + 4 * LAUNCH)
    # fp32-copy (BF16_Optimizer): cast (2 in, 4 out) and add (4 + 4 in, 4 out) = 18 bytes and
    # two kernels per tensor, every micro-batch.
    for first in (True, False):
        assert gradient_accumulation_time(1e6, 4, "fp32-copy", first, DEVICE) == pytest.approx(
            18e6 / STREAMING + 8 * LAUNCH)
        assert gradient_accumulation_time(1e6, 4, "in-gemm", first, DEVICE) == 0.0
    with pytest.raises(ValueError, match="gradient accumulation must be one of"):
        gradient_accumulation_time(1e6, 4, "fused", False, DEVICE)


def test_pipeline_config_refuses_unknown_engine_settings():
    with pytest.raises(ValueError, match="gradient_accumulation must be one of"):
        PipelineConfig(stages=2, gradient_accumulation="fp64")
    with pytest.raises(ValueError, match="partitioned_p2p must be true or false"):
        PipelineConfig(stages=2, partitioned_p2p="yes")
    with pytest.raises(ValueError, match="overlap_grad_reduce must be true or false"):
        PipelineConfig(stages=2, overlap_grad_reduce=1)


def test_partitioned_sends_carry_a_tp_slice_and_the_receiver_gathers_it():
    # tp=2 x pp=2 on one node of 4. The boundary tensor of a micro-batch of 2: 2 x 32 x 64
    # bf16 values = 8192 bytes, replicated over tp. Partitioned, each rank sends its half:
    # 1 µs + 4096 / 1e9 = 5.096 µs; the receiver all-gathers 8192 bytes over 2 ranks on the
    # ring: 1/2 x 8192 / 1e9 + 1 µs = 5.096 µs. Forward: one gather per micro-batch on the
    # receiving stage; backward: the gradient's and the sender's own output, two per
    # micro-batch on stage 0.
    cluster, graph, spec, name = _toy(4)
    whole = megatron_plan(graph, cluster, spec, name, tp=2, pp=2, micro_batch=2, blocking_p2p=True)
    parted = megatron_plan(graph, cluster, spec, name, tp=2, pp=2, micro_batch=2, blocking_p2p=True,
                           partitioned_p2p=True)
    assert parted.pipeline.partitioned_p2p
    full_sends = [e for e in Simulator(whole, graph).run().timeline if e.name.startswith("send")]
    timeline = Simulator(parted, graph).run().timeline
    sends = [e for e in timeline if e.name.startswith("send")]
    assert len(sends) == len(full_sends) == 2 * 4
    assert all(e.duration_s == pytest.approx(1e-6 + 8192 / 1e9) for e in full_sends)
    assert all(e.duration_s == pytest.approx(1e-6 + 4096 / 1e9) for e in sends)
    gathers = [e for e in timeline if e.name.startswith("gather")]
    assert sorted((e.device, e.name.split(" ")[1]) for e in gathers) == sorted(
        [("stage 1", "act")] * 4 + [("stage 0", "grad")] * 4 + [("stage 0", "output")] * 4)
    assert all(e.stream == "compute" and e.duration_s == pytest.approx(8192 / 2 / 1e9 + 1e-6) for e in gathers)
    # Each pass starts after the gathers that rebuild what it reads.
    for gather in gathers:
        mb = gather.name.split("mb")[1]
        needs = "F" if gather.name.startswith("gather act") else "B"
        first = min(e.start_s for e in timeline if e.device == gather.device and e.name.split(" ")[0] == f"{needs}{mb}")
        assert first >= gather.start_s + gather.duration_s - 1e-12


def test_gradient_accumulation_runs_after_each_micro_batch_backward():
    # pp=2 on 2 devices, 4 micro-batches of 2. Stage 1 holds blocks 2 and 3, ln_f and the
    # LM head: per block, ln_1 and ln_2 (2 x 128), attention c_attn (64 x 192 + 192) and
    # c_proj (64 x 64 + 64), MLP c_fc (64 x 256 + 256) and c_proj (256 x 64 + 64) = 49,984
    # elements in 12 tensors; ln_f 128 in 2; the head 64 x 32 = 2,048 in 1 (no bias):
    # 102,144 elements in 27 tensors. "autograd" adds micro-batches 1-3 (6 bytes each).
    cluster, graph, spec, name = _toy(2)
    plan = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, gradient_accumulation="autograd")
    timeline = Simulator(plan, graph).run().timeline
    added = sorted((e.name.split(" ")[0], e.duration_s) for e in timeline
                   if e.device == "stage 1" and e.name.endswith("accumulate grads"))
    elements, tensors = 2 * 49_984 + 128 + 2_048, 2 * 12 + 2 + 1
    assert [mb for mb, _ in added] == ["B1", "B2", "B3"]
    assert all(seconds == pytest.approx(6 * elements / STREAMING + tensors * LAUNCH) for _, seconds in added)


def test_reduction_after_the_schedule_waits_for_the_whole_last_backward():
    # pp=2 x dp=2: with overlap the gradient buckets of the last micro-batch start reducing
    # while its backward runs; DeepSpeed's ReduceGrads starts them after it ends. Width 512:
    # a block's gradients (about 3.1M bf16 elements) fill DDP's 1 MiB first bucket.
    cluster, graph, spec, name = _toy(4, n_embd=512, n_head=8)
    for overlap in (True, False):
        plan = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, overlap_grad_reduce=overlap)
        timeline = Simulator(plan, graph).run().timeline
        for device in ("stage 0", "stage 1"):
            last_backward = max(e.start_s + e.duration_s for e in timeline
                                if e.device == device and e.name.startswith("B1 "))
            reductions = [e for e in timeline if e.device == device and "grads" in e.name and e.stream == "collective"]
            assert reductions
            first = min(e.start_s for e in reductions)
            if overlap:
                assert first < last_backward
            else:
                assert first >= last_backward - 1e-12


def test_deepspeed_train_schedule_worked_by_hand():
    # Stage 1 of 3, 3 micro-batches: 2 x (3 + 3 - 1) = 10 steps; an odd stage forwards on odd
    # steps (micro-batch (step - 1) // 2) and runs backward on even ones (step // 2 - 2).
    # Step 1: receive and run F0; step 2: send F0's output (no valid backward yet); step 3: F1;
    # step 4: send F1's output, receive B0's gradient, B0; step 5: receive for F2, send B0's
    # input gradient, F2; and so on (deepspeed/runtime/pipe/schedule.py, TrainSchedule).
    assert deepspeed_train_steps(1, 3, 3) == [
        ("recv act", 0), ("F", 0), ("send act", 0), ("recv act", 1), ("F", 1), ("send act", 1), ("recv grad", 0),
        ("B", 0), ("recv act", 2), ("send grad", 0), ("F", 2), ("send act", 2), ("recv grad", 1), ("B", 1),
        ("send grad", 1), ("recv grad", 2), ("B", 2), ("send grad", 2),
    ]
    # Its passes are 1F1B's, on every stage.
    for stages, micro_batches in ((2, 4), (4, 3), (5, 8)):
        for stage in range(stages):
            passes = [step for step in deepspeed_train_steps(stage, stages, micro_batches) if step[0] in ("F", "B")]
            assert passes == [(kind, mb) for kind, mb, _ in one_f_one_b(stage, stages, micro_batches)]


def _rendezvous_makespan(stages: int, micro_batches: int, forward_s: float, backward_s: float) -> float:
    """When the last stage finishes, running ``deepspeed_train_steps`` with every send and
    receive a rendezvous (both sides start it together; transfers take no time)."""
    program = {stage: deepspeed_train_steps(stage, stages, micro_batches) for stage in range(stages)}
    partner = {"send act": (1, "recv act"), "recv act": (-1, "send act"),
               "send grad": (-1, "recv grad"), "recv grad": (1, "send grad")}
    position = dict.fromkeys(program, 0)
    clock = dict.fromkeys(program, 0.0)
    moved = True
    while moved:
        moved = False
        for stage, steps in program.items():
            while position[stage] < len(steps):
                what, mb = steps[position[stage]]
                if what in ("F", "B"):
                    clock[stage] += forward_s if what == "F" else backward_s
                else:
                    step, matching = partner[what]
                    other = stage + step
                    if program[other][position[other]:position[other] + 1] != [(matching, mb)]:
                        break
                    clock[stage] = clock[other] = max(clock[stage], clock[other])
                    position[other] += 1
                position[stage] += 1
                moved = True
    assert all(position[stage] == len(steps) for stage, steps in program.items()), "deadlock"
    return max(clock.values())


def test_rendezvous_sends_in_train_schedule_order_cost_no_more_than_1f1b():
    # Neighbouring stages run opposite passes at each step (one forwards while the other runs
    # backward), yet blocking sends in TrainSchedule's order do not hold each step to the longer
    # pass: with forward 1 and backward 3 (full recomputation: recompute + 2x), the step is
    # 1F1B's (m + pp - 1)(f + b), not (m + pp - 1) x 2b. MT-NLG's shape: pp 35, 240 micro-batches.
    for stages, micro_batches in ((2, 8), (4, 16), (35, 240)):
        assert _rendezvous_makespan(stages, micro_batches, 1.0, 3.0) == (micro_batches + stages - 1) * 4.0


def test_a_blocking_send_waits_for_the_receiver_to_arrive():
    # pp=3 (3 layers): a transfer starts when both its stages are ready, so each one starts no earlier
    # than the end of whatever its receiver ran before the matching receive.
    cluster, graph, spec, name = _toy(3, n_layer=3)
    plan = megatron_plan(graph, cluster, spec, name, pp=3, micro_batch=2, blocking_p2p=True)
    timeline = Simulator(plan, graph).run().timeline
    def partner(send):
        stage = int(send.device.split(" ")[1]) + (1 if send.name.startswith("send act") else -1)
        return next(e for e in timeline if e.name == "recv" + send.name[len("send"):] and e.device == f"stage {stage}")
    for send in (e for e in timeline if e.name.startswith("send")):
        receive = partner(send)
        before = [e for e in timeline if e.device == receive.device and e.stream == "compute"
                  and e.start_s + e.duration_s <= receive.start_s + 1e-12 and e.duration_s > 0]
        assert send.start_s == pytest.approx(receive.start_s)
        assert send.start_s >= max((e.start_s + e.duration_s for e in before), default=0.0) - 1e-12
    # Somewhere a sender waits: a send starts after its own stage's previous task ended.
    waited = 0
    for send in (e for e in timeline if e.name.startswith("send")):
        own = [e for e in timeline if e.device == send.device and e.stream == "compute" and e.duration_s > 0
               and e.start_s + e.duration_s <= send.start_s + 1e-12]
        waited += send.start_s > max(e.start_s + e.duration_s for e in own) + 1e-9
    assert waited > 0


def test_fp32_copy_keeps_fp32_gradients_beside_the_16_bit_ones():
    # BF16_Optimizer's fp32 gradient buffer (4 bytes per element) is the size of the whole
    # group, kept beside the bf16 gradients (2 bytes) each backward writes: 6 bytes, not 2.
    cluster, graph, spec, name = _toy(2)
    memory = {mode: megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, gradient_accumulation=mode)
              .estimate.memory.gradients for mode in ("in-gemm", "fp32-copy")}
    assert memory["fp32-copy"] == pytest.approx(3 * memory["in-gemm"])


def test_tied_weight_gradients_are_all_reduced_between_their_stages_before_the_reduction():
    # pp=2 x dp=2 on one node of 4, GPT with its embedding tied to the LM head (stage 0 and
    # stage 1 each hold wte.weight: 32 x 64 = 2,048 elements). After the last backward both
    # stages all-reduce its bf16 gradient (4,096 bytes) between ranks 0 and 2 (DeepSpeed's
    # ReduceTiedGrads), on the 2-rank ring: 2 x 1/2 x 4096 / 1e9 + 2 x 1 µs = 6.096 µs; in
    # fp32 (BF16_Optimizer's _hp_grad, "fp32-copy") 8,192 bytes: 10.192 µs. Both start
    # together, after each stage's last backward, and the data-parallel reduction waits.
    cluster, graph, spec, name = _toy(4, tie_weights=True)
    for mode, seconds in (("in-gemm", 6.096e-6), ("fp32-copy", 10.192e-6)):
        plan = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, blocking_p2p=True,
                             overlap_grad_reduce=False, gradient_accumulation=mode)
        # DeepSpeed's engine holds 16-bit weights and gradients (Plan.half_precision_weights),
        # unlike the planner's own bf16 programs, whose fp32 gradients would move 4 bytes.
        plan = dataclasses.replace(plan, half_precision_weights=True)
        timeline = Simulator(plan, graph).run().timeline
        tied = [e for e in timeline if e.name == "all-reduce tied grads (stages 0, 1)"]
        assert sorted(e.device for e in tied) == ["stage 0", "stage 1"]
        assert all(e.duration_s == pytest.approx(seconds) for e in tied)
        assert tied[0].start_s == pytest.approx(tied[1].start_s)
        for event in tied:
            own = [e for e in timeline if e.device == event.device]
            assert event.start_s >= max(e.start_s + e.duration_s for e in own if e.name.startswith("B")) - 1e-12
            reductions = [e for e in own if e.stream == "collective" and "grads" in e.name]
            assert reductions and min(e.start_s for e in reductions) >= event.start_s + event.duration_s - 1e-12
    # Untied, nothing is shared and nothing is all-reduced between stages.
    cluster, graph, spec, name = _toy(4)
    plan = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, blocking_p2p=True, overlap_grad_reduce=False)
    assert not [e for e in Simulator(plan, graph).run().timeline if "tied" in e.name]


@pytest.mark.parametrize("blocking", [False, True])
def test_block_overhead_adds_its_seconds_per_layer_per_micro_batch(blocking):
    # pp=2 on 2 devices, 4 layers (2 per stage), micro-batches of 2 out of 8: m = 4. Every
    # block pays 1 ms more per micro-batch, so every stage's forward + backward per
    # micro-batch grows by 2 ms, and a 1F1B step of (m + p - 1) micro-batch slots by
    # (4 + 2 - 1) x 2 x 1 ms = 10 ms, with or without DeepSpeed's rendezvous schedule.
    cluster, graph, spec, name = _toy(2)
    plain = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, blocking_p2p=blocking)
    slowed = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, blocking_p2p=blocking,
                           block_overhead_s=1e-3)
    assert slowed.pipeline.block_overhead_s == 1e-3
    assert slowed.estimate.step_time_s - plain.estimate.step_time_s == pytest.approx((4 + 2 - 1) * 2 * 1e-3, rel=1e-9)


def test_block_overhead_round_trips_through_the_plan_file_and_rejects_bad_values(tmp_path):
    cluster, graph, spec, name = _toy(2)
    plan = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, block_overhead_s=2.5e-3)
    plan.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").pipeline == plan.pipeline
    # A plan file written before the field existed loads with no overhead.
    data = json.loads((tmp_path / "plan.json").read_text())
    del data["pipeline"]["block_overhead_s"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert load_plan(tmp_path / "old.json").pipeline.block_overhead_s == 0.0
    for bad in (-1e-3, float("nan"), float("inf"), "1e-3", True):
        with pytest.raises(ValueError, match="block_overhead_s must be a number of seconds >= 0"):
            PipelineConfig(stages=2, block_overhead_s=bad)


def test_fp16_zero1_step_checks_overflow_and_norm_before_adam_worked_by_hand():
    # pp=2 x dp=2, DeepSpeed's fp16 engine (gradients accumulated by autograd) with ZeRO-1.
    # Stage 1 holds 102,144 elements in 27 tensors (test above), flattened in that order and
    # split over dp 2 into partitions of 51,072: rank 0's holds block 2 (49,984 in 12
    # tensors) and the first 1,088 elements of block 3, which cross ln_1's weight and bias
    # (64 + 64) into c_attn's weight: 15 tensors, the busiest. Before Adam, DeepSpeed's step
    # moves 52 bytes per partition element (overflow check 10, fp64 norm 18, fp32 gradient 10,
    # unscale 8, fp16 copy-back 6) in 4 kernels per tensor + 4:
    # 51,072 x 52 / 8e10 + (4 x 15 + 4) x 5 us = 33.2 us + 320 us.
    cluster, graph, spec, name = _toy(4)
    expected = 51_072 * 52 / STREAMING + (4 * 15 + 4) * LAUNCH
    for accumulation, checked in (("autograd", True), ("in-gemm", False)):
        plan = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, dp_flavour="zero1", blocking_p2p=True,
                             gradient_accumulation=accumulation, overlap_grad_reduce=False)
        timeline = Simulator(plan, graph).run().timeline
        checks = [e for e in timeline if e.device == "stage 1" and e.name.startswith("overflow check")]
        if not checked:  # Megatron-LM's own path (gradients accumulated in the GEMM) has none
            assert checks == []
            continue
        (check,) = checks
        assert check.duration_s == pytest.approx(expected)
        step = next(e for e in timeline if e.device == "stage 1" and e.name == "optimizer step")
        reductions = [e for e in timeline if e.device == "stage 1" and "grads" in e.name and e.stream == "collective"]
        assert check.start_s >= max(e.start_s + e.duration_s for e in reductions) - 1e-12
        assert step.start_s >= check.start_s + check.duration_s - 1e-12
