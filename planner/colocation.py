"""``planner colocate``: what two or more training jobs sharing one cluster would gain.

Given saved plans for the same cluster, three arrangements are simulated and compared:

  * one after the other: a round (one step of every job) costs the sum of their steps;
  * split the cluster: each job re-planned on its share of the devices (half for two jobs),
    the jobs run side by side and the slower bounds a round;
  * co-located (crossover): both jobs' simulated timelines on shared streams, one job's
    gradient communication under the other's compute (``cost_model.colocation``), with both
    jobs' states resident on every device.

A round is one step of every job; combined throughput is the steps of all jobs per second
(jobs x rounds per second). The arrangement with the shortest round that fits in memory wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from planner.cluster import Cluster
from planner.errors import ArgumentError, PlanningError
from planner.units import format_bytes, format_seconds

if TYPE_CHECKING:  # both import torch: ``planner --help`` must not wait for it
    from planner.plans import Plan
    from planner.strategy import TimelineEvent

SEQUENTIAL = "one after the other"
SPLIT = "split the cluster"
COLOCATED = "co-located (crossover)"


@dataclass(frozen=True)
class Arrangement:
    """One way to run the jobs: seconds per round, each job's step in it, whether it fits.

    ``note`` says why an arrangement cannot run (then ``round_s`` is 0) or what it assumed."""

    name: str
    round_s: float
    job_step_s: tuple[float, ...]
    fits: bool
    note: str = ""

    @property
    def steps_per_s(self) -> float:
        """Steps of all jobs per second (0 when the arrangement cannot run)."""
        return len(self.job_step_s) / self.round_s if self.fits and self.round_s > 0 else 0.0


@dataclass(frozen=True)
class Colocation:
    """The comparison ``colocate`` returns.

    Attributes:
        labels: the jobs' short names (``A``, ``B``, ...), in the order given.
        names: each job's plan name (or file).
        alone_s: each job's simulated step owning the whole cluster.
        memory_bytes: each job's memory on its fullest device.
        capacity_bytes: memory of the cluster's smallest device.
        arrangements: one after the other, split (unless skipped), co-located.
        timeline: the co-located first round, both jobs on shared device slots.
    """

    labels: tuple[str, ...]
    names: tuple[str, ...]
    alone_s: tuple[float, ...]
    memory_bytes: tuple[int, ...]
    capacity_bytes: int
    arrangements: tuple[Arrangement, ...]
    timeline: "tuple[TimelineEvent, ...]"

    @property
    def winner(self) -> Arrangement | None:
        """The arrangement with the most steps per second among those that fit."""
        runnable = [a for a in self.arrangements if a.fits and a.round_s > 0]
        return max(runnable, key=lambda a: a.steps_per_s) if runnable else None

    def report(self) -> list[str]:
        """The comparison as lines of text."""
        lines = [f"job {label}: {name}, alone {format_seconds(step)} per step, {format_bytes(memory)} per device"
                 for label, name, step, memory in zip(self.labels, self.names, self.alone_s, self.memory_bytes)]
        both = sum(self.memory_bytes)
        lines.append(f"memory with every job resident: {format_bytes(both)} of {format_bytes(self.capacity_bytes)} "
                     f"per device ({'fits' if both <= self.capacity_bytes else 'does not fit'})")
        for arrangement in self.arrangements:
            lines.append(f"{arrangement.name}:")
            if arrangement.round_s > 0:
                slowdowns = ", ".join(f"{label} {step / alone:.2f}x" for label, step, alone
                                      in zip(self.labels, arrangement.job_step_s, self.alone_s))
                lines.append(f"  round (one step of each) {format_seconds(arrangement.round_s)}; "
                             f"slowdown against alone: {slowdowns}")
                lines.append(f"  combined throughput {len(self.labels) / arrangement.round_s:.2f} steps/s")
            if arrangement.note:
                lines.append(f"  {arrangement.note}")
        winner = self.winner
        if winner is None:
            lines.append("winner: none of the arrangements fits")
        else:
            sequential = next(a for a in self.arrangements if a.name == SEQUENTIAL)
            gain = sequential.round_s / winner.round_s if sequential.fits and winner is not sequential else 1.0
            lines.append(f"winner: {winner.name}" + (f" ({gain:.2f}x the throughput of one after the other)"
                                                    if winner is not sequential else ""))
        return lines

    def to_chrome_trace(self, path: str | os.PathLike, *, force: bool = False) -> None:
        """Write the co-located first round as a Chrome/Perfetto trace: one process per
        device slot, one thread per shared stream, each task named ``LABEL: task``."""
        from planner.strategy import write_chrome_trace

        write_chrome_trace(self.timeline, str(path), force=force)


def colocate(plans: Sequence["Plan | str | os.PathLike"], *, split: bool = True, rounds: int = 3) -> Colocation:
    """Compare running ``plans`` (two or more, for clusters of the same size) one after the
    other, on a split cluster (re-planned on its share; skipped with ``split=False``) and
    co-located on the same devices in crossover order (``cost_model.colocation``).

    Raises:
        ArgumentError: fewer than two plans, clusters of different sizes, or ``rounds`` < 2.
        PlannerError: a plan file is bad or its model can no longer be simulated.
    """
    from cost_model.colocation import colocate_timelines
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
    sizes = [plan.cluster.world_size for plan in loaded]
    if len(set(sizes)) > 1:
        listed = ", ".join(f"{name}: {size}" for name, size in zip(names, sizes))
        raise ArgumentError(f"the plans are for clusters of different sizes ({listed} devices); "
                            f"plan every job for the same cluster to compare sharing it")
    labels = tuple(chr(ord("A") + index) if index < 26 else f"J{index}" for index in range(len(loaded)))
    results = [simulate(plan) for plan in loaded]
    for name, result in zip(names, results):
        if not result.timeline:
            raise PlanningError(f"the simulation of {name} has no timeline to share the devices with")
    alone = tuple(result.step_time_s for result in results)
    memory = tuple(result.memory.total for result in results)
    cluster = loaded[0].cluster
    capacity = cluster.min_device_memory
    sequential = Arrangement(SEQUENTIAL, sum(alone), tuple(sum(alone) for _ in alone), True,
                             "each job's states leave the devices while the other runs (reload time not modelled)")
    profile = nccl_profile(cluster)
    slowdown = profile.overlap_slowdown if profile is not None else 0.0
    shared = colocate_timelines([result.timeline for result in results], labels, slowdown, rounds)
    fits = sum(memory) <= capacity
    colocated = Arrangement(
        COLOCATED, shared.round_s, tuple(shared.round_s for _ in alone), fits,
        (f"compute beside the other job's communication slowed {slowdown:.1%}" if slowdown
         else f"no compute slowdown beside communication is known for {cluster.name}") + (
            "" if fits else f"; both jobs' states need {format_bytes(sum(memory))} of "
                            f"{format_bytes(capacity)} per device: does not fit (swapping states out is not modelled)"))
    arrangements = [sequential]
    if split:
        arrangements.append(_split(loaded, alone))
    arrangements.append(colocated)
    return Colocation(labels, names, alone, memory, capacity, tuple(arrangements), shared.timeline)


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


def run_colocate(options: argparse.Namespace) -> int:
    """Run ``planner colocate``: the checks on --trace first, then the comparison."""
    from planner.cli_output import say, status
    from planner.outputs import check_output_file, refuse_input_as_output
    from planner.strategy import is_chrome_trace

    if options.trace is not None:
        check_output_file(options.trace, what="Chrome trace", is_ours=is_chrome_trace, force=options.force)
        refuse_input_as_output(options.trace, "--trace", options.plans)
    with status("simulating the jobs alone and together"):
        result = colocate(options.plans, split=not options.no_split)
    for line in result.report():
        say(line)
    if options.trace is not None:
        result.to_chrome_trace(options.trace, force=options.force)
        say(f"wrote the co-located round to {options.trace} (open it in https://ui.perfetto.dev)")
    return 0
