"""DeepSeek-V3's DualPipe as a simulated pipeline schedule (DeepSeek-V3 technical report,
arXiv 2412.19437, section 3.2.1; the reference schedule is ``DualPipe.step`` in
github.com/deepseek-ai/DualPipe, ``dualpipe/dualpipe.py``).

``stages`` (even) devices each hold two pipeline stages: device r holds stage r of the
model fed from device 0 ("down") and stage ``stages - 1 - r`` of a copy fed from the last
device ("up"). Half the micro-batches go each way. A device's two stages are its phases 0
and 1: on the first half of the devices phase 0 is the down stage, on the second half the
up stage. Backward is split as zero-bubble pipelines split it: ``B`` computes the input's
gradient (what the previous stage waits for), ``W`` the weights' (deferred to fill bubbles).
In the steady state a device runs one phase's forward beside the other phase's backward as
one overlapped chunk (``FB``), whose all-to-alls hide under the other's compute
(``cost_model.moe_overlap``).

``dualpipe_order`` lists a device's work in the reference's eight steps; ``simulate``
times every device's list with each pass waiting for the pass it depends on on the
neighbouring device (list scheduling, sends free unless ``p2p_s`` is given). The report's
bubble, ``(stages / 2 - 1) (F&B + B - 3W)`` (table 2), is what ``simulate`` leaves idle on
the busiest device when forward, input-gradient and weight-gradient passes take equal times,
as the report's figure draws them (tests/test_dualpipe.py); with a longer backward the
simulated bubble is smaller than the formula (at 8 stages, F = W = 1, B = 2, F&B = 4:
11 against 12).
"""

from __future__ import annotations

from dataclasses import dataclass

# One entry of a device's order: ("F", phase, held) (``held``: its output is sent only
# after the device's next pass, as the reference holds some sends back), ("B", phase)
# (input gradient, weights deferred), ("BW", phase) (input and weight gradients at once),
# ("W",) (the oldest deferred weight gradient), ("FB", forward phase, backward phase)
# (overlapped; its backward computes both gradients, as the reference's overlapped chunk does).
Work = tuple


@dataclass(frozen=True)
class PassTimes:
    """Seconds of one stage's passes for one micro-batch: forward, the input-gradient
    backward, the weight-gradient backward, and one forward overlapped with another
    micro-batch's whole backward (``cost_model.moe_overlap``; without overlap it is
    ``forward + backward + weights``)."""

    forward: float
    backward: float
    weights: float
    overlapped: float

    @classmethod
    def serial(cls, forward: float, backward: float, weights: float) -> "PassTimes":
        """Times with nothing overlapped: the overlapped chunk is the three in a row."""
        return cls(forward, backward, weights, forward + backward + weights)


def dualpipe_order(rank: int, stages: int, micro_batches: int) -> list[Work]:
    """Device ``rank``'s work in a DualPipe step of ``micro_batches`` (both directions
    together), in the reference's eight steps (nF0, nF0F1, nB1W1F1, nF0B1F1B0, nB1F1B0,
    nB1B0, nWB0, nW)."""
    if stages < 2 or stages % 2:
        raise ValueError(f"DualPipe needs an even number of pipeline stages, at least 2, not {stages}")
    if micro_batches % 2 or micro_batches < 2 * stages:
        raise ValueError(f"DualPipe needs an even number of micro-batches, at least twice the stages ({2 * stages}), "
                         f"not {micro_batches}")
    half_ranks, half = stages // 2, micro_batches // 2
    half_rank = min(rank, stages - 1 - rank)
    middle = half_rank == half_ranks - 1
    order: list[Work] = [("F", 0, False)] * ((half_ranks - half_rank - 1) * 2)  # step 1
    for i in range(half_rank + 1):  # step 2: outside the middle, phase 0's send waits for phase 1's forward
        order += [("F", 0, not middle), ("F", 1, middle and i == half_rank)]
    for _ in range(half_ranks - half_rank - 1):  # step 3: zero bubble
        order += [("B", 1), ("W",), ("F", 1, False)]
    for i in range(half - stages + half_rank + 1):  # step 4, the main step
        if i == 0 and middle:  # the reference runs these two apart to shorten the bubble
            order += [("F", 0, True), ("BW", 1)]
        else:
            order.append(("FB", 0, 1))
        order.append(("FB", 1, 0))
    for _ in range(half_ranks - half_rank - 1):  # step 5
        order += [("BW", 1), ("FB", 1, 0)]
    deferred = False  # step 6: the second half of its backwards defer their weights
    for i in range(half_rank + 1):
        if i == (half_rank + 1) // 2 and half_rank % 2 == 1:
            deferred = True
        order.append(("B" if deferred else "BW", 1))
        if i == (half_rank + 1) // 2 and half_rank % 2 == 0:
            deferred = True
        order.append(("B" if deferred else "BW", 0))
    for _ in range(half_ranks - half_rank - 1):  # step 7
        order += [("W",), ("B", 0)]
    order += [("W",)] * (half_rank + 1)  # step 8
    return order


def _direction(rank: int, stages: int, phase: int) -> tuple[int, int]:
    """(direction, position in it) of ``rank``'s ``phase``: direction 0 enters at device 0,
    direction 1 at the last device."""
    direction = phase if rank < stages // 2 else 1 - phase
    return direction, rank if direction == 0 else stages - 1 - rank


def _rank_at(position: int, direction: int, stages: int) -> int:
    return position if direction == 0 else stages - 1 - position


@dataclass(frozen=True)
class Timeline:
    """A simulated DualPipe step: each device's ``(work, start, end)`` in order, the step's
    end, and each device's idle time before it (its bubble)."""

    passes: dict[int, list[tuple[Work, float, float]]]
    step_s: float

    def bubble(self, rank: int) -> float:
        busy = sum(end - start for _, start, end in self.passes[rank])
        return self.step_s - busy


def simulate(stages: int, micro_batches: int, times: PassTimes, p2p_s: float = 0.0) -> Timeline:
    """Every device's ``dualpipe_order`` timed: a forward waits for the same micro-batch's
    forward on the device before it in its direction (``p2p_s`` later), a backward for the
    device after it (the last stage of a direction for its own forward), a deferred weight
    pass for its backward; each device runs its list in order.

    Raises:
        ValueError: the order deadlocks (a bug: the reference's order does not).
    """
    orders = {rank: dualpipe_order(rank, stages, micro_batches) for rank in range(stages)}
    done_forward: dict[tuple[int, int, int], float] = {}  # (direction, micro-batch, position) -> end
    done_backward: dict[tuple[int, int, int], float] = {}
    next_mb = {(rank, kind, phase): 0 for rank in range(stages) for kind in "FB" for phase in (0, 1)}
    deferred: dict[int, list[float]] = {rank: [] for rank in range(stages)}  # ends of B passes owing a W
    clock = {rank: 0.0 for rank in range(stages)}
    position = {rank: 0 for rank in range(stages)}
    passes: dict[int, list[tuple[Work, float, float]]] = {rank: [] for rank in range(stages)}

    def ready(rank: int, kind: str, phase: int) -> float | None:
        """When ``rank``'s next ``kind`` pass of ``phase`` may start, or None if not yet known."""
        direction, where = _direction(rank, stages, phase)
        mb = next_mb[(rank, kind, phase)]
        if kind == "F":
            if where == 0:
                return 0.0
            upstream = done_forward.get((direction, mb, where - 1))
            return None if upstream is None else upstream + p2p_s
        if where == stages - 1:
            return done_forward.get((direction, mb, where))
        downstream = done_backward.get((direction, mb, where + 1))
        return None if downstream is None else downstream + p2p_s

    held: dict[int, tuple[int, int, int] | None] = {rank: None for rank in range(stages)}  # a forward not sent yet

    def finish(rank: int, kind: str, phase: int, end: float, hold: bool = False) -> None:
        direction, where = _direction(rank, stages, phase)
        mb = next_mb[(rank, kind, phase)]
        if hold:
            held[rank] = (direction, mb, where)
        else:
            (done_forward if kind == "F" else done_backward)[(direction, mb, where)] = end
        next_mb[(rank, kind, phase)] = mb + 1

    while any(position[r] < len(orders[r]) for r in orders):
        progressed = False
        for rank, order in orders.items():
            while position[rank] < len(order):
                work = order[position[rank]]
                if work[0] == "W":
                    start, duration = max(clock[rank], deferred[rank][0]), times.weights
                    deferred[rank].pop(0)
                elif work[0] == "FB":
                    forward, backward = ready(rank, "F", work[1]), ready(rank, "B", work[2])
                    if forward is None or backward is None:
                        break
                    start, duration = max(clock[rank], forward, backward), times.overlapped
                else:
                    kind = "F" if work[0] == "F" else "B"
                    earliest = ready(rank, kind, work[1])
                    if earliest is None:
                        break
                    start = max(clock[rank], earliest)
                    duration = {"F": times.forward, "B": times.backward,
                                "BW": times.backward + times.weights}[work[0]]
                end = start + duration
                if held[rank] is not None:  # sent once this pass is done
                    done_forward[held[rank]] = end
                    held[rank] = None
                if work[0] == "FB":
                    finish(rank, "F", work[1], end)
                    finish(rank, "B", work[2], end)
                elif work[0] == "F":
                    finish(rank, "F", work[1], end, hold=work[2])
                elif work[0] in ("B", "BW"):
                    finish(rank, "B", work[1], end)
                    if work[0] == "B":
                        deferred[rank].append(end)
                clock[rank] = end
                passes[rank].append((work, start, end))
                position[rank] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"the DualPipe order deadlocks at {stages} stages and {micro_batches} micro-batches")
    return Timeline(passes=passes, step_s=max(clock.values()))


def dualpipe_bubble_formula(stages: int, times: PassTimes) -> float:
    """The reference's bubble per device (its README's table; the report's table 2):
    ``(stages / 2 - 1) (F&B + B - 3W)``, B there the whole backward (our ``backward + weights``)."""
    return (stages / 2 - 1) * (times.overlapped + times.backward + times.weights - 3 * times.weights)


def one_f_one_b_bubble_formula(stages: int, times: PassTimes) -> float:
    """1F1B's bubble in the same table: ``(stages - 1) (F + B)``, B the whole backward."""
    return (stages - 1) * (times.forward + times.backward + times.weights)
