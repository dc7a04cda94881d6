"""One linear layer's partition type and per-rank ratios, chosen exactly (ACCPAR's per-layer
choice with uneven ratios; vocabulary layer: arithmetic only).

For each partition kind ``k`` the cost model (``costs.layer_terms``) gives, per rank ``r``,
the line ``fixed[k][r] + unit[k][r] * s_r`` of its forward and backward seconds at share
``s_r`` of the split dimension ``D_k``, and the layer's communication as ``comm[k] +
per_max[k] * max_r s_r``: the program gathers uneven slices by padding each to the largest
(``runtime.gather_slices``), so a gather moves ``p * max_r s_r`` slices whatever the others
are. Every rank waits for the layer's collectives, so the layer costs the slowest rank's
compute plus its communication (AccPar's per-layer cost, section IV-B: computation of the
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

__all__ = ["KindTerms", "LayerChoice", "best_layer_split", "best_shares", "feasible", "layer_objective"]


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
