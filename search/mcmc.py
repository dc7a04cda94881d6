"""MCMC search over node strategies, scored by the simulator (FlexFlow, Jia et al. 2019).

Metropolis-Hastings: from the current assignment, propose one node's strategy changed to
another of its candidates (uniformly); half of the proposals are compound moves that then
re-fit the node's producers and consumers to their cheapest candidates given the change
(by the cost tables), since moving to a tensor-parallel layout needs several neighbours to
change at once and every single step of the way costs resharding. Each proposal is
re-simulated with delta simulation and accepted with probability
min(1, exp(-(cost' - cost) / T)), where cost is the simulated step time, multiplied by
(1 + 10 x the fraction of device memory exceeded) for plans that do not fit, and T anneals
geometrically from ``temperature`` to a hundredth of it (times the starting cost) over the
patience window, restarting whenever a new best is found. A rejected move is undone. The best
assignment seen is kept, so the search is anytime; it stops after a number of proposals, or
when ``patience`` proposals in a row bring no new best. Budgets count proposals, not seconds,
so a seed gives the same walk and the same answer on any machine; a wall-clock cap is a
safety net only, and the result says when it cut the walk short.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from cost_model.simulator import Simulator
from planner.strategy import SimResult
from search.cost_tables import CostTables

OVERFLOW_PENALTY = 10.0


@dataclass(frozen=True)
class McmcResult:
    """The best assignment found and how the search went."""

    choice: dict[str, int]
    result: SimResult
    cost: float
    iterations: int
    accepted: int
    seconds: float
    cut_by_wall_clock: bool = False


def score(result: SimResult) -> float:
    """Simulated step time, penalised by how far the plan overflows device memory."""
    overflow = max(0.0, result.memory.total / result.device_memory_bytes - 1) if result.device_memory_bytes else 0.0
    return result.step_time_s * (1 + OVERFLOW_PENALTY * overflow)


def mcmc(
    plan,
    tables: CostTables,
    start: dict[str, int] | None = None,
    seed: int = 0,
    iterations: int = 2000,
    wall_clock_cap_s: float | None = None,
    temperature: float = 0.2,
    patience: int | None = None,
    on_step=None,
) -> McmcResult:
    """Search from ``start`` (default: every node's first candidate, all-replicate).

    Args:
        plan: a plan on the target mesh; its strategies are replaced as the search moves.
        tables: the candidates of every node.
        iterations: stop after this many proposals (the budget; deterministic for a seed).
        wall_clock_cap_s: a safety cap in seconds; if it stops the walk first, the result
            says so (``cut_by_wall_clock``) and may differ on another machine.
        patience: also stop after this many proposals without a new best (default: 50 per
            node that can move, at least 2,000), so small models do not use the whole budget.
        on_step: called with the iteration number after each proposal (progress bars).
    """
    started = time.perf_counter()
    rng = random.Random(seed)
    choice = dict(start) if start else {name: 0 for name in tables.candidates}
    strategies = tuple(tables.candidates[node.name][choice[node.name]].strategy for node in tables.graph.nodes)
    simulator = Simulator(_with_strategies(plan, strategies), tables.graph)
    current_result = simulator.run(trace=False)
    current = score(current_result)
    best_choice, best_result, best = dict(choice), current_result, current
    movable = [name for name, options in tables.candidates.items() if len(options) > 1]
    scale = temperature * current if current > 0 else 1.0
    accepted = steps = since_best = 0
    patience = patience if patience is not None else max(2000, 50 * len(movable))
    neighbours = _neighbours(tables)
    cut = False
    while movable and since_best < patience and steps < iterations:
        if wall_clock_cap_s is not None and time.perf_counter() - started >= wall_clock_cap_s:
            cut = True
            break
        steps += 1
        name = rng.choice(movable)
        new = rng.randrange(len(tables.candidates[name]) - 1)
        new += new >= choice[name]  # any candidate but the current one
        moves = {name: new}
        if rng.random() < 0.5:
            trial = {**choice, **moves}
            for other in neighbours[name]:
                moves[other] = trial[other] = _cheapest(tables, other, trial, neighbours)
        undo = {node: choice[node] for node in moves}
        for node, index in moves.items():
            simulator.assign(node, tables.candidates[node][index].strategy)
        result = simulator.run(trace=False)
        proposed = score(result)
        heat = scale * 0.01 ** min(1.0, since_best / patience)
        if proposed <= current or rng.random() < math.exp(-(proposed - current) / heat):
            choice.update(moves)
            current, current_result = proposed, result
            accepted += 1
            if proposed < best:
                best_choice, best_result, best = dict(choice), result, proposed
                since_best = -1
        else:
            for node, index in undo.items():  # back to the current assignment: no run needed
                simulator.assign(node, tables.candidates[node][index].strategy)
        since_best += 1
        if on_step is not None:
            on_step(steps)
    return McmcResult(
        choice=best_choice, result=best_result, cost=best, iterations=steps, accepted=accepted,
        seconds=time.perf_counter() - started, cut_by_wall_clock=cut,
    )


def _neighbours(tables: CostTables) -> dict[str, list[str]]:
    """Producers and consumers of every node, along graph edges."""
    found: dict[str, list[str]] = {name: [] for name in tables.candidates}
    for producer, consumer, _ in tables.edges:
        found[producer].append(consumer)
        found[consumer].append(producer)
    return {name: list(dict.fromkeys(others)) for name, others in found.items()}


def _cheapest(tables: CostTables, name: str, choice: dict[str, int], neighbours) -> int:
    """The candidate of ``name`` with the least own cost plus resharding to its neighbours."""
    incoming = [(p, pos) for p, c, pos in tables.edges if c == name]
    outgoing = [(c, pos) for p, c, pos in tables.edges if p == name]

    def local(index: int) -> float:
        candidate = tables.candidates[name][index]
        total = candidate.compute_s + candidate.communication_s
        for producer, position in incoming:
            src = tables.candidates[producer][choice[producer]].output
            if src is not None:
                total += tables.edge_cost(producer, name, position, src, candidate.inputs[position])
        if candidate.output is not None:
            for consumer, position in outgoing:
                dst = tables.candidates[consumer][choice[consumer]].inputs[position]
                total += tables.edge_cost(name, consumer, position, candidate.output, dst)
        return total

    return min(range(len(tables.candidates[name])), key=local)


def _with_strategies(plan, strategies):
    import dataclasses

    return dataclasses.replace(plan, strategies=strategies)
