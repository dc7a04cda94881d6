"""The runners-up a searched plan carries, so its report can say why it won.

They are the next fastest plans the search considered, the best plan of every route it
reached plans by (``planner.verdict.plan_route``: pure data parallelism, the Megatron grid,
the per-op search without or with pipelines, MoE layouts) whatever its rank, and the
Megatron-LM and data-parallel baselines. Each is labelled by its route with its step time,
MFU, memory and why it lost.
"""

from __future__ import annotations

import dataclasses

from planner.plans import Plan
from planner.strategy import Alternative
from planner.verdict import ROUTES, plan_label, plan_route
from search.data_parallel import alternative

RUNNERS_UP = 8


def route_best(plans: list[Plan]) -> Plan:
    """The fastest plan that fits, or, when none fits, the one nearest to fitting (least
    memory): the plan that speaks for its route."""
    return min(plans, key=lambda p: (not p.estimate.fits, p.estimate.step_time_s if p.estimate.fits else p.estimate.memory.total))


def runners_up(best: Plan, plans: list[Plan], baselines: list[Plan], count: int = RUNNERS_UP) -> tuple[Alternative, ...]:
    """``best``'s runners-up among ``plans`` (the searched ones) and ``baselines``: the
    ``count`` fastest, then the best of each route not already among them (the chosen
    plan speaks for its own route), then the fastest Megatron-LM baseline that fits (or
    the one nearest to fitting), then data-parallel baselines while fewer than ``count``
    rows are listed."""
    fitting_names = {p.name for p in plans if p.recompute == "none" and p.estimate.fits}
    # A recomputing variant is worth a row only when the plan without recomputation does not
    # fit; otherwise it is the same plan, slower.
    others = sorted(
        (p for p in plans if p is not best and not (p.recompute != "none" and p.name in fitting_names)),
        key=lambda p: p.estimate.step_time_s,
    )
    labelled = [(plan_label(p), p) for p in others[:count]]
    for route in ROUTES:
        members = [p for p in plans if plan_route(p) == route]
        if not members or plan_route(best) == route:
            continue
        leader = route_best(members)
        if all(p is not leader for _, p in labelled):
            labelled.append((plan_label(leader), leader))
    baselines = [p for p in baselines if p is not best]
    megatron = [p for p in baselines if p.label == "megatron"]
    if megatron:
        labelled.append((f"baseline {plan_label(route_best(megatron))}", route_best(megatron)))
    labelled += [(f"baseline {plan_label(p)}", p) for p in baselines if p.label != "megatron"][: max(0, count - len(labelled))]
    return tuple(dataclasses.replace(alternative(p, best), name=label) for label, p in labelled)
