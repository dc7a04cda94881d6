"""The fit behind ``planner calibrate``: cost-model parameters that make simulated step times
match measured ones.

Every parameter ``planner calibrate`` fits enters the simulated step time linearly once it is
written as a *time coefficient*: seconds per FLOP scale with ``1 / matmul_efficiency``,
seconds per byte streamed with ``1 / memory_efficiency``, a collective's bytes with
``1 / link_bandwidth``; ``kernel_overhead_s``, ``dtensor_op_overhead_s``, ``redistribute_overhead_s`` and the link's latency
are seconds already. The simulator then sums these terms along the busiest path of the step
(a max over paths of linear functions), so the step time is piecewise linear in the
coefficients ``t``, with the critical path's counts as its slope.

The fit is Gauss-Newton on the relative error, with non-negative least squares for the step:

  1. at the current ``t``, the slope ``J[i, j]`` of observation ``i`` in coefficient ``j``
     (a forward difference: one simulation per coefficient); an observation is a run's step
     time (``planner calibrate``'s only kind), weighted ``w_i``;
  2. the linear model ``s_i(t') = s_i(t) + J[i] . (t' - t)``; minimise
     ``sum_i w_i^2 (s_i(t') / m_i - 1)^2 + prior_weight * prior_penalty`` (linearised) over
     ``t' >= lower bounds`` (times at least 0, efficiencies at most 100): a non-negative
     least-squares problem after shifting by the bounds (``nnls``, Lawson and Hanson's active
     set method, "Solving Least Squares Problems", 1974, ch. 23), columns scaled to unit norm
     (the coefficients span 1e-13 to 1e3);
  3. move to ``t'`` (or half, a quarter of the way while the simulated objective does not
     improve), and repeat until it no longer moves.

Relative error (``s / m - 1``) weighs a plan of 40 ms like one of 400 ms. The prior keeps a
parameter the runs say nothing about at its start. Everything is arithmetic on simulated
figures, in a fixed order: the same measured files give the same cluster on any machine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

# name -> (inverse: the coefficient is 1 / value, lower bound, upper bound, finite-difference
# floor) with the bounds on the coefficient. Efficiencies are fractions of the datasheet peak,
# which may be 100x too low (a preset's guess) or 1000x too high; a bandwidth lies in
# 1 MB/s .. 10 TB/s.
COEFFICIENTS = {
    "matmul_efficiency": (True, 1e-2, 1e3, 1.0),
    "memory_efficiency": (True, 1e-2, 1e3, 1.0),
    "kernel_overhead_s": (False, 0.0, 1e-2, 1e-6),
    "dtensor_op_overhead_s": (False, 0.0, 1e-2, 1e-6),
    "redistribute_overhead_s": (False, 0.0, 1e-1, 1e-4),
    "link_latency_s": (False, 1e-9, 1e-1, 1e-6),
    "link_bandwidth": (True, 1e-13, 1e-6, 1e-10),
}
_STEP = 0.05  # forward-difference step, relative to the coefficient (or its floor)
_ITERATIONS = 15
_LINE_SEARCH = (1.0, 0.5, 0.25, 0.125)
_CONVERGED = 1e-4  # largest relative move of a coefficient that still counts as a move


def to_coefficient(name: str, value: float) -> float:
    """The time coefficient of parameter ``name`` (see the module docstring)."""
    inverse = COEFFICIENTS[name][0]
    return 1.0 / value if inverse else value


def from_coefficient(name: str, coefficient: float) -> float:
    """The parameter value of time coefficient ``coefficient``."""
    inverse = COEFFICIENTS[name][0]
    return 1.0 / coefficient if inverse else coefficient


def prior_penalty(start: dict[str, float], values: dict[str, float], parameters: Sequence[str]) -> float:
    """Sum over ``parameters`` of ``log((t + f) / (t0 + f))^2``: each time coefficient's
    distance from its start ``t0`` in log terms (a 2x move costs the same either way), softened
    by the coefficient's floor ``f`` so a coefficient may start at or move to 0."""
    total = 0.0
    for name in parameters:
        floor = COEFFICIENTS[name][3]
        total += math.log((to_coefficient(name, values[name]) + floor) / (to_coefficient(name, start[name]) + floor)) ** 2
    return total


def nnls(matrix: np.ndarray, target: np.ndarray, iterations: int | None = None) -> np.ndarray:
    """``x >= 0`` minimising ``|matrix @ x - target|`` (Lawson and Hanson's active set method).

    Deterministic: ties between candidate columns go to the lowest index.
    """
    rows, columns = matrix.shape
    x = np.zeros(columns)
    passive = np.zeros(columns, dtype=bool)
    tolerance = 10 * max(rows, columns) * np.finfo(float).eps * max(1.0, float(np.abs(matrix).max(initial=0.0)))
    for _ in range(iterations or 3 * columns + 10):
        gradient = matrix.T @ (target - matrix @ x)
        candidates = np.where(~passive & (gradient > tolerance))[0]
        if candidates.size == 0:
            break
        passive[candidates[np.argmax(gradient[candidates])]] = True
        while True:
            z = np.zeros(columns)
            z[passive] = np.linalg.lstsq(matrix[:, passive], target, rcond=None)[0]
            if np.all(z[passive] > tolerance):
                x = z
                break
            # Step back towards x until a passive coefficient reaches 0; it leaves the set.
            blocked = passive & (z <= tolerance)
            ratios = x[blocked] / np.maximum(x[blocked] - z[blocked], 1e-300)
            alpha = float(np.min(ratios))
            x = x + alpha * (z - x)
            passive &= x > tolerance
            x[~passive] = 0.0
            if not passive.any():
                break
    return x


@dataclass(frozen=True)
class FitTrace:
    """What the fit did: simulations run and Gauss-Newton iterations taken."""

    simulations: int
    iterations: int


def gauss_newton_fit(
    cases: Sequence, start: dict[str, float], observe: Callable, measured: Sequence[Sequence[float]],
    weights: Sequence[Sequence[float]], parameters: Sequence[str], prior_weight: float,
) -> tuple[dict[str, float], FitTrace]:
    """The fitted parameter values (every key of ``start``; those not in ``parameters`` kept).

    Minimises ``sum over cases and observations of (weight x log(simulated / measured))^2 /
    cases + prior_weight x prior_penalty`` (the linearised steps use the relative error
    ``simulated / measured - 1``, its first-order equal).

    Args:
        cases: what ``observe(case, values)`` simulates: it returns the case's observations
            (its step time first, then e.g. the seconds of op classes), as ``measured[i]``
            lists their measured values and ``weights[i]`` their weights.
        start: every parameter's start value (also the prior's centre).
        parameters: the names (keys of ``COEFFICIENTS``) to fit.
        prior_weight: weight of the pull towards ``start`` (see the module docstring).
    """
    names = [name for name in COEFFICIENTS if name in parameters]
    lower = np.array([COEFFICIENTS[name][1] for name in names])
    upper = np.array([COEFFICIENTS[name][2] for name in names])
    floor = np.array([COEFFICIENTS[name][3] for name in names])
    origin = np.array([to_coefficient(name, start[name]) for name in names])
    target_values = np.array([value for row in measured for value in row])
    row_weights = np.array([weight for row in weights for weight in row]) / math.sqrt(len(cases))
    simulations = 0

    def values_of(coefficients: np.ndarray) -> dict[str, float]:
        return {**start, **{name: from_coefficient(name, float(c)) for name, c in zip(names, coefficients)}}

    def simulated(coefficients: np.ndarray) -> np.ndarray:
        nonlocal simulations
        simulations += len(cases)
        chosen = values_of(coefficients)
        return np.array([value for case in cases for value in observe(case, chosen)])

    def objective(coefficients: np.ndarray) -> float:
        chosen = values_of(coefficients)
        misses = row_weights * np.log(np.maximum(simulated(coefficients), 1e-300) / target_values)
        return float(misses @ misses) + prior_weight * prior_penalty(start, chosen, names)

    current = np.clip(origin, lower, upper)
    best = objective(current)
    iterations = 0
    for iterations in range(1, _ITERATIONS + 1):
        base = simulated(current)
        steps = _STEP * np.maximum(np.abs(current), floor)
        slopes = np.empty((len(base), len(names)))
        for j in range(len(names)):
            moved = current.copy()
            moved[j] += steps[j]
            slopes[:, j] = (simulated(moved) - base) / steps[j]
        # Rows: w J_i t' / m_i = w (1 - (s_i - J_i t) / m_i).
        scale = row_weights / target_values
        matrix = slopes * scale[:, None]
        target = row_weights - scale * (base - slopes @ current)
        if prior_weight > 0:
            # w log((t' + f) / (t0 + f)) linearised at t: w (t' - t) / (t + f) + w log((t + f) / (t0 + f)).
            weight = math.sqrt(prior_weight)
            matrix = np.vstack([matrix, np.diag(weight / (current + floor))])
            target = np.concatenate([target, weight * (current / (current + floor) - np.log((current + floor) / (origin + floor)))])
        # t' = lower + x, x >= 0; columns scaled to unit norm.
        shifted = target - matrix @ lower
        norms = np.linalg.norm(matrix, axis=0)
        norms[norms == 0] = 1.0
        proposal = np.clip(lower + nnls(matrix / norms, shifted) / norms, lower, upper)
        moved_to = None
        for fraction in _LINE_SEARCH:
            candidate = current + fraction * (proposal - current)
            score = objective(candidate)
            if score < best - 1e-12:
                moved_to, best = candidate, score
                break
        if moved_to is None:
            break
        change = np.max(np.abs(moved_to - current) / np.maximum(np.abs(current), floor))
        current = moved_to
        if change < _CONVERGED:
            break
    return values_of(current), FitTrace(simulations=simulations, iterations=iterations)
