"""FSDP2's schedule in the simulator, against timelines worked by hand.

A toy of three units (``u0``, ``u1``, ``u2``) of equal size, each with known forward and
backward seconds, whose all-gathers and reduce-scatters take known seconds, runs one
micro-batch's forward and backward through ``StepTasks``. The start and end of every
gather, pass and reduce-scatter must be what FSDP2's streams give (``cost_model.step_tasks.
prefetch_after`` and ``cost_model.data_parallel_step``): gathers on their own stream, the next
unit's gather issued when the previous unit's pass starts (it waits for the end of the unit
two before), reduce-scatters on another stream after each unit's backward.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_parity import run_ranks

import planner
from cost_model.data_parallel_step import DataParallelStep
from cost_model.scheduler import TaskGraph
from cost_model.segments import Segment
from cost_model.step_context import StepContext
from cost_model.step_contributor import GATHER_STREAM, REDUCE_STREAM
from cost_model.simulator import Simulator
from cost_model.step_tasks import StepTasks
from planner.cluster import DeviceSpec
from planner.model_spec import ModelSpec

UNITS = ("u0", "u1", "u2")
REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "fsdp_order_worker.py"


UNIT_ELEMENTS = 1e6  # bf16 weights: a unit's gather moves 2 MB, its copy-out reads and writes them


def _device(copy_s: float) -> DeviceSpec:
    """A device on which FSDP2's copy-out of a unit (4 MB read and written) takes ``copy_s``."""
    bandwidth = 4 * UNIT_ELEMENTS / copy_s if copy_s else 1e16
    return DeviceSpec(name="toy", peak_flops={"bfloat16": 1e15}, memory_bytes=2**34, memory_bandwidth=bandwidth,
                      memory_efficiency=1.0, kernel_overhead_s=0.0)


class ToyContext:
    """What FSDP's tasks read of a plan's ``StepContext``: an fsdp (or zero2) plan over 8 ranks
    whose units are ``UNITS``, on NCCL, with every all-gather taking ``gather_s``, every
    reduce-scatter ``reduce_s`` and every copy-out ``copy_s`` (the units are of one size)."""

    dp = 8
    micro_batches = 1
    graph_program = False
    cluster = SimpleNamespace(backend="nccl")
    reduced_gradient_bytes = StepContext.reduced_gradient_bytes

    def __init__(self, flavour: str, gather_s: float, reduce_s: float, copy_s: float) -> None:
        self.plan = SimpleNamespace(dp_flavour=flavour, pipeline=None, fsdp_units=UNITS, precision="bf16",
                                    label=None, recompute_at=lambda stage: "none")
        self.seconds = {"all_gather": gather_s, "reduce_scatter": reduce_s}
        self.device = _device(copy_s)

    def collective(self, kind: str, size_bytes: float, axis: str) -> float:
        assert axis == "dp" and size_bytes > 0
        return self.seconds[kind]


def _timeline(flavour: str, forward_s: float, backward_s: float, gather_s: float, reduce_s: float,
              copy_s: float = 0.0):
    """Each task's (start, end) after one micro-batch's forward and backward of the toy
    (without copy-outs, when they take no time)."""
    segments = [Segment(name=unit, stage=0, block=True, forward_s=forward_s, backward_s=backward_s,
                        params={f"{unit}.weight": UNIT_ELEMENTS}, dp_synced={f"{unit}.weight"}) for unit in UNITS]
    tasks = StepTasks(ToyContext(flavour, gather_s, reduce_s, copy_s), (DataParallelStep(),))
    last = tasks.forward("gpu", segments, 0, [])
    tasks.backward("gpu", segments, 0, [last], "none", True, {}, True)
    graph: TaskGraph = tasks.graph
    graph.run()
    # to the microsecond: "no time" is the 0.4 ns a copy takes at the largest bandwidth allowed
    timeline = {task.name: (round(task.start, 6), round(task.finish, 6)) for task in graph.tasks}
    if not copy_s:
        timeline = {name: times for name, times in timeline.items() if not name.startswith(("copy-out", "copy-in"))}
    return timeline, graph


def test_compute_bound_gathers_are_hidden_but_the_first():
    # forward 2 s, backward 4 s, all-gather 1 s, reduce-scatter 1 s per unit.
    # Forward: u0's gather is the only one the compute waits for; u1's follows it on the
    # gather stream; u2's is issued when u1's forward starts (u0's has ended, at 3).
    # Backward: u2 was freed after its forward and is gathered again behind the forward's
    # gathers (at 4, while u2 still computes its forward); u1's is issued when the backward
    # starts (7), u0's when u1's backward starts (u2's has ended, at 11). Each unit's
    # reduce-scatter follows its backward; the last one is the step's only exposed one.
    timeline, _ = _timeline("fsdp", forward_s=2, backward_s=4, gather_s=1, reduce_s=1)
    assert timeline == {
        "all-gather u0": (0, 1), "F0 u0": (1, 3),
        "all-gather u1": (1, 2), "F0 u1": (3, 5),
        "all-gather u2": (3, 4), "F0 u2": (5, 7),
        "all-gather u2 (bwd)": (4, 5), "B0 u2": (7, 11), "reduce-scatter grads (u2)": (11, 12),
        "all-gather u1 (bwd)": (7, 8), "B0 u1": (11, 15), "reduce-scatter grads (u1)": (15, 16),
        "all-gather u0 (bwd)": (11, 12), "B0 u0": (15, 19), "reduce-scatter grads (u0)": (19, 20),
    }


def test_copy_outs_and_copy_ins_run_before_each_pass_and_each_collective():
    # As the compute-bound case (forward 2 s, backward 4 s, all-gather 1 s, reduce-scatter
    # 1 s), on a device streaming 8 MB/s:
    # - each gathered unit is copied out (0.5 s: 2 MB of bf16 weights read and written) on
    #   the compute stream before its pass: u1's copy-out waits for u0's forward;
    # - each gather's input is copied in first (FSDP2's foreach_all_gather), on its own
    #   stream: this rank's 1/8 of the unit, 1.25e5 fp32 weights read (0.5 MB) and written
    #   in bf16 (0.25 MB) = 0.75 MB = 0.09375 s; the gather waits for it;
    # - each unit's gradients are copied into the reduce-scatter input on the reduce-scatter
    #   stream after its backward (FSDP2's _chunk_cat): 1e6 bf16 gradients read (2 MB) and
    #   written in fp32, the reduce dtype (4 MB) = 6 MB = 0.75 s; the reduce-scatter follows.
    # u0's gather ends at 0.09375 + 1, u1's copy-in runs right after u0's (0.09375-0.1875) and
    # its gather waits for the gather stream (1.09375-2.09375); u2's copy-in waits for the end
    # of u0's forward (3.59375). In backward, u2's second copy-in queues behind u2's first.
    c = 0.09375
    timeline, graph = _timeline("fsdp", forward_s=2, backward_s=4, gather_s=1, reduce_s=1, copy_s=0.5)
    assert timeline == {
        "copy-in u0": (0, c), "all-gather u0": (c, 1 + c), "copy-out u0": (1 + c, 1.5 + c), "F0 u0": (1.5 + c, 3.5 + c),
        "copy-in u1": (c, 2 * c), "all-gather u1": (1 + c, 2 + c), "copy-out u1": (3.5 + c, 4 + c),
        "F0 u1": (4 + c, 6 + c),
        "copy-in u2": (3.5 + c, 3.5 + 2 * c), "all-gather u2": (3.5 + 2 * c, 4.5 + 2 * c),
        "copy-out u2": (6 + c, 6.5 + c), "F0 u2": (6.5 + c, 8.5 + c),
        "copy-in u2 (bwd)": (3.5 + 2 * c, 3.5 + 3 * c), "all-gather u2 (bwd)": (4.5 + 2 * c, 5.5 + 2 * c),
        "copy-out u2 (bwd)": (8.5 + c, 9 + c), "B0 u2": (9 + c, 13 + c),
        "copy-in grads (u2)": (13 + c, 13.75 + c), "reduce-scatter grads (u2)": (13.75 + c, 14.75 + c),
        "copy-in u1 (bwd)": (8.5 + c, 8.5 + 2 * c), "all-gather u1 (bwd)": (8.5 + 2 * c, 9.5 + 2 * c),
        "copy-out u1 (bwd)": (13 + c, 13.5 + c), "B0 u1": (13.5 + c, 17.5 + c),
        "copy-in grads (u1)": (17.5 + c, 18.25 + c), "reduce-scatter grads (u1)": (18.25 + c, 19.25 + c),
        "copy-in u0 (bwd)": (13 + c, 13 + 2 * c), "all-gather u0 (bwd)": (13 + 2 * c, 14 + 2 * c),
        "copy-out u0 (bwd)": (17.5 + c, 18 + c), "B0 u0": (18 + c, 22 + c),
        "copy-in grads (u0)": (22 + c, 22.75 + c), "reduce-scatter grads (u0)": (22.75 + c, 23.75 + c),
    }
    streams = {task.name: task.stream[1] for task in graph.tasks}
    assert {streams[name] for name in timeline if name.startswith("copy-out")} == {"compute"}
    assert {streams[name] for name in timeline if name.startswith("copy-in grads")} == {REDUCE_STREAM}
    assert {streams[name] for name in timeline if name.startswith("copy-in u")} == {"all_gather copy-in"}


def test_communication_bound_gathers_run_back_to_back_beside_the_reduce_scatters():
    # forward 1 s, backward 2 s, all-gather 3 s, reduce-scatter 3 s per unit.
    # The gather stream never idles once it starts: each pass waits for its unit's gather.
    # In backward the gathers run beside the reduce-scatters (u1's gather, 12-15, while
    # u2's reduce-scatter runs, 14-17): a gather never queues behind a reduce-scatter.
    timeline, graph = _timeline("fsdp", forward_s=1, backward_s=2, gather_s=3, reduce_s=3)
    assert timeline == {
        "all-gather u0": (0, 3), "F0 u0": (3, 4),
        "all-gather u1": (3, 6), "F0 u1": (6, 7),
        "all-gather u2": (6, 9), "F0 u2": (9, 10),
        "all-gather u2 (bwd)": (9, 12), "B0 u2": (12, 14), "reduce-scatter grads (u2)": (14, 17),
        "all-gather u1 (bwd)": (12, 15), "B0 u1": (15, 17), "reduce-scatter grads (u1)": (17, 20),
        "all-gather u0 (bwd)": (15, 18), "B0 u0": (18, 20), "reduce-scatter grads (u0)": (20, 23),
    }
    streams = {task.name: task.stream[1] for task in graph.tasks}
    assert {streams[name] for name in timeline if name.startswith("all-gather")} == {GATHER_STREAM}
    assert {streams[name] for name in timeline if name.startswith("reduce-scatter")} == {REDUCE_STREAM}


def test_zero2_gathers_in_forward_only_and_backward_never_waits_for_the_network():
    # ZeRO-2 is FSDP2 with reshard_after_forward=False: the forward gathers as FSDP's
    # (1 s forward, 3 s gathers: as above), the units stay gathered through backward, so
    # each backward follows the last without waiting; reduce-scatters queue on their stream.
    timeline, _ = _timeline("zero2", forward_s=1, backward_s=2, gather_s=3, reduce_s=3)
    assert timeline == {
        "all-gather u0": (0, 3), "F0 u0": (3, 4),
        "all-gather u1": (3, 6), "F0 u1": (6, 7),
        "all-gather u2": (6, 9), "F0 u2": (9, 10),
        "B0 u2": (10, 12), "reduce-scatter grads (u2)": (12, 15),
        "B0 u1": (12, 14), "reduce-scatter grads (u1)": (15, 18),
        "B0 u0": (14, 16), "reduce-scatter grads (u0)": (18, 21),
    }


@pytest.mark.parametrize("flavour", ["fsdp", "zero2"])
def test_at_most_two_units_are_gathered_at_once_in_forward(flavour):
    # The memory model holds two units' gathered weights (the one computing and the one
    # arriving): no forward gather may start before the unit two before it has finished.
    for forward_s, gather_s in ((2, 1), (1, 3), (5, 0.5)):
        timeline, _ = _timeline(flavour, forward_s=forward_s, backward_s=2, gather_s=gather_s, reduce_s=1)
        for position in range(2, len(UNITS)):
            gather_start = timeline[f"all-gather {UNITS[position]}"][0]
            assert gather_start >= timeline[f"F0 {UNITS[position - 2]}"][1]


def test_compute_beside_two_collective_streams_is_slowed_once_for_the_time_either_runs():
    # Compute of 4 s beside a gather (0-3 s) and a reduce-scatter (2-5 s) on two streams:
    # communication runs during 0-4 of it, so a 10% slowdown adds 0.4 s, not 0.1 x (3 + 2).
    graph = TaskGraph()
    graph.add("compute", ("gpu", "compute"), 4.0)
    graph.add("gather", ("gpu", GATHER_STREAM), 3.0, kind="comm")
    graph.add("idle", ("gpu", REDUCE_STREAM), 2.0, kind="optimizer")
    graph.add("reduce-scatter", ("gpu", REDUCE_STREAM), 3.0, kind="comm")
    graph.run()
    graph.contend(0.1)
    assert graph.run() == pytest.approx(5.0)
    assert graph.tasks[0].finish == pytest.approx(4.4)


# What the compiled program dispatches for a gather and for a gradient reduction (FSDP2 on
# gloo all-reduces the whole gradient: data_parallel_step._gradient_sync).
_PROGRAM_KIND = {"_allgather_base_": "gather", "all_gather_into_tensor": "gather", "allgather_": "gather",
                 "allreduce_": "reduce", "_reduce_scatter_base_": "reduce", "reduce_scatter_tensor": "reduce"}
_SIMULATED = re.compile(r"(all-gather|all-reduce grads|reduce-scatter grads) \(?(blocks\.\d+)\b")


@pytest.mark.distributed
def test_the_simulated_order_of_each_units_collectives_is_the_compiled_programs(tmp_path):
    # A compiled FSDP program of the GPT example on 2 gloo ranks runs one forward and
    # backward with its collectives counted in the order rank 0 issues them. Its blocks are
    # FSDP2 units of one size; the simulated step must issue their gathers and reductions in
    # the same order: each block gathered before its forward, then in backward the last
    # block gathered, the next one prefetched before the last's reduction, and so on
    # (FSDP2's pre_backward prefetch), each block's reduction after its backward.
    plan = planner.plan(ModelSpec(str(REPO / "examples" / "gpt.py"), {"batch_size": 8, "n_layer": 4}), "cpu:1x2",
                        dp_flavour="fsdp", progress=False)
    assert plan.fsdp_units and all(unit.startswith("blocks.") for unit in plan.fsdp_units)
    folder = planner.compile(plan, tmp_path / "fsdp")
    launch = run_ranks(2, WORKER, [str(folder)], REPO, 300)
    assert launch.returncode == 0 and "DONE" in launch.stdout, launch.describe()
    block_bytes = {sum(meta.numel for name, meta in plan.graph.parameters.items() if name.startswith(unit + "."))
                   * 4 for unit in plan.fsdp_units}  # fp32 weights and gradients on the cpu preset
    assert len(block_bytes) == 1
    program = [_PROGRAM_KIND[op] for _, op, size in (line.split(" ") for line in launch.stdout.splitlines()
                                                      if line.startswith("CALL ")) if int(size) in block_bytes]
    timeline = sorted(Simulator(plan, plan.graph).run().timeline, key=lambda event: event.start_s)
    simulated = []
    for event in timeline:
        match = _SIMULATED.match(event.name)
        if match:
            simulated.append(("gather" if match.group(1) == "all-gather" else "reduce", match.group(2)))
    blocks = len(plan.fsdp_units)
    # forward: every block's gather; backward: two gathers, then reduction and gather in
    # turn, the last two reductions at the end.
    assert [kind for kind, _ in simulated] == program
    assert program == ["gather"] * blocks + ["gather", "gather"] + ["reduce", "gather"] * (blocks - 2) + ["reduce"] * 2
    # and the simulated gathers go down the blocks in backward order
    backward_gathers = [block for kind, block in simulated[blocks:] if kind == "gather"]
    assert backward_gathers == list(reversed(plan.fsdp_units))
