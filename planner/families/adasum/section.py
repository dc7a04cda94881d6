"""Adasum's section of a plan: how many ranks average inside a node before Adasum combines.

Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021;
Horovod's ``op=hvd.Adasum``) replaces data parallelism's gradient average by a combination
that adapts to how much two gradients agree:

    adasum(g1, g2) = (1 - g1.g2 / (2 |g1|^2)) g1 + (1 - g1.g2 / (2 |g2|^2)) g2

(equal gradients give their average, orthogonal ones their sum), applied recursively over
pairs of ranks, so the number of combined copies must be a power of two. On a mesh whose
nodes hold several ranks it is hierarchical, as Horovod runs it on GPUs: the ``local``
ranks of a node average their gradients first, then the ``dp / local`` node copies are
combined by Adasum across the nodes.

An Adasum plan is a ``ddp`` plan on a mesh of ``dp`` alone plus this section, stored under
the plan JSON key ``"adasum"`` as ``{"local": k}`` (1: no averaging inside nodes).

Vocabulary layer: imports only the planner's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.cluster import MAX_RANKS
from planner.errors import PlanFileError, one_line

if TYPE_CHECKING:
    from planner.plans import Plan

JSON_KEY = "adasum"
FIELD = "adasum.local"


def is_power_of_two(count: int) -> bool:
    """Whether ``count`` is 1, 2, 4, 8, ...: the copies Adasum's pairwise tree can combine."""
    return count >= 1 and count & (count - 1) == 0


@dataclass(frozen=True)
class AdasumSection:
    """``local`` consecutive ranks (one node's) average their gradients; the ``dp / local``
    averages are combined by Adasum (module docstring).

    Raises:
        ValueError: ``local`` is not an integer from 1 to ``MAX_RANKS`` (a bool neither);
            whether it fits a plan is :meth:`check`'s question.
    """

    local: int = 1

    # What launch.py --check answers (codegen.runtime.launcher): there is no one-device step to match.
    parity_refusal = (
        "--check compares with one device's step, but Adasum combines the ranks' gradients instead of averaging "
        "them, so the step differs by design; run --steps N (tests/test_adasum.py checks the rule against its "
        "single-process reference)"
    )

    def __post_init__(self) -> None:
        local = self.local
        if isinstance(local, bool) or not isinstance(local, int) or not 1 <= local <= MAX_RANKS:
            raise ValueError(
                f"field '{FIELD}' must be an integer from 1 to {MAX_RANKS} (the ranks averaged inside a node), "
                f"got {one_line(repr(local))[:40]}; give 1, or the devices of one node"
            )

    def check(self, plan: "Plan") -> None:
        """Raise ``ValueError`` (one line naming the problem and the fix) unless this section
        fits ``plan``: a ``ddp`` plan on a mesh of ``dp`` alone (no pipeline, no expert
        layouts), ``local`` dividing the smallest node's devices and ``dp``, and a power of
        two of Adasum copies (``dp / local``)."""
        if plan.dp_flavour != "ddp" or plan.mesh.names != ("dp",) or plan.pipeline is not None or plan.expert_layouts:
            raise ValueError(
                f"Adasum combines the gradients of a ddp plan on a mesh of dp alone, but the plan is {plan.name}; "
                "drop the adasum section or plan with --family adasum alone"
            )
        dp = plan.mesh.axis_size("dp")
        per_node = plan.cluster.min_devices_per_node
        if dp % self.local or per_node % self.local:
            raise ValueError(
                f"field '{FIELD}' is {self.local}, which does not divide dp={dp} and the {per_node} device(s) of a "
                f"node; choose 1 or a divisor of both"
            )
        copies = dp // self.local
        if copies < 2 or not is_power_of_two(copies):
            raise ValueError(refusal(dp, self.local))

    def copies(self, plan: "Plan") -> int:
        """How many gradients Adasum combines: one per group of ``local`` ranks."""
        return plan.mesh.axis_size("dp") // self.local

    def describe(self, plan: "Plan") -> str:
        """The words this section adds to the plan's name."""
        return "adasum" if self.local == 1 else f"adasum {self.copies(plan)} nodes x avg {self.local}"

    def strategy_text(self, plan: "Plan") -> str:
        """The report's strategy line for ``plan``, instead of its ddp flavour's."""
        inside = (f"gradients averaged inside each group of {self.local} ranks of a node, then " if self.local > 1
                  else "")
        return (
            f"Adasum data parallelism: weights replicated over dp={plan.mesh.axis_size('dp')}, {inside}the "
            f"{self.copies(plan)} gradients combined pairwise by Adasum (recursive doubling), tensor by tensor"
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored under the plan's ``"adasum"`` key."""
        return {"local": self.local}

    @classmethod
    def from_json(cls, data: Any, source: str) -> "AdasumSection":
        """The section stored under a plan file's ``"adasum"`` key, every field checked.

        Raises:
            PlanFileError: ``data`` is not an object, has a key other than ``local``, or
                ``local`` is missing or not an integer from 1 to ``MAX_RANKS``; one line.
        """
        if not isinstance(data, dict):
            raise PlanFileError(
                f"{source}: field '{JSON_KEY}' must be a JSON object such as {{\"local\": 1}}, got {type(data).__name__}"
            )
        unknown = [key for key in data if key != "local"]
        if unknown:
            raise PlanFileError(
                f"{source}: field '{JSON_KEY}' has an unknown key {one_line(str(unknown[0]))[:40]!r}; its only key is local"
            )
        if "local" not in data:
            raise PlanFileError(f"{source}: field '{FIELD}' is missing")
        try:
            return cls(data["local"])
        except ValueError as error:
            raise PlanFileError(f"{source}: {error}") from None


def refusal(dp: int, local: int) -> str:
    """The one line that refuses Adasum over ``dp`` ranks averaged ``local`` at a time."""
    copies = dp // local
    below = 1 << (copies.bit_length() - 1) if copies >= 1 else 1
    where = f"{copies} nodes" if local > 1 else f"{dp} ranks"
    return (
        f"Adasum combines gradients pairwise, so it needs a power of two of copies (2, 4, 8, ...), but this plan "
        f"has {where}; use {max(below, 2) * local} devices, or another data-parallel family"
    )
