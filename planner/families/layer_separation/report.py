"""Layer separation's lines of the report (vocabulary layer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.report_parts import Paragraph

if TYPE_CHECKING:
    from planner.plans import Plan


def layer_separation_section(plan: "Plan") -> list:
    """The report part of the ``layer-separation`` family (``planner.families``): the split,
    what crosses between the groups, and the gain over the best plan without it."""
    section = plan.sections["layer-separation"]
    trunks, heads, batch = section.trunk_ranks(plan), section.head_ranks, plan.batch_size
    head_reduce = (f"all-reduced among the {heads} head ranks only" if heads > 1
                   else "never reduced (one head rank holds them)")
    head_ranks = f"rank {trunks}" if heads == 1 else f"ranks {trunks}-{trunks + heads - 1}"
    text = (
        f"Layer separation (Stanza): ranks 0-{trunks - 1} run '{section.trunk}' (the convolutions, most of the "
        f"FLOPs) data parallel on {batch // trunks} samples each; {head_ranks} run the rest "
        f"(the fully connected layers, most of the weights) on {batch // heads} samples each. Activations cross "
        f"once each way per step; the trunk's gradients are all-reduced among the trunk ranks and the head's are "
        f"{head_reduce}, so the large fully connected gradients never cross the whole cluster."
    )
    rivals = [alternative for alternative in plan.runners_up
              if "layer separation" not in alternative.name and alternative.fits]
    if rivals:
        best = min(rivals, key=lambda alternative: alternative.step_time_s)
        gain = best.step_time_s / plan.estimate.step_time_s
        text += (f" Predicted gain over the best plan without it, {best.name} at {best.step_time_s:.4g} s: "
                 f"{gain:.2f}x ({plan.estimate.step_time_s:.4g} s per step).")
    return [Paragraph(text)]
