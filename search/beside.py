"""Planning a job beside another one already on the devices (``planner plan --co-runner``).

Alone, the fastest plan wins. Beside a co-runner, the two jobs share each device's compute
stream and communication streams (``cost_model.colocation``): a plan whose step leaves its
devices idle (communication it cannot hide, pipeline bubbles) lends that time to the other
job, so a plan slower alone can make the shared round shorter.

The objective: the largest combined throughput, i.e. the shortest co-located round (one
step of each job; both jobs' steps per second are 2 / round), among the plans whose memory
fits on every device beside the co-runner's (rank by rank: each job's bytes on the pipeline
stage that rank holds, against that rank's device). Ties go to the plan faster alone.

Affordable because it re-ranks, not re-searches: the candidates are the search's kept
plans, the fastest ``KEPT`` that fit alone and the best of every route
(``planner.verdict.plan_route``), each simulated once more with its timeline and scheduled
beside the co-runner. The work is counted in plans (at most ``KEPT`` + one per route), not
seconds, so the choice is the same on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from cost_model.colocation import CoRunner, colocate_timelines, rank_memory
from cost_model.simulator import simulate_plan
from planner.errors import PlanningError
from planner.graph import OpGraph
from planner.plans import Plan
from planner.strategy import TimelineEvent
from planner.units import format_bytes, format_seconds
from planner.verdict import ROUTES, plan_route

# The kept plans re-ranked beside a co-runner: as many as the report lists as runners-up
# (search.runners_up.RUNNERS_UP, not imported: runners_up imports the data-parallel search,
# which re-ranks its flavours here).
KEPT = 8


@dataclass(frozen=True)
class Beside:
    """One candidate scheduled beside the co-runner.

    Attributes:
        plan: the candidate (a ``Plan`` in the search).
        alone_s: its step alone.
        round_s: the co-located round (one step of each job), steady state.
        tightest: (rank, both jobs' bytes there, that device's capacity) where the room
            left is smallest.
    """

    plan: Any
    alone_s: float
    round_s: float
    tightest: tuple[int, int, int]

    @property
    def fits(self) -> bool:
        """Whether both jobs' bytes fit on every rank's device."""
        return self.tightest[1] <= self.tightest[2]


def kept_candidates(fitting: list[Plan], count: int = KEPT) -> list[Plan]:
    """The plans re-ranked beside a co-runner: the ``count`` fastest of ``fitting`` (plans
    that fit alone), then the fastest of every route not among them."""
    ordered = sorted(fitting, key=lambda plan: plan.estimate.step_time_s)
    kept = ordered[:count]
    for route in ROUTES:
        members = [plan for plan in ordered if plan_route(plan) == route]
        if members and all(plan is not members[0] for plan in kept):
            kept.append(members[0])
    return kept


def timeline_beside(co_runner: CoRunner, candidate: Any, name: str, alone_s: float,
                    timeline: Sequence[TimelineEvent], rank_bytes: Sequence[int], capacities: Sequence[int]) -> Beside:
    """``candidate`` (called ``name``; its step ``alone_s``, its ``timeline`` and its bytes
    on each rank) scheduled with ``co_runner`` on shared devices whose memories are
    ``capacities`` (``cost_model.colocation.colocate_timelines``, the co-runner first)."""
    shared = colocate_timelines([co_runner.timeline, timeline], [co_runner.name, name], co_runner.overlap_slowdown)
    rows = [(rank, theirs + ours, capacity)
            for rank, (theirs, ours, capacity) in enumerate(zip(co_runner.rank_bytes, rank_bytes, capacities))]
    return Beside(candidate, alone_s, shared.round_s, min(rows, key=lambda row: row[2] - row[1]))


def schedule_beside(co_runner: CoRunner, plan: Plan, graph: OpGraph) -> Beside:
    """``plan`` simulated with its timeline and scheduled beside ``co_runner``."""
    result = simulate_plan(plan, graph)
    memory = rank_memory(plan.mesh, result.stage_memory, result.memory)
    capacities = [plan.cluster.device_of(rank).memory_bytes for rank in range(plan.cluster.world_size)]
    return timeline_beside(co_runner, plan, plan.name, result.step_time_s, result.timeline,
                           [m.total for m in memory], capacities)


def pick_beside(co_runner: CoRunner, scheduled: Sequence[Beside]) -> tuple[Beside, str]:
    """Of ``scheduled`` (the plan fastest alone first), the one with the shortest round
    among those that fit beside ``co_runner`` (ties: faster alone), and the search line.

    Raises:
        PlanningError: none fits beside the co-runner on every device.
    """
    fastest_alone = scheduled[0]
    room = [entry for entry in scheduled if entry.fits]
    if not room:
        rank, need, capacity = min((entry.tightest for entry in scheduled), key=lambda row: row[1] - row[2])
        raise PlanningError(
            f"none of the {len(scheduled)} plans kept fits beside {co_runner.name}: the closest needs "
            f"{format_bytes(need)} for both jobs on rank {rank}, which has {format_bytes(capacity)}; run the jobs "
            f"one after the other (plan without --co-runner) or on more devices"
        )
    best = min(room, key=lambda entry: (entry.round_s, entry.alone_s))
    against = (f"{format_seconds(fastest_alone.round_s)} for the plan fastest alone" if fastest_alone.fits else
               f"the plan fastest alone, which does not fit beside it ({format_bytes(fastest_alone.tightest[1])} on "
               f"rank {fastest_alone.tightest[0]} of {format_bytes(fastest_alone.tightest[2])})")
    return best, (f"planned beside {co_runner.name}: co-located round {format_seconds(best.round_s)} against "
                  f"{against}; {len(scheduled)} kept plans re-ranked by co-located round")


def choose_beside(co_runner: CoRunner, fitting: list[Plan], graph: OpGraph) -> tuple[Plan, str]:
    """The plan of ``fitting`` (the search's plans that fit alone) with the shortest
    co-located round beside ``co_runner`` among the kept ones that fit beside it
    (``pick_beside``), and the search line that compares it with the plan fastest alone."""
    scheduled = [schedule_beside(co_runner, plan, graph) for plan in kept_candidates(fitting)]
    best, line = pick_beside(co_runner, scheduled)
    return best.plan, line
