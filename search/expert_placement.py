"""Expert placement: which devices of an expert-parallel group hold which experts of an MoE
layer, and how a hot expert's tokens split among its copies.

Three methods, from the same routing statistics (``planner.routing``: each expert's share of
the routed tokens) and the same number of expert slots per device:

- ``round_robin``: expert ``e`` on device ``e % devices``; no copies. What an expert-parallel
  layer does when it knows nothing about the routing.
- ``eplb``: DeepSeek's expert-parallel load balancer as its documentation describes it (this
  is our implementation of that description). Slots beyond one per expert become redundant
  copies, each given in turn to the expert with the largest load per copy; the copies are
  packed onto devices by balanced packing (heaviest first, each to the lightest device that
  still has a free slot), each copy taking an equal share of its expert's tokens. With expert
  groups and several nodes (the hierarchical policy), groups are first packed onto nodes the
  same way, and copies made and packed within each node, so a token's experts tend to share
  a node.
- ``balanced``: ours. Starts from EPLB's copies and packing, gives every expert's copies the
  shares that minimise the busiest device's load (a linear program: GLOP), then swaps
  copies between the busiest device and the others while the given cost falls (a
  fixed number of evaluations, so the same inputs give the same placement on any machine).
  Unequal shares matter: with equal shares a hot expert with two copies still loads both
  of its devices with half its tokens each, whatever else they hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from planner.errors import PlanningError
from planner.strategy import ExpertPlacement

# Evaluations of the cost the local search may spend per expert (work, not seconds).
SEARCH_EVALUATIONS_PER_EXPERT = 8


def round_robin(experts: int, devices: int) -> ExpertPlacement:
    """Expert ``e`` on device ``e % devices``, one copy each.

    Raises:
        PlanningError: the experts do not divide evenly over the devices.
    """
    if devices < 1 or experts < 1 or experts % devices:
        raise PlanningError(
            f"round-robin placement needs the experts to divide evenly over the devices, got {experts} experts on "
            f"{devices} devices"
        )
    return ExpertPlacement.round_robin(experts, devices)


def replica_counts(loads: Sequence[float], slots: int) -> list[int]:
    """Copies per expert when ``slots`` copies are made in all: one each, then each extra one
    to the expert with the largest load per copy (the lowest index on a tie)."""
    if slots < len(loads):
        raise PlanningError(f"{slots} expert slots cannot hold {len(loads)} experts; give each device more slots")
    counts = [1] * len(loads)
    for _ in range(slots - len(loads)):
        hottest = max(range(len(loads)), key=lambda e: (loads[e] / counts[e], -e))
        counts[hottest] += 1
    return counts


def balanced_packing(weights: Sequence[float], packs: int) -> list[list[int]]:
    """Items (by index) into ``packs`` packs of equal count, heaviest first, each to the
    lightest pack with room (the lowest index on a tie)."""
    if packs < 1 or len(weights) % packs:
        raise PlanningError(f"{len(weights)} items do not split evenly into {packs} packs")
    room = len(weights) // packs
    contents: list[list[int]] = [[] for _ in range(packs)]
    totals = [0.0] * packs
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        pack = min((p for p in range(packs) if len(contents[p]) < room), key=lambda p: (totals[p], p))
        contents[pack].append(item)
        totals[pack] += weights[item]
    return contents


def eplb(
    loads: Sequence[float],
    devices: int,
    slots_per_device: int,
    devices_per_node: int | None = None,
    groups: int | None = None,
) -> ExpertPlacement:
    """EPLB's placement (see the module docstring): hierarchical when ``groups`` expert
    groups (consecutive experts) split evenly over the nodes, global otherwise.

    Args:
        loads: each expert's load (token share or tokens).
        devices: devices of the expert-parallel group.
        slots_per_device: expert copies each device holds.
        devices_per_node: devices per node (the whole group on one node when None).
        groups: expert groups (DeepSeek-V3's routing groups), for the hierarchical policy.
    """
    experts = len(loads)
    _check_slots(experts, devices, slots_per_device)
    per_node = devices_per_node or devices
    nodes = devices // per_node if devices % per_node == 0 else 1
    if groups and nodes > 1 and groups % nodes == 0 and experts % groups == 0:
        size = experts // groups
        group_loads = [sum(loads[g * size:(g + 1) * size]) for g in range(groups)]
        copies: dict[int, list[tuple[int, float]]] = {}
        for node, node_groups in enumerate(balanced_packing(group_loads, nodes)):
            members = [g * size + i for g in sorted(node_groups) for i in range(size)]
            device_ids = list(range(node * per_node, (node + 1) * per_node))
            _pack_copies(members, loads, device_ids, slots_per_device, copies)
        method = "EPLB (hierarchical)"
    else:
        copies = {}
        _pack_copies(list(range(experts)), loads, list(range(devices)), slots_per_device, copies)
        method = "EPLB (global)"
    return ExpertPlacement(devices, tuple(tuple(copies[e]) for e in range(experts)), method)


def balanced(
    loads: Sequence[float],
    devices: int,
    slots_per_device: int,
    cost: Callable[[ExpertPlacement], float] | None = None,
    devices_per_node: int | None = None,
    groups: int | None = None,
    evaluations: int | None = None,
) -> ExpertPlacement:
    """Our placement (see the module docstring): EPLB's copies with shares that minimise the
    busiest device's load, improved by swapping copies while ``cost`` falls (by default the
    busiest device's load), for at most ``evaluations`` placements (by default
    ``SEARCH_EVALUATIONS_PER_EXPERT`` per expert). Never worse under ``cost`` than EPLB's
    placement with those shares."""
    experts = len(loads)
    cost = cost or (lambda placement: max(placement.device_loads(loads)))
    start = eplb(loads, devices, slots_per_device, devices_per_node, groups)
    holders = [[d for d, _ in copies] for copies in start.replicas]
    best = best_shares(loads, holders, devices, "balanced")
    best_cost = cost(best)
    evaluations = SEARCH_EVALUATIONS_PER_EXPERT * experts if evaluations is None else evaluations
    improved = True
    while improved and evaluations > 0:
        improved = False
        device_loads = best.device_loads(loads)
        busiest = max(range(devices), key=lambda d: (device_loads[d], -d))
        for other in sorted(range(devices), key=lambda d: (device_loads[d], d)):
            if other == busiest or evaluations <= 0:
                continue
            for candidate in _swaps(holders, busiest, other):
                evaluations -= 1
                placement = best_shares(loads, candidate, devices, "balanced")
                value = cost(placement)
                if value < best_cost * (1 - 1e-9):
                    best, best_cost, holders, improved = placement, value, candidate, True
                    break
                if evaluations <= 0:
                    break
            if improved:
                break
    return best


def best_shares(loads: Sequence[float], holders: Sequence[Sequence[int]], devices: int, method: str) -> ExpertPlacement:
    """The shares of each expert's copies (on devices ``holders[e]``) that minimise the
    busiest device's load: a linear program (GLOP). An expert with one copy sends it all, so
    only experts with copies get variables (the others are constants of their device), and
    without any copies no program is needed."""
    fixed = [0.0] * devices  # load of the single-copy experts on each device
    copied = []
    for expert, devices_of in enumerate(holders):
        if len(devices_of) == 1:
            fixed[devices_of[0]] += loads[expert]
        else:
            copied.append(expert)
    if not copied:
        return ExpertPlacement(devices, tuple(((devices_of[0], 1.0),) for devices_of in holders), method)
    from ortools.linear_solver import pywraplp

    solver = pywraplp.Solver.CreateSolver("GLOP")
    peak = solver.NumVar(max(fixed), solver.infinity(), "peak")
    shares = {}
    terms: list[list] = [[] for _ in range(devices)]
    for expert in copied:
        variables = [solver.NumVar(0.0, 1.0, f"s_{expert}_{d}") for d in holders[expert]]
        solver.Add(sum(variables) == 1.0)
        shares[expert] = variables
        for device, variable in zip(holders[expert], variables):
            terms[device].append(loads[expert] * variable)
    for device in range(devices):
        if terms[device]:
            solver.Add(sum(terms[device]) + fixed[device] <= peak)
    solver.Minimize(peak)
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        raise RuntimeError("the share LP of an expert placement has no optimum; it always has one when loads are finite")
    replicas = []
    for expert, devices_of in enumerate(holders):
        if expert not in shares:
            replicas.append(((devices_of[0], 1.0),))
            continue
        values = [max(0.0, v.solution_value()) for v in shares[expert]]
        total = sum(values) or 1.0
        replicas.append(tuple((d, value / total) for d, value in zip(devices_of, values)))
    return ExpertPlacement(devices, tuple(replicas), method)


def load_balance(placement: ExpertPlacement, loads: Sequence[float]) -> tuple[float, float]:
    """(busiest device's load, its ratio to the mean device load)."""
    device_loads = placement.device_loads(loads)
    mean = sum(device_loads) / len(device_loads)
    return max(device_loads), (max(device_loads) / mean if mean else 1.0)


def _pack_copies(
    members: list[int], loads: Sequence[float], device_ids: list[int], slots_per_device: int,
    copies: dict[int, list[tuple[int, float]]],
) -> None:
    """Make copies of ``members`` to fill ``device_ids``' slots and pack them (EPLB); a device
    given two copies of one expert holds one copy with both shares."""
    counts = replica_counts([loads[e] for e in members], len(device_ids) * slots_per_device)
    items = [(member, count) for member, count in zip(members, counts) for _ in range(count)]
    weights = [loads[member] / count for member, count in items]
    for position, pack in enumerate(balanced_packing(weights, len(device_ids))):
        for index in pack:
            member, count = items[index]
            device = device_ids[position]
            held = copies.setdefault(member, [])
            existing = next((i for i, (d, _) in enumerate(held) if d == device), None)
            if existing is None:
                held.append((device, 1.0 / count))
            else:
                held[existing] = (device, held[existing][1] + 1.0 / count)


def _swaps(holders: list[list[int]], busiest: int, other: int) -> list[list[list[int]]]:
    """Placements with one copy on ``busiest`` exchanged with one on ``other`` (each device
    keeps its number of copies), never two copies of an expert on one device."""
    on_busiest = [e for e, devices in enumerate(holders) if busiest in devices]
    on_other = [e for e, devices in enumerate(holders) if other in devices]
    candidates = []
    for a in on_busiest:
        for b in on_other:
            if a == b or other in holders[a] or busiest in holders[b]:
                continue
            moved = [list(devices) for devices in holders]
            moved[a] = [other if d == busiest else d for d in moved[a]]
            moved[b] = [busiest if d == other else d for d in moved[b]]
            candidates.append(moved)
    return candidates


def _check_slots(experts: int, devices: int, slots_per_device: int) -> None:
    if devices < 1 or experts < 1:
        raise PlanningError(f"an expert placement needs experts and devices, got {experts} experts on {devices} devices")
    if devices * slots_per_device < experts:
        raise PlanningError(
            f"{devices} devices with {slots_per_device} expert slots each cannot hold {experts} experts; "
            f"give each device at least {-(-experts // devices)} slots"
        )
