"""One linear layer's partition type and per-rank ratios, chosen exactly (ACCPAR's per-layer
choice with uneven ratios; vocabulary layer: arithmetic only).

For each partition kind ``k`` the cost model (``costs.layer_terms``) gives, per rank ``r``,
the line ``fixed[k][r] + unit[k][r] * s_r`` of its forward and backward seconds at share
``s_r`` of the split dimension ``D_k``, and the layer's communication as ``comm[k] +
per_max[k] * max_r s_r``: the program's gather-v (``runtime.gather_slices``) takes as long
as the largest share's rank takes to send its slice to the ``p - 1`` others, whatever the
others' shares (``costs.gather_v_seconds``). Every rank waits for the layer's collectives,
so the layer costs the slowest rank's compute plus its communication (AccPar's per-layer cost, section IV-B: computation of the
slowest partition plus the communication of the partition type)::

    minimise    max_r (fixed[k][r] + unit[k][r] s_r) + comm[k] + per_max[k] max_r s_r
    over        the kind k and integers 1 <= s_r <= cap[k][r] with sum_r s_r = D_k

``best_layer_split`` solves it exactly, kind by kind, over the largest share ``M``: with
every share capped at ``M`` the least slowest-rank time is what the greedy of
``planner.families.uneven_dp.shares.balanced_shares`` gives (exact, tested there against
enumeration), and a split of largest share ``M`` costs at least that plus ``per_max * M``.
So the best over ``M`` from ``ceil(D / p)`` (no split has a smaller largest share) to the
largest share of the uncapped greedy (beyond it the time no longer falls and the gather
only grows) is the best split. ``tests/test_uneven_tp.py`` checks it against enumeration.

Between layers (ACCPAR's inter-layer cost): a layer's activation is made whole after it (the
gather-v or all-reduce above), except in a fused group (``regions.py``), whose column
splits keep their output split into a row split of the same shares; the group is then one
``KindTerms`` (kind ``fused``) over those shares. A layer may also stay whole (no split, the
slowest device's time) where every rank holds it. ``best_chain`` chooses, over the chain of
linear layers in graph order, which groups to fuse and each other layer's kind or whole, by
dynamic programming over prefixes: ``best[i] = min(best[i-1] + single[i-1], best[j] +
group(j..i))`` (layer costs are additive: every split layer meets at its collectives);
``tests/test_uneven_tp.py`` checks it against enumerating every choice on small chains.

A CP-SAT model of the same problem (one Boolean per kind, integer shares, seconds scaled to
integers) was tried first and dropped: at the scales that keep a 20480-wide layer's
per-unit seconds exact to 6 digits (1e9 units and above), CP-SAT took 4-10 s and sometimes
its whole time limit to prove a 3-rank, 5-unit layer optimal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.families.uneven_dp.shares import balanced_shares

__all__ = ["ChainStep", "KindTerms", "LayerChoice", "best_chain", "best_layer_split", "best_shares", "feasible",
           "layer_objective"]


@dataclass(frozen=True)
class KindTerms:
    """The cost of one partition kind of one layer as lines in the shares (module docstring).

    Attributes:
        kind: ``batch``, ``column`` or ``row``.
        dim: the size of the split dimension ``D``.
        fixed, unit: per rank, seconds at share 0 and per unit of share.
        caps: per rank, the largest share its memory holds.
        comm, per_max: the layer's collective seconds independent of the shares, and per
            unit of the largest share.
    """

    kind: str
    dim: int
    fixed: tuple[float, ...]
    unit: tuple[float, ...]
    caps: tuple[int, ...]
    comm: float
    per_max: float


@dataclass(frozen=True)
class LayerChoice:
    """The chosen kind and shares, and their modelled seconds."""

    kind: str
    shares: tuple[int, ...]
    seconds: float


def layer_objective(terms: KindTerms, shares: Sequence[int]) -> float:
    """The modelled seconds of ``terms``' kind with ``shares`` (module docstring)."""
    slowest = max(f + u * s for f, u, s in zip(terms.fixed, terms.unit, shares))
    return slowest + terms.comm + terms.per_max * max(shares)


def feasible(terms: KindTerms) -> bool:
    """Whether every rank can take at least one unit and the caps cover the dimension."""
    return min(terms.caps) >= 1 and sum(min(cap, terms.dim) for cap in terms.caps) >= terms.dim >= len(terms.caps)


def best_shares(terms: KindTerms) -> tuple[int, ...] | None:
    """The integer shares of least ``layer_objective`` for one kind (module docstring), or
    None when none fits. Ties go to the smallest largest share."""
    ranks = len(terms.caps)
    caps = [min(cap, terms.dim) for cap in terms.caps]
    free = balanced_shares(terms.dim, terms.fixed, terms.unit, caps)
    if free is None:
        return None
    best, best_value = free, layer_objective(terms, free)
    for largest in range(math.ceil(terms.dim / ranks), max(free)):
        capped = [min(cap, largest) for cap in caps]
        shares = balanced_shares(terms.dim, terms.fixed, terms.unit, capped)
        if shares is not None and layer_objective(terms, shares) < best_value:
            best, best_value = shares, layer_objective(terms, shares)
    return best


def best_layer_split(options: Sequence[KindTerms]) -> LayerChoice | None:
    """The kind and integer shares of least modelled seconds over ``options`` (one
    ``KindTerms`` per kind allowed; ties to the first), or None when no kind fits."""
    best: LayerChoice | None = None
    for terms in options:
        shares = best_shares(terms) if feasible(terms) else None
        if shares is not None and (best is None or layer_objective(terms, shares) < best.seconds):
            best = LayerChoice(terms.kind, shares, layer_objective(terms, shares))
    return best


@dataclass(frozen=True)
class ChainStep:
    """One choice of ``best_chain``: layers ``start`` to ``stop - 1`` of the chain, left whole
    (``choice`` None, one layer) or split as ``choice`` (one layer, or a fused group)."""

    start: int
    stop: int
    choice: LayerChoice | None


def best_chain(whole: Sequence[float | None], singles: Sequence[LayerChoice | None],
               groups: dict[tuple[int, int], LayerChoice | None]) -> tuple[tuple[ChainStep, ...], float] | None:
    """The least-seconds choice over a chain of ``len(singles)`` layers (module docstring):
    layer ``i`` whole at ``whole[i]`` seconds (None: not allowed) or split as ``singles[i]``
    (None: none fits); ``groups[(j, i)]``, layers ``j..i-1`` fused as one choice. Returns the
    steps in chain order and their seconds, or None when some layer has no choice. Ties go
    to the split over whole, and to the single layers over a group."""
    count = len(singles)
    best: list[tuple[float, ChainStep | None, int] | None] = [(0.0, None, 0)] + [None] * count
    for stop in range(1, count + 1):
        previous = best[stop - 1]
        options = []
        if previous is not None:
            if singles[stop - 1] is not None:
                single = singles[stop - 1]
                options.append((previous[0] + single.seconds, 0, ChainStep(stop - 1, stop, single)))
            if whole[stop - 1] is not None:
                options.append((previous[0] + whole[stop - 1], 1, ChainStep(stop - 1, stop, None)))
        for (start, end), choice in groups.items():
            if end == stop and choice is not None and best[start] is not None:
                options.append((best[start][0] + choice.seconds, 2, ChainStep(start, stop, choice)))
        if options:
            seconds, _, step = min(options, key=lambda option: option[:2])
            best[stop] = (seconds, step, step.start)
    if best[count] is None:
        return None
    steps, stop = [], count
    while stop > 0:
        steps.append(best[stop][1])
        stop = best[stop][2]
    return tuple(reversed(steps)), best[count][0]
