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


@dataclass
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


class TaskGraph:
    """Tasks in stream order, scheduled by ``run``."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []
        self._streams: dict[tuple[str, str], list[int]] = {}

    def add(self, name: str, stream: tuple[str, str], duration: float, deps=(), kind: str = "compute") -> int:
        """Append a task to ``stream``; returns its id for use in later ``deps``."""
        task_id = len(self.tasks)
        self.tasks.append(Task(name, stream, max(0.0, duration), [d for d in deps if d is not None], kind))
        self._streams.setdefault(stream, []).append(task_id)
        return task_id

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
        dependents: list[list[int]] = [[] for _ in tasks]
        for task_id, task in enumerate(tasks):
            for dep in task.deps:
                dependents[dep].append(task_id)
        stream_of = {task_id: stream for stream, order in self._streams.items() for task_id in order}
        head = {stream: 0 for stream in self._streams}
        stream_free = {stream: 0.0 for stream in self._streams}
        ready = [stream for stream, order in self._streams.items() if waiting[order[0]] == 0]
        scheduled = 0
        makespan = 0.0
        while ready:
            stream = ready.pop()
            order = self._streams[stream]
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
                    if waiting[dependent] == 0 and other != stream and self._streams[other][head[other]] == dependent:
                        ready.append(other)
            head[stream] = position
        if scheduled != len(tasks):
            stuck = next(tasks[o[head[s]]].name for s, o in self._streams.items() if head[s] < len(o))
            raise RuntimeError(f"the task graph deadlocks at '{stuck}': a dependency comes later on its own stream")
        return makespan

    def busy(self, stream: tuple[str, str], kinds: tuple[str, ...]) -> float:
        """Total duration of the tasks of ``kinds`` on ``stream`` (after ``run``)."""
        return sum(t.finish - t.start for t in self.tasks if t.stream == stream and t.kind in kinds)
