"""The first thing a report says: what was chosen and why, and what looks wrong.

``verdict(plan)`` is one paragraph: the strategy in words, the predicted step time,
throughput, MFU and memory headroom, and why it won against the runners-up (the faster plans
that do not fit, the next plan that does, the data-parallel and Megatron baselines).

``findings(plan)`` are the things a careful engineer would point out about the plan itself
(they are not warnings about the input, which live in ``plan.warnings``): a mesh axis on
which every op is replicated (those devices duplicate each other's work), a model far too
small for its cluster, and a close call (runners-up that fit predicted within
``CLOSE_CALL_MARGIN`` of the chosen plan, a margin at which the simulator's ranking is not
to be trusted). All read only the ``Plan``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.tensor import Replicate

from planner.strategy import KEEP_A2A, NORMS_MOE_ACT, expert_modes_summary
from planner.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from planner.plans import Plan

_FLAVOUR_WORDS = {
    "ddp": "DDP data parallelism (weights replicated, gradients all-reduced)",
    "zero1": "ZeRO-1 data parallelism (optimizer states sharded)",
    "zero2": "ZeRO-2 data parallelism (optimizer states and gradients sharded)",
    "fsdp": "FSDP data parallelism (weights, gradients and optimizer states sharded)",
}
# Below this MFU, with this little work per device, a cluster is mostly idle: the model
# (or its batch) is far too small for it.
TOO_SMALL_MFU = 0.02
TOO_SMALL_COMPUTE_S = 0.01
# Plans predicted closer than this are a toss-up for the simulator: on BigScience's published
# layout sweep of 17 configurations (``python benchmarks/fidelity_sweep.py``, its "pairs in
# the published order, by predicted margin"), pairs predicted within 3% of each other were in
# the published order 8 times of 18; 3-10% apart, 40 of 48; 10% or more, 66 of 70.
CLOSE_CALL_MARGIN = 0.03
CLOSE_CALLS_NAMED = 3  # runners-up named in the finding, at most


def plan_label(plan: "Plan") -> str:
    """The plan's name as the runners-up table spells it: ``zero2 (dp=16), recompute full``."""
    return f"{plan.name}{', recompute ' + plan.recompute if plan.recompute != 'none' else ''}"


# How the search reached a plan (a runner-up's "route"): not a parallelism family of
# ``planner.families`` (those say what a plan runs; a route is where the search found it).
ROUTES = ("data parallel", "Megatron grid", "searched, no pipeline", "searched pipeline", "MoE layouts")


def plan_route(plan: "Plan") -> str:
    """How the search reached ``plan``, one of ``ROUTES``: pure data parallelism
    (DDP, ZeRO, FSDP: no label), Megatron-LM's layouts (the pipeline grid's pp x dp x tp
    configurations and the Megatron baseline), or per-op shardings found by the search,
    without or with pipeline stages."""
    if plan.label == "megatron":
        return "Megatron grid"
    if plan.expert_layouts:
        return "MoE layouts"
    if plan.label:
        return "searched, no pipeline" if plan.pipeline is None else "searched pipeline"
    return "data parallel"


def _section_words(plan: "Plan") -> str:
    """The phrase a family section gives its plans in place of the flavour's
    (``strategy_words(plan)``: layer separation's groups), or ""."""
    return next((section.strategy_words(plan) for section in plan.sections.values()
                 if callable(getattr(section, "strategy_words", None))), "")


def strategy_words(plan: "Plan") -> str:
    """The strategy in a phrase: ``ZeRO-2 data parallelism (...) on all 16 GPUs (dp=16)``."""
    devices = _devices(plan)
    if plan.label == "megatron":
        names = plan.mesh.names
        kind = "tensor" if "tp" in names else "pipeline" if "pp" in names else "data"
        sequence = " with sequence parallelism" if plan.sequence_parallel else ""  # as Plan.name says
        text = f"Megatron-LM {kind} parallelism{sequence} on {devices} ({plan.mesh})"
    elif plan.label == "soap":
        split = sum(
            1 for placements in _parameter_placements(plan).values() if not all(isinstance(p, Replicate) for p in placements)
        )
        text = (
            f"per-op sharding chosen by the search on {devices} ({plan.mesh}), "
            f"{split} of {len(_parameter_placements(plan))} weights split"
        )
    elif plan.expert_layouts:
        text = (
            f"{_FLAVOUR_WORDS[plan.dp_flavour]} on all {devices} ({plan.mesh}), the {len(plan.expert_layouts)} "
            f"MoE layer(s) by layout: {expert_modes_summary(plan.expert_layouts)}"
        )
    elif _section_words(plan):
        text = _section_words(plan)
    else:
        text = f"{_FLAVOUR_WORDS[plan.dp_flavour]} on all {devices} ({plan.mesh})"
    composed = plan.label and not plan.expert_layouts  # an MoE plan's flavour is named above
    if composed and plan.dp_flavour != "ddp" and "dp" in plan.mesh.names and plan.mesh.axis_size("dp") > 1:
        text += f", {_FLAVOUR_WORDS[plan.dp_flavour].split(' (')[0]} on dp"  # composed with the other axes
    # A family section may add words (``verdict_words``; gradient compression: what replaces the all-reduce).
    text += "".join(f", {section.verdict_words(plan)}" for section in plan.sections.values()
                    if hasattr(section, "verdict_words"))
    # A section may name the pipeline itself (``pipeline_words``: stages of different widths).
    pipeline_words = next((section.pipeline_words(plan) for section in plan.sections.values()
                           if callable(getattr(section, "pipeline_words", None))), "")
    if pipeline_words:
        text += f", {pipeline_words}"
    elif plan.pipeline is not None:
        text += f", {plan.pipeline.stages} pipeline stages ({plan.pipeline.schedule}, {plan.pipeline.micro_batches} micro-batches)"
    if plan.accumulation_steps > 1:
        text += f", gradients accumulated over {plan.accumulation_steps} micro-batches"
    if plan.recompute == "full":
        text += ", every repeated block recomputed in backward"
    elif plan.recompute == KEEP_A2A:
        text += ", every repeated block recomputed in backward but its MoE layers' all-to-alls (outputs kept)"
    elif plan.recompute == "selective":
        text += ", attention recomputed in backward"
    elif plan.recompute == NORMS_MOE_ACT:
        text += ", each block's norms and the experts' activation function recomputed in backward"
    return text + f", {plan.precision}" + (" mixed precision" if plan.precision != "fp32" else "")


def verdict(plan: "Plan") -> str:
    """One paragraph: the choice, its predicted cost, and why it beat the others."""
    estimate = plan.estimate
    rate = f"{estimate.samples_per_s:,.1f} samples/s" + (
        f", {estimate.tokens_per_s:,.0f} tokens/s" if estimate.tokens_per_s else ""
    )
    memory = estimate.memory.total
    capacity = estimate.device_memory_bytes
    headroom = (
        f"{format_bytes(memory)} of {format_bytes(capacity)} per device ({format_bytes(capacity - memory)} to spare)"
        if estimate.fits
        else f"{format_bytes(memory)} per device, MORE than the {format_bytes(capacity)} a device has"
    )
    parts = [
        f"Chosen: {strategy_words(plan)}.",
        f"Predicted: {format_seconds(estimate.step_time_s)} per step ({rate})"
        + (f", MFU {estimate.mfu:.1%}" if estimate.model_flops else "")
        + f"; {headroom}.",
    ]
    why = _why(plan)
    if why:
        parts.append(f"Why: {why}.")
    return " ".join(parts)


def _why(plan: "Plan") -> str:
    alternatives = list(plan.runners_up)
    if not alternatives:
        return ""
    reasons = []
    faster = [alt for alt in alternatives if alt.step_time_s < plan.estimate.step_time_s and not alt.fits]
    if faster:
        quickest = min(faster, key=lambda alt: alt.step_time_s)
        reasons.append(
            f"{len(faster)} faster plan{'s' if len(faster) > 1 else ''} need{'' if len(faster) > 1 else 's'} more memory "
            f"than a device has (the fastest, {quickest.name}, {format_seconds(quickest.step_time_s)} per step, "
            f"needs {format_bytes(quickest.memory_bytes)})"
        )
    fitting = [alt for alt in alternatives if alt.fits and not alt.name.startswith("baseline ")]
    if fitting:
        nearest = min(fitting, key=lambda alt: alt.step_time_s)
        slower = nearest.step_time_s / plan.estimate.step_time_s - 1 if plan.estimate.step_time_s else 0.0
        reasons.append(f"the next plan that fits, {nearest.name}, is {slower:.1%} slower")
    megatron = [alt for alt in alternatives if alt.name.startswith("baseline megatron")]
    fitting_megatron = [alt for alt in megatron if alt.fits]
    if fitting_megatron:
        best = min(fitting_megatron, key=lambda alt: alt.step_time_s)
        slower = best.step_time_s / plan.estimate.step_time_s - 1 if plan.estimate.step_time_s else 0.0
        reasons.append(f"the best Megatron-LM baseline ({best.name.removeprefix('baseline ')}) is {slower:.1%} slower")
    elif megatron:
        reasons.append(f"the Megatron-LM baseline ({megatron[0].name.removeprefix('baseline ')}) does not fit")
    return "; ".join(reasons)


def findings(plan: "Plan") -> list[str]:
    """What looks wrong with the plan itself, one sentence each (see the module docstring)."""
    found = []
    for axis in _replicated_axes(plan):
        size = plan.mesh.axis_size(axis)
        found.append(
            f"every op is replicated on mesh axis '{axis}': its {size} ranks per group do the same work and hold the "
            f"same data, so {size - 1} of every {size} devices add nothing; the model is too small (or its batch too "
            f"small) to split over '{axis}'"
        )
    estimate = plan.estimate
    if estimate.model_flops and estimate.mfu < TOO_SMALL_MFU and estimate.compute_s < TOO_SMALL_COMPUTE_S:
        found.append(
            f"the model is far too small for this cluster: each device computes {format_seconds(estimate.compute_s)} per "
            f"step at MFU {estimate.mfu:.1%}, so fixed costs (launches, communication latency) dominate; plan it for "
            f"fewer devices, or a larger model or batch"
        )
    close = close_calls(plan)
    if close:
        named = ", ".join(f"{alt.name} ({alt.step_time_s / estimate.step_time_s - 1:+.1%})"
                          for alt in close[:CLOSE_CALLS_NAMED])
        more = f" and {len(close) - CLOSE_CALLS_NAMED} more" if len(close) > CLOSE_CALLS_NAMED else ""
        found.append(
            f"close call: {named}{more} {'fits' if len(close) == 1 else 'fit'} and {'is' if len(close) == 1 else 'are'} "
            f"predicted within {CLOSE_CALL_MARGIN:.0%} of this plan, closer than the simulator ranks reliably; before "
            f"a long run, measure this plan (launch.py --steps N --profile, then planner compare) and expect any of "
            f"these to be as fast"
        )
    return found


def close_calls(plan: "Plan") -> list:
    """Runners-up that fit and are predicted within ``CLOSE_CALL_MARGIN`` of the chosen
    plan's step time (slower or, when the chosen plan does not fit, faster), closest first."""
    chosen = plan.estimate.step_time_s
    if chosen <= 0:
        return []
    close = [alt for alt in plan.runners_up
             if alt.fits and alt.step_time_s > 0 and abs(alt.step_time_s / chosen - 1) <= CLOSE_CALL_MARGIN]
    return sorted(close, key=lambda alt: abs(alt.step_time_s / chosen - 1))


def _replicated_axes(plan: "Plan") -> list[str]:
    """Mesh axes (other than pp) on which no op splits or sums anything."""
    axes = []
    for index, axis in enumerate(plan.mesh.names):
        if axis == "pp" or plan.mesh.axis_size(axis) == 1 or not plan.strategies:
            continue
        if axis == "dp" and not plan.label:
            continue  # a data-parallel plan splits the batch over dp whatever its placements say
        if all(
            isinstance(placements[index], Replicate)
            for strategy in plan.strategies
            for placements in (*strategy.inputs, *strategy.outputs, *strategy.params.values())
            if placements is not None and len(placements) > index
        ):
            axes.append(axis)
    return axes


def _parameter_placements(plan: "Plan") -> dict:
    found: dict = {}
    for strategy in plan.strategies:
        for name, placements in strategy.params.items():
            found.setdefault(name, placements)
    return found


def _devices(plan: "Plan") -> str:
    kind = "GPUs" if plan.cluster.backend == "nccl" else "processes"
    return f"{plan.world_size} {kind}"
