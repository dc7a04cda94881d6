"""Layer separation's section of a plan (Stanza): which module is the trunk, how many ranks
run the head.

Stanza (Wu et al., "Stanza: Layer Separation for Distributed Training in Deep Learning",
IEEE Trans. Services Computing 2020, arXiv:1812.10624): in a CNN most FLOPs are in the
convolutions and most weights (so most gradient bytes) in the fully connected layers. So
``T = world - H`` ranks run the convolutional trunk data parallel and ``H`` ranks run the
fully connected head: the trunk's activations go to the head ranks and their gradients come
back, the head's weights are reduced only among the head ranks and never cross the rest of
the cluster.

A layer-separation plan is a ``ddp`` plan on a mesh of ``dp`` alone plus this section,
stored under the plan JSON key ``"layer-separation"`` as ``{"trunk": "features",
"head_ranks": 1}``: ``trunk`` is the module path of the trunk (the module the model's first
input enters, whose output the head flattens), every other parameter is the head's.

Vocabulary layer: imports only the planner's vocabulary.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.errors import PlanFileError, one_line

if TYPE_CHECKING:
    from planner.plans import Plan

JSON_KEY = "layer-separation"
MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_0-9][A-Za-z0-9_]*)*")


@dataclass(frozen=True)
class LayerSeparationSection:
    """The trunk's module path and the ranks that run the head (module docstring).

    Raises:
        ValueError: ``trunk`` is not a dotted module path or ``head_ranks`` not a positive
            integer; one line. Whether they fit a plan is :meth:`check`'s question.
    """

    trunk: str
    head_ranks: int

    # The simulator's per-op costs of a plan with this section differ from its ddp plan's
    # (cost_model.simulation_cache.costing_key keys on sections that say so).
    changes_op_costs = True
    # What launch.py answers --checkpoint-dir and --init-from with (codegen.runtime.launcher).
    checkpoint_refusal = (
        "checkpoints are not written yet for layer separation: a trunk rank holds a stale copy of the head's "
        "weights and no optimizer states for them, so a checkpoint would save the wrong ones; run without "
        "--checkpoint-dir and --init-from, or compile a ddp plan of the model to checkpoint it"
    )

    def __post_init__(self) -> None:
        if not isinstance(self.trunk, str) or not MODULE_PATH.fullmatch(self.trunk) or len(self.trunk) > 200:
            raise ValueError(
                f"field '{JSON_KEY}.trunk' must be a module path such as 'features', got {one_line(repr(self.trunk))[:60]}"
            )
        heads = self.head_ranks
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ValueError(
                f"field '{JSON_KEY}.head_ranks' must be a positive integer (the ranks that run the head), "
                f"got {one_line(repr(heads))[:40]}"
            )

    def trunk_ranks(self, plan: "Plan") -> int:
        """The ranks that run the trunk: the others."""
        return plan.world_size - self.head_ranks

    def check(self, plan: "Plan") -> None:
        """Raise ``ValueError`` (one line with the fix) unless this section fits ``plan``: a
        ddp plan on ``dp`` alone without accumulation, pipeline or expert layouts, at least
        one trunk rank per head rank, the trunk ranks a multiple of the head ranks, the
        batch divisible by both, and ``trunk`` a module with parameters."""
        if (plan.dp_flavour != "ddp" or plan.mesh.names != ("dp",) or plan.pipeline is not None
                or plan.expert_layouts or plan.accumulation_steps != 1):
            raise ValueError(
                f"layer separation splits a ddp plan on a mesh of dp alone without gradient accumulation, but the "
                f"plan is {plan.name}; drop the layer-separation section or plan with --family layer-separation"
            )
        trunk, heads, batch = self.trunk_ranks(plan), self.head_ranks, plan.batch_size
        if trunk < heads or trunk % heads:
            raise ValueError(
                f"field '{JSON_KEY}.head_ranks' is {heads} of {plan.world_size} ranks, leaving {trunk} trunk ranks, "
                f"which is not a multiple of {heads}; choose head ranks H with (world - H) a multiple of H"
            )
        if batch % trunk or batch % heads:
            raise ValueError(
                f"the global batch of {batch} does not split evenly over {trunk} trunk ranks and {heads} head ranks; "
                f"use a batch that is a multiple of both (e.g. --set batch_size={_common_multiple(trunk, heads, batch)})"
            )
        graph = plan.graph
        if graph is not None and not any(name.startswith(self.trunk + ".") for name in graph.parameters):
            raise ValueError(
                f"field '{JSON_KEY}.trunk' is {self.trunk!r}, which holds no parameter of the model; give the "
                f"module path of its convolutional trunk"
            )

    def describe(self, plan: "Plan") -> str:
        """The words this section adds to the plan's name."""
        return f"layer separation: {self.trunk_ranks(plan)} trunk + {self.head_ranks} head"

    def strategy_words(self, plan: "Plan") -> str:
        """The report's "Chosen:" phrase."""
        return (f"layer separation (Stanza): '{self.trunk}' data parallel on {self.trunk_ranks(plan)} of "
                f"{plan.world_size} devices, the rest of the model on {self.head_ranks}")

    def batch_text(self, plan: "Plan") -> str:
        """The report's batch line: each group's share."""
        trunk, batch = self.trunk_ranks(plan), plan.batch_size
        return (f"global {batch}, {batch // trunk} per trunk rank, {batch // self.head_ranks} per head rank "
                f"(its trunk ranks' samples)")

    def strategy_text(self, plan: "Plan") -> str:
        """The report's strategy line, instead of the ddp flavour's."""
        trunk = self.trunk_ranks(plan)
        return (
            f"Layer separation (Stanza): '{self.trunk}' data parallel on {trunk} ranks (batch / {trunk} each), the "
            f"rest of the model on {self.head_ranks} rank(s), activations sent to them and their gradients back; "
            f"each part's gradients averaged among its own ranks only"
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored under the plan's ``"layer-separation"`` key."""
        return {"trunk": self.trunk, "head_ranks": self.head_ranks}

    @classmethod
    def from_json(cls, data: Any, source: str) -> "LayerSeparationSection":
        """The section stored under a plan file's ``"layer-separation"`` key, checked.

        Raises:
            PlanFileError: not an object, an unknown or missing key, or a bad value; one line.
        """
        if not isinstance(data, dict):
            raise PlanFileError(
                f"{source}: field '{JSON_KEY}' must be a JSON object such as "
                f"{{\"trunk\": \"features\", \"head_ranks\": 1}}, got {type(data).__name__}"
            )
        unknown = [key for key in data if key not in ("trunk", "head_ranks")]
        if unknown:
            raise PlanFileError(
                f"{source}: field '{JSON_KEY}' has an unknown key {one_line(str(unknown[0]))[:40]!r}; its keys are "
                f"trunk and head_ranks"
            )
        missing = [key for key in ("trunk", "head_ranks") if key not in data]
        if missing:
            raise PlanFileError(f"{source}: field '{JSON_KEY}.{missing[0]}' is missing")
        try:
            return cls(data["trunk"], data["head_ranks"])
        except ValueError as error:
            raise PlanFileError(f"{source}: {error}") from None


def _common_multiple(trunk: int, heads: int, batch: int) -> int:
    """The smallest multiple of both ``trunk`` and ``heads`` at least ``batch``."""
    step = math.lcm(trunk, heads)
    return -(-batch // step) * step
