"""The MoE-folding section of a plan: tensor parallelism beside expert parallelism.

Megatron-Core's "MoE parallel folding" (Liu et al. 2025, arXiv 2504.14960;
``megatron/core/parallel_state.py``, its expert groups): the attention and dense layers run
over ``TP x DP (x PP)`` and the MoE layers over ``ETP x EP x EDP (x PP)`` on the same ranks.
Here the mesh is ``(pp,) dp x tp``; the dense ops are laid out Megatron-style on ``tp``
(column/row-parallel, heads split), and every MoE layer is an ``expert_parallel``
``ExpertLayout`` on the folded axis ``dp*tp``: its ``dp x tp`` ranks, in mesh order, split
into expert-tensor-parallel groups of ``ETP = layout.tensor_parallel`` consecutive ranks,
expert-parallel groups of ``EP = placement.devices`` ranks ``ETP`` apart, and the
``EDP = dp x tp / (EP x ETP)`` copies of those (Megatron's order: ETP innermost, then EP,
then EDP).

Tokens between the two layouts: without sequence parallelism the dense part holds each dp
rank's tokens whole on every tp rank, and the MoE layer takes 1/tp of them on each (a local
slice) and all-gathers its output over tp; with it, the residual stream is already split on
the sequence over tp and nothing moves (``cost_model.moe_folding``).

Stored under the plan JSON key ``"moe-folding"`` as ``{"sequence_parallel": false}``.
Vocabulary layer: imports only the planner's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.errors import PlanFileError, one_line
from planner.expert_layouts import FOLDED_DP_TP, expert_axis_size

if TYPE_CHECKING:
    from planner.plans import Plan

JSON_KEY = "moe-folding"


@dataclass(frozen=True)
class MoeFoldingSection:
    """A folded MoE plan (module docstring); ``sequence_parallel``: the residual stream
    between blocks is split on the sequence over ``tp``."""

    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(
                f"field '{JSON_KEY}.sequence_parallel' must be true or false, got {one_line(repr(self.sequence_parallel))[:40]}"
            )

    def check(self, plan: "Plan") -> None:
        """Raise ``ValueError`` (one line naming the layer or field and the fix) unless the
        plan is folded: a mesh ``(pp,) dp x tp`` with tp > 1, and every MoE layer expert
        parallel on ``dp*tp`` with EP x ETP dividing its ranks and EP dividing its experts, and
        (``sharded_copies``) at least two expert-data-parallel copies to shard over."""
        names = tuple(name for name in plan.mesh.names if name != "pp")
        if names != ("dp", "tp") or plan.mesh.axis_size("tp") < 2:
            raise ValueError(
                f"field '{JSON_KEY}' needs a mesh of dp x tp (tp >= 2, optionally pp outermost), not {plan.mesh}; "
                f"plan with --mesh dp=..,tp=.. or drop the {JSON_KEY} section"
            )
        if not plan.expert_layouts:
            raise ValueError(f"field '{JSON_KEY}' needs MoE layers with expert layouts; this plan has none")
        ranks = expert_axis_size(plan.mesh, FOLDED_DP_TP)
        for layout in plan.expert_layouts:
            where = f"expert layout of {one_line(layout.module)[:80]!r}"
            if layout.mode != "expert_parallel" or layout.axis != FOLDED_DP_TP:
                raise ValueError(
                    f"{where} is {layout.mode} on {one_line(layout.axis)[:20]!r}; a folded plan runs every MoE layer "
                    f"expert parallel on {FOLDED_DP_TP!r}: set mode expert_parallel and axis {FOLDED_DP_TP!r}"
                )
            ep, etp = layout.placement.devices, layout.tensor_parallel
            if layout.experts % ep:
                raise ValueError(
                    f"{where}: its {layout.experts} experts do not split evenly over EP={ep} ranks; choose an EP that "
                    f"divides {layout.experts}"
                )
            if ranks % (ep * etp):
                raise ValueError(
                    f"{where}: EP={ep} x ETP={etp} = {ep * etp} does not divide the {ranks} ranks of dp x tp; "
                    f"choose EP and ETP whose product divides {ranks}"
                )
            if layout.sharded_copies and ranks // (ep * etp) < 2:
                raise ValueError(
                    f"{where} shards its experts over their expert-data-parallel copies, but EP={ep} x ETP={etp} "
                    f"leaves one copy of each on the {ranks} ranks of dp x tp; set sharded_copies to false"
                )

    def describe(self, plan: "Plan") -> str:
        """The words this section adds to the plan's name: ``"EP4 x ETP1 folded over dp x tp"``."""
        shapes = sorted({(layout.placement.devices, layout.tensor_parallel) for layout in plan.expert_layouts
                         if layout.placement is not None})
        folded = ", ".join(f"EP{ep} x ETP{etp}" for ep, etp in shapes)
        return f"{folded} folded over dp x tp" + ("; sequence parallel" if self.sequence_parallel else "")

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored under the plan's ``"moe-folding"`` key."""
        return {"sequence_parallel": self.sequence_parallel}

    @classmethod
    def from_json(cls, data: Any, source: str) -> "MoeFoldingSection":
        """The section stored under a plan file's ``"moe-folding"`` key, every field checked.

        Raises:
            PlanFileError: not an object, an unknown key, or a value of the wrong type; one
                line naming ``source`` and the field.
        """
        if not isinstance(data, dict):
            raise PlanFileError(
                f"{source}: field '{JSON_KEY}' must be a JSON object such as {{\"sequence_parallel\": false}}, "
                f"got {type(data).__name__}"
            )
        unknown = [key for key in data if key != "sequence_parallel"]
        if unknown:
            raise PlanFileError(
                f"{source}: field '{JSON_KEY}' has an unknown key {one_line(str(unknown[0]))[:40]!r}; its only key is "
                f"sequence_parallel"
            )
        try:
            return cls(data.get("sequence_parallel", False))
        except ValueError as error:
            raise PlanFileError(f"{source}: {error}") from None


def folding_of(plan) -> MoeFoldingSection | None:
    """``plan``'s folding section, or None for a plan that does not fold its MoE layers."""
    return getattr(plan, "sections", {}).get(JSON_KEY)
