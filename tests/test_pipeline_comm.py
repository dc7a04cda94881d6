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
