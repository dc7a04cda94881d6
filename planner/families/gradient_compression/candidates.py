"""The compression families' candidates for the search (search layer): the ddp plans found,
again with PowerSGD or top-k on their buckets, kept only where they win.

Compression is lossy, so a compressed plan competes only where the simulator predicts it
faster than the best uncompressed plan found so far by more than ``MIN_PREDICTED_GAIN``
(unless the user asked for the family by ``--family``); the search summary says the gain,
or why no compression was kept. The uncompressed plans it is compared with are every plan
the families before it found (data parallel in all flavours, tensor parallel, pipelines),
each reducing its gradients in the plan's precision (bf16 under ``--precision bf16``: the
strongest uncompressed reduction) and overlapped with backward as they are simulated.
"""

from __future__ import annotations

import dataclasses

from cost_model.simulator import simulated
from planner.errors import PlanningError
from planner.families.gradient_compression.section import (
    COMPRESSIONS,
    HALF_REDUCE,
    POWERSGD,
    TOP_K,
    HalfReduceSection,
    PowerSgdSection,
    TopKSection,
)
from planner.plans import Plan
from search.context import SearchContext
from search.data_parallel import data_parallel_plan

# Settings searched: PowerSGD's paper trains with ranks 1 to 4 (Vogels et al. 2019, tables 3
# and 7: rank 2 for ResNet-18 on CIFAR-10, rank 4 for an LSTM); Deep Gradient Compression
# sends 0.1% of the gradients (Lin et al. ICLR 2018, section 3), ordinary top-k works use 1%.
POWERSGD_RANKS = (1, 4)
TOP_K_FRACTIONS = (0.01, 0.001)
# A lossy plan must beat the best uncompressed one by more than the simulator's typical error:
# benchmarks/fidelity.py's median error over 26 published runs is 8.5% (README, "Fidelity").
MIN_PREDICTED_GAIN = 0.10


def compressed_candidates(context: SearchContext) -> list[Plan]:
    """The candidates part of the ``powersgd``, ``top-k`` and ``half-reduce`` families
    (``planner.families``): each allowed setting on the ddp plans found on ``dp`` alone (or on
    a ddp plan built here when ``--family`` left ddp out), simulated; those predicted slower than the best
    uncompressed plan by less than ``MIN_PREDICTED_GAIN`` are dropped, unless ``--family``
    named the compression family. On gloo clusters only with ``--family``. A sentence for the
    search summary either way."""
    wanted = [name for name in (POWERSGD, TOP_K, HALF_REDUCE) if context.constraints.allows_family(name)]
    if not wanted or context.whole_batch_only or context.summa_only or context.cluster.world_size < 2:
        return []
    # On gloo (CPU) clusters, whose figures are placeholders and whose programs exist to be
    # checked against one device (which a lossy plan cannot pass), compression is tried only
    # when --family names it.
    if context.cluster.backend != "nccl" and context.constraints.families is None:
        return []
    bases = [plan for plan in context.found
             if plan.dp_flavour == "ddp" and not plan.label and plan.mesh.names == ("dp",) and not plan.sections
             and plan.accumulation_steps == 1 and plan.pipeline is None]
    if not bases:
        try:
            bases = [data_parallel_plan(context.graph, context.cluster, context.spec, context.model_name, "ddp",
                                        context.warnings, context.precision)]
        except PlanningError:
            return []
    sections = ([PowerSgdSection(rank) for rank in POWERSGD_RANKS] if POWERSGD in wanted else []) + (
        [TopKSection(fraction) for fraction in TOP_K_FRACTIONS] if TOP_K in wanted else []) + (
        # 16-bit reduction of an fp32 plan (a bf16 plan reduces in 16 bits already); bf16's hook needs NCCL.
        [HalfReduceSection(dtype) for dtype in ("fp16", "bf16")[:1 + (context.cluster.backend == "nccl")]]
        if HALF_REDUCE in wanted else [])
    plans = [simulated(dataclasses.replace(base, sections={**base.sections, _key(section): section}), context.graph)
             for base in bases for section in sections
             if not isinstance(section, HalfReduceSection) or base.precision == "fp32"]
    fitting = [plan for plan in plans if plan.estimate.fits]
    # Every uncompressed plan found so far (HSDP's, with a section of its own, included).
    uncompressed = [plan for plan in context.found if plan.estimate.fits and not set(plan.sections) & set(COMPRESSIONS)]
    # With --family leaving every uncompressed family out, the ddp plan built here still compares.
    uncompressed = uncompressed or [base for base in bases if base.estimate.fits]
    baseline = min(uncompressed, key=lambda plan: plan.estimate.step_time_s, default=None)
    asked = context.constraints.families is not None
    if not fitting:
        context.notes.append("gradient compression: no compressed ddp plan fits in memory")
        return []
    best = min(fitting, key=lambda plan: plan.estimate.step_time_s)
    if baseline is None:
        context.notes.append(f"gradient compression: {best.name} predicted {best.estimate.step_time_s * 1e3:.3g} ms "
                             f"a step, with no uncompressed plan to compare")
        return fitting
    gain = 1 - best.estimate.step_time_s / baseline.estimate.step_time_s
    compared = (f"best compressed {best.name} {best.estimate.step_time_s * 1e3:.3g} ms vs best uncompressed "
                f"{baseline.name} {baseline.estimate.step_time_s * 1e3:.3g} ms a step ({-gain:+.0%} step time)")
    if asked:
        context.notes.append(f"gradient compression (asked by --family): {compared}")
        return fitting
    kept = [plan for plan in fitting
            if plan.estimate.step_time_s < baseline.estimate.step_time_s * (1 - MIN_PREDICTED_GAIN)]
    if kept:
        context.notes.append(f"gradient compression pays: {compared}")
    else:
        context.notes.append(f"gradient compression not chosen: {compared}, below the {MIN_PREDICTED_GAIN:.0%} a lossy "
                             f"plan must gain")
    return kept


def _key(section) -> str:
    return {PowerSgdSection: POWERSGD, TopKSection: TOP_K, HalfReduceSection: HALF_REDUCE}[type(section)]
