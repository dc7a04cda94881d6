"""A starting solution for CP-SAT: the LP relaxation rounded, then improved node by node.

The intra-op model's relaxation is nearly tight (the transportation form of the resharding
pairs, aggregated gradient-reduction rows): on the tiny Llama its optimum is 0.004% below
the integer one on dp=2 x tp=2 and 1.2% below on a 3-axis mesh, and mostly integral, so
rounding it gives CP-SAT a far better starting solution than a layout built by hand (there,
the optimum itself), and CP-SAT's own search has only to close the last gap. GLOP is
deterministic (a simplex method, one thread, run to its optimum; only the wall-clock safety
cap can stop it), so the hint it gives does not depend on the machine.
The rounded solution (each node's largest x) is then improved by iterated conditional
modes: each node in turn takes its cheapest candidate given its neighbours' choices, within
the memory budget, until no node changes (``improve``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ortools.linear_solver import linear_solver_pb2, pywraplp
from ortools.sat.python import cp_model

from search.ilp_reduce import Edge, IlpData


def solve_relaxation(model: cp_model.CpModel, time_limit_s: float | None = None) -> tuple[float, list[float]] | None:
    """The optimum of the LP relaxation of ``model`` (all Booleans) and the values of every
    variable there, or None when GLOP does not find one (then the caller keeps its hint).

    ``time_limit_s`` is a wall-clock safety cap (None: none); GLOP stopped by it gives None.
    Reads the model's proto: exactly-one constraints and linear constraints over Boolean
    variables (positive literals), and a linear objective; anything else gives None."""
    proto = model.proto
    lp = linear_solver_pb2.MPModelProto()
    for _ in proto.variables:
        variable = lp.variable.add()
        variable.lower_bound, variable.upper_bound = 0.0, 1.0
    # Rows and the objective scaled to unit largest coefficient: nanoseconds and kilobytes
    # span ten orders of magnitude, which GLOP's simplex does not take well unscaled.
    scale = max((abs(c) for c in proto.objective.coeffs), default=1) or 1
    for variable, coefficient in zip(proto.objective.vars, proto.objective.coeffs):
        lp.variable[variable].objective_coefficient = coefficient / scale
    for constraint in proto.constraints:
        row = lp.constraint.add()
        if len(constraint.enforcement_literal):
            return None
        if constraint.has_exactly_one():
            literals = list(constraint.exactly_one.literals)
            if any(literal < 0 for literal in literals):
                return None
            row.var_index.extend(literals)
            row.coefficient.extend([1.0] * len(literals))
            row.lower_bound = row.upper_bound = 1.0
        elif constraint.has_linear() and len(constraint.linear.domain) == 2:
            largest = max((abs(c) for c in constraint.linear.coeffs), default=1) or 1
            row.var_index.extend(constraint.linear.vars)
            row.coefficient.extend(c / largest for c in constraint.linear.coeffs)
            low, high = constraint.linear.domain
            row.lower_bound = low / largest if low > -(2**62) else -math.inf
            row.upper_bound = high / largest if high < 2**62 else math.inf
        else:
            return None
    solver = pywraplp.Solver.CreateSolver("GLOP")
    if solver is None or solver.LoadModelFromProto(lp):
        return None
    if time_limit_s is not None:
        solver.SetTimeLimit(max(1, int(time_limit_s * 1000)))
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return None
    value = solver.Objective().Value() * scale + proto.objective.offset
    return value, [variable.solution_value() for variable in solver.variables()]


@dataclass
class Trigger:
    """A gradient reduction z[u,a]: paid once when any reader candidate (v, c) runs while
    u outputs a placement in ``outputs`` (replicated on axis a)."""

    producer: str
    cost: int
    readers: list[tuple[str, int]]
    outputs: set = field(default_factory=set)


class Objective:
    """The reduced model's objective and memory for a choice of every node left in it."""

    def __init__(self, data: IlpData, outputs: dict[str, list], triggers: list[Trigger], memory_cap_kb: int | None):
        self.data, self.outputs, self.triggers, self.memory_cap_kb = data, outputs, triggers, memory_cap_kb
        self.incident: dict[str, list[Edge]] = {name: [] for name in data.costs}
        for edge in data.edges:
            self.incident[edge.producer].append(edge)
            self.incident[edge.consumer].append(edge)
        self.triggers_of: dict[str, list[Trigger]] = {name: [] for name in data.costs}
        for trigger in triggers:
            for name in dict.fromkeys([trigger.producer, *(reader for reader, _ in trigger.readers)]):
                self.triggers_of[name].append(trigger)

    def _paid(self, trigger: Trigger, choice: dict[str, int]) -> int:
        if self.outputs[trigger.producer][choice[trigger.producer]] not in trigger.outputs:
            return 0
        return trigger.cost if any(choice[reader] == index for reader, index in trigger.readers) else 0

    def total(self, choice: dict[str, int]) -> int:
        data = self.data
        value = data.offset_ns + sum(data.costs[name][choice[name]] for name in data.costs)
        value += sum(edge.pair_cost(choice[edge.producer], choice[edge.consumer]) for edge in data.edges)
        return value + sum(self._paid(trigger, choice) for trigger in self.triggers)

    def memory_kb(self, choice: dict[str, int]) -> int:
        return self.data.offset_kb + sum(self.data.memory_kb[name][choice[name]] for name in self.data.costs)

    def fits(self, choice: dict[str, int]) -> bool:
        return self.memory_cap_kb is None or self.memory_kb(choice) <= self.memory_cap_kb

    def local(self, choice: dict[str, int], name: str) -> int:
        """The terms that depend on ``name``'s choice."""
        value = self.data.costs[name][choice[name]]
        value += sum(edge.pair_cost(choice[edge.producer], choice[edge.consumer]) for edge in self.incident[name])
        return value + sum(self._paid(trigger, choice) for trigger in self.triggers_of[name])


def rounded(values: list[float], x: dict[str, list]) -> dict[str, int]:
    """Each node's candidate with the largest LP value (the first on ties)."""
    return {name: max(range(len(variables)), key=lambda c: (values[variables[c].index], -c)) for name, variables in x.items()}


def improve(objective: Objective, choice: dict[str, int], passes: int = 20) -> dict[str, int]:
    """Iterated conditional modes: every node in turn moves to the candidate that lowers
    the objective most given the others (memory permitting), until a pass changes nothing.
    A choice that does not fit comes back as it is."""
    choice = dict(choice)
    if not objective.fits(choice):
        return choice
    cap = objective.memory_cap_kb
    memory = objective.memory_kb(choice)
    for _ in range(passes):
        changed = False
        for name, costs in objective.data.costs.items():
            current = choice[name]
            best, best_value = current, objective.local(choice, name)
            kilobytes = objective.data.memory_kb[name]
            for index in range(len(costs)):
                if index == current or (cap is not None and memory - kilobytes[current] + kilobytes[index] > cap):
                    continue
                choice[name] = index
                value = objective.local(choice, name)
                if value < best_value:
                    best, best_value = index, value
            choice[name] = best
            if best != current:
                memory += kilobytes[best] - kilobytes[current]
                changed = True
        if not changed:
            break
    return choice
