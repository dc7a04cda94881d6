"""Pipeline point-to-point costs and the interleaved schedule's extra communication, worked
by hand on a toy α–β cluster (1e9 B/s, 1 µs links)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_model.simulator import Simulator
from planner.api import prepare_model
from planner.cluster import Cluster, DeviceSpec, LinkSpec, NodeSpec
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan

GPT = str(Path(__file__).resolve().parent.parent / "examples" / "gpt.py")
LINK = LinkSpec(bandwidth=1e9, latency=1e-6)
DEVICE = DeviceSpec(name="toy", peak_flops={"float32": 1e12}, memory_bytes=10**10, memory_bandwidth=1e11)


def test_every_virtual_stage_boundary_sends_each_micro_batch_both_ways():
    cluster = Cluster(name="toy", nodes=(NodeSpec(DEVICE, 2, LINK),), inter_link=LINK, backend="gloo")
    spec = ModelSpec(GPT, {"n_layer": 4, "n_embd": 64, "n_head": 4, "seq_len": 32, "vocab_size": 32, "batch_size": 8})
    graph, spec, name, _ = prepare_model(spec, cluster)
    sends = {}
    for schedule, chunks in (("1f1b", 1), ("interleaved", 2)):
        plan = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, schedule=schedule, virtual_stages=chunks)
        assert plan.precision == "bf16"  # Megatron's mixed precision: 2-byte activations
        timeline = Simulator(plan, graph).run().timeline
        sends[schedule] = [event for event in timeline if event.name.startswith(("send act", "send grad"))]
    # 8 samples in micro-batches of 2: 4 micro-batches. 1F1B on 2 stages has 1 boundary; the
    # interleaved schedule with 2 chunks per stage has 2·2 − 1 = 3 (stage 0 → 1 → 0 → 1).
    # Each boundary sends every micro-batch's activations forward and its gradients back.
    assert len(sends["1f1b"]) == 1 * 4 * 2
    assert len(sends["interleaved"]) == 3 * 4 * 2
    # One send: the residual stream of a micro-batch, 2 × 32 × 64 bf16 values = 8192 bytes,
    # over the 1e9 B/s link after 1 µs: 1e-6 + 8192 / 1e9 = 9.192e-6 s.
    for event in sends["1f1b"] + sends["interleaved"]:
        assert event.duration_s == pytest.approx(9.192e-6)


def test_blocking_sends_hold_both_compute_streams_as_a_rendezvous():
    # DeepSpeed's pipeline engine sends synchronously (PipelineConfig.blocking_p2p): each
    # transfer holds the sender's compute stream and the receiver's, from when the later of
    # the two reaches it (cost_model.deepspeed_pipeline): stage 0 sends the 4 micro-batches'
    # activations and receives their 4 gradients, stage 1 the reverse, 9.192 µs each (as
    # above), so each compute stream is busy for its passes plus 8 transfers.
    cluster = Cluster(name="toy", nodes=(NodeSpec(DEVICE, 2, LINK),), inter_link=LINK, backend="gloo")
    spec = ModelSpec(GPT, {"n_layer": 4, "n_embd": 64, "n_head": 4, "seq_len": 32, "vocab_size": 32, "batch_size": 8})
    graph, spec, name, _ = prepare_model(spec, cluster)
    results = {}
    for blocking in (False, True):
        plan = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, blocking_p2p=blocking)
        assert plan.pipeline.blocking_p2p is blocking
        results[blocking] = Simulator(plan, graph).run()
    def busy(result, device, sends_only=False):
        return sum(e.duration_s for e in result.timeline if e.device == device and e.stream == "compute"
                   and (not sends_only or e.name.startswith("send")))
    blocked = results[True]
    sends = [e for e in blocked.timeline if e.name.startswith(("send act", "send grad"))]
    assert len(sends) == 8 and all(e.stream == "compute" for e in sends)
    assert {e.device for e in sends if e.name.startswith("send act")} == {"stage 0"}
    assert {e.device for e in sends if e.name.startswith("send grad")} == {"stage 1"}
    for device in ("stage 0", "stage 1"):
        assert busy(blocked, device, sends_only=True) == pytest.approx(4 * 9.192e-6)
        assert busy(blocked, device) == pytest.approx(busy(results[False], device) + 8 * 9.192e-6)
    receives = [e for e in blocked.timeline if e.name.startswith(("recv act", "recv grad"))]
    assert len(receives) == 8 and all(e.stream == "compute" for e in receives)
    for send in sends:
        partner = next(e for e in receives if e.name == "recv" + send.name[len("send"):])
        assert partner.device != send.device
        assert partner.start_s == pytest.approx(send.start_s) and partner.duration_s == pytest.approx(send.duration_s)
    # Every send still precedes the pass that needs it on the other stage.
    for send in sends:
        mb = send.name.split("mb")[1]
        needs = "F" if send.name.startswith("send act") else "B"
        other = "stage 1" if send.device == "stage 0" else "stage 0"
        first = min(e.start_s for e in blocked.timeline if e.device == other and e.stream == "compute"
                    and e.name.split(" ")[0] == f"{needs}{mb}")
        assert first >= send.start_s + send.duration_s - 1e-12
    assert blocked.step_time_s > results[False].step_time_s


def test_bytes_sent_over_pp_are_each_boundarys_values_and_gradients():
    """bytes_per_axis["pp"]: the busiest device's sends over a step (counted against a running
    program by tests/test_comm_audit.py). Worked by hand for the GPT above, 4 micro-batches of 2
    samples, bf16 activations: with 1F1B on 2 stages, stage 0 sends each micro-batch's residual
    stream (2 × 32 × 64 × 2 B = 8192 B) and the targets the last stage's loss reads (2 × 32
    int64 = 512 B) forward; stage 1 sends the residual stream's gradient (8192 B) back. With 2
    chunks per stage (interleaved), device 0 runs virtual stages 0 and 2 and device 1 runs 1
    and 3: each device sends forward on 2 of the 3 boundaries (0→1 and 2→3, or 1→2) and
    gradients back on 1 or 2 of them (1→0, or 2→1 and 3→2)."""
    cluster = Cluster(name="toy", nodes=(NodeSpec(DEVICE, 2, LINK),), inter_link=LINK, backend="gloo")
    spec = ModelSpec(GPT, {"n_layer": 4, "n_embd": 64, "n_head": 4, "seq_len": 32, "vocab_size": 32, "batch_size": 8})
    graph, spec, name, _ = prepare_model(spec, cluster)
    residual, targets, micro_batches = 2 * 32 * 64 * 2, 2 * 32 * 8, 4
    one = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, schedule="1f1b")
    assert Simulator(one, graph).run().bytes_per_axis["pp"] == pytest.approx(micro_batches * (residual + targets))
    two = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, schedule="interleaved", virtual_stages=2)
    device0 = 2 * (residual + targets) + 1 * residual  # forward on 0→1 and 2→3, gradient back on 1→0
    device1 = 1 * (residual + targets) + 2 * residual  # forward on 1→2, gradients back on 2→1 and 3→2
    assert Simulator(two, graph).run().bytes_per_axis["pp"] == pytest.approx(micro_batches * max(device0, device1))
