"""Gradient accumulation (``Plan.accumulation_steps``): simulated, searched, compiled, run.

A plan that accumulates cuts each rank's part of the batch into micro-batches and runs
forward and backward on each in turn (``codegen.runtime.accumulation``): one micro-batch's
activations at a time. The simulator runs it as a one-stage 1F1B schedule, DDP's all-reduce
once after the last micro-batch, FSDP2's reduce-scatter after each. Here: what the
simulator charges, what compile refuses, the batch split, and parity with one device for
every data-parallel flavour and a graph program (Megatron's tp=2 layout) at world 2, in one
torchrun launch (ZeRO-2 and ZeRO-1 beside tp accumulate in ``test_composed_dp.py``).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import planner
from codegen.runtime.accumulation import micro_batches
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.data_parallel import data_parallel_plan
from search.megatron import megatron_plan
from launch_groups import register_group
from test_parity import REPO, result_of

GPT = ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8})


@functools.cache
def _gpt_world2():
    return prepare_model(GPT, "cpu:1x2")  # traced once for this module's fixture and its programs


@pytest.fixture(scope="module")
def gpt_world2():
    return _gpt_world2()


def test_micro_batches_cut_the_batch_dimension_only():
    tokens, mask = torch.arange(12).reshape(4, 3), torch.ones(3, 3)
    parts = micro_batches((tokens, mask), {"labels": tokens + 1, "scale": 2.0}, 2, 4)
    assert [p[0][0].tolist() for p in parts] == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]]]
    assert all(p[0][1] is mask and p[1]["scale"] == 2.0 for p in parts)  # no batch dimension: whole
    assert parts[1][1]["labels"].tolist() == [[7, 8, 9], [10, 11, 12]]


def test_accumulation_holds_one_micro_batch_and_reduces_once(gpt_world2):
    graph, spec, name, cluster = gpt_world2
    at_once = data_parallel_plan(graph, cluster, spec, name, "ddp")
    accumulated = dataclasses.replace(at_once, accumulation_steps=4)
    from cost_model.simulator import simulated

    accumulated = simulated(accumulated, graph)
    ours, theirs = accumulated.estimate, at_once.estimate
    # Four micro-batches of one sample instead of four samples at once: a quarter of the
    # activations held, the same weights, gradients and states, and the same bytes on dp
    # (DDP all-reduces once, after the last micro-batch).
    assert ours.memory.activations == pytest.approx(theirs.memory.activations / 4, rel=0.02)
    assert (ours.memory.weights, ours.memory.gradients, ours.memory.optimizer_states) == (
        theirs.memory.weights, theirs.memory.gradients, theirs.memory.optimizer_states,
    )
    assert ours.bytes_per_axis["dp"] == pytest.approx(theirs.bytes_per_axis["dp"])
    # FSDP2 reduce-scatters every micro-batch and gathers every block again for each.
    fsdp = data_parallel_plan(graph, cluster, spec, name, "fsdp")
    fsdp4 = simulated(dataclasses.replace(fsdp, accumulation_steps=4), graph)
    assert fsdp4.estimate.bytes_per_axis["dp"] == pytest.approx(4 * fsdp.estimate.bytes_per_axis["dp"])
    assert accumulated.name == "ddp (dp=2; 4 micro-batches)"


def _with_device_memory(cluster, memory_bytes):
    nodes = tuple(dataclasses.replace(n, device=dataclasses.replace(n.device, memory_bytes=memory_bytes)) for n in cluster.nodes)
    return dataclasses.replace(cluster, nodes=nodes)


@pytest.mark.parametrize("flavour", ["ddp", "zero1", "zero2", "fsdp"])
def test_accumulating_stops_when_what_micro_batches_cannot_shrink_overflows(gpt_world2, flavour, monkeypatch):
    # Micro-batches shrink the activations only: every other part of a device's memory is the
    # same at any count, so when those parts alone overflow, no count is simulated at all.
    # Just above them, accumulation is tried and found.
    from cost_model.simulator import simulated
    from search import data_parallel
    from search.data_parallel import accumulating

    graph, spec, name, cluster = gpt_world2
    whole = data_parallel_plan(graph, cluster, spec, name, flavour).estimate.memory
    for steps in (2, 4):
        memory = simulated(dataclasses.replace(data_parallel_plan(graph, cluster, spec, name, flavour), accumulation_steps=steps), graph).estimate.memory
        assert memory.total - memory.activations == whole.total - whole.activations
    static = whole.total - whole.activations
    tight = data_parallel_plan(graph, _with_device_memory(cluster, static - 1), spec, name, flavour)
    roomy = data_parallel_plan(graph, _with_device_memory(cluster, static + whole.activations // 2), spec, name, flavour)
    simulations = []
    monkeypatch.setattr(data_parallel, "simulated", lambda *a: simulations.append(a) or simulated(*a))
    assert accumulating(tight, graph) is None
    assert simulations == []
    found = accumulating(roomy, graph)
    assert found is not None and found.estimate.fits and found.accumulation_steps == 2


def test_bad_accumulation_is_refused_in_one_line(gpt_world2):
    graph, spec, name, cluster = gpt_world2
    plan = data_parallel_plan(graph, cluster, spec, name, "ddp")
    for steps, words in ((3, "divides the batch"), (0, "positive integer"), (True, "positive integer")):
        with pytest.raises(ValueError, match=words) as error:
            dataclasses.replace(plan, accumulation_steps=steps)
        assert "\n" not in str(error.value)
    pipelined = megatron_plan(graph, cluster, spec, name, pp=2, micro_batch=2, precision="fp32")
    with pytest.raises(ValueError, match="pipeline.micro_batches") as error:
        dataclasses.replace(pipelined, accumulation_steps=2)  # a pipeline accumulates with its own micro-batches
    assert "\n" not in str(error.value)


def _accumulated_programs(root, world):
    graph, spec, name, cluster = _gpt_world2()
    folders = {}
    for flavour in ("ddp", "zero1", "zero2", "fsdp"):
        plan = dataclasses.replace(data_parallel_plan(graph, cluster, spec, name, flavour), accumulation_steps=2)
        folders[flavour] = planner.compile(plan, root / flavour)
    recomputed = dataclasses.replace(data_parallel_plan(graph, cluster, spec, name, "ddp"), accumulation_steps=4, recompute="full")
    folders["ddp-4-recompute"] = planner.compile(recomputed, root / "ddp-4-recompute")
    # A graph program (Megatron's layout on tp=2), written from the graph traced at one micro-batch.
    megatron = dataclasses.replace(megatron_plan(graph, cluster, spec, name, tp=2, precision="fp32"), accumulation_steps=2)
    folders["megatron-tp2"] = planner.compile(megatron, root / "megatron-tp2")
    return folders, list(folders.values())


ACCUMULATED = register_group(2, _accumulated_programs)  # checked in the session's world-2 launch (launch_groups.py)


@pytest.mark.distributed
def test_accumulated_step_equals_single_device(parity_launches):
    folders, launch = parity_launches.result(ACCUMULATED)
    for case, folder in folders.items():
        result = result_of(launch, folder)
        assert result.startswith("ok parity ok: "), f"{case}: {result}"
    assert "ACCUMULATION_STEPS = 2" in (folders["ddp"] / "model_spmd.py").read_text()
