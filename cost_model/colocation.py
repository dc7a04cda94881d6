"""Two or more jobs time-sharing the same devices, scheduled from their simulated timelines.

CrossoverScheduler's idea (one job computes while the other synchronises its gradients,
alternately) read as list scheduling. The model, stated so a reader can check it by hand:

  * Each job's timeline (``SimResult.timeline``) gives, per simulated device, its tasks on
    each stream with their durations. The simulator's devices are representatives (``stage
    0`` for a plan without a pipeline stands for every rank), so device slot k holds each
    job's (k mod its device count)-th simulated device: a data-parallel job beside a
    two-stage pipeline runs on both stages' slots.
  * The jobs share the streams of a slot by name: one ``compute`` stream, and each
    communication stream (``collective``, ``p2p``, ...) shared with the same stream of the
    other jobs. A stream runs one task at a time; each job's tasks keep their own order.
  * A job's task waits for the job's tasks that had finished when it started alone (the
    last one of every other stream, on any of its devices): the backward pass before its
    gradient all-reduce, the all-reduce before the optimizer, a pipeline stage's send before
    the next stage's work. So no job runs faster than alone; the dependencies read this way
    are conservative (a task may wait for one it did not need).
  * ``rounds`` steps of every job run back to back: a job's next step starts after its
    previous one ends on that device. When a shared stream frees, the ready task that can
    start earliest runs; a tie goes to the job listed first. This gives the crossover order:
    job A computes, then B computes while A's gradients move, and B's gradients move under
    A's next step.
  * That greedy rule can lose: a job's short task that gates its next step (its optimizer,
    ready just after its all-reduce) waits behind the other job's long compute that was
    ready a moment earlier, and the round grows past the compute both jobs need (two
    ResNet-50 jobs on 16 V100s gave 64.7 ms at 100 Gb/s, 55.3 ms at 25 Gb/s). So two
    more orders are scheduled and the shortest steady round kept, as a co-located program
    could pick its order: by phase (the order ``compile --colocate``'s program runs the
    jobs' halves in: A computes, B finishes, B computes, A finishes, ...) and one after the
    other (each job's step whole in turn), so a round is never longer than the jobs' steps
    one after the other.
  * Compute beside another job's communication is slowed by the overlap slowdown the
    simulator charges within one job (``cost_model.nccl.OVERLAP_COMPUTE_SLOWDOWN``) via
    ``TaskGraph.contend``; a job's own overlap is already in its timeline's durations, so
    only the other jobs' communication is charged here. One pass, as in the simulator.

Memory (``rank_memory``, ``swap_seconds``): every job's states and activations stay resident
on every device they use; a rank needs the sum of each job's bytes on the pipeline stage it
holds, against that rank's own device. Jobs that do not fit together can still run one after
the other by moving states to host memory over PCIe between their steps (``swap_seconds``);
interleaving within a step with swapping is not modelled (both jobs' states are live then).

Not modelled: memory bandwidth or cache sharing between two jobs' kernels (beyond the
overlap slowdown), and two jobs' collectives sharing a link concurrently (a shared stream
runs them one after the other).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

from cost_model.scheduler import TaskGraph
from planner.strategy import MemoryBreakdown, Mesh, TimelineEvent

COMPUTE_STREAM = "compute"

# The orders ``colocate_timelines`` tries on the shared streams, keeping the shortest round
# (a co-located program can run any of them): see ``_list_order`` and ``_one_after_the_other``.
CROSSOVER = "crossover"
BY_PHASE = "by phase"
ONE_AFTER_THE_OTHER = "one after the other"
ORDER_RULES = (CROSSOVER, BY_PHASE, ONE_AFTER_THE_OTHER)

# Host <-> device copy bandwidth, bytes/s each way: PCIe 4.0 x16, 16 GT/s per lane x 16 lanes
# x 128b/130b encoding / 8 bits = 31.5 GB/s (PCI-SIG, PCI Express Base Specification 4.0: the
# host link of A100 servers such as the DGX A100). V100 hosts (PCIe 3.0) move half as fast,
# H100 hosts (PCIe 5.0) twice: one figure for all clusters (a cluster file has no host link).
PCIE_BYTES_PER_S = 16e9 * 16 * (128 / 130) / 8


@dataclass(frozen=True)
class CoRunner:
    """The job already sharing the devices, as the planner of another job sees it.

    Attributes:
        name: the job's plan name (shown in the search line).
        timeline: its simulated step (``SimResult.timeline``).
        rank_bytes: its bytes on each rank (``rank_memory``), rank order.
        step_s: its simulated step alone.
        overlap_slowdown: the fraction compute slows beside the other job's communication
            on this cluster (``cost_model.nccl``; 0 when unknown).
    """

    name: str
    timeline: tuple[TimelineEvent, ...]
    rank_bytes: tuple[int, ...]
    step_s: float
    overlap_slowdown: float


def co_runner_context(name: str, plan, result, cluster) -> CoRunner:
    """The context ``search_plan`` plans another job beside: ``plan`` (called ``name``), its
    simulation ``result`` (with its timeline) on ``cluster``, its bytes on each rank and the
    compute slowdown beside communication there (``cost_model.nccl``).

    Raises:
        ValueError: ``result`` has no timeline (simulated without one).
    """
    from cost_model.nccl import nccl_profile

    if not result.timeline:
        raise ValueError(f"the simulation of {name} has no timeline to share the devices with")
    profile = nccl_profile(cluster)
    memory = rank_memory(plan.mesh, result.stage_memory, result.memory)
    return CoRunner(name=name, timeline=result.timeline, rank_bytes=tuple(m.total for m in memory),
                    step_s=result.step_time_s, overlap_slowdown=profile.overlap_slowdown if profile else 0.0)


def rank_memory(mesh: Mesh, stage_memory: Sequence[MemoryBreakdown], fullest: MemoryBreakdown) -> tuple[MemoryBreakdown, ...]:
    """Each rank's memory (rank order): the breakdown of the pipeline stage it holds, its
    coordinate on the mesh's ``pp`` axis (``fullest`` for every rank of a plan simulated
    without per-stage figures). The mesh is outermost first, so rank r's ``pp`` coordinate
    is ``(r // the size of the axes inside pp) % pp``."""
    if "pp" not in mesh.names or not stage_memory:
        return tuple(stage_memory[0] if len(stage_memory) == 1 else fullest for _ in range(mesh.size))
    inner = 1
    for name, size in reversed(mesh.axes):
        if name == "pp":
            break
        inner *= size
    stages = mesh.axis_size("pp")
    return tuple(stage_memory[(rank // inner) % stages] for rank in range(mesh.size))


def swap_seconds(overflow_bytes: int, switches: int = 2, bytes_per_s: float = PCIE_BYTES_PER_S) -> float:
    """Seconds a round of jobs run one after the other spends swapping: at each of its
    ``switches`` from one job to the next (two for two jobs), ``overflow_bytes`` of the
    stopping job's states go out to host memory and as many of the starting job's come back,
    one copy after the other at the link's peak (copies a copy engine hid under compute would
    cost less, a link below its peak more)."""
    return switches * 2 * max(0, overflow_bytes) / bytes_per_s


@dataclass(frozen=True)
class ColocatedRound:
    """The co-located schedule of every job.

    Attributes:
        round_s: steady-state seconds per round (one step of every job): the last round's
            makespan minus the one before it.
        first_round_s: makespan of the first round alone (the crossover's start-up).
        job_finish_s: when each job's first step ends in the co-located schedule.
        timeline: every task of the first round, on device slots named ``device k``, each
            task's name prefixed with its job's label.
    """

    round_s: float
    first_round_s: float
    job_finish_s: tuple[float, ...]
    timeline: tuple[TimelineEvent, ...]


@dataclass
class _SharedTask:
    """One task of one job's step ``round``, placed on device ``slot``; ``finishing``: it
    starts alone after the job's last communication ends (its optimizer step)."""

    job: int
    round: int
    slot: int
    event: TimelineEvent
    finishing: bool = False


def colocate_timelines(
    timelines: Sequence[Sequence[TimelineEvent]],
    labels: Sequence[str],
    overlap_slowdown: float,
    rounds: int = 3,
    orders: Sequence[str] = ORDER_RULES,
) -> ColocatedRound:
    """Schedule ``rounds`` steps of every job's ``timelines`` on shared streams (see the
    module docstring) in each of ``orders`` (``ORDER_RULES``) and keep the one with the
    shortest steady round; ``labels`` name the jobs in the timeline, ``overlap_slowdown`` is
    the fraction compute slows beside another job's communication. Needs ``rounds >= 2``."""
    if rounds < 2:
        raise ValueError("colocate_timelines needs at least 2 rounds to read a steady-state round")
    if len(timelines) != len(labels):
        raise ValueError("colocate_timelines needs one label per timeline")
    if not all(timelines):
        raise ValueError("colocate_timelines needs a task in every timeline")
    if not orders or not set(orders) <= set(ORDER_RULES):
        raise ValueError(f"colocate_timelines' orders must be some of {ORDER_RULES}, got {tuple(orders)}")
    best_rule, best_round = None, float("inf")
    for rule in orders:
        steady = (_makespan(timelines, labels, overlap_slowdown, rounds, rule)[0]
                  - _makespan(timelines, labels, overlap_slowdown, rounds - 1, rule)[0])
        # The shortest steady round wins; a tie keeps the rule listed first (the crossover).
        if best_rule is None or steady < best_round - 1e-12:
            best_rule, best_round = rule, steady
    # The first round's figures only for the winning order: one schedule, not one per order.
    first = _makespan(timelines, labels, overlap_slowdown, 1, best_rule)
    return ColocatedRound(round_s=best_round, first_round_s=first[0], job_finish_s=first[1], timeline=first[2])


def _makespan(timelines, labels, slowdown: float, rounds: int, rule: str):
    tasks, deps = _tasks(timelines, rounds)
    if rule == ONE_AFTER_THE_OTHER:
        order = _one_after_the_other(tasks, deps)
    else:
        order = _list_order(tasks, deps, rule)
    graph = TaskGraph()
    ids: dict[int, int] = {}
    for index in order:
        task = tasks[index]
        stream = (f"device {task.slot}", task.event.stream)
        kind = "compute" if task.event.stream == COMPUTE_STREAM else "comm"
        ids[index] = graph.add(task.event.name, stream, task.event.duration_s, [ids[d] for d in deps[index]], kind)
    # Task ids in ``graph`` follow ``order``; map back to ``tasks`` for the jobs.
    job_of = [tasks[index].job for index in order]
    makespan = graph.run()
    if slowdown > 0 and len(timelines) > 1:
        _contend_across_jobs(graph, job_of, len(timelines), slowdown)
        makespan = graph.run()
    finish = [0.0] * len(timelines)
    events = []
    for graph_id, index in enumerate(order):
        task, scheduled = tasks[index], graph.tasks[graph_id]
        finish[task.job] = max(finish[task.job], scheduled.finish)
        events.append(TimelineEvent(scheduled.stream[0], scheduled.stream[1], f"{labels[task.job]}: {task.event.name}",
                                    scheduled.start, scheduled.finish - scheduled.start))
    events.sort(key=lambda event: (event.start_s, event.device, event.stream))
    return makespan, tuple(finish), tuple(events)


def _tasks(timelines, rounds: int) -> tuple[list[_SharedTask], list[list[int]]]:
    """Every job's tasks for ``rounds`` steps and the dependencies kept within each job."""
    tasks: list[_SharedTask] = []
    deps: list[list[int]] = []
    slots = max(len({event.device for event in timeline}) for timeline in timelines)
    for job, timeline in enumerate(timelines):
        devices = list(dict.fromkeys(event.device for event in timeline))
        position = {device: index for index, device in enumerate(devices)}
        events = sorted(timeline, key=lambda e: (e.start_s, e.name))
        waits = _waits(events)
        communication = [event.start_s + event.duration_s for event in events if event.stream != COMPUTE_STREAM]
        last_communication = max(communication, default=float("inf"))
        previous_round: dict[int, list[int]] = {}
        for round_index in range(rounds):
            # A job simulated on fewer devices than the slots repeats them (replica r holds
            # its devices on slots r*n ... r*n+n-1): its devices stand for every device of
            # their kind (every rank of a data-parallel job).
            placed: dict[tuple[int, int], int] = {}
            for slot in range(slots):
                replica, index = divmod(slot, len(devices))
                for event_index, event in enumerate(events):
                    if position[event.device] == index:
                        placed[(slot, event_index)] = len(tasks)
                        finishing = event.stream == COMPUTE_STREAM and event.start_s >= last_communication - 1e-12
                        tasks.append(_SharedTask(job, round_index, slot, event, finishing))
                        deps.append(list(previous_round.get(slot, [])))
            for (slot, event_index), task_id in placed.items():
                replica = slot // len(devices)
                for waited in waits[event_index]:
                    other = placed.get((replica * len(devices) + position[events[waited].device], waited))
                    if other is not None:  # a partial replica has no such device: dropped
                        deps[task_id].append(other)
            # The next step on a device starts after this step's tasks there end.
            on_slot: dict[int, list[int]] = {}
            for (slot, _), task_id in sorted(placed.items()):
                on_slot.setdefault(slot, []).append(task_id)
            previous_round = {slot: _last_per_stream(tasks, ids) for slot, ids in on_slot.items()}
    return tasks, deps


def _waits(events: list[TimelineEvent]) -> list[list[int]]:
    """For each event (indices into ``events``, sorted by start), the last event of every
    other stream of the job, on any device, that had finished when it started alone: its
    backward before its all-reduce, a pipeline stage's send before the next stage's work.
    A stream runs one task at a time, so its finishes grow with its starts (bisect)."""
    finishes: dict[tuple[str, str], tuple[list[float], list[int]]] = {}
    for index, event in enumerate(events):
        times, indices = finishes.setdefault((event.device, event.stream), ([], []))
        times.append(event.start_s + event.duration_s)
        indices.append(index)
    waits = []
    for event in events:
        waited = []
        for key, (times, indices) in finishes.items():
            if key == (event.device, event.stream):
                continue
            last = bisect.bisect_right(times, event.start_s + 1e-12) - 1
            if last >= 0:
                waited.append(indices[last])
        waits.append(waited)
    return waits


def _last_per_stream(tasks: list[_SharedTask], ids: list[int]) -> list[int]:
    last: dict[str, int] = {}
    for task_id in ids:
        last[tasks[task_id].event.stream] = task_id
    return list(last.values())


def _list_order(tasks: list[_SharedTask], deps: list[list[int]], rule: str) -> list[int]:
    """The order tasks run on each shared stream, chosen one task at a time among the ready
    ones (their job's earlier tasks on the stream and their dependencies placed):

      * ``CROSSOVER``: the task that can start earliest, ties to the job listed first, then
        the earlier round and the earlier start alone.
      * ``BY_PHASE``: the task earliest in the order a co-located program runs the jobs'
        halves (``_phase``), then the one that can start earliest: a stream may wait for a
        job's short task that gates its next step (its optimizer after its all-reduce)
        rather than start the other job's long compute that was ready a moment earlier.
    """
    queues: dict[tuple[int, int, str], list[int]] = {}
    for task_id, task in enumerate(tasks):
        queues.setdefault((task.job, task.slot, task.event.stream), []).append(task_id)
    heads = {key: 0 for key in queues}
    jobs = 1 + max(task.job for task in tasks)
    finish: list[float | None] = [None] * len(tasks)
    stream_free: dict[tuple[int, str], float] = {}
    order: list[int] = []
    while len(order) < len(tasks):
        ready = []  # (start, task id, queue key)
        for key, queue in queues.items():
            if heads[key] == len(queue):
                continue
            task_id = queue[heads[key]]
            if any(finish[d] is None for d in deps[task_id]):
                continue
            task = tasks[task_id]
            start = max([stream_free.get((task.slot, task.event.stream), 0.0)] + [finish[d] for d in deps[task_id]])
            ready.append((start, task_id, key))
        if not ready:
            raise RuntimeError("the co-located jobs' tasks wait on each other (a timeline with a dependency cycle)")
        if rule == BY_PHASE:
            start, task_id, key = min(ready, key=lambda r: (_phase(tasks[r[1]], jobs), r[0], tasks[r[1]].job,
                                                            tasks[r[1]].event.start_s))
        else:
            start, task_id, key = min(ready, key=lambda r: (r[0], tasks[r[1]].job, tasks[r[1]].round,
                                                            tasks[r[1]].event.start_s))
        task = tasks[task_id]
        finish[task_id] = start + task.event.duration_s
        stream_free[(task.slot, task.event.stream)] = finish[task_id]
        heads[key] += 1
        order.append(task_id)
    return order


def _phase(task: _SharedTask, jobs: int) -> tuple[int, int]:
    """Where ``task`` falls in the order a co-located program runs its jobs' halves
    (``codegen.runtime.colocate_jobs``): in round r each job in turn computes, then the job
    before it finishes (waits for its all-reduces, steps its optimizer); the last job
    finishes after the first job's next compute. So in round r job j's compute is (r, 2j),
    its finish (r, 2j + 3), the last job's finish (r + 1, 1)."""
    if not task.finishing:
        return (task.round, 2 * task.job)
    if task.job == jobs - 1:
        return (task.round + 1, 1)
    return (task.round, 2 * task.job + 3)


def _one_after_the_other(tasks: list[_SharedTask], deps: list[list[int]]) -> list[int]:
    """Each job's step whole on each device slot, in turn (rounds, then the jobs as
    listed): every task of a step waits (added to ``deps``) for the last task of each
    stream of the step before it on its slot. Nothing of two jobs overlaps, so a round is
    never longer than the jobs' steps one after the other."""
    blocks: dict[tuple[int, int, int], list[int]] = {}
    for task_id, task in enumerate(tasks):
        blocks.setdefault((task.slot, task.round, task.job), []).append(task_id)
    previous: dict[int, list[int]] = {}
    for (slot, _, _), ids in sorted(blocks.items()):
        for task_id in ids:
            deps[task_id].extend(previous.get(slot, []))
        previous[slot] = _last_per_stream(tasks, ids)
    return _list_order(tasks, deps, CROSSOVER)


def _contend_across_jobs(graph: TaskGraph, job_of: list[int], jobs: int, slowdown: float) -> None:
    """Charge each job's compute for the time it ran beside the other jobs' communication
    (``TaskGraph.contend``, one job at a time: it resets every task's charge, so each job's
    charge is kept aside and all are restored at the end)."""
    kinds = [task.kind for task in graph.tasks]
    charged = [0.0] * len(graph.tasks)
    for job in range(jobs):
        for task, owner, kind in zip(graph.tasks, job_of, kinds):
            if owner == job:
                task.kind = "slowed" if kind == "compute" else "own"
            else:
                task.kind = "beside" if kind == "comm" else "other"
        graph.contend(slowdown, slowed="slowed", by="beside")
        for index, (task, owner) in enumerate(zip(graph.tasks, job_of)):
            if owner == job:
                charged[index] = task.contention
    for task, kind, charge in zip(graph.tasks, kinds, charged):
        task.kind = kind
        task.contention = charge
