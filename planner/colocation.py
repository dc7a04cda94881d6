"""``planner colocate``: what two or more training jobs sharing one cluster would gain.

Given saved plans for the same cluster, three arrangements are simulated and compared:

  * one after the other: a round (one step of every job) costs the sum of their steps;
  * split the cluster: each job re-planned on its share of the devices (half for two jobs),
    the jobs run side by side and the slower bounds a round;
  * co-located (crossover): both jobs' simulated timelines on shared streams, one job's
    gradient communication under the other's compute, the shortest of a few stream orders
    (``cost_model.colocation``), with both jobs' states resident on every device.

A round is one step of every job; combined throughput is the steps of all jobs per second
(jobs x rounds per second). The arrangement with the shortest round that fits in memory wins.

Memory is read device by device (``cost_model.colocation.rank_memory``): each rank needs
every job's bytes on the pipeline stage it holds, against its own device. Jobs that do not
fit together run one after the other by swapping states to host memory over PCIe at each
switch (priced, ``cost_model.colocation.swap_seconds``); co-located they cannot run
(swapping within an interleaved round is not modelled). The report is
``planner.colocation_report``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import TYPE_CHECKING, Sequence

from planner.cluster import Cluster
from planner.colocation_report import COLOCATED, SEQUENTIAL, SPLIT, Arrangement, Colocation, DeviceMemory
from planner.errors import ArgumentError, PlanningError
from planner.shared_cluster import check_same_cluster
from planner.units import format_bytes

if TYPE_CHECKING:  # imports torch: ``planner --help`` must not wait for it
    from planner.plans import Plan
    from planner.strategy import MemoryBreakdown

__all__ = ["COLOCATED", "SEQUENTIAL", "SPLIT", "Arrangement", "Colocation", "DeviceMemory", "colocate",
           "share_of_cluster"]


def colocate(plans: Sequence["Plan | str | os.PathLike"], *, split: bool = True, rounds: int = 3) -> Colocation:
    """Compare running ``plans`` (two or more, for the same cluster) one after the other, on
    a split cluster (re-planned on its share; skipped with ``split=False``) and co-located on
    the same devices in crossover order (``cost_model.colocation``).

    Raises:
        ArgumentError: fewer than two plans, plans for different clusters, or ``rounds`` < 2.
        PlannerError: a plan file is bad or its model can no longer be simulated.
    """
    from cost_model.colocation import colocate_timelines, rank_memory
    from cost_model.nccl import nccl_profile
    from planner.api import simulate
    from planner.plans import Plan, load_plan

    if len(plans) < 2:
        raise ArgumentError("colocate needs two or more plans (one per job sharing the cluster)")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 2:
        raise ArgumentError(f"colocate's rounds must be an integer of at least 2 (the steady round is the last "
                            f"minus the one before), got {rounds!r}")
    loaded = [plan if isinstance(plan, Plan) else load_plan(plan) for plan in plans]
    names = tuple(str(plan) if not isinstance(plan, Plan) else plan.name for plan in plans)
    check_same_cluster(names, [plan.cluster for plan in loaded])
    labels = tuple(chr(ord("A") + index) if index < 26 else f"J{index}" for index in range(len(loaded)))
    results = [simulate(plan) for plan in loaded]
    for name, result in zip(names, results):
        if not result.timeline:
            raise PlanningError(f"the simulation of {name} has no timeline to share the devices with")
    alone = tuple(result.step_time_s for result in results)
    cluster = loaded[0].cluster
    per_rank = [rank_memory(plan.mesh, result.stage_memory, result.memory) for plan, result in zip(loaded, results)]
    devices = tuple(DeviceMemory(rank, cluster.device_of(rank).name, tuple(job[rank].total for job in per_rank),
                                 cluster.device_of(rank).memory_bytes) for rank in range(cluster.world_size))
    profile = nccl_profile(cluster)
    slowdown = profile.overlap_slowdown if profile is not None else 0.0
    shared = colocate_timelines([result.timeline for result in results], labels, slowdown, rounds)
    arrangements = [one_after_the_other(cluster, alone, devices, per_rank)]
    if split:
        arrangements.append(_split(loaded, alone))
    arrangements.append(colocated_arrangement(cluster, alone, devices, shared.round_s, slowdown))
    return Colocation(labels, names, alone, tuple(result.memory.total for result in results), devices,
                      tuple(arrangements), shared.timeline)


def _tightest(devices: Sequence[DeviceMemory]) -> DeviceMemory:
    """The device with the least room left (the most missing) with every job resident."""
    return min(devices, key=lambda device: device.capacity_bytes - device.total_bytes)


def one_after_the_other(cluster: Cluster, alone: tuple[float, ...], devices: Sequence[DeviceMemory],
                         per_rank: "list[tuple[MemoryBreakdown, ...]]") -> Arrangement:
    """The jobs in turn on ``cluster`` (steps ``alone``; ``devices`` every rank's memory,
    ``per_rank`` each job's breakdown by rank). States stay resident where every job fits on
    every device; else at each switch between jobs (one per job a round) the bytes missing on
    the fullest device leave for host memory over PCIe and as many come back
    (``swap_seconds``), which each job's states (all but activations, freed when its step
    ends) must be able to give up."""
    from cost_model.colocation import PCIE_BYTES_PER_S, swap_seconds

    round_s = sum(alone)
    tightest = _tightest(devices)
    overflow = tightest.total_bytes - tightest.capacity_bytes
    if overflow <= 0:
        return Arrangement(SEQUENTIAL, round_s, tuple(round_s for _ in alone), True,
                           "every job's states stay resident (they fit together on every device)")
    if cluster.backend == "gloo":
        return Arrangement(SEQUENTIAL, round_s, tuple(round_s for _ in alone), True,
                           "the jobs do not fit together in the host's memory: one job's states would have to "
                           "leave it while the other runs (not priced on a CPU cluster)")
    for device, memories in zip(devices, zip(*per_rank)):
        missing = device.total_bytes - device.capacity_bytes
        states = [memory.total - memory.activations for memory in memories]
        if missing > min(states):
            return Arrangement(SEQUENTIAL, 0.0, alone, False,
                               f"rank {device.rank} lacks {format_bytes(missing)} with every job resident, more than "
                               f"a job's states there ({format_bytes(min(states))}) that could leave for host memory")
    swap = swap_seconds(overflow, switches=len(alone))
    round_s += swap
    return Arrangement(SEQUENTIAL, round_s, tuple(round_s for _ in alone), True,
                       f"swapping {format_bytes(overflow)} of states to host memory and back at each switch "
                       f"(rank {tightest.rank}) at {PCIE_BYTES_PER_S / 1e9:.1f} GB/s (PCIe 4.0 x16): "
                       f"+{swap * 1e3:.3g} ms a round", swap)


def colocated_arrangement(cluster: Cluster, alone: tuple[float, ...], devices: Sequence[DeviceMemory],
                          round_s: float, slowdown: float) -> Arrangement:
    """The crossover arrangement (``round_s`` from ``colocate_timelines``, compute slowed
    ``slowdown`` beside communication): it runs only where every job fits on every device."""
    tightest = _tightest(devices)
    note = (f"compute beside the other job's communication slowed {slowdown:.1%}" if slowdown
            else f"no compute slowdown beside communication is known for {cluster.name}")
    if not tightest.fits:
        note += (f"; rank {tightest.rank} needs {format_bytes(tightest.total_bytes)} of "
                 f"{format_bytes(tightest.capacity_bytes)} with every job resident: does not fit (swapping states "
                 f"out within an interleaved round is not modelled)")
    return Arrangement(COLOCATED, round_s, tuple(round_s for _ in alone), tightest.fits, note)


def share_of_cluster(cluster: Cluster, shares: int) -> Cluster | None:
    """``cluster`` cut into ``shares`` equal parts (whole nodes, or one node's devices),
    one part; None when it does not divide evenly."""
    if cluster.num_nodes % shares == 0 and cluster.num_nodes >= shares:
        return dataclasses.replace(cluster, nodes=cluster.nodes[: cluster.num_nodes // shares])
    if cluster.num_nodes == 1 and cluster.nodes[0].devices % shares == 0:
        node = cluster.nodes[0]
        return dataclasses.replace(cluster, nodes=(dataclasses.replace(node, devices=node.devices // shares),))
    return None


def _split(plans: "list[Plan]", alone: tuple[float, ...]) -> Arrangement:
    """Each job re-planned on its share of the cluster, all shares running side by side."""
    from planner.api import plan as make_plan

    share = share_of_cluster(plans[0].cluster, len(plans))
    if share is None:
        return Arrangement(SPLIT, 0.0, alone, False, f"{plans[0].cluster.world_size} devices do not split into "
                                                     f"{len(plans)} equal shares of whole nodes or devices")
    devices = f"{share.world_size} device{'s' if share.world_size > 1 else ''}"
    steps = []
    for plan in plans:
        if plan.model is None:
            return Arrangement(SPLIT, 0.0, alone, False, f"{plan.name} has no model spec to re-plan it on a share")
        try:
            replanned = make_plan(plan.model, share, precision=plan.precision, progress=False)
        except PlanningError as error:
            return Arrangement(SPLIT, 0.0, alone, False, f"{plan.name} cannot be planned on {devices}: "
                                                         f"{error}")
        if not replanned.estimate.fits:
            return Arrangement(SPLIT, 0.0, alone, False, f"{devices} cannot hold {plan.name}: it "
                                                         f"needs {format_bytes(replanned.estimate.memory.total)} per device")
        steps.append(replanned.estimate.step_time_s)
    return Arrangement(SPLIT, max(steps), tuple(steps), True,
                       f"each job re-planned on {share.world_size} of {plans[0].cluster.world_size} devices")



# ---- the command line: ``planner colocate`` ----

def add_colocate_command(commands) -> None:
    """``planner colocate A.json B.json [...]``."""
    colocate_ = commands.add_parser(
        "colocate",
        help="simulate two or more jobs sharing one cluster: one after the other, split, co-located",
        description="Compare running the planned jobs one after the other, each re-planned on its share of the "
        "cluster, and co-located on the same devices (one job's gradient communication under the other's compute). "
        "Simulated only: see the README's \"Sharing a cluster (simulated)\".",
    )
    colocate_.add_argument("plans", metavar="PLAN_JSON", nargs="+", help="plans saved by `planner plan -o`, same cluster size")
    colocate_.add_argument("--no-split", action="store_true", help="skip re-planning each job on its share of the cluster")
    colocate_.add_argument("--trace", metavar="TRACE_JSON", help="write the co-located round as a Chrome trace (ui.perfetto.dev)")
    colocate_.add_argument("--force", action="store_true", help="let --trace overwrite a file that is not a Chrome trace")
    colocate_.add_argument("--format", choices=("text", "json"), default="text",
                           help="text: the report (default); json: the whole report as one object (schema: "
                           "planner.colocation_report.Colocation.to_dict)")


def run_colocate(options: argparse.Namespace) -> int:
    """Run ``planner colocate``: the checks on --trace first, then the comparison."""
    from planner.cli_output import say, say_json, status
    from planner.strategy import check_trace_output

    if options.trace is not None:
        check_trace_output(options.trace, options.plans, force=options.force)
    with status("simulating the jobs alone and together"):
        result = colocate(options.plans, split=not options.no_split)
    if options.trace is not None:
        result.to_chrome_trace(options.trace, force=options.force)
    if options.format == "json":
        say_json({**result.to_dict(), "trace": options.trace})
        return 0
    for line in result.report():
        say(line)
    if options.trace is not None:
        say(f"wrote the co-located round to {options.trace} (open it in https://ui.perfetto.dev)")
    return 0
