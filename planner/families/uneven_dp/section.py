"""The uneven data-parallel section of a plan: how many samples of the global batch each rank
takes, and what the simulator predicted for each rank.

A plan with this section is a data-parallel plan on a mesh of ``dp`` alone (any flavour:
ddp, zero1, zero2, fsdp) whose ranks take uneven shares of the batch, in proportion to their
devices' speed and within their memory (``shares.balanced_shares``). Weights and their
sharding are the flavour's, unchanged; only the batch slices and the gradients' weights
differ: rank r's loss is scaled by ``b_r * dp / B`` before the flavour's averaging reduction,
so the reduced gradient is ``sum_r (b_r / B) * grad_r``, one device's gradient of the whole
batch. Stored under the plan JSON key ``"uneven"`` as ``{"shares": [...], "busy_s": [...],
"memory_bytes": [...]}`` (the last two: the prediction per rank, for the report; empty when
not simulated), and on a ZeRO-1 plan optionally ``"state_shares": [...]``: one integer weight
per rank, each rank's part of the flat vector of trainable parameters whose gradients it
reduces and whose optimizer states it holds (``state_shares.state_parts``), sized by its
memory rather than its speed (Cephalo).

Vocabulary layer: imports only the planner's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from planner.cluster import MAX_RANKS
from planner.errors import PlanFileError, one_line

if TYPE_CHECKING:
    from planner.plans import Plan

JSON_KEY = "uneven"
KEYS = ("shares", "busy_s", "memory_bytes", "state_shares")
# The largest state weight a plan may give a rank (the search writes weights summing to 1000).
MAX_STATE_WEIGHT = 10**6


@dataclass(frozen=True)
class UnevenSection:
    """Rank r of ``dp`` takes ``shares[r]`` consecutive samples of the global batch (rank 0
    the first); ``busy_s[r]`` and ``memory_bytes[r]`` are its predicted compute seconds and
    bytes (empty: not simulated); ``state_shares[r]``: rank r's weight in the split of the
    flat parameter vector whose gradients and optimizer states it holds (empty: the
    flavour's even split).

    Raises:
        ValueError: a share is not an integer from 1 to ``MAX_RANKS`` times the batch limit,
            or a prediction is not a finite non-negative number, or the lengths differ.
    """

    shares: tuple[int, ...]
    busy_s: tuple[float, ...] = ()
    memory_bytes: tuple[int, ...] = ()
    state_shares: tuple[int, ...] = ()
    # Node costs read the shares (costs.py prices the slowest rank's share): the simulator's
    # cache of node costs must not hand this plan the even plan's.
    changes_op_costs: ClassVar[bool] = True
    # Each rank cuts its own share into the plan's micro-batches (shares.micro_batch_sizes):
    # the global batch need not divide by dp x accumulation_steps (planner.plans).
    cuts_micro_batches: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "shares", tuple(self.shares) if isinstance(self.shares, (list, tuple)) else self.shares)
        shares = self.shares
        if not isinstance(shares, tuple) or not 2 <= len(shares) <= MAX_RANKS or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shares
        ):
            raise ValueError(
                f"field '{JSON_KEY}.shares' must be a list of 2 or more positive integers (samples per dp rank), "
                f"got {_shown(shares)}; give each rank at least one sample"
            )
        for key, kind in (("busy_s", float), ("memory_bytes", int)):
            values = tuple(getattr(self, key))
            if values and (len(values) != len(shares) or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf") for v in values
            )):
                raise ValueError(
                    f"field '{JSON_KEY}.{key}' must be empty or one finite non-negative number per share "
                    f"({len(shares)}), got {_shown(values)}; drop it and simulate the plan again"
                )
            object.__setattr__(self, key, tuple(kind(v) for v in values))
        weights = tuple(self.state_shares) if isinstance(self.state_shares, (list, tuple)) else None
        if weights is None or weights and (len(weights) != len(shares) or any(
            isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= MAX_STATE_WEIGHT for w in weights
        ) or sum(weights) == 0):
            raise ValueError(
                f"field '{JSON_KEY}.state_shares' must be empty or one integer from 0 to {MAX_STATE_WEIGHT} per share "
                f"({len(shares)}), some positive, got {_shown(self.state_shares)}; give each rank its weight"
            )
        object.__setattr__(self, "state_shares", weights)

    def check(self, plan: "Plan") -> None:
        """Raise ``ValueError`` (one line naming ``uneven.shares`` and the fix) unless this
        section fits ``plan``: a data-parallel plan on a mesh of ``dp`` alone, without
        pipeline, expert layouts or other sections, one share per dp rank, the shares summing
        to the plan's batch, each at least one sample per micro-batch."""
        if (plan.mesh.names != ("dp",) or plan.pipeline is not None or plan.expert_layouts
                or set(plan.sections) - {JSON_KEY} or plan.label):
            raise ValueError(
                f"field '{JSON_KEY}.shares' needs a data-parallel plan on a mesh of dp alone, without pipeline, "
                f"expert layouts or other sections, but the plan is {plan.name}; drop the uneven section"
            )
        dp = plan.mesh.axis_size("dp")
        if len(self.shares) != dp:
            raise ValueError(
                f"field '{JSON_KEY}.shares' has {len(self.shares)} shares for dp={dp} ranks; give one per rank"
            )
        if sum(self.shares) != plan.batch_size:
            raise ValueError(
                f"field '{JSON_KEY}.shares' sums to {sum(self.shares)}, not the plan's batch of {plan.batch_size}; "
                f"make the shares add up to the batch"
            )
        if min(self.shares) < plan.accumulation_steps:
            raise ValueError(
                f"field '{JSON_KEY}.shares' gives a rank {min(self.shares)} samples, fewer than the plan's "
                f"{plan.accumulation_steps} micro-batches (accumulation_steps); give every rank at least one sample "
                f"per micro-batch"
            )
        if self.state_shares and plan.dp_flavour != "zero1":
            raise ValueError(
                f"field '{JSON_KEY}.state_shares' needs the zero1 flavour (weights whole, states split), but the plan's "
                f"is {plan.dp_flavour}; drop state_shares or plan with --dp-flavour zero1"
            )

    def verdict_words(self, plan: "Plan") -> str:
        """The report's headline words for the shares (``planner.verdict``): the Chosen line
        of an uneven plan must not read as an even one."""
        words = f"batch shares {'/'.join(map(str, self.shares))} by device speed"
        if self.state_shares:
            words += f", optimizer states {'/'.join(map(str, self.state_shares))} by memory"
        return words

    def offsets(self) -> tuple[int, ...]:
        """The first sample of each rank's slice of the global batch."""
        starts, total = [], 0
        for share in self.shares:
            starts.append(total)
            total += share
        return tuple(starts)

    def describe(self, plan: "Plan") -> str:
        """The words this section adds to the plan's name, ``"uneven 6/6/3/3"``."""
        shown = "/".join(str(s) for s in self.shares[:8]) + ("/..." if len(self.shares) > 8 else "")
        states = "/".join(str(w) for w in self.state_shares[:8]) + ("/..." if len(self.state_shares) > 8 else "")
        return f"uneven {shown}" + (f", states {states}" if self.state_shares else "")

    def batch_text(self, plan: "Plan") -> str:
        """The report's batch line: the global batch and each rank's share of it."""
        return (f"global {plan.batch_size}, uneven over the data-parallel ranks: "
                f"{', '.join(str(share) for share in self.shares[:16])}{', ...' if len(self.shares) > 16 else ''}")

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored under the plan's ``"uneven"`` key."""
        data = {"shares": list(self.shares), "busy_s": list(self.busy_s), "memory_bytes": list(self.memory_bytes)}
        return {**data, "state_shares": list(self.state_shares)} if self.state_shares else data

    @classmethod
    def from_json(cls, data: Any, source: str) -> "UnevenSection":
        """The section stored under a plan file's ``"uneven"`` key, every field checked.

        Raises:
            PlanFileError: ``data`` is not an object, has an unknown key, lacks ``shares``,
                or a field is malformed; one line naming ``source`` and the field.
        """
        if not isinstance(data, dict):
            raise PlanFileError(
                f"{source}: field '{JSON_KEY}' must be a JSON object such as {{\"shares\": [6, 6, 3, 3]}}, "
                f"got {type(data).__name__}"
            )
        unknown = [key for key in data if key not in KEYS]
        if unknown:
            raise PlanFileError(
                f"{source}: field '{JSON_KEY}' has an unknown key {one_line(str(unknown[0]))[:40]!r}; "
                f"its keys are {', '.join(KEYS)}"
            )
        if "shares" not in data:
            raise PlanFileError(f"{source}: field '{JSON_KEY}.shares' is missing")
        for key in KEYS:
            if key in data and not isinstance(data[key], list):
                raise PlanFileError(f"{source}: field '{JSON_KEY}.{key}' must be a list, got {type(data[key]).__name__}")
        try:
            return cls(tuple(data["shares"]), tuple(data.get("busy_s", ())), tuple(data.get("memory_bytes", ())),
                       tuple(data.get("state_shares", ())))
        except ValueError as error:
            raise PlanFileError(f"{source}: {error}") from None


def _shown(value: Any) -> str:
    """``value`` as a message quotes it: one line, at most 40 characters."""
    return one_line(repr(value))[:40]
