"""Where a fidelity run's data-parallel communication goes: the collective view of a row.

    python benchmarks/fidelity_dp.py --runs 'MCore*'

For each run of ``benchmarks/fidelity.py``, on the device whose compute stream is busy longest
(its tasks of every kind, the sequence-parallel collectives it waits for included): the seconds its weight gathers ("param gather" stream)
and its gradient collectives ("collective" stream: the reduce-scatters or all-reduces over dp,
and the small all-reduces off dp beside them) keep their links busy, how much of that time
runs beside compute, the step's exposed communication (``SimResult.communication_s``), and what
the overlap costs the compute beside it: the step again with the NCCL profile's
``overlap_slowdown`` set to zero (``cost_model.nccl.OVERLAP_COMPUTE_SLOWDOWN``, the 18.9%
that compute kernels lose beside a collective), so "contention" is the step's own seconds
that the slowdown adds. ``fidelity.py --breakdown`` shows the step; ``fidelity_ops.py`` its
kernels by kind of op.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass

from cost_model.simulator import Simulator
from planner.strategy import TimelineEvent

try:  # run as a script (python benchmarks/fidelity_dp.py) or imported as benchmarks.fidelity_dp
    from benchmarks.fidelity import simulate
    from benchmarks.fidelity_runs import chosen_runs
except ModuleNotFoundError:  # pragma: no cover - the script's own folder is on sys.path instead
    from fidelity import simulate
    from fidelity_runs import chosen_runs

# The simulator's stream names for the data-parallel collectives (cost_model.step_tasks and
# cost_model.megatron_grad_sync): the weights' all-gathers and the gradients' reductions.
GATHER_STREAM = "param gather"
GRADIENT_STREAM = "collective"
COMPUTE_STREAM = "compute"


@dataclass(frozen=True)
class DataParallelTime:
    """One run's data-parallel communication on its busiest device, in seconds.

    Attributes:
        step: the simulated step.
        gather_busy, gradient_busy: time the weight gathers and the gradient collectives run.
        beside_compute: of their union, the time the compute stream is busy too.
        exposed: the step's exposed communication (``SimResult.communication_s``).
        contention: the step less the same step with no compute slowdown beside collectives.
    """

    step: float
    gather_busy: float
    gradient_busy: float
    beside_compute: float
    exposed: float
    contention: float


def intervals(timeline: Iterable[TimelineEvent], device: str, streams: tuple[str, ...]) -> list[tuple[float, float]]:
    """The busy intervals of ``device``'s ``streams``, merged where they touch or overlap."""
    spans = sorted((event.start_s, event.start_s + event.duration_s) for event in timeline
                   if event.device == device and event.stream in streams and event.duration_s > 0)
    merged: list[tuple[float, float]] = []
    for start, finish in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], finish))
        else:
            merged.append((start, finish))
    return merged


def busy_s(timeline: Iterable[TimelineEvent], device: str, streams: tuple[str, ...]) -> float:
    """Seconds at least one of ``device``'s ``streams`` runs a task."""
    return sum(finish - start for start, finish in intervals(timeline, device, streams))


def overlap_s(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    """Seconds two lists of merged, sorted intervals are busy at the same time."""
    total, i, j = 0.0, 0, 0
    while i < len(first) and j < len(second):
        total += max(0.0, min(first[i][1], second[j][1]) - max(first[i][0], second[j][0]))
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return total


def busiest_device(timeline: Iterable[TimelineEvent]) -> str:
    """The device whose compute stream is busy longest, counting every task on it (ties: the
    first by name)."""
    events = list(timeline)
    devices = sorted({event.device for event in events})
    return max(devices, key=lambda device: busy_s(events, device, (COMPUTE_STREAM,)))


def data_parallel_time(plan) -> DataParallelTime:
    """``plan``'s data-parallel communication on its busiest device (module docstring)."""
    estimate = plan.estimate
    timeline = estimate.timeline
    device = busiest_device(timeline)
    collectives = intervals(timeline, device, (GATHER_STREAM, GRADIENT_STREAM))
    compute = intervals(timeline, device, (COMPUTE_STREAM,))
    simulator = Simulator(plan, plan.graph)
    simulator.context.overlap_slowdown = 0.0
    without_contention = simulator.run(trace=False).step_time_s
    return DataParallelTime(
        step=estimate.step_time_s,
        gather_busy=busy_s(timeline, device, (GATHER_STREAM,)),
        gradient_busy=busy_s(timeline, device, (GRADIENT_STREAM,)),
        beside_compute=overlap_s(collectives, compute),
        exposed=estimate.communication_s,
        contention=estimate.step_time_s - without_contention,
    )


def row(name: str, published_s: float, time: DataParallelTime) -> str:
    """One printed line: the step and its error, then the collectives' seconds in ms."""
    return (f"{name:<26} step {time.step:7.3f} s ({time.step / published_s - 1:+6.1%})  gathers {time.gather_busy * 1e3:7.1f}"
            f"  gradients {time.gradient_busy * 1e3:7.1f}  beside compute {time.beside_compute * 1e3:7.1f}"
            f"  exposed {time.exposed * 1e3:7.1f}  contention {time.contention * 1e3:6.1f} ms")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True, help="run names or shell patterns (fidelity.py --rows-only)")
    options = parser.parse_args(argv)
    chosen = chosen_runs(parser, options.runs)
    for run in chosen:
        plan, _ = simulate(run)
        print(row(run.name, run.published_step_s, data_parallel_time(plan)), flush=True)


if __name__ == "__main__":
    main()
