"""Event-by-event list scheduling of a task graph on streams (FlexFlow's simulator).

Each task runs on one stream (a device's compute stream, its collective stream, its
point-to-point stream); a stream runs its tasks one at a time in the order they were added;
a task starts when its stream is free and every task it depends on has finished:

    start(t) = max(finish(previous task on t's stream), max(finish(d) for d in deps(t)))

With fixed stream orders this gives exact start times without a global clock, in
O(tasks + dependencies): a task's stream is revisited only when its last dependency finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Task:
    """One unit of work: ``duration`` seconds on ``stream`` after ``deps`` finish."""

    name: str
    stream: tuple[str, str]  # (device, stream kind)
    duration: float
    deps: list[int] = field(default_factory=list)
    kind: str = "compute"  # compute | comm | p2p | optimizer
    start: float = 0.0
    finish: float = 0.0
    # Set for a run of back-to-back pieces, (seconds, count): it ends exactly where that many
    # tasks of its own would, each added to the clock in turn. ``duration`` is their sum.
    pieces: tuple[tuple[float, int], ...] | None = None
    # Seconds added because collectives ran beside it (``TaskGraph.contend``); scaled with
    # the collectives' kind in ``run`` (no collectives, no contention).
    contention: float = 0.0


class TaskGraph:
    """Tasks in stream order, scheduled by ``run``."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []
        self._streams: dict[tuple[str, str], list[int]] = {}
        self._linked: tuple[list[list[int]], list[tuple[str, str]]] | None = None

    def _links(self) -> tuple[list[list[int]], list[tuple[str, str]]]:
        """(each task's dependents, each task's stream), kept between runs of the same graph."""
        if self._linked is None:
            dependents: list[list[int]] = [[] for _ in self.tasks]
            for task_id, task in enumerate(self.tasks):
                for dep in task.deps:
                    dependents[dep].append(task_id)
            self._linked = (dependents, [task.stream for task in self.tasks])
        return self._linked

    def add(self, name: str, stream: tuple[str, str], duration: float, deps=(), kind: str = "compute") -> int:
        """Append a task to ``stream``; returns its id for use in later ``deps``."""
        self._linked = None
        task_id = len(self.tasks)
        self.tasks.append(Task(name, stream, duration if duration > 0.0 else 0.0,
                               [d for d in deps if d is not None], kind))
        order = self._streams.get(stream)
        if order is None:
            self._streams[stream] = [task_id]
        else:
            order.append(task_id)
        return task_id

    def add_dependency(self, task_id: int, dep: int) -> None:
        """Make ``task_id`` also wait for ``dep`` (which may have been added after it: a
        rendezvous links two streams both ways once both sides exist)."""
        self._linked = None
        self.tasks[task_id].deps.append(dep)

    def add_pieces(self, name: str, stream: tuple[str, str], pieces: list[tuple[float, int]], deps=(), kind: str = "compute") -> int:
        """Append ``count`` back-to-back tasks of ``seconds`` for each (seconds, count) of
        ``pieces``, all with the same ``deps``, as one task: the same finish time as adding
        them one by one, without thousands of tasks (a large model's gradient buckets)."""
        pieces = tuple((max(0.0, seconds), count) for seconds, count in pieces if count > 0)
        task_id = self.add(name, stream, sum(seconds * count for seconds, count in pieces), deps, kind)
        self.tasks[task_id].pieces = pieces
        return task_id

    def run(self, scale: dict[str, float] | None = None) -> float:
        """Schedule every task; returns the makespan. ``scale`` multiplies durations by task
        kind (e.g. ``{"comm": 0}`` to see the step without communication)."""
        scale = scale or {}
        tasks = self.tasks
        waiting = [len(task.deps) for task in tasks]
        dependents, stream_of = self._links()
        streams = self._streams
        head = {stream: 0 for stream in streams}
        stream_free = {stream: 0.0 for stream in streams}
        ready = [stream for stream, order in streams.items() if waiting[order[0]] == 0]
        comm_scale = scale.get("comm", 1.0)
        scheduled = 0
        makespan = 0.0
        while ready:
            stream = ready.pop()
            order = streams[stream]
            position = head[stream]
            while position < len(order) and waiting[order[position]] == 0:
                task_id = order[position]
                task = tasks[task_id]
                start = stream_free[stream]
                for dep in task.deps:
                    if tasks[dep].finish > start:
                        start = tasks[dep].finish
                task.start = start
                factor = scale.get(task.kind, 1.0)
                if task.pieces is None:
                    task.finish = start + task.duration * factor
                    if task.contention:
                        task.finish += task.contention * comm_scale
                else:
                    finish = start
                    for seconds, count in task.pieces:
                        seconds *= factor
                        for _ in range(count):
                            finish += seconds
                    task.finish = finish
                stream_free[stream] = task.finish
                if task.finish > makespan:
                    makespan = task.finish
                scheduled += 1
                position += 1
                for dependent in dependents[task_id]:
                    waiting[dependent] -= 1
                    other = stream_of[dependent]
                    if waiting[dependent] == 0 and other != stream and streams[other][head[other]] == dependent:
                        ready.append(other)
            head[stream] = position
        if scheduled != len(tasks):
            stuck = next(tasks[o[head[s]]].name for s, o in self._streams.items() if head[s] < len(o))
            raise RuntimeError(f"the task graph deadlocks at '{stuck}': a dependency comes later on its own stream")
        return makespan

    def busy(self, stream: tuple[str, str], kinds: tuple[str, ...]) -> float:
        """Total duration of the tasks of ``kinds`` on ``stream`` (after ``run``)."""
        tasks = self.tasks
        return sum(tasks[i].finish - tasks[i].start for i in self._streams.get(stream, ()) if tasks[i].kind in kinds)

    def contend(self, slowdown: float, slowed: str = "compute", by: str = "comm") -> None:
        """Slow every task of kind ``slowed`` by ``slowdown`` × the time it ran beside tasks of
        kind ``by`` on the same device, in the schedule of the last ``run``: the compute
        kernels lose the SMs the communication kernels occupy (overlap is not free). One
        pass: the overlap is read from the schedule without contention, then the next
        ``run`` adds the extra time (a fixed point is not sought)."""
        if slowdown <= 0:
            return
        by_device: dict[str, tuple[list[Task], list[Task]]] = {}
        for task in self.tasks:
            task.contention = 0.0
            if task.kind == slowed or task.kind == by:
                pair = by_device.setdefault(task.stream[0], ([], []))
                pair[0 if task.kind == slowed else 1].append(task)
        for slowed_tasks, busy_tasks in by_device.values():
            if not busy_tasks:
                continue
            busy = _union(busy_tasks)
            slowed_tasks.sort(key=lambda t: t.start)
            first = 0
            for task in slowed_tasks:
                # The busy intervals do not overlap each other; skip those that ended
                # before this task starts.
                while first < len(busy) and busy[first][1] <= task.start:
                    first += 1
                overlap = 0.0
                index = first
                while index < len(busy) and busy[index][0] < task.finish:
                    start, finish = busy[index]
                    overlap += max(0.0, min(task.finish, finish) - max(task.start, start))
                    index += 1
                task.contention = slowdown * overlap


def _union(tasks: list[Task]) -> list[tuple[float, float]]:
    """The (start, finish) intervals when any of ``tasks`` runs, in time order and disjoint:
    collectives on two streams of one device (FSDP2's gathers beside its reduce-scatters)
    slow compute once while either runs, not twice. Intervals that only touch stay apart,
    so one stream's tasks come back as they were."""
    intervals: list[tuple[float, float]] = []
    for task in sorted(tasks, key=lambda t: t.start):
        if intervals and task.start < intervals[-1][1]:
            intervals[-1] = (intervals[-1][0], max(intervals[-1][1], task.finish))
        else:
            intervals.append((task.start, task.finish))
    return intervals
