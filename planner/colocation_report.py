"""The co-location report: which arrangement wins, by how much, and each device's memory.

``planner colocate`` prints it as text or, with ``--format json``, as one JSON object (the
schema is ``Colocation.to_dict``'s docstring and the README's "Sharing a cluster").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.units import format_bytes, format_seconds

if TYPE_CHECKING:  # imports torch: ``planner --help`` must not wait for it
    from planner.strategy import TimelineEvent

SEQUENTIAL = "one after the other"
SPLIT = "split the cluster"
COLOCATED = "co-located (crossover)"


@dataclass(frozen=True)
class Arrangement:
    """One way to run the jobs: seconds per round, each job's step in it, whether it fits.

    ``swap_s`` is the part of the round spent moving states to host memory and back
    (``cost_model.colocation.swap_seconds``); ``note`` says why an arrangement cannot run
    (then ``round_s`` is 0) or what it assumed."""

    name: str
    round_s: float
    job_step_s: tuple[float, ...]
    fits: bool
    note: str = ""
    swap_s: float = 0.0

    @property
    def steps_per_s(self) -> float:
        """Steps of all jobs per second (0 when the arrangement cannot run)."""
        return len(self.job_step_s) / self.round_s if self.fits and self.round_s > 0 else 0.0


@dataclass(frozen=True)
class DeviceMemory:
    """One rank's memory with every job resident: each job's bytes on the pipeline stage
    that rank holds, against that rank's own device."""

    rank: int
    device: str
    job_bytes: tuple[int, ...]
    capacity_bytes: int

    @property
    def total_bytes(self) -> int:
        """Every job's bytes on this rank together."""
        return sum(self.job_bytes)

    @property
    def fits(self) -> bool:
        """Whether every job fits on this rank's device at once."""
        return self.total_bytes <= self.capacity_bytes


@dataclass(frozen=True)
class Colocation:
    """The comparison ``planner.colocate`` returns.

    Attributes:
        labels: the jobs' short names (``A``, ``B``, ...), in the order given.
        names: each job's plan name (or file).
        alone_s: each job's simulated step owning the whole cluster.
        memory_bytes: each job's memory on its fullest device.
        devices: every rank's memory with all jobs resident (``DeviceMemory``).
        arrangements: one after the other, split (unless skipped), co-located.
        timeline: the co-located first round, both jobs on shared device slots.
    """

    labels: tuple[str, ...]
    names: tuple[str, ...]
    alone_s: tuple[float, ...]
    memory_bytes: tuple[int, ...]
    devices: tuple[DeviceMemory, ...]
    arrangements: tuple[Arrangement, ...]
    timeline: "tuple[TimelineEvent, ...]"

    @property
    def capacity_bytes(self) -> int:
        """Memory of the cluster's smallest device (``devices`` has each rank's own)."""
        return min(device.capacity_bytes for device in self.devices)

    @property
    def winner(self) -> Arrangement | None:
        """The arrangement with the most steps per second among those that fit."""
        runnable = [a for a in self.arrangements if a.fits and a.round_s > 0]
        return max(runnable, key=lambda a: a.steps_per_s) if runnable else None

    @property
    def gain(self) -> float | None:
        """The winner's throughput over running the jobs one after the other (None when
        either cannot run)."""
        winner, sequential = self.winner, self.arrangement(SEQUENTIAL)
        if winner is None or not sequential.fits or sequential.round_s <= 0:
            return None
        return sequential.round_s / winner.round_s

    def arrangement(self, name: str) -> Arrangement:
        """The arrangement called ``name`` (``KeyError`` when it was not simulated)."""
        for arrangement in self.arrangements:
            if arrangement.name == name:
                return arrangement
        raise KeyError(name)

    def report(self) -> list[str]:
        """The comparison as lines of text."""
        lines = [f"job {label}: {name}, alone {format_seconds(step)} per step, {format_bytes(memory)} on its "
                 f"fullest device" for label, name, step, memory
                 in zip(self.labels, self.names, self.alone_s, self.memory_bytes)]
        lines += self._memory_lines()
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
        winner, gain = self.winner, self.gain
        if winner is None:
            lines.append("winner: none of the arrangements fits")
        elif winner.name == SEQUENTIAL or gain is None:
            lines.append(f"winner: {winner.name}")
        else:
            lines.append(f"winner: {winner.name} ({gain:.2f}x the throughput of one after the other)")
        return lines

    def _memory_lines(self) -> list[str]:
        """Each device's memory with every job resident, ranks with the same figures on one
        line (a data-parallel job gives one line, a two-stage pipeline two)."""
        lines = ["memory with every job resident, device by device:"]
        groups: list[list[DeviceMemory]] = []
        for device in self.devices:
            previous = groups[-1][-1] if groups else None
            same = previous is not None and (previous.job_bytes, previous.capacity_bytes, previous.device) == (
                device.job_bytes, device.capacity_bytes, device.device)
            if same and previous.rank + 1 == device.rank:
                groups[-1].append(device)
            else:
                groups.append([device])
        for group in groups:
            first, last = group[0], group[-1]
            ranks = f"rank {first.rank}" if first is last else f"ranks {first.rank}-{last.rank}"
            parts = " + ".join(f"{label} {format_bytes(size)}" for label, size in zip(self.labels, first.job_bytes))
            lines.append(f"  {ranks} ({first.device}): {parts} = {format_bytes(first.total_bytes)} of "
                         f"{format_bytes(first.capacity_bytes)} ({'fits' if first.fits else 'does not fit'})")
        return lines

    def to_chrome_trace(self, path: str | os.PathLike, *, force: bool = False) -> None:
        """Write the co-located first round as a Chrome/Perfetto trace: one process per
        device slot, one thread per shared stream, each task named ``LABEL: task``."""
        from planner.strategy import write_chrome_trace

        write_chrome_trace(self.timeline, str(path), force=force)

    def to_dict(self) -> dict[str, Any]:
        """The whole report as JSON-ready data (``planner colocate --format json``).

        Schema (times in seconds, memory in bytes):

        * ``jobs``: one object per job, in the order given: ``label`` (``"A"``...),
          ``name``, ``alone_s`` (its step owning the cluster), ``memory_bytes`` (its
          fullest device).
        * ``devices``: one object per rank: ``rank``, ``device`` (the device's name),
          ``job_bytes`` (each job's bytes there, in job order), ``total_bytes``,
          ``capacity_bytes`` (that device's memory), ``fits``.
        * ``arrangements``: one object per arrangement simulated: ``name`` (``"one after
          the other"``, ``"split the cluster"``, ``"co-located (crossover)"``),
          ``round_s`` (one step of every job; 0 when it cannot run), ``job_step_s`` and
          ``slowdown`` (each job's step in it, and that over its step alone), ``swap_s``
          (the part of the round spent swapping states to host memory), ``steps_per_s``
          (all jobs' steps per second; 0 when it cannot run), ``fits``, ``note``.
        * ``winner``: the name of the arrangement with the most steps per second that
          fits, or null; ``gain_over_sequential``: its throughput over one after the
          other's (null when either cannot run).
        """
        winner = self.winner
        return {
            "jobs": [{"label": label, "name": name, "alone_s": alone, "memory_bytes": memory}
                     for label, name, alone, memory in zip(self.labels, self.names, self.alone_s, self.memory_bytes)],
            "devices": [{"rank": d.rank, "device": d.device, "job_bytes": list(d.job_bytes),
                         "total_bytes": d.total_bytes, "capacity_bytes": d.capacity_bytes, "fits": d.fits}
                        for d in self.devices],
            "arrangements": [{"name": a.name, "round_s": a.round_s, "job_step_s": list(a.job_step_s),
                              "slowdown": [step / alone if alone else None for step, alone in zip(a.job_step_s, self.alone_s)]
                              if a.round_s > 0 else None,
                              "swap_s": a.swap_s, "steps_per_s": a.steps_per_s, "fits": a.fits, "note": a.note}
                             for a in self.arrangements],
            "winner": winner.name if winner is not None else None,
            "gain_over_sequential": self.gain,
        }
