"""Overlap is not free: compute beside collectives slows by the measured fraction
(``TaskGraph.contend``, ``cost_model.nccl.OVERLAP_COMPUTE_SLOWDOWN``), worked by hand."""

from __future__ import annotations

import pytest

from cost_model.nccl import OVERLAP_COMPUTE_SLOWDOWN, nccl_profile
from cost_model.scheduler import TaskGraph
from planner.cluster import Cluster


def test_compute_slows_by_the_overlapped_time():
    graph = TaskGraph()
    first = graph.add("F", ("gpu0", "compute"), 10.0)
    graph.add("all-reduce", ("gpu0", "collective"), 4.0, deps=[], kind="comm")  # runs 0..4
    graph.add("B", ("gpu0", "compute"), 5.0, deps=[first])  # runs 10..15, beside nothing
    graph.add("F other", ("gpu1", "compute"), 3.0)  # another device: no collective beside it
    assert graph.run() == 15.0
    graph.contend(0.25)
    # F overlapped the all-reduce for 4 s: 0.25 · 4 = 1 s more; B starts at 11 and ends at 16.
    assert [task.contention for task in graph.tasks] == [1.0, 0.0, 0.0, 0.0]
    assert graph.run() == 16.0
    assert graph.tasks[2].start == 11.0
    # Without communication there is nothing to contend with.
    assert graph.run(scale={"comm": 0.0}) == 15.0


def test_partial_overlap_with_several_collectives():
    graph = TaskGraph()
    graph.add("idle", ("gpu0", "compute"), 2.0, kind="optimizer")  # not a compute kind: never slowed
    compute = graph.add("F", ("gpu0", "compute"), 6.0)  # runs 2..8
    graph.add("c1", ("gpu0", "collective"), 3.0, kind="comm")  # 0..3: overlaps F for 1
    graph.add("c2", ("gpu0", "collective"), 4.0, kind="comm")  # 3..7: overlaps F for 4
    graph.add("c3", ("gpu0", "collective"), 5.0, kind="comm")  # 7..12: overlaps F for 1
    graph.run()
    graph.contend(0.5)
    assert graph.tasks[compute].contention == pytest.approx(0.5 * (1 + 4 + 1))
    assert graph.tasks[0].contention == 0.0


def test_only_gpu_presets_pay_contention():
    assert nccl_profile(Cluster.preset("dgx-h100")).overlap_slowdown == OVERLAP_COMPUTE_SLOWDOWN == 0.189
    assert nccl_profile(Cluster.preset("cpu")) is None  # gloo: the simulator adds no contention
