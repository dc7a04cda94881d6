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
    reduce[u,a,v]:       z[u,a] >= sum_c x[v,c] + sum_p out[u,p] - 1 (add_gradient_reduction_constraints)
                         per reader v, over its candidates c whose weights split on axis a
                         while they read u replicated there, and over u's outputs p
                         replicated on a (aggregated: far tighter than one row per (c, p))
    memory:              sum w[n] * m[n,c] * x[n,c] <= device memory (add_memory_constraint)

Objective (add_objective): minimise sum w[n] t[n,c] x[n,c] + sum w[e] r[e,p,q] y[e,p,q]
+ sum w[u] R[u,a] z[u,a], in integer nanoseconds.

Before CP-SAT sees it, the model is made smaller without changing its optimum:
- views, casts and elementwise ops between one producer and one consumer (and leaves and
  sources), whose candidates all hold the same memory and take no part in z, are taken out
  and their cost folded into a merged edge or a neighbour's candidates (``search.ilp_reduce``);
- on each edge, producer placements with equal cost rows, and consumer placements with equal
  cost columns, share one index of y (``Edge.groups``).

The solve is deterministic: one worker, a budget of CP-SAT's deterministic time (work, not
seconds), and a complete hint: the better of the layout built directly and the LP
relaxation (GLOP) rounded, each improved node by node (``search.ilp_start``). The LP
optimum is also a lower bound; the result says whether it is optimal and reports the gap.
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
from search.ilp_reduce import Edge, IlpData, expand, reduce_model
from search.ilp_start import Objective, Trigger, improve, rounded, solve_relaxation

SCALE = 1e9  # seconds -> integer nanoseconds for CP-SAT


@dataclass(frozen=True)
class IlpResult:
    """The chosen candidate per node and how good the solve was.

    ``work`` is CP-SAT's deterministic time spent (its unit is close to a second of one
    core's work, and it does not depend on how busy the machine is); ``cut_by_wall_clock``
    says that the wall-clock safety cap, not the work budget, ended the solve, so the result
    may differ on another machine; ``from_hint`` that the hint (a layout built directly)
    was kept because nothing better was found within the budget."""

    choice: dict[str, int]
    objective_s: float
    bound_s: float
    optimal: bool
    seconds: float
    work: float = 0.0
    cut_by_wall_clock: bool = False
    from_hint: bool = False
    variables: int = 0  # CP-SAT variables after the exact reductions (search.ilp_reduce)

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

    pairs: list[tuple[Edge, dict, dict, dict[tuple, object]]]  # edge, its groups, (src, dst) -> y
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

    ``hint`` (node -> candidate index) is a known solution, e.g. the Megatron layout; CP-SAT
    starts from the better of it and the rounded LP relaxation, so the answer is never worse
    than the hint, and it is the hint itself (``from_hint``) when nothing better was found.

    Raises:
        PlanningError: no assignment fits in memory, or the solver found nothing in time
            (and there is no hint to fall back on).
    """
    started = time.perf_counter()
    reduced = reduce_repeated_blocks(tables.graph, tables)
    data = reduce_model(build_data(tables, reduced))
    model = cp_model.CpModel()
    x = add_choice_variables(model, tables, data)
    resharding_terms, pairs = add_resharding_constraints(model, data, x)
    reduction_terms, reductions, z = add_gradient_reduction_constraints(model, tables, reduced, x)
    if memory_bytes is not None:
        add_memory_constraint(model, data, x, memory_bytes)
    add_objective(model, data, x, resharding_terms + reduction_terms)
    full_hint = _complete_choice(hint or {}, tables, reduced)
    cap_kb = None if memory_bytes is None else int(memory_bytes // 1024)
    outputs = {name: [c.output for c in tables.candidates[name]] for name in data.nodes}
    objective = Objective(data, outputs, _triggers(tables, reduced, reductions), cap_kb)
    start, relaxation_ns, lp_cut = _starting_solution(
        model, x, objective, {name: full_hint[name] for name in data.nodes}, _seconds_left(wall_clock_cap_s, started)
    )
    _add_hint(model, tables, data, x, _Auxiliary(pairs, reductions, z), start)

    solver = cp_model.CpSolver()
    # One worker: CP-SAT's multi-threaded search depends on thread timing; a single worker
    # stopped by deterministic time does not.
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = max(0.01, work)
    # Presolve spends a whole budget on these models (tens of thousands of pair variables)
    # before searching at all; searching the model as built finds and proves far more.
    solver.parameters.cp_model_presolve = False
    # Probing spends half of a default budget on these models before the search starts and
    # proves nothing the LP relaxation does not: on the tiny Llama's dp=2 x tp=2 mesh the
    # optimum is proven in 0.06 units of work without it, 1.8 with it.
    solver.parameters.cp_model_probing_level = 0
    if wall_clock_cap_s is not None:
        solver.parameters.max_time_in_seconds = _seconds_left(wall_clock_cap_s, started)
    status = solver.solve(model)
    seconds = time.perf_counter() - started
    cut = lp_cut or (
        wall_clock_cap_s is not None
        and status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
        and solver.deterministic_time < 0.99 * work
    )
    if status == cp_model.INFEASIBLE:
        raise PlanningError("no sharding of this model fits in device memory on this mesh")
    hinted = _expand_blocks(full_hint, reduced)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        # Stopped before CP-SAT loaded its hint: the starting solution is the answer.
        if not objective.fits(start):
            raise PlanningError(f"CP-SAT found no sharding within its budget ({work:g} units of work); raise --effort")
        choice = _expand_blocks(expand(data, start), reduced)
        return IlpResult(
            choice, tables.objective(choice), relaxation_ns / SCALE, False, seconds, solver.deterministic_time, cut,
            from_hint=choice == hinted, variables=len(model.proto.variables),
        )
    modelled = {name: next(c for c, var in enumerate(x[name]) if solver.value(var)) for name in data.nodes}
    choice = _expand_blocks(expand(data, modelled), reduced)
    return IlpResult(
        choice=choice,
        objective_s=solver.objective_value / SCALE,
        bound_s=max(solver.best_objective_bound, relaxation_ns) / SCALE,
        optimal=status == cp_model.OPTIMAL,
        seconds=seconds,
        work=solver.deterministic_time,
        cut_by_wall_clock=cut,
        # CP-SAT returns a solution at least as good as its complete hint, which is at least
        # as good as the layout it was given: equal to it means nothing better was found.
        from_hint=choice == hinted and not status == cp_model.OPTIMAL,
        variables=len(model.proto.variables),
    )


def _seconds_left(cap_s: float | None, started: float) -> float | None:
    """What is left of the wall-clock safety cap (never below 0.01 s), or None without one."""
    return None if cap_s is None else max(0.01, cap_s - (time.perf_counter() - started))


def _complete_choice(hint: dict[str, int], tables: CostTables, reduced: _Reduced) -> dict[str, int]:
    """The hint for every modelled node (the all-replicate candidate where it says nothing)."""
    return {
        name: hint.get(name, 0) if hint.get(name, 0) < len(tables.candidates[name]) else 0 for name in reduced.nodes
    }


def _triggers(tables: CostTables, reduced: _Reduced, reductions: dict) -> list[Trigger]:
    """The gradient reductions as the starting-solution search evaluates them."""
    triggers = []
    for (producer, axis), readers in reductions.items():
        cost = round(tables.reduction_cost(producer, axis) * SCALE * reduced.weight[producer])
        triggers.append(Trigger(producer, cost, [(v, c) for v, c, _ in readers], {p for _, _, p in readers}))
    return triggers


def _starting_solution(
    model, x, objective: Objective, hint: dict[str, int], seconds: float | None
) -> tuple[dict[str, int], float, bool]:
    """The best of the hint and the rounded LP relaxation, each improved node by node
    (``search.ilp_start``; the hint as it is when neither fits in memory), the LP optimum
    in nanoseconds (a lower bound on the objective; 0 when GLOP found none), and whether
    the wall-clock cap stopped GLOP."""
    starts, bound = [hint], 0.0
    began = time.perf_counter()
    relaxation = solve_relaxation(model, seconds)
    cut = relaxation is None and seconds is not None and time.perf_counter() - began >= 0.99 * seconds
    if relaxation is not None:
        # Less GLOP's tolerances (1e-6 relative, far above its primal and dual ones).
        bound = relaxation[0] - 1e-6 * abs(relaxation[0])
        starts.append(rounded(relaxation[1], x))
    improved = [improve(objective, start) for start in starts]
    fitting = [start for start in improved if objective.fits(start)]
    return (min(fitting, key=objective.total) if fitting else hint), bound, cut


def _add_hint(model, tables: CostTables, data: IlpData, x, auxiliary: _Auxiliary, choice: dict[str, int]) -> None:
    """Hint every variable: x from ``choice``, y and z as that choice implies them, so CP-SAT
    starts from a complete solution instead of having to repair a partial one."""
    for name in data.nodes:
        for position, var in enumerate(x[name]):
            model.add_hint(var, position == choice[name])
    for edge, src_group, dst_group, pairs in auxiliary.pairs:
        src = src_group[edge.src[choice[edge.producer]]]
        dst = dst_group[edge.dst[choice[edge.consumer]]]
        for (p, q), var in pairs.items():
            model.add_hint(var, p == src and q == dst)
    for key, var in auxiliary.z.items():
        producer, _ = key
        src = tables.candidates[producer][choice[producer]].output
        model.add_hint(var, any(choice[v] == c and p == src for v, c, p in auxiliary.reductions[key]))


# ----------------------------------------------------------------- model builders


def build_data(tables: CostTables, reduced: _Reduced) -> IlpData:
    """The model's coefficients: weighted integer nanoseconds per candidate and per
    resharding pair, weighted kilobytes per candidate. An edge from a node into its own
    twin of the next block is a cost of that node's choice alone (both take the same)."""
    costs, memory_kb = {}, {}
    for name in reduced.nodes:
        weight = reduced.weight[name]
        costs[name] = [round((c.compute_s + c.communication_s) * SCALE * weight) for c in tables.candidates[name]]
        memory_kb[name] = [-(-int(c.memory_bytes * weight) // 1024) for c in tables.candidates[name]]
    edges, pinned = [], set()
    # Placements as small integers: hashing DTensor placements dominates the reductions.
    number: dict = {}
    for producer, consumer, position, weight in reduced.edges:
        if any(where == position for c in tables.candidates[consumer] for where, _ in c.gradient_reductions):
            pinned |= {producer, consumer}  # z variables read these choices
        src = [c.output for c in tables.candidates[producer]]
        if None in src:
            continue  # the producer has no tensor output on this edge
        dst = [c.inputs[position] for c in tables.candidates[consumer]]
        cost = {
            (number.setdefault(p, len(number)), number.setdefault(q, len(number))):
                round(tables.edge_cost(producer, consumer, position, p, q) * SCALE * weight)
            for p in dict.fromkeys(src)
            for q in dict.fromkeys(dst)
        }
        src, dst = [number[p] for p in src], [number[q] for q in dst]
        if producer == consumer:
            for index in range(len(src)):
                costs[producer][index] += cost[src[index], dst[index]]
        else:
            edges.append(Edge(producer, consumer, f"{producer}->{consumer}.{position}", src, dst, cost))
    return IlpData(costs, memory_kb, edges, pinned)


def add_choice_variables(model: cp_model.CpModel, tables: CostTables, data: IlpData) -> dict[str, list]:
    """x[n,c] and one_strategy[n]: exactly one candidate per node left in the model."""
    x = {}
    for name in data.nodes:
        x[name] = [model.new_bool_var(f"x[{name},{c}]") for c in range(len(tables.candidates[name]))]
        model.add_exactly_one(x[name]).with_name(f"one_strategy[{name}]")
    return x


def _indicator(x_node: list, keys: list) -> dict:
    """placement -> the candidates of a node having it (their sum is the indicator)."""
    groups: dict = {}
    for var, key in zip(x_node, keys):
        groups.setdefault(key, []).append(var)
    return groups


def add_resharding_constraints(model, data: IlpData, x) -> tuple[list, dict]:
    """y[e,p,q]: the joint choice of producer output p and consumer input q on edge e.
    Returns the objective terms and the y variables of each edge.

    The marginal (transportation) form, tighter than y >= out + in - 1: every pair gets a
    variable, free pairs included, and they add up to the choices on each side,
        sum_q y[e,p,q] = out[u,p]     (reshard_out[e,p])
        sum_p y[e,p,q] = in[v,i,q]    (reshard_in[e,q])
    so y is exactly the product of the two choices and the LP relaxation stays close to
    the integer optimum. Only pairs with a cost enter the objective. Edges merged through a
    removed node (``search.ilp_reduce``) are built the same way, with their merged costs.
    """
    terms = []
    variables: list[tuple[Edge, dict, dict, dict[tuple, object]]] = []
    for edge in data.edges:
        src_group, dst_group = edge.groups()
        outs = _indicator(x[edge.producer], [src_group[p] for p in edge.src])
        ins = _indicator(x[edge.consumer], [dst_group[q] for q in edge.dst])
        pairs = {(src, dst): model.new_bool_var(f"y[{edge.name},{src}->{dst}]") for src in outs for dst in ins}
        variables.append((edge, src_group, dst_group, pairs))
        for src, src_vars in outs.items():
            model.add(sum(pairs[src, dst] for dst in ins) == sum(src_vars)).with_name(f"reshard_out[{edge.name},{src}]")
        for dst, dst_vars in ins.items():
            model.add(sum(pairs[src, dst] for src in outs) == sum(dst_vars)).with_name(f"reshard_in[{edge.name},{dst}]")
        cost = {(src_group[p], dst_group[q]): value for (p, q), value in edge.cost.items()}
        terms += [(cost[pair], var) for pair, var in pairs.items() if cost[pair]]
    return terms, variables


def add_gradient_reduction_constraints(model, tables: CostTables, reduced: _Reduced, x) -> tuple[list, dict, dict]:
    """z[u,a] >= sum_c x[v,c] + sum_p out[u,p] - 1: a replicated activation read by split
    weights, one constraint per reader v, summed over the reader's candidates c that split
    their weights on a while reading u replicated there and over u's outputs p replicated
    on a (both sums are 0 or 1: the aggregated form is tighter than one constraint per
    (c, p) pair and has the same integer solutions). Returns the objective terms, what
    triggers each z (reader candidate and producer output), and the z variables."""
    z: dict[tuple[str, int], object] = {}
    triggers: dict[tuple[str, int], list[tuple[str, int, tuple]]] = {}
    for producer, consumer, position, weight in reduced.edges:
        readers: dict[int, list[int]] = {}
        for index, candidate in enumerate(tables.candidates[consumer]):
            for where, axis in candidate.gradient_reductions:
                if where == position:
                    readers.setdefault(axis, []).append(index)
        for axis, indices in readers.items():
            replicated = [
                (index, candidate.output)
                for index, candidate in enumerate(tables.candidates[producer])
                if candidate.output is not None and isinstance(candidate.output[axis], Replicate)
            ]
            key = (producer, axis)
            if key not in z:
                z[key] = model.new_bool_var(f"z[{producer},{axis}]")
            if not replicated:
                continue
            outputs = list(dict.fromkeys(src for _, src in replicated))
            triggers.setdefault(key, []).extend((consumer, index, src) for index in indices for src in outputs)
            model.add(
                z[key] >= sum(x[consumer][i] for i in indices) + sum(x[producer][i] for i, _ in replicated) - 1
            ).with_name(f"reduce[{producer},{axis},{consumer}.{position}]")
    terms = [
        (round(tables.reduction_cost(producer, axis) * SCALE * reduced.weight[producer]), var)
        for (producer, axis), var in z.items()
    ]
    return terms, triggers, z


def add_memory_constraint(model, data: IlpData, x, memory_bytes: float) -> None:
    """Per-device memory of the chosen candidates fits the device (kilobytes, rounded up;
    nodes taken out of the model hold the same whatever they chose: ``offset_kb``)."""
    terms = [kb * x[name][index] for name in data.nodes for index, kb in enumerate(data.memory_kb[name]) if kb]
    model.add(sum(terms) <= int(memory_bytes // 1024) - data.offset_kb).with_name("memory")


def add_objective(model, data: IlpData, x, extra_terms: list) -> None:
    """Minimise node times + resharding + gradient reductions (integer nanoseconds), plus
    the fixed cost of the nodes taken out of the model."""
    terms = [cost * x[name][index] for name in data.nodes for index, cost in enumerate(data.costs[name]) if cost]
    terms += [coefficient * var for coefficient, var in extra_terms if coefficient]
    model.minimize(sum(terms) + data.offset_ns)


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
