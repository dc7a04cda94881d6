"""The gradient-compression sections of a plan: PowerSGD, top-k with error feedback, and
fp32 gradients all-reduced in 16 bits.

A compressed plan is a ``ddp`` plan on a mesh of ``dp`` alone (no pipeline, no expert
layouts, no gradient accumulation) whose DDP all-reduce of each gradient bucket is replaced by
a DDP communication hook (``DistributedDataParallel.register_comm_hook``):

- ``"powersgd"``: ``{"rank": r, "warm_start": bool, "error_feedback": bool}``, PyTorch's
  ``powerSGD_hook`` with a ``PowerSGDState`` (Vogels et al., "PowerSGD: Practical Low-Rank
  Gradient Compression for Distributed Optimization", NeurIPS 2019): each gradient matrix
  M (n x m) is sent as two all-reduced factors P (n x r) and Q (m x r).
- ``"top-k"``: ``{"fraction": f, "error_feedback": bool}``, our own hook
  (``planner.families.gradient_compression.runtime``): each bucket sends its ``ceil(f n)``
  largest-magnitude entries, values and indices all-gathered (Aji & Heafield 2017; Lin et
  al., "Deep Gradient Compression", ICLR 2018, for the error feedback).
- ``"half-reduce"``: ``{"dtype": "fp16" | "bf16"}``, PyTorch's ``fp16_compress_hook`` or
  ``bf16_compress_hook`` on an fp32 plan (a bf16 plan reduces in 16 bits already).

Both are lossy: a compressed step is not the uncompressed one, so parity with one device
cannot hold (``--check`` refuses such a program and points to the convergence benchmark).
ZeRO and FSDP reduce-scatter gradients inside FSDP2/ZeRO machinery that takes no DDP
hook, so a compressed plan must be ``ddp``: the others are refused in one line.

Vocabulary layer: imports only the planner's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.errors import PlanFileError, one_line

if TYPE_CHECKING:
    from planner.plans import Plan

POWERSGD, TOP_K, HALF_REDUCE = "powersgd", "top-k", "half-reduce"
COMPRESSIONS = (POWERSGD, TOP_K, HALF_REDUCE)
MAX_POWERSGD_RANK = 64  # beyond this the factors of a 4096-wide layer save little (r(n+m) vs nm)


def check_compressible(plan: "Plan", key: str) -> None:
    """Raise ``ValueError`` in one line naming section ``key`` and the fix unless ``plan`` is
    a ``ddp`` plan on a ``dp`` mesh of two or more ranks, without pipeline, expert layouts or
    gradient accumulation, and with no other compression section."""
    if plan.dp_flavour != "ddp":
        raise ValueError(
            f"field '{key}' compresses DDP's gradient all-reduce, but the plan is {plan.dp_flavour}: ZeRO and FSDP "
            f"reduce gradients in FSDP2/ZeRO code that takes no DDP communication hook; plan with --dp ddp or drop "
            f"the {key} section"
        )
    if plan.mesh.names != ("dp",) or plan.mesh.axis_size("dp") < 2 or plan.pipeline is not None or plan.expert_layouts:
        raise ValueError(
            f"field '{key}' needs a ddp plan on a mesh of dp alone (2 ranks or more), without pipeline or expert "
            f"layouts, but the plan is {plan.name}; drop the {key} section"
        )
    if plan.accumulation_steps != 1:
        raise ValueError(
            f"field '{key}' compresses one all-reduce per step, but the plan accumulates "
            f"{plan.accumulation_steps} micro-batches; drop the {key} section or the accumulation"
        )
    others = [name for name in plan.sections if name in COMPRESSIONS and name != key]
    if others:
        raise ValueError(f"field '{key}' and field '{others[0]}' both compress the gradients; keep one of them")


def _flag(data: dict, key: str, field: str, source: str, default: bool) -> bool:
    value = data.get(field, default)
    if not isinstance(value, bool):
        raise PlanFileError(f"{source}: field '{key}.{field}' must be true or false, got {one_line(repr(value))[:40]}")
    return value


def _object(data: Any, key: str, source: str, fields: tuple[str, ...], example: str) -> dict:
    if not isinstance(data, dict):
        raise PlanFileError(f"{source}: field '{key}' must be a JSON object such as {example}, got {type(data).__name__}")
    unknown = [name for name in data if name not in fields]
    if unknown:
        raise PlanFileError(
            f"{source}: field '{key}' has an unknown key {one_line(str(unknown[0]))[:40]!r}; its keys are "
            f"{', '.join(fields)}"
        )
    return data


@dataclass(frozen=True)
class PowerSgdSection:
    """PowerSGD on every DDP bucket (module docstring).

    Attributes:
        rank: the rank r of the factors P (n x r) and Q (m x r) of each gradient matrix.
        warm_start: reuse last step's Q as this step's starting point (``PowerSGDState``'s
            ``warm_start``; else Q is drawn afresh each step).
        error_feedback: add what compression dropped last step to this step's gradient
            (``use_error_feedback``): one buffer of every compressed gradient's size.

    Raises:
        ValueError: ``rank`` is not an integer from 1 to ``MAX_POWERSGD_RANK`` or a flag
            is not a bool.
    """

    rank: int
    warm_start: bool = True
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= MAX_POWERSGD_RANK:
            raise ValueError(
                f"field '{POWERSGD}.rank' must be an integer from 1 to {MAX_POWERSGD_RANK}, got "
                f"{one_line(repr(self.rank))[:40]}; PowerSGD's paper uses 1 to 4"
            )
        for name in ("warm_start", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"field '{POWERSGD}.{name}' must be true or false, got {one_line(repr(getattr(self, name)))[:40]}")

    def check(self, plan: "Plan") -> None:
        """One line (``ValueError``) unless ``plan`` can carry a DDP hook (``check_compressible``)."""
        check_compressible(plan, POWERSGD)

    def describe(self, plan: "Plan") -> str:
        """``"powersgd rank 2"`` (and what is off)."""
        off = [name for name, on in (("no warm start", self.warm_start), ("no error feedback", self.error_feedback)) if not on]
        return ", ".join([f"powersgd rank {self.rank}", *off])

    def verdict_words(self, plan: "Plan") -> str:
        """The report's headline words for the compression (``planner.verdict``)."""
        return f"gradients compressed by PowerSGD rank {self.rank} (lossy)"

    def strategy_text(self, plan: "Plan") -> str:
        """The report's strategy line."""
        return (
            f"DDP with PowerSGD gradient compression (rank {self.rank}): each gradient matrix all-reduced as two "
            f"rank-{self.rank} factors, vectors uncompressed"
            + (", error feedback" if self.error_feedback else ", no error feedback")
            + (", warm start" if self.warm_start else "")
        )

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "warm_start": self.warm_start, "error_feedback": self.error_feedback}

    @classmethod
    def from_json(cls, data: Any, source: str) -> "PowerSgdSection":
        """The section under a plan file's ``"powersgd"`` key; ``PlanFileError`` in one line."""
        data = _object(data, POWERSGD, source, ("rank", "warm_start", "error_feedback"), '{"rank": 2}')
        if "rank" not in data:
            raise PlanFileError(f"{source}: field '{POWERSGD}.rank' is missing")
        warm = _flag(data, POWERSGD, "warm_start", source, True)
        feedback = _flag(data, POWERSGD, "error_feedback", source, True)
        try:
            return cls(data["rank"], warm, feedback)
        except ValueError as error:
            raise PlanFileError(f"{source}: {error}") from None


@dataclass(frozen=True)
class TopKSection:
    """Top-k sparsification of every DDP bucket (module docstring).

    Attributes:
        fraction: the share of a bucket's entries sent, in (0, 0.5] (above half, values and
            indices weigh more than the dense bucket).
        error_feedback: keep what was not sent and add it to the next step's gradient.

    Raises:
        ValueError: ``fraction`` is not a number in (0, 0.5], or the flag is not a bool.
    """

    fraction: float
    error_feedback: bool = True

    def __post_init__(self) -> None:
        value = self.fraction
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 0.5:
            raise ValueError(
                f"field '{TOP_K}.fraction' must be a number in (0, 0.5], got {one_line(repr(value))[:40]}; "
                f"e.g. 0.01 sends the largest 1% of each bucket"
            )
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"field '{TOP_K}.error_feedback' must be true or false, got {one_line(repr(self.error_feedback))[:40]}")

    def check(self, plan: "Plan") -> None:
        """One line (``ValueError``) unless ``plan`` can carry a DDP hook (``check_compressible``)."""
        check_compressible(plan, TOP_K)

    def describe(self, plan: "Plan") -> str:
        """``"top-k 1%"`` (and what is off)."""
        return f"top-k {self.fraction * 100:g}%" + ("" if self.error_feedback else ", no error feedback")

    def verdict_words(self, plan: "Plan") -> str:
        """The report's headline words for the compression (``planner.verdict``)."""
        return f"gradients sparsified to their top {self.fraction * 100:g}%, values and indices all-gathered (lossy)"

    def strategy_text(self, plan: "Plan") -> str:
        """The report's strategy line."""
        return (
            f"DDP with top-k gradient sparsification: each bucket's largest {self.fraction * 100:g}% entries "
            f"(values and indices) all-gathered"
            + (", the rest kept as error feedback for the next step" if self.error_feedback else ", no error feedback")
        )

    def to_json(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "error_feedback": self.error_feedback}

    @classmethod
    def from_json(cls, data: Any, source: str) -> "TopKSection":
        """The section under a plan file's ``"top-k"`` key; ``PlanFileError`` in one line."""
        data = _object(data, TOP_K, source, ("fraction", "error_feedback"), '{"fraction": 0.01}')
        if "fraction" not in data:
            raise PlanFileError(f"{source}: field '{TOP_K}.fraction' is missing")
        feedback = _flag(data, TOP_K, "error_feedback", source, True)
        try:
            return cls(data["fraction"], feedback)
        except ValueError as error:
            raise PlanFileError(f"{source}: {error}") from None


@dataclass(frozen=True)
class HalfReduceSection:
    """An fp32 plan's gradient buckets all-reduced in 16 bits: PyTorch's
    ``default_hooks.fp16_compress_hook`` or ``bf16_compress_hook`` (cast the bucket, all-reduce
    it, cast the average back). Half the bytes of an fp32 reduction, rounded to 16 bits.

    Attributes:
        dtype: ``"fp16"`` or ``"bf16"`` (bf16's hook needs NCCL: refused on gloo clusters).

    Raises:
        ValueError: ``dtype`` is neither.
    """

    dtype: str = "fp16"

    def __post_init__(self) -> None:
        if self.dtype not in ("fp16", "bf16"):
            raise ValueError(f"field '{HALF_REDUCE}.dtype' must be 'fp16' or 'bf16', got {one_line(repr(self.dtype))[:40]}")

    def check(self, plan: "Plan") -> None:
        """One line (``ValueError``) unless ``plan`` can carry a DDP hook, is an fp32 plan (a
        bf16 plan's gradients are reduced in 16 bits already) and, for bf16, runs on NCCL."""
        check_compressible(plan, HALF_REDUCE)
        if plan.precision != "fp32":
            raise ValueError(
                f"field '{HALF_REDUCE}' halves an fp32 reduction, but the plan's precision is {plan.precision}, "
                f"whose gradients are reduced in 16 bits already; drop the {HALF_REDUCE} section"
            )
        if self.dtype == "bf16" and plan.cluster.backend != "nccl":
            raise ValueError(
                f"field '{HALF_REDUCE}.dtype' is bf16, whose PyTorch hook needs NCCL, but the cluster runs "
                f"{plan.cluster.backend}; use fp16"
            )

    def describe(self, plan: "Plan") -> str:
        """``"grads reduced in fp16"``."""
        return f"grads reduced in {self.dtype}"

    def verdict_words(self, plan: "Plan") -> str:
        """The report's headline words for the compression (``planner.verdict``)."""
        return f"gradients all-reduced in {self.dtype} (rounded)"

    def strategy_text(self, plan: "Plan") -> str:
        """The report's strategy line."""
        return f"DDP whose fp32 gradient buckets are cast to {self.dtype} for the all-reduce and back"

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype}

    @classmethod
    def from_json(cls, data: Any, source: str) -> "HalfReduceSection":
        """The section under a plan file's ``"half-reduce"`` key; ``PlanFileError`` in one line."""
        data = _object(data, HALF_REDUCE, source, ("dtype",), '{"dtype": "fp16"}')
        try:
            return cls(data.get("dtype", "fp16"))
        except ValueError as error:
            raise PlanFileError(f"{source}: {error}") from None


def compression_of(plan: "Plan"):
    """The plan's compression section (PowerSGD, top-k or half-precision reduction), or None."""
    return next((plan.sections[key] for key in COMPRESSIONS if key in plan.sections), None)
