"""HSDP's section of a plan: how many ranks share one copy of the weights.

Hybrid sharding (HSDP) is FSDP2 on a 2-D ``replicate x shard`` mesh made of the plan's
``dp`` ranks: each group of ``shard`` consecutive ranks (inside one node) holds one copy of
the weights, gradients and optimizer states, sharded among its ranks; the
``replicate = dp / shard`` groups hold equal copies. Forward and backward all-gather
weights inside a group; gradients are reduce-scattered inside it and all-reduced across
groups, so only 1/shard of the gradients crosses the slower links between nodes.

A HSDP plan is an ``fsdp`` plan on a mesh of ``dp`` alone (its batch split, FSDP units
and recomputation are the fsdp plan's) plus this section, stored under the plan JSON key
``"hsdp"`` as ``{"shard": s}``.

Vocabulary layer: imports only the planner's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.cluster import MAX_RANKS
from planner.errors import PlanFileError, one_line

if TYPE_CHECKING:
    from planner.plans import Plan

JSON_KEY = "hsdp"
FIELD = "hsdp.shard"


@dataclass(frozen=True)
class HsdpSection:
    """The ranks of one shard group: ``shard`` ranks hold one sharded copy of the model,
    the plan's ``dp`` ranks hold ``dp / shard`` copies (see the module docstring).

    Raises:
        ValueError: ``shard`` is not an integer from 2 to ``MAX_RANKS`` (a bool neither);
            whether it fits a plan is :meth:`check`'s question.
    """

    shard: int

    def __post_init__(self) -> None:
        shard = self.shard
        if isinstance(shard, bool) or not isinstance(shard, int) or not 2 <= shard <= MAX_RANKS:
            raise ValueError(
                f"field '{FIELD}' must be an integer from 2 to {MAX_RANKS} (the ranks of one shard group), "
                f"got {_shown(shard)}; give the devices that share one copy of the weights, e.g. a node's"
            )

    def check(self, plan: "Plan") -> None:
        """Raise ``ValueError`` (one line naming ``hsdp.shard`` and the fix) unless this
        section fits ``plan``: an ``fsdp`` plan on a mesh of ``dp`` alone (no pipeline, no
        expert layouts) whose dp size ``shard`` divides without equalling it, on a cluster
        whose every node holds whole shard groups."""
        if plan.dp_flavour != "fsdp" or plan.mesh.names != ("dp",) or plan.pipeline is not None or plan.expert_layouts:
            raise ValueError(
                f"field '{FIELD}' needs an fsdp plan on a mesh of dp alone, without pipeline or expert layouts, "
                f"but the plan is {plan.name}; drop the hsdp section or plan with --dp fsdp"
            )
        dp = plan.mesh.axis_size("dp")
        if self.shard == dp:
            raise ValueError(
                f"field '{FIELD}' is {self.shard}, all the dp={dp} ranks: that is plain fsdp; drop the hsdp section "
                f"or choose a divisor of {dp} below it"
            )
        if dp % self.shard:
            raise ValueError(
                f"field '{FIELD}' is {self.shard}, which does not divide dp={dp} into whole shard groups; "
                f"choose a divisor of {dp}"
            )
        per_node = plan.cluster.min_devices_per_node
        if per_node % self.shard:
            raise ValueError(
                f"field '{FIELD}' is {self.shard} but the smallest node of cluster {one_line(repr(plan.cluster.name))[:60]} has "
                f"{per_node} device(s), so a shard group would span nodes; choose a divisor of {per_node}"
            )

    def replicate(self, plan: "Plan") -> int:
        """The number of shard groups: copies of the weights over ``plan``'s dp ranks."""
        return plan.mesh.axis_size("dp") // self.shard

    def describe(self, plan: "Plan") -> str:
        """The words this section adds to the plan's name, ``"hsdp 2 x 2"`` (replicate x shard)."""
        return f"hsdp {self.replicate(plan)} x {self.shard}"

    def strategy_text(self, plan: "Plan") -> str:
        """The report's strategy line for ``plan``, instead of its fsdp flavour's."""
        return (
            f"HSDP: FSDP inside each group of {self.shard} consecutive dp ranks (weights, gradients and optimizer "
            f"states sharded over the group, weights all-gathered per unit), {self.replicate(plan)} copies across "
            f"the groups, gradient shards all-reduced across them"
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored under the plan's ``"hsdp"`` key."""
        return {"shard": self.shard}

    @classmethod
    def from_json(cls, data: Any, source: str) -> "HsdpSection":
        """The section stored under a plan file's ``"hsdp"`` key, every field checked.

        Raises:
            PlanFileError: ``data`` is not an object, has a key other than ``shard``, or
                ``shard`` is missing or not an integer from 2 to ``MAX_RANKS``; one line
                naming ``source`` and the field.
        """
        if not isinstance(data, dict):
            raise PlanFileError(
                f"{source}: field '{JSON_KEY}' must be a JSON object such as {{\"shard\": 2}}, got {type(data).__name__}"
            )
        unknown = [key for key in data if key != "shard"]
        if unknown:
            raise PlanFileError(
                f"{source}: field '{JSON_KEY}' has an unknown key {one_line(unknown[0])[:40]!r}; its only key is shard"
            )
        if "shard" not in data:
            raise PlanFileError(f"{source}: field '{FIELD}' is missing")
        try:
            return cls(data["shard"])
        except ValueError as error:
            raise PlanFileError(f"{source}: {error}") from None


def _shown(value: Any) -> str:
    """``value`` as a message quotes it: one line, at most 40 characters (an integer too long
    to print is named as one)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    return one_line(repr(value))[:40]
