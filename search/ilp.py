"""Exact intra-op sharding search with CP-SAT (OR-tools).

The model (Alpa's and autoparallel's intra-op formulation, with memory as a constraint and
repeated blocks solved once):

Data. Nodes n with candidates c (``search.cost_tables``): time t[n,c] (compute plus its own
communication), memory m[n,c] (sharded parameters with their gradients and optimizer
states, saved activations). Edges (u -> v at input i): resharding time r[e,p,q] from the
producer's output placement p to the placement q the consumer reads. Blocks: when the graph
has L > 1 identical blocks, only the first is modelled and its terms weigh L (edges from
one block into the next weigh L - 1), so every block gets the same strategy and depth
costs nothing.

Variables.
    x[n,c]    in {0,1}   node n runs candidate c                   (add_choice_variables)
    y[e,p,q]  in {0,1}   edge e carries producer output p to consumer input q (add_resharding_constraints)
    z[u,a]    in {0,1}   u's output gradient is all-reduced on axis a (add_gradient_reduction_constraints)

Constraints.
    one_strategy[n]:     sum_c x[n,c] = 1                          (add_choice_variables)
    reshard_out[e,p]:    sum_q y[e,p,q] = out[u,p]                 (add_resharding_constraints)
    reshard_in[e,q]:     sum_p y[e,p,q] = in[v,i,q]
                         where out[u,p] = sum of x[u,c] with output p, in[v,i,q] likewise
                         (the marginal form: y is the joint choice, a tight relaxation)
    reduce[u,a,v,c,p]:   z[u,a] >= x[v,c] + out[u,p] - 1           (add_gradient_reduction_constraints)
                         for every reader candidate (v,c) whose weights split on axis a while
                         it reads u replicated there, and producer output p replicated on a
    memory:              sum w[n] * m[n,c] * x[n,c] <= device memory (add_memory_constraint)

Objective (add_objective): minimise sum w[n] t[n,c] x[n,c] + sum w[e] r[e,p,q] y[e,p,q]
+ sum w[u] R[u,a] z[u,a], in integer nanoseconds. The solve is deterministic: one worker,
a budget of CP-SAT's deterministic time (work, not seconds), and a complete hint (x from a
layout built directly, y and z as it implies); the result says whether it is optimal and
reports the optimality gap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ortools.sat.python import cp_model
from torch.distributed.tensor import Replicate

from planner.errors import PlanningError
from planner.graph import OpGraph
from search.blocks import block_representatives
from search.cost_tables import CostTables

SCALE = 1e9  # seconds -> integer nanoseconds for CP-SAT


@dataclass(frozen=True)
class IlpResult:
    """The chosen candidate per node and how good the solve was.

    ``work`` is CP-SAT's deterministic time spent (its unit is close to a second of one
    core's work, and it does not depend on how busy the machine is); ``cut_by_wall_clock``
    says that the wall-clock safety cap, not the work budget, ended the solve, so the result
    may differ on another machine; ``from_hint`` that the hint (a layout built directly)
    was kept because CP-SAT found nothing better within its budget."""

    choice: dict[str, int]
    objective_s: float
    bound_s: float
    optimal: bool
    seconds: float
    work: float = 0.0
    cut_by_wall_clock: bool = False
    from_hint: bool = False

    @property
    def gap(self) -> float:
        """Relative optimality gap (0 when proven optimal)."""
        return 0.0 if self.optimal or not self.objective_s else max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


@dataclass
class _Reduced:
    """Which nodes are modelled and with what weight (repeated blocks solved once)."""

    nodes: list[str]
    weight: dict[str, int]
    representative: dict[str, str]  # every node -> the modelled node whose choice it takes
    edges: list[tuple[str, str, int, int]]  # (producer, consumer, position, weight), modelled names


@dataclass
class _Auxiliary:
    """The y and z variables, kept so a hint on x can be completed into a whole solution."""

    pairs: dict[tuple[str, str, int], dict[tuple, object]]  # edge -> (src, dst) -> y
    reductions: dict[tuple[str, int], list[tuple[str, int, tuple]]]  # (u, a) -> triggers (v, c, p)
    z: dict[tuple[str, int], object]


def solve(
    tables: CostTables,
    memory_bytes: float | None,
    work: float = 10.0,
    wall_clock_cap_s: float | None = None,
    hint: dict[str, int] | None = None,
) -> IlpResult:
    """Choose one candidate per node minimising the objective within the memory budget.

    The solve is deterministic: one CP-SAT worker, stopped by ``work`` units of CP-SAT's
    deterministic time, so the same tables give the same answer on a fast, a slow or a busy
    machine. ``wall_clock_cap_s`` is a safety cap only; when it ends the solve first the
    result says so (``cut_by_wall_clock``).

    ``hint`` (node -> candidate index) is a known solution CP-SAT starts from, e.g. the
    Megatron layout; it is completed into values for every variable, and when CP-SAT finds
    nothing better within its budget the hint itself is returned (``from_hint``).

    Raises:
        PlanningError: no assignment fits in memory, or the solver found nothing in time
            (and there is no hint to fall back on).
    """
    started = time.perf_counter()
    reduced = reduce_repeated_blocks(tables.graph, tables)
    model = cp_model.CpModel()
    x = add_choice_variables(model, tables, reduced)
    resharding_terms, pairs = add_resharding_constraints(model, tables, reduced, x)
    reduction_terms, reductions, z = add_gradient_reduction_constraints(model, tables, reduced, x)
    if memory_bytes is not None:
        add_memory_constraint(model, tables, reduced, x, memory_bytes)
    add_objective(model, tables, reduced, x, resharding_terms + reduction_terms)
    full_hint = _complete_choice(hint or {}, tables, reduced)
    if full_hint is not None:
        _add_hint(model, tables, reduced, x, _Auxiliary(pairs, reductions, z), full_hint)

    solver = cp_model.CpSolver()
    # One worker: CP-SAT's multi-threaded search depends on thread timing; a single worker
    # stopped by deterministic time does not.
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = max(0.01, work)
    # Presolve spends a whole budget on these models (tens of thousands of pair variables)
    # before searching at all; searching the model as built finds and proves far more.
    solver.parameters.cp_model_presolve = False
    if wall_clock_cap_s is not None:
        solver.parameters.max_time_in_seconds = max(0.01, wall_clock_cap_s)
    status = solver.solve(model)
    seconds = time.perf_counter() - started
    cut = (
        wall_clock_cap_s is not None
        and status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
        and solver.deterministic_time < 0.99 * work
    )
    if status == cp_model.INFEASIBLE:
        raise PlanningError("no sharding of this model fits in device memory on this mesh")
    hint_fits = full_hint is not None and (
        memory_bytes is None or tables.memory(_expand_blocks(full_hint, reduced)) <= memory_bytes
    )
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if not hint_fits:
            raise PlanningError(f"CP-SAT found no sharding within its budget ({work:g} units of work); raise --effort")
        choice = _expand_blocks(full_hint, reduced)
        return IlpResult(choice, tables.objective(choice), 0.0, False, seconds, solver.deterministic_time, cut, True)
    modelled = {name: next(c for c, var in enumerate(x[name]) if solver.value(var)) for name in reduced.nodes}
    choice = _expand_blocks(modelled, reduced)
    result = IlpResult(
        choice=choice,
        objective_s=solver.objective_value / SCALE,
        bound_s=solver.best_objective_bound / SCALE,
        optimal=status == cp_model.OPTIMAL,
        seconds=seconds,
        work=solver.deterministic_time,
        cut_by_wall_clock=cut,
    )
    if hint_fits and not result.optimal:
        # CP-SAT may wander off a good hint; never return worse than the layout it was given.
        hinted = _expand_blocks(full_hint, reduced)
        hinted_s = tables.objective(hinted)
        if hinted == choice or hinted_s < tables.objective(choice) - 1e-12:
            return IlpResult(hinted, hinted_s, result.bound_s, False, seconds, result.work, cut, True)
    return result


def _complete_choice(hint: dict[str, int], tables: CostTables, reduced: _Reduced) -> dict[str, int]:
    """The hint for every modelled node (the all-replicate candidate where it says nothing)."""
    return {
        name: hint.get(name, 0) if hint.get(name, 0) < len(tables.candidates[name]) else 0 for name in reduced.nodes
    }


def _add_hint(model, tables: CostTables, reduced: _Reduced, x, auxiliary: _Auxiliary, choice: dict[str, int]) -> None:
    """Hint every variable: x from ``choice``, y and z as that choice implies them, so CP-SAT
    starts from a complete solution instead of having to repair a partial one."""
    for name, index in choice.items():
        for position, var in enumerate(x[name]):
            model.add_hint(var, position == index)
    for (producer, consumer, position), pairs in auxiliary.pairs.items():
        src = tables.candidates[producer][choice[producer]].output
        dst = tables.candidates[consumer][choice[consumer]].inputs[position]
        for (p, q), var in pairs.items():
            model.add_hint(var, p == src and q == dst)
    for key, var in auxiliary.z.items():
        producer, _ = key
        src = tables.candidates[producer][choice[producer]].output
        model.add_hint(var, any(choice[v] == c and p == src for v, c, p in auxiliary.reductions[key]))


# ----------------------------------------------------------------- model builders


def add_choice_variables(model: cp_model.CpModel, tables: CostTables, reduced: _Reduced) -> dict[str, list]:
    """x[n,c] and one_strategy[n]: exactly one candidate per modelled node."""
    x = {}
    for name in reduced.nodes:
        x[name] = [model.new_bool_var(f"x[{name},{c}]") for c in range(len(tables.candidates[name]))]
        model.add_exactly_one(x[name]).with_name(f"one_strategy[{name}]")
    return x


def _indicator(x_node: list, candidates, pick) -> dict:
    """placement -> the candidates of a node having it (their sum is the indicator)."""
    groups: dict = {}
    for index, candidate in enumerate(candidates):
        groups.setdefault(pick(candidate), []).append(x_node[index])
    return groups


def add_resharding_constraints(model, tables: CostTables, reduced: _Reduced, x) -> tuple[list, dict]:
    """y[e,p,q]: the joint choice of producer output p and consumer input q on edge e.
    Returns the objective terms and the y variables of each edge.

    The marginal (transportation) form, tighter than y >= out + in - 1: every pair gets a
    variable, free pairs included, and they add up to the choices on each side,
        sum_q y[e,p,q] = out[u,p]     (reshard_out[e,p])
        sum_p y[e,p,q] = in[v,i,q]    (reshard_in[e,q])
    so y is exactly the product of the two choices and the LP relaxation stays close to
    the integer optimum. Only pairs with a cost enter the objective.
    """
    terms = []
    variables: dict[tuple[str, str, int], dict[tuple, object]] = {}
    for producer, consumer, position, weight in reduced.edges:
        outs = _indicator(x[producer], tables.candidates[producer], lambda c: c.output)
        ins = _indicator(x[consumer], tables.candidates[consumer], lambda c: c.inputs[position])
        if None in outs:
            continue  # the producer has no tensor output on this edge
        edge = f"{producer}->{consumer}.{position}"
        pairs = {
            (src, dst): model.new_bool_var(f"y[{edge},{src}->{dst}]") for src in outs for dst in ins
        }
        variables[producer, consumer, position] = pairs
        for src, src_vars in outs.items():
            model.add(sum(pairs[src, dst] for dst in ins) == sum(src_vars)).with_name(f"reshard_out[{edge},{src}]")
        for dst, dst_vars in ins.items():
            model.add(sum(pairs[src, dst] for src in outs) == sum(dst_vars)).with_name(f"reshard_in[{edge},{dst}]")
        for (src, dst), var in pairs.items():
            seconds = tables.edge_cost(producer, consumer, position, src, dst)
            if seconds > 0:
                terms.append((round(seconds * SCALE * weight), var))
    return terms, variables


def add_gradient_reduction_constraints(model, tables: CostTables, reduced: _Reduced, x) -> tuple[list, dict, dict]:
    """z[u,a] >= x[v,c] + out[u,p] - 1: a replicated activation read by split weights.
    Returns the objective terms, what triggers each z (reader candidate and producer
    output), and the z variables."""
    z: dict[tuple[str, int], object] = {}
    triggers: dict[tuple[str, int], list[tuple[str, int, tuple]]] = {}
    for producer, consumer, position, weight in reduced.edges:
        outs = _indicator(x[producer], tables.candidates[producer], lambda c: c.output)
        for index, candidate in enumerate(tables.candidates[consumer]):
            for where, axis in candidate.gradient_reductions:
                if where != position:
                    continue
                key = (producer, axis)
                if key not in z:
                    z[key] = model.new_bool_var(f"z[{producer},{axis}]")
                for src, src_vars in outs.items():
                    if src is not None and isinstance(src[axis], Replicate):
                        triggers.setdefault(key, []).append((consumer, index, src))
                        model.add(z[key] >= x[consumer][index] + sum(src_vars) - 1).with_name(
                            f"reduce[{producer},{axis},{consumer},{index},{src}]"
                        )
    terms = [
        (round(tables.reduction_cost(producer, axis) * SCALE * reduced.weight[producer]), var)
        for (producer, axis), var in z.items()
    ]
    return terms, triggers, z


def add_memory_constraint(model, tables: CostTables, reduced: _Reduced, x, memory_bytes: float) -> None:
    """Per-device memory of the chosen candidates fits the device (kilobytes, rounded up)."""
    terms = []
    for name in reduced.nodes:
        for index, candidate in enumerate(tables.candidates[name]):
            kilobytes = -(-int(candidate.memory_bytes * reduced.weight[name]) // 1024)
            if kilobytes:
                terms.append(kilobytes * x[name][index])
    model.add(sum(terms) <= int(memory_bytes // 1024)).with_name("memory")


def add_objective(model, tables: CostTables, reduced: _Reduced, x, extra_terms: list) -> None:
    """Minimise node times + resharding + gradient reductions (integer nanoseconds)."""
    terms = []
    for name in reduced.nodes:
        for index, candidate in enumerate(tables.candidates[name]):
            cost = round((candidate.compute_s + candidate.communication_s) * SCALE * reduced.weight[name])
            if cost:
                terms.append(cost * x[name][index])
    terms += [coefficient * var for coefficient, var in extra_terms if coefficient]
    model.minimize(sum(terms))


# ------------------------------------------------------------------- repeated blocks


def reduce_repeated_blocks(graph: OpGraph, tables: CostTables) -> _Reduced:
    """Model only block 0 of the first stack of repeated blocks, weighted by the block count.

    Node k of block b maps to node k of block 0 (``search.blocks``). Edges inside a block
    weigh L; an edge from block b-1 into block b becomes an edge from block 0 into block 0
    weighing L-1; edges between the rest and the blocks keep their weight per block they touch.
    """
    representative = block_representatives(graph)
    weight = {name: 0 for name in representative}
    for name, modelled in representative.items():
        weight[modelled] += 1
    nodes = [node.name for node in graph.nodes if representative[node.name] == node.name]
    edge_weight: dict[tuple[str, str, int], int] = {}
    for producer, consumer, position in tables.edges:
        key = (representative[producer], representative[consumer], position)
        edge_weight[key] = edge_weight.get(key, 0) + 1
    edges = [(producer, consumer, position, w) for (producer, consumer, position), w in edge_weight.items()]
    return _Reduced(nodes=nodes, weight=weight, representative=representative, edges=edges)


def _expand_blocks(choice: dict[str, int], reduced: _Reduced) -> dict[str, int]:
    """A choice for every node, from one for the modelled nodes (or for every node)."""
    return {name: choice[modelled] for name, modelled in reduced.representative.items()}
