"""DeepSpeed's activation-checkpointing options as the simulator prices them
(``cost_model.deepspeed_checkpointing``), worked by hand on a toy α–β cluster (links 1e9 B/s
and 1 µs; memory 1e11 B/s at the default 0.8 efficiency: 8e10 B/s a copy; 5 µs a kernel
launch, and a ``torch.cuda.synchronize()`` priced as one launch gap).

The layout: tp 2 x pp 2 on 4 devices, 4 layers (2 per stage), micro-batches of 2 sequences of
32 out of 8: m = 4. A block's input is 2 x 32 x 64 bf16 values, B = 8192 bytes, whole on each
tp rank; its partition P = B / 2 = 4096 bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import planner
from cost_model.simulator import Simulator
from planner.api import prepare_model
from planner.cluster import Cluster, DeviceSpec, LinkSpec, NodeSpec
from planner.errors import PlanFileError
from planner.model_spec import ModelSpec
from planner.plans import load_plan
from planner.strategy import PipelineConfig
from search.megatron import megatron_plan

GPT = str(Path(__file__).resolve().parent.parent / "examples" / "gpt.py")
LINK = LinkSpec(bandwidth=1e9, latency=1e-6)
DEVICE = DeviceSpec(name="toy", peak_flops={"float32": 1e12}, memory_bytes=10**10, memory_bandwidth=1e11)
TOY = {"n_layer": 4, "n_embd": 64, "n_head": 4, "seq_len": 32, "vocab_size": 32, "batch_size": 8}
STREAMING = 1e11 * 0.8  # bytes/s a copy moves (defaults.MEMORY_EFFICIENCY)
LAUNCH = 5e-6  # defaults.KERNEL_OVERHEAD_S: a launch, and the device's wait after a sync
WHOLE, PART = 8192, 4096  # a block's input per micro-batch, and one tp rank's half of it
# The all-gather of WHOLE over 2 ranks on the ring: (2 - 1)/2 x 8192 / 1e9 + 1 µs.
GATHER = 0.5 * WHOLE / 1e9 + 1e-6
# Per block per micro-batch, forward and backward:
# partition_activations: the clone of P (2P bytes, one launch); the backward's torch.zeros of
# B and copy_ of P (B + 2P bytes, two launches), then the all-gather.
PARTITION = (2 * PART / STREAMING + LAUNCH, (WHOLE + 2 * PART) / STREAMING + 2 * LAUNCH + GATHER)
# contiguous_memory_optimization: the page-touching write, the blocking copy of its index to
# the device (a sync) and the copy of P into the buffer.
CONTIGUOUS = (2 * PART / STREAMING + 3 * LAUNCH, 0.0)
# synchronize_checkpoint_boundary: a sync at the start and the end of each pass.
SYNCHRONIZE = (2 * LAUNCH, 2 * LAUNCH)
# A 1F1B step of m + p - 1 = 5 micro-batch slots, each holding one stage's forward and
# backward of 2 blocks, grows by 5 x 2 x (what a block adds per micro-batch).
SLOTS_X_BLOCKS = (4 + 2 - 1) * 2
ALL_THREE = ("partition_activations", "contiguous_memory_optimization", "synchronize_checkpoint_boundary")


def _toy_plan(**layout):
    cluster = Cluster(name="toy", nodes=(NodeSpec(DEVICE, 4, LINK),), inter_link=LINK, backend="gloo")
    graph, spec, name, _ = prepare_model(ModelSpec(GPT, TOY), cluster)
    settings = {"tp": 2, "pp": 2, "micro_batch": 2, "blocking_p2p": True, "partitioned_p2p": True,
                "recompute": "full", **layout}
    return megatron_plan(graph, cluster, spec, name, **settings), graph


@pytest.mark.parametrize("options, per_block", [
    (("partition_activations",), sum(PARTITION)),  # 5.1024 + 15.3008 = 20.4032 µs
    (("synchronize_checkpoint_boundary",), sum(SYNCHRONIZE)),  # 20 µs
    (("profile",), sum(SYNCHRONIZE)),  # its timers' two syncs a pass: 20 µs
    (ALL_THREE, sum(PARTITION) + sum(CONTIGUOUS) + sum(SYNCHRONIZE)),  # 20.4032 + 15.1024 + 20 = 55.5056 µs
])
def test_each_option_adds_its_hand_worked_seconds_per_block_per_micro_batch(options, per_block):
    plain, _ = _toy_plan()
    checkpointed, _ = _toy_plan(deepspeed_checkpointing=options)
    assert checkpointed.pipeline.deepspeed_checkpointing == options
    grown = checkpointed.estimate.step_time_s - plain.estimate.step_time_s
    assert grown == pytest.approx(SLOTS_X_BLOCKS * per_block, rel=1e-9)  # all three: 555.056 µs


def test_the_partitioned_input_is_gathered_over_tp_before_the_backward_and_copied_in_the_forward():
    plain, graph = _toy_plan()
    checkpointed, _ = _toy_plan(deepspeed_checkpointing=ALL_THREE)
    before = {(e.device, e.name): e.duration_s for e in Simulator(plain, graph).run().timeline}
    after = {(e.device, e.name): e.duration_s for e in Simulator(checkpointed, graph).run().timeline}
    # Each block's forward: the clone, the contiguous copy and three syncs (30.2048 µs).
    forward = PARTITION[0] + CONTIGUOUS[0] + SYNCHRONIZE[0]
    for device, block in (("stage 0", "blocks.0"), ("stage 0", "blocks.1"), ("stage 1", "blocks.3")):
        assert after[(device, f"F1 {block}")] - before[(device, f"F1 {block}")] == pytest.approx(forward, rel=1e-9)
    # The first micro-batch's backward is one task per stage (no gradient sync after it): two
    # blocks' zeros, copy and syncs on the compute stream (2 x 20.2048 µs), and their two
    # all-gathers with the tensor-parallel collectives (2 x 5.096 µs).
    assert after[("stage 0", "B0")] - before[("stage 0", "B0")] == pytest.approx(
        2 * (PARTITION[1] - GATHER + SYNCHRONIZE[1]), rel=1e-9)
    assert after[("stage 0", "B0 tp-comm")] - before[("stage 0", "B0 tp-comm")] == pytest.approx(2 * GATHER, rel=1e-9)


def test_nothing_is_added_where_blocks_are_not_recomputed_whole():
    # DeepSpeed's CheckpointFunction runs only for checkpointed layers: without recomputation
    # (or with only the attention core recomputed) the options cost nothing.
    for recompute in ("none", "selective"):
        plain, _ = _toy_plan(recompute=recompute)
        checkpointed, _ = _toy_plan(recompute=recompute, deepspeed_checkpointing=ALL_THREE)
        assert checkpointed.estimate.step_time_s == plain.estimate.step_time_s


def test_options_round_trip_through_the_plan_file_and_bad_ones_are_refused(tmp_path):
    plan, _ = _toy_plan(deepspeed_checkpointing=ALL_THREE)
    plan.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").pipeline == plan.pipeline
    # A plan file written before the field existed loads with no options.
    data = json.loads((tmp_path / "plan.json").read_text())
    del data["pipeline"]["deepspeed_checkpointing"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert load_plan(tmp_path / "old.json").pipeline.deepspeed_checkpointing == ()
    for bad in (("partition",), ("profile", "profile"), "profile", ["profile"]):
        with pytest.raises(ValueError, match="deepspeed_checkpointing must list distinct options among"):
            PipelineConfig(stages=2, deepspeed_checkpointing=bad)
    # DeepSpeed asserts contiguous buffers only with partitioned activations.
    with pytest.raises(ValueError, match="contiguous_memory_optimization needs partition_activations"):
        PipelineConfig(stages=2, deepspeed_checkpointing=("contiguous_memory_optimization",))


def test_partitioned_checkpoints_keep_a_tp_share_of_each_block_input():
    # What a micro-batch keeps per recomputed block is the input it reads from another block:
    # on stage 0 blocks.1's (blocks.0 reads the embedding's output, kept by that segment), on
    # stage 1 both blocks' (8192 bytes each). Partitioned, a tp rank keeps half: stage 0,
    # 2 micro-batches in flight (1F1B warm-up), keeps 2 x 4096 bytes less; stage 1, one in
    # flight, 4096 + 4096 less. Either way the fullest device holds 8192 bytes fewer.
    plain, _ = _toy_plan()
    partitioned, _ = _toy_plan(deepspeed_checkpointing=("partition_activations",))
    assert plain.estimate.memory.activations - partitioned.estimate.memory.activations == 2 * PART
    synchronized, _ = _toy_plan(deepspeed_checkpointing=("synchronize_checkpoint_boundary",))
    assert synchronized.estimate.memory.activations == plain.estimate.memory.activations


def test_compile_refuses_a_plan_with_deepspeed_checkpointing_in_one_line(tmp_path):
    # The options describe DeepSpeed's engine, which compiled programs do not run.
    plan, _ = _toy_plan(deepspeed_checkpointing=("synchronize_checkpoint_boundary",))
    with pytest.raises(PlanFileError, match="plan field 'pipeline.deepspeed_checkpointing' lists "
                                            "synchronize_checkpoint_boundary") as refused:
        planner.compile(plan, tmp_path / "out")
    assert "\n" not in str(refused.value)
