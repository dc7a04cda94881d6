"""HSDP's simulated step (``planner.families.hsdp.costs``), against times worked out by hand,
and the search choosing it where it should.

HSDP 2 x 2 on ``cpu:2x2`` (2 nodes of 2 ranks): FSDP runs inside each node's shard group of
ranks {0, 1} (so its all-gathers cross no node), and each unit's gradient shard is then
all-reduced over the replicate group {0, 2} (one rank per node). Weights, gradients and
optimizer states are divided by the shard group (2), not by dp (4).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from test_fsdp_schedule import UNIT_ELEMENTS, UNITS, ToyContext

import planner
from cost_model.collectives import collective_time
from cost_model.scheduler import TaskGraph
from cost_model.segments import Segment
from cost_model.simulator import Simulator, simulated
from cost_model.step_contributor import ALL_REDUCE_STREAM
from cost_model.step_tasks import StepTasks
from planner.cluster import Cluster
from planner.cluster_edits import with_inter_node, with_memory
from planner.families.hsdp.costs import HybridShardingStep
from planner.families.hsdp.section import HsdpSection
from planner.model_spec import ModelSpec
from search.data_parallel import data_parallel_plan

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")
FAMILIES = ["ddp", "zero1", "zero2", "fsdp", "hsdp"]


@pytest.fixture(scope="module")
def plans():
    fsdp = planner.plan(ModelSpec(GPT, {"batch_size": 16}), "cpu:2x2", dp_flavour="fsdp")
    hsdp = simulated(dataclasses.replace(fsdp, sections={"hsdp": HsdpSection(2)}), fsdp.graph)
    return fsdp, hsdp


def _events(plan) -> dict[str, float]:
    result = Simulator(plan, plan.graph).run()
    # FSDP2's collectives (on gloo they block the compute stream: data_parallel_step.fsdp2_stream)
    collectives = ("all-gather", "reduce-scatter", "all-reduce")
    return {event.name: event.duration_s for event in result.timeline if event.name.startswith(collectives)}


def _block_elements(plan, block: str) -> int:
    return sum(meta.numel for name, meta in plan.graph.parameters.items() if name.startswith(block + "."))


def test_gathers_stay_in_the_node_and_gradient_shards_cross_it(plans):
    fsdp, hsdp = plans
    cluster: Cluster = hsdp.cluster
    elements = _block_elements(hsdp, "blocks.0")
    events = _events(hsdp)
    # fp32: 4-byte weights and gradients. The shard group {0, 1} is alone on its node's links;
    # each node holds one rank of both replicate groups {0, 2} and {1, 3}.
    gather = collective_time("all_gather", elements * 4, cluster, [0, 1], 1)
    assert events["all-gather blocks.0"] == pytest.approx(gather, rel=1e-12)
    # FSDP2 on gloo all-reduces a unit's whole gradient in the group and keeps its shard.
    assert events["all-reduce grads (blocks.0)"] == pytest.approx(
        collective_time("all_reduce", elements * 4, cluster, [0, 1], 1), rel=1e-12)
    assert events["all-reduce grad shard over replicate (blocks.0)"] == pytest.approx(
        collective_time("all_reduce", elements * 4 / 2, cluster, [0, 2], 2), rel=1e-12)
    # Plain FSDP gathers over all four ranks, across the nodes.
    assert _events(fsdp)["all-gather blocks.0"] == pytest.approx(
        collective_time("all_gather", elements * 4, cluster, [0, 1, 2, 3], 1), rel=1e-12)


def test_what_a_rank_keeps_is_divided_by_the_shard_group(plans):
    fsdp, hsdp = plans
    shared = sum(meta.numel for meta in hsdp.graph.parameters.values())
    # fp32 AdamW: 4 bytes of weights, 4 of gradients and 8 of states per element.
    assert hsdp.estimate.memory.weights == pytest.approx(shared * 4 / 2, rel=0.02)
    assert hsdp.estimate.memory.gradients == pytest.approx(shared * 4 / 2, rel=0.02)
    assert hsdp.estimate.memory.optimizer_states == pytest.approx(shared * 8 / 2, rel=0.02)
    assert fsdp.estimate.memory.weights == pytest.approx(shared * 4 / 4, rel=0.02)


def _slow_and_small(memory: int) -> Cluster:
    """4 DGX-A100 nodes whose network is 8 times slower, their devices with ``memory`` bytes."""
    preset = Cluster.preset("dgx-a100-80g", nodes=4)
    return with_memory(with_inter_node(preset, bandwidth=preset.inter_link.bandwidth / 8), memory)


WIDE = ModelSpec(GPT, {"batch_size": 32, "n_layer": 16, "n_embd": 1024, "n_head": 16})


def test_the_search_chooses_hsdp_on_a_slow_network_where_only_sharded_weights_fit():
    """ZeRO-2 keeps whole weights and does not fit; FSDP fits but gathers every unit across
    the slow network twice a step; HSDP over a node's 8 ranks fits and gathers inside it.
    In fp32, where gathers and reductions move the same 4 bytes: in bf16 the program gathers
    2 bytes and reduces 4 (``cost_model.mixed_precision``), so FSDP's two gathers cost what
    one reduction does, while HSDP's all-reduce of the shard over 4 nodes moves 2 x 3/4 of
    it: on this network the two then tie (FSDP was 2% faster), and the choice is no test."""
    roomy = planner.plan(WIDE, _slow_and_small(80 * 2**30), precision="fp32", constraints={"families": FAMILIES})
    graph = roomy.graph
    needs = {}
    for flavour in ("zero2", "fsdp"):
        needs[flavour] = data_parallel_plan(graph, roomy.cluster, WIDE, "gpt", flavour, (), roomy.precision).estimate.memory.total
    hsdp8 = simulated(dataclasses.replace(
        data_parallel_plan(graph, roomy.cluster, WIDE, "gpt", "fsdp", (), roomy.precision),
        sections={"hsdp": HsdpSection(8)}), graph).estimate.memory.total
    assert needs["fsdp"] < hsdp8 < needs["zero2"]
    memory = int((hsdp8 + needs["zero2"]) / 2)
    chosen = planner.plan(WIDE, _slow_and_small(memory), precision="fp32", constraints={"families": FAMILIES})
    assert chosen.sections == {"hsdp": HsdpSection(8)}, chosen.name
    fsdp = data_parallel_plan(chosen.graph, chosen.cluster, WIDE, "gpt", "fsdp", (), chosen.precision)
    assert fsdp.estimate.fits and fsdp.estimate.step_time_s > 1.2 * chosen.estimate.step_time_s


# ---- HSDP's schedule and collective times, worked by hand ----


class ToyShardGroupView:
    """What ``HybridShardingStep`` reads of the shard-group view of a ``ToyContext`` (dp 8 =
    replicate 2 x shard 4): ``dp`` is the group, each collective takes the toy's seconds,
    ``all_reduce`` (over ``"replicate"``) ``all_reduce_s``; every collective's kind, bytes and
    axis are recorded."""

    def __init__(self, context, shard: int, all_reduce_s: float) -> None:
        self._context, self.dp, self.replicate = context, shard, context.dp // shard
        self.all_reduce_s = all_reduce_s
        self.calls: list[tuple[str, float, str]] = []

    def collective(self, kind: str, size_bytes: float, axis: str) -> float:
        self.calls.append((kind, size_bytes, axis))
        return self.all_reduce_s if kind == "all_reduce" else self._context.seconds[kind]

    def __getattr__(self, name: str):
        return getattr(self._context, name)


def _hsdp_timeline(all_reduce_s: float):
    """The toy of ``tests/test_fsdp_schedule.py`` (three units of 1e6 elements, forward 2 s,
    backward 4 s, all-gather 1 s, reduce-scatter 1 s) as HSDP 2 x 4, its all-reduces over the
    replicas taking ``all_reduce_s``: each task's (start, end) and stream, and the view."""
    context = ToyContext("fsdp", gather_s=1, reduce_s=1, copy_s=0.0)
    view = ToyShardGroupView(context, shard=4, all_reduce_s=all_reduce_s)

    class ToyHybridStep(HybridShardingStep):
        def _view(self, _context):  # the toy's seconds in place of the cluster's
            return view

    segments = [Segment(name=unit, stage=0, block=True, forward_s=2, backward_s=4,
                        params={f"{unit}.weight": UNIT_ELEMENTS}, dp_synced={f"{unit}.weight"}) for unit in UNITS]
    tasks = StepTasks(context, (ToyHybridStep(),))
    last = tasks.forward("gpu", segments, 0, [])
    tasks.backward("gpu", segments, 0, [last], "none", True, {}, True)
    graph: TaskGraph = tasks.graph
    graph.run()
    timeline = {task.name: (round(task.start, 6), round(task.finish, 6)) for task in graph.tasks
                if not task.name.startswith(("copy-out", "copy-in"))}
    streams = {task.name: task.stream[1] for task in graph.tasks}
    return timeline, streams, view


def test_hsdp_all_reduces_each_gradient_shard_after_its_reduce_scatter_on_a_stream_of_its_own():
    # FSDP's schedule inside the group of 4 is the hand-worked one of
    # test_fsdp_schedule.test_compute_bound_gathers_are_hidden_but_the_first; each unit's
    # reduce-scatter is then followed by the all-reduce of its shard over the 2 replicas
    # (1.5 s), on FSDP2's all-reduce stream (foreach_reduce: all_reduce_stream waits for the
    # reduce-scatter stream): u2 12-13.5, u1 16-17.5, u0 20-21.5.
    timeline, streams, view = _hsdp_timeline(all_reduce_s=1.5)
    assert timeline == {
        "all-gather u0": (0, 1), "F0 u0": (1, 3),
        "all-gather u1": (1, 2), "F0 u1": (3, 5),
        "all-gather u2": (3, 4), "F0 u2": (5, 7),
        "all-gather u2 (bwd)": (4, 5), "B0 u2": (7, 11), "reduce-scatter grads (u2)": (11, 12),
        "all-reduce grad shard over replicate (u2)": (12, 13.5),
        "all-gather u1 (bwd)": (7, 8), "B0 u1": (11, 15), "reduce-scatter grads (u1)": (15, 16),
        "all-reduce grad shard over replicate (u1)": (16, 17.5),
        "all-gather u0 (bwd)": (11, 12), "B0 u0": (15, 19), "reduce-scatter grads (u0)": (19, 20),
        "all-reduce grad shard over replicate (u0)": (20, 21.5),
    }
    assert {streams[name] for name in timeline if name.startswith("all-reduce")} == {ALL_REDUCE_STREAM}
    # The gathers and reduce-scatters run over the shard group ("dp" of the view), the
    # all-reduces over "replicate", of the shard each rank holds: 1e6 gradients reduced in
    # fp32 (FSDP2's reduce dtype under bf16) / 4 ranks = 1e6 bytes.
    assert {(kind, axis) for kind, _, axis in view.calls} == {
        ("all_gather", "dp"), ("reduce_scatter", "dp"), ("all_reduce", "replicate")}
    assert {size for kind, size, _ in view.calls if kind == "all_reduce"} == {1e6 * 4 / 4}


def test_a_slow_all_reduce_queues_on_its_stream_and_never_delays_the_reduce_scatters():
    # The all-reduces take 5 s, longer than a unit's backward: u2's runs 12-17, u1's waits for
    # it (17-22) and u0's for that (22-27), while the reduce-scatters keep their times (u1's
    # 15-16, u0's 19-20): they are on another stream.
    timeline, _, _ = _hsdp_timeline(all_reduce_s=5)
    assert timeline["reduce-scatter grads (u1)"] == (15, 16)
    assert timeline["reduce-scatter grads (u0)"] == (19, 20)
    assert [timeline[f"all-reduce grad shard over replicate ({unit})"] for unit in ("u2", "u1", "u0")] == [
        (12, 17), (17, 22), (22, 27)]


def test_hsdp_collective_times_on_two_dgx_a100_nodes_by_hand():
    """HSDP 2 x 8 on two DGX A100 nodes priced with the alpha-beta model (the preset without
    its NCCL measurements: ``derived_from`` None): each node is a shard group, so gathers and
    reduce-scatters cross NVLink only, and the 8 replicate groups {r, r + 8} each all-reduce
    their shard across the two nodes at once, one GPU per node per group."""
    cluster = dataclasses.replace(Cluster.preset("dgx-a100-80g", nodes=2), derived_from=None)
    wide = ModelSpec(GPT, {"batch_size": 16, "n_layer": 2, "n_embd": 1024, "n_head": 16})
    fsdp = planner.plan(wide, cluster, dp_flavour="fsdp")
    hsdp = simulated(dataclasses.replace(fsdp, sections={"hsdp": HsdpSection(8)}), fsdp.graph)
    assert hsdp.precision == "bf16"  # FSDP2 gathers bf16 weights (2 bytes), reduces fp32 gradients (4)
    elements = _block_elements(hsdp, "blocks.0")
    events = _events(hsdp)
    nvlink_bandwidth, nvlink_latency = 300e9, 3e-6  # the preset's intra-node link (planner/presets.py)
    nic_bandwidth, nic_latency = 25e9, 8e-6  # its inter-node link per GPU (HDR InfiniBand, 200 Gb/s)
    # Ring inside the node of 8: 7/8 of the bytes over NVLink and 7 hops.
    assert events["all-gather blocks.0"] == pytest.approx(
        7 / 8 * elements * 2 / nvlink_bandwidth + 7 * nvlink_latency, rel=1e-9)
    assert events["reduce-scatter grads (blocks.0)"] == pytest.approx(
        7 / 8 * elements * 4 / nvlink_bandwidth + 7 * nvlink_latency, rel=1e-9)
    # The shard (elements x 4 bytes / 8) all-reduced by a ring of 2 across the nodes: the 8
    # groups' members on a node share its 8 x 25 GB/s, 25 GB/s each; 2 x 1/2 of the bytes
    # and 2 hops (the tree's 2 x bytes / bandwidth is slower).
    shard_bytes = elements * 4 / 8
    assert events["all-reduce grad shard over replicate (blocks.0)"] == pytest.approx(
        shard_bytes / nic_bandwidth + 2 * nic_latency, rel=1e-9)
    # Plain FSDP gathers over all 16 ranks, across the nodes: the cheaper of a flat ring
    # (15/16 of the bytes at the NIC's 25 GB/s, 15 InfiniBand hops) and NCCL-style two levels
    # (1/2 of a node's eighth across the nodes, 1 hop, then 7/8 of the bytes over NVLink, 7 hops).
    gathered = elements * 2
    ring = 15 / 16 * gathered / nic_bandwidth + 15 * nic_latency
    two_level = (gathered / 8 / 2 / nic_bandwidth + nic_latency
                 + 7 / 8 * gathered / nvlink_bandwidth + 7 * nvlink_latency)
    assert _events(fsdp)["all-gather blocks.0"] == pytest.approx(min(ring, two_level), rel=1e-9)
