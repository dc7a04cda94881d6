"""The devices a plan leaves idle, and why (vocabulary layer): the search's record, so the
report says it without searching again.

On a cluster of two or more kinds of device the search may choose a plan on the fastest
devices alone (uneven data parallelism's and the heterogeneous pipelines' candidates, as
Sailor chooses which GPUs to use at all). Its plan's ``cluster`` is then the sub-cluster it
runs on; ``Plan.left_out`` keeps what was cut off (device kinds and counts) and the best
plan the same search found that used every device (its name and predicted step), or none
when no such plan fit. Stored under the plan JSON key ``"left_out"`` only when set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.errors import PlanFileError, one_line
from planner.json_files import section_lists

if TYPE_CHECKING:
    from planner.plans import Plan

JSON_KEY = "left_out"
KEYS = ("devices", "cluster_ranks", "with_all", "with_all_step_s")


@dataclass(frozen=True)
class LeftOutDevices:
    """``devices``: ``(device name, ranks)`` of each kind of device the plan leaves idle;
    ``cluster_ranks``: the ranks of the whole cluster planned for; ``with_all``: the name of
    the best fitting plan that used every device ("" when none fit) and ``with_all_step_s``
    its predicted step seconds.

    Raises:
        ValueError: a malformed field; one line naming it.
    """

    devices: tuple[tuple[str, int], ...]
    cluster_ranks: int
    with_all: str = ""
    with_all_step_s: float = 0.0

    def __post_init__(self) -> None:
        devices = tuple(tuple(pair) if isinstance(pair, (list, tuple)) else pair for pair in self.devices)
        if not devices or any(
            not isinstance(pair, tuple) or len(pair) != 2 or not isinstance(pair[0], str) or not pair[0]
            or isinstance(pair[1], bool) or not isinstance(pair[1], int) or pair[1] < 1 for pair in devices
        ):
            raise ValueError(f"field '{JSON_KEY}.devices' must list [device name, ranks] pairs, got "
                             f"{_shown(self.devices)}; drop the field or plan again")
        object.__setattr__(self, "devices", devices)
        left = sum(count for _, count in devices)
        if isinstance(self.cluster_ranks, bool) or not isinstance(self.cluster_ranks, int) or self.cluster_ranks <= left:
            raise ValueError(f"field '{JSON_KEY}.cluster_ranks' must be an integer above the {left} ranks left out, "
                             f"got {_shown(self.cluster_ranks)}; drop the field or plan again")
        step = self.with_all_step_s
        if (not isinstance(self.with_all, str) or isinstance(step, bool) or not isinstance(step, (int, float))
                or not (0 <= step < math.inf) or bool(self.with_all) != (step > 0)):
            raise ValueError(f"field '{JSON_KEY}.with_all' must name a plan with a positive 'with_all_step_s', or "
                             f"both be empty, got {_shown(self.with_all)} at {_shown(step)}; drop the field or plan again")
        object.__setattr__(self, "with_all_step_s", float(step))

    def text(self, plan: "Plan") -> str:
        """The report's line: which devices are idle and why, against ``plan``'s own step."""
        idle = ", ".join(f"{count} {one_line(name)[:40]}" for name, count in self.devices)
        left = sum(count for _, count in self.devices)
        head = (f"{idle} of the {self.cluster_ranks} devices {'is' if left == 1 else 'are'} idle: this plan runs on "
                f"the other {self.cluster_ranks - left}")
        if not self.with_all:
            return f"{head}; no plan the search found on every device fits in memory"
        ours = plan.estimate.step_time_s
        ratio = f", {self.with_all_step_s / ours:.2f}x this plan's {ours * 1e3:.4g} ms" if ours > 0 else ""
        return (f"{head}; the best plan the search found using every device, {one_line(self.with_all)[:120]}, "
                f"is predicted at {self.with_all_step_s * 1e3:.4g} ms per step{ratio}")

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored under the plan's ``"left_out"`` key."""
        return {"devices": [list(pair) for pair in self.devices], "cluster_ranks": self.cluster_ranks,
                "with_all": self.with_all, "with_all_step_s": self.with_all_step_s}

    @classmethod
    def from_json(cls, data: Any, source: str) -> "LeftOutDevices":
        """The record stored under a plan file's ``"left_out"`` key, every field checked.

        Raises:
            PlanFileError: not an object, an unknown or missing key, or a malformed field;
                one line naming ``source`` and the field.
        """
        section_lists(data, source, JSON_KEY, KEYS, ("devices",), '{"devices": [["A100", 8]], "cluster_ranks": 16}',
                      PlanFileError)
        try:
            return cls(tuple(data["devices"]), data.get("cluster_ranks"), data.get("with_all", ""),
                       data.get("with_all_step_s", 0.0))
        except ValueError as error:
            raise PlanFileError(f"{source}: {error}") from None


def _shown(value: Any) -> str:
    """``value`` as a message quotes it: one line, at most 40 characters."""
    return one_line(repr(value))[:40]
