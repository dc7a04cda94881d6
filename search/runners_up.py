"""The runners-up a searched plan carries, so its report can say why it won.

They are the next fastest plans the search considered, the best plan of every family it
considered (``planner.verdict.plan_family``: pure data parallelism, the Megatron grid, the
per-op search without pipelines) whatever its rank, and the Megatron-LM and data-parallel
baselines. Each is labelled by family with its step time, MFU, memory and why it lost.
"""

from __future__ import annotations

import dataclasses

from planner.plans import Plan
from planner.strategy import Alternative
from planner.verdict import FAMILIES, plan_family, plan_label
from search.data_parallel import alternative

RUNNERS_UP = 8


def family_best(plans: list[Plan]) -> Plan:
    """The fastest plan that fits, or, when none fits, the one nearest to fitting (least
    memory): the plan that speaks for its family."""
    return min(plans, key=lambda p: (not p.estimate.fits, p.estimate.step_time_s if p.estimate.fits else p.estimate.memory.total))


def runners_up(best: Plan, plans: list[Plan], baselines: list[Plan], count: int = RUNNERS_UP) -> tuple[Alternative, ...]:
    """``best``'s runners-up among ``plans`` (the searched ones) and ``baselines``: the
    ``count`` fastest, then the best of each family not already among them (the chosen
    plan speaks for its own family), then the fastest Megatron-LM baseline that fits (or
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
    for family in FAMILIES:
        members = [p for p in plans if plan_family(p) == family]
        if not members or plan_family(best) == family:
            continue
        leader = family_best(members)
        if all(p is not leader for _, p in labelled):
            labelled.append((plan_label(leader), leader))
    baselines = [p for p in baselines if p is not best]
    megatron = [p for p in baselines if p.label == "megatron"]
    if megatron:
        labelled.append((f"baseline {plan_label(family_best(megatron))}", family_best(megatron)))
    labelled += [(f"baseline {plan_label(p)}", p) for p in baselines if p.label != "megatron"][: max(0, count - len(labelled))]
    return tuple(dataclasses.replace(alternative(p, best), name=label) for label, p in labelled)
