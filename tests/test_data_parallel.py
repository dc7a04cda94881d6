"""Golden data-parallel plans (search/data_parallel.py): where the answer is known, the
planner must find it, and its predicted cost must equal the one worked out by hand.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import planner
from cost_model import defaults
from planner.cluster import Cluster
from planner.errors import PlanningError
from planner.model_spec import ModelSpec
from planner.trace import trace
from search.data_parallel import DATA_PARALLEL_FLAVOURS, accumulating, data_parallel_plan, fsdp_units, plan_data_parallel

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
S0, R = (Shard(0),), (Replicate(),)


def traced(name: str, **overrides):
    spec = ModelSpec(str(EXAMPLES / f"{name}.py"), overrides).resolved()
    model, args, kwargs = spec.build("meta")
    return spec, trace(model, args, kwargs)


def with_device_memory(cluster: Cluster, memory_bytes: int) -> Cluster:
    """``cluster`` with every device's memory set to ``memory_bytes``."""
    nodes = tuple(
        dataclasses.replace(node, device=dataclasses.replace(node.device, memory_bytes=memory_bytes))
        for node in cluster.nodes
    )
    return dataclasses.replace(cluster, nodes=nodes)


@pytest.fixture(scope="module")
def gpt():
    return traced("gpt", n_layer=4)


# ------------------------------------------------------------- batch-sharded layout


def test_small_model_on_two_processes_is_data_parallel():
    plan = planner.plan(str(EXAMPLES / "mlp.py"), "cpu:1x2", search="dp")
    assert plan.mesh.axes == (("dp", 2),) and plan.world_size == 2
    assert plan.inputs == {"inputs": S0, "targets": S0}
    assert plan.batch_size == 16
    # Plenty of memory and a tiny model: no flavour is short of memory, so the step time
    # decides, and DDP does least. ZeRO-1 steps half of every weight (AdamW still runs op by
    # op over every tensor on gloo, a piece each) and then all-gathers each updated weight,
    # one call after another; ZeRO-2 and FSDP all-reduce the whole gradient on gloo (it has
    # no reduce-scatter) and gather the weights besides.
    assert plan.dp_flavour == "ddp"
    assert [alt.name for alt in plan.runners_up] == ["zero1 (dp=2)", "zero2 (dp=2)", "fsdp (dp=2)", "baseline megatron (tp=2)"]
    assert all(alt.fits and alt.step_time_s > plan.estimate.step_time_s for alt in plan.runners_up)


def test_batch_sharded_placements(gpt):
    spec, graph = gpt
    plan = plan_data_parallel(graph, Cluster.preset("cpu", 1, 2), spec, "GPT")
    assert [s.node for s in plan.strategies] == [n.name for n in graph.nodes]
    by_node = {s.node: s for s in plan.strategies}
    linears = [n for n in graph.nodes if n.op == "aten.linear.default"]
    assert len(linears) == 4 * 4 + 1  # c_attn, c_proj, c_fc, c_proj per block + lm_head
    for node in linears:
        strategy = by_node[node.name]
        assert strategy.inputs[0] == S0, node.name  # the activation carries the batch
        assert strategy.outputs == (S0,), node.name
        assert set(strategy.params) == set(node.params) and all(p == R for p in strategy.params.values())
    # Every parameter of every op is replicated: data parallelism never shards weights' view.
    assert all(p == R for s in plan.strategies for p in s.params.values())
    loss = plan.strategies[-1]
    assert loss.op == "aten.cross_entropy_loss.default"
    assert loss.inputs == (S0, S0)
    assert len(loss.outputs) == 1 and isinstance(loss.outputs[0][0], Partial)  # mean over the batch
    # Positions (arange -> wpe) do not depend on the batch: replicated.
    position_embedding = next(s for s in plan.strategies if s.module == "wpe")
    assert position_embedding.outputs == (R,)


def test_placements_survive_the_plan_file(gpt, tmp_path):
    spec, graph = gpt
    plan = plan_data_parallel(graph, Cluster.preset("cpu", 1, 2), spec, "GPT")
    plan.save(tmp_path / "plan.json")
    assert planner.load_plan(tmp_path / "plan.json").strategies == plan.strategies


# --------------------------------------------------------------- golden step time


class OneLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(128, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) + 1.0).relu().mean()


def test_ddp_step_time_by_hand():
    # OneLayer on (8, 128), cpu:1x2 (dp = 2): 50e9 FLOP/s, 10e9 B/s (x0.8 = 8e9), link 2e9 B/s,
    # 50 µs. Each rank runs half the batch; every op costs max(compute, memory) + 5 µs.
    #   linear: 524,288 FLOPs, 144,384 B -> per rank 262,144 FLOPs, 72,192 B:
    #     fwd max(262,144/27.5e9 = 9.5325 µs, 72,192/8e9 = 9.024 µs) + 5 = 14.5325 µs
    #     bwd max(19.065, 18.048) + 5 = 24.065 µs
    #   add 1.0: 16,384 B -> 8,192 per rank: fwd 1.024 + 5 = 6.024 µs; bwd 2.048 + 5 = 7.048 µs
    #   relu: the same, 6.024 µs and 7.048 µs
    #   mean: 8,196 B -> 4,098 per rank: fwd 0.51225 + 5 = 5.51225 µs; bwd 1.0245 + 5 = 6.0245 µs
    #   forward 32.09275 µs, backward 44.1855 µs
    # Gradients 33,024 params * 4 B = 132,096 B, all-reduced over 2 ranks of one node after
    # the (single-segment) backward: ring S/β + 2α = 66.048 + 100 = 166.048 µs (cheaper than
    # the tree's 2S/β + 2α = 232.096 µs); nothing is left to overlap it with.
    # AdamW on CPU tensors (gloo): torch.optim's single-tensor loop, priced as 7 accesses per
    # element (cache-resident, as fused) and 10 ops on each of the 2 tensors (weight, bias):
    #   33,024 * (4 + 4 + 8) B = 528,384 B * 7/4 / 8e9 = 115.584 µs, + 20 x 5 = 215.584 µs
    # step = 32.09275 + 44.1855 + 166.048 + 215.584 = 457.91025 µs
    with torch.device("meta"):
        model, x = OneLayer(), torch.randn(8, 128)
    graph = trace(model, (x,))
    plan = data_parallel_plan(graph, Cluster.preset("cpu", 1, 2), None, "OneLayer", "ddp")
    overhead = defaults.KERNEL_OVERHEAD_S
    bandwidth = 10e9 * defaults.MEMORY_EFFICIENCY
    linear = max(262_144 / (50e9 * defaults.MATMUL_EFFICIENCY), 72_192 / bandwidth)
    forward = linear + 2 * (8_192 / bandwidth) + 4_098 / bandwidth + 4 * overhead
    backward = 2 * (forward - 4 * overhead) + 4 * overhead
    all_reduce = 132_096 / 2e9 + 2 * 50e-6
    optimizer = 528_384 * 7 / 4 / bandwidth + 2 * 10 * overhead
    estimate = plan.estimate
    assert forward == pytest.approx(32.09275e-6)
    assert estimate.step_time_s == pytest.approx(forward + backward + all_reduce + optimizer)
    assert estimate.step_time_s == pytest.approx(457.91025e-6)
    assert estimate.communication_s == pytest.approx(all_reduce)
    assert estimate.compute_s == pytest.approx(forward + backward + optimizer)


# ----------------------------------------------------------------- memory-tight


def by_name_of(plan) -> dict:
    """``plan``'s runners-up by name."""
    return {alt.name: alt for alt in plan.runners_up}


def _memory_by_flavour(graph, cluster, spec) -> dict[str, int]:
    return {f: data_parallel_plan(graph, cluster, spec, "GPT", f).estimate.memory.total for f in DATA_PARALLEL_FLAVOURS}


def test_memory_tight_gathers_weights_rather_than_accumulate_gradients(gpt):
    spec, graph = gpt
    cluster = Cluster.preset("cpu", 1, 2)
    memory = _memory_by_flavour(graph, cluster, spec)
    # Each flavour shards one more part of the training state than the one before it.
    assert memory["ddp"] > memory["zero1"] > memory["zero2"] > memory["fsdp"]
    tight = with_device_memory(cluster, (memory["zero2"] + memory["fsdp"]) // 2)  # at once, only FSDP fits
    plan = plan_data_parallel(graph, tight, spec, "GPT")
    # ZeRO-1 and ZeRO-2 fit over two micro-batches of two samples each (one micro-batch's
    # activations at a time), but both lose to FSDP at once: FSDP2 reshards a ZeRO-2 unit
    # after every backward, so each micro-batch gathers its weights again (as many gathers as
    # FSDP's two a step, and a reduce-scatter per micro-batch), and ZeRO-1 all-gathers each
    # weight in its own call after the step (ShardedStatesOptimizer).
    assert plan.name == "fsdp (dp=2)" and plan.accumulation_steps == 1 and plan.estimate.fits
    by_name = by_name_of(plan)
    for slower in ("zero1 (dp=2; 2 micro-batches)", "zero2 (dp=2; 2 micro-batches)"):
        assert by_name[slower].fits and by_name[slower].step_time_s > plan.estimate.step_time_s, slower
    accumulating_zero2 = accumulating(data_parallel_plan(graph, tight, spec, "GPT", "zero2"), graph)
    at_once = data_parallel_plan(graph, cluster, spec, "GPT", "zero2").estimate.memory
    assert accumulating_zero2.estimate.fits
    assert accumulating_zero2.estimate.memory.activations == pytest.approx(at_once.activations / 2, rel=0.02)
    assert not by_name["ddp (dp=2)"].fits and by_name["ddp (dp=2)"].memory_bytes == memory["ddp"]  # not even 1 sample at a time


def test_memory_tight_for_ddp_accumulates_in_ddp(gpt):
    # Between ZeRO-1's and DDP's needs: all but DDP fit at once, and DDP does in two
    # micro-batches, which is the fastest on gloo: FSDP2 (ZeRO-2, FSDP) issues its gathers and
    # gradient reductions with async_op=False, holding the thread that runs the model, and
    # ZeRO-1 all-gathers each weight in its own call after the step (ShardedStatesOptimizer),
    # while DDP's bucketed all-reduce runs beside the second micro-batch's backward.
    spec, graph = gpt
    cluster = Cluster.preset("cpu", 1, 2)
    memory = _memory_by_flavour(graph, cluster, spec)
    plan = plan_data_parallel(graph, with_device_memory(cluster, (memory["ddp"] + memory["zero1"]) // 2), spec, "GPT")
    assert plan.name == "ddp (dp=2; 2 micro-batches)" and plan.estimate.fits
    by_name = by_name_of(plan)
    assert by_name["zero1 (dp=2)"].fits and by_name["zero2 (dp=2)"].fits and by_name["fsdp (dp=2)"].fits
    assert all(alt.step_time_s > plan.estimate.step_time_s for alt in plan.runners_up if alt.fits)


@pytest.mark.parametrize("flavour", ["zero1", "zero2"])
def test_forced_zero_flavour(gpt, flavour):
    spec, graph = gpt
    cluster = Cluster.preset("cpu", 1, 2)
    plan = plan_data_parallel(graph, cluster, spec, "GPT", dp_flavour=flavour)
    assert plan.dp_flavour == flavour and plan.name == f"{flavour} ({plan.mesh})"
    assert plan.fsdp_units == (("blocks.0", "blocks.1", "blocks.2", "blocks.3") if flavour == "zero2" else ())
    assert all(p == R for s in plan.strategies for p in s.params.values())  # weights whole in every op
    assert planner.plan(spec, cluster, dp_flavour=flavour).dp_flavour == flavour


def test_forced_ddp_is_respected(gpt):
    spec, graph = gpt
    cluster = Cluster.preset("cpu", 1, 2)
    plan = plan_data_parallel(graph, cluster, spec, "GPT", dp_flavour="ddp")
    assert plan.dp_flavour == "ddp" and plan.fsdp_units == ()
    assert [alt.name for alt in plan.runners_up] == ["zero1 (dp=2)", "zero2 (dp=2)", "fsdp (dp=2)", "baseline megatron (tp=2)"]
    assert planner.plan(spec, cluster, dp_flavour="ddp").dp_flavour == "ddp"


def test_forced_ddp_that_does_not_fit(gpt):
    spec, graph = gpt
    cluster = Cluster.preset("cpu", 1, 2)
    ddp = data_parallel_plan(graph, cluster, spec, "GPT", "ddp").estimate.memory
    # Less than DDP's weights, gradients and optimizer states alone: no micro-batching helps.
    state = ddp.total - ddp.activations
    with pytest.raises(PlanningError, match="does not fit"):
        plan_data_parallel(graph, with_device_memory(cluster, state - 1), spec, "GPT", dp_flavour="ddp")


def test_too_small_everywhere():
    # ~21M parameters (84 MB fp32): FSDP over 2 ranks needs about 0.3 GiB per device.
    spec, graph = traced("gpt", n_layer=4, n_embd=512, n_head=8, vocab_size=8192, seq_len=64)
    cluster = with_device_memory(Cluster.preset("cpu", 1, 2), 2**30 // 10)
    needs = {f: data_parallel_plan(graph, cluster, spec, "GPT", f).estimate.memory.total for f in DATA_PARALLEL_FLAVOURS}
    with pytest.raises(PlanningError) as info:
        plan_data_parallel(graph, cluster, spec, "GPT")
    message = str(info.value)
    smallest = min(needs.values())
    # Sizes print in the largest binary unit that keeps them >= 1: here MiB.
    assert f"smallest plan (fsdp) needs {smallest / 2**20:.2f} MiB per device" in message
    assert "a device has 102.40 MiB" in message
    devices = int(re.search(r"about (\d+) devices", message)[1])
    assert devices > cluster.world_size
    assert "\n" not in message


def test_layers_larger_than_a_device():
    # A device smaller than FSDP's two gathered units: more devices cannot help, and the
    # message must say so rather than name a device count.
    spec, graph = traced("gpt", n_layer=4, n_embd=512, n_head=8, vocab_size=8192, seq_len=64)
    cluster = with_device_memory(Cluster.preset("cpu", 1, 2), 100_000)
    with pytest.raises(PlanningError) as info:
        plan_data_parallel(graph, cluster, spec, "GPT")
    message = str(info.value)
    assert "exceed a device whatever the device count" in message
    assert "tensor or pipeline parallelism" in message
    assert "about" not in message


# ------------------------------------------------------------------- bad requests


@pytest.mark.parametrize("flavour", ["zero3", "DDP", "zero"])
def test_invalid_flavour(gpt, flavour):
    spec, graph = gpt
    with pytest.raises(PlanningError, match=f"flavour '{flavour}' is not available; choose one of ddp, zero1, zero2, fsdp"):
        plan_data_parallel(graph, Cluster.preset("cpu", 1, 2), spec, "GPT", dp_flavour=flavour)


def test_batch_not_divisible(gpt):
    spec, graph = gpt  # batch 8
    with pytest.raises(PlanningError, match=r"global batch of 8 is not divisible by the data-parallel degree 3"):
        plan_data_parallel(graph, Cluster.preset("cpu", 1, 3), spec, "GPT")


class _Cummax(nn.Module):
    """A linear layer, then torch.cummax along the features: an op with no sharding rule."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x):
        return torch.cummax(self.linear(x), dim=1).values.mean()


def test_an_op_without_a_rule_keeps_the_batch_split_under_data_parallelism():
    # DDP/ZeRO/FSDP run the model's own modules on each rank's slice of the batch, so an op
    # the rules do not know still works on that slice: it must not be priced as a gather of
    # the whole batch on every rank.
    with torch.device("meta"):
        model, x = _Cummax(), torch.randn(512, 64)
    graph = trace(model, (x,))
    plan = data_parallel_plan(graph, Cluster.preset("cpu", 1, 2), None, "Cummax", "ddp")
    cummax = next(s for s in plan.strategies if s.op == "aten.cummax.default")
    assert cummax.inputs == ((Shard(0),),) and cummax.outputs == ((Shard(0),), (Shard(0),))
    mean = next(s for s in plan.strategies if s.op.startswith("aten.mean"))
    assert mean.inputs == ((Shard(0),),)  # the loss is still averaged over the split batch


class _Router(nn.Module):
    """A layer whose parameters live in it and in a child (ERNIE-4.5-MoE's router and its
    ``moe_statics`` bias)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16))
        self.statics = nn.Linear(16, 16)

    def forward(self, x):
        return self.statics(x @ self.weight)


class _NestedOwners(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.router, self.last = nn.Linear(16, 16), _Router(), nn.Linear(16, 16)

    def forward(self, x):
        return self.last(self.router(self.first(x))).square().mean()


def test_fsdp_units_never_nest_one_inside_another():
    # FSDP2 wraps the units in order: a child unit listed after its parent would find its
    # parameters already sharded by the parent (DeviceMesh "Cannot concatenate overlapping
    # meshes"), so a module inside another unit joins that unit.
    with torch.device("meta"):
        model, x = _NestedOwners(), torch.randn(8, 16)
    graph = trace(model, (x,))
    assert not graph.block_paths()  # the per-module units, not the repeated blocks
    assert fsdp_units(graph) == ("first", "router", "last")
