"""The ``Plan``: everything needed to explain, simulate and compile one parallelization.

A plan is saved as versioned JSON (never pickle) and validated on load: a corrupt file, a
file of another version or a bad field raises ``PlanFileError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from planner.cluster import Cluster
from planner.graph import OpGraph
from planner.errors import ClusterError, PlanFileError, SpecError, one_line
from planner.model_spec import ModelSpec
from planner.strategy import (
    DP_FLAVOURS,
    RECOMPUTE_MODES,
    Alternative,
    CostParts,
    Mesh,
    NodeStrategy,
    MemoryBreakdown,
    PipelineConfig,
    SimResult,
    Placements,
    placements_from_json,
    placements_to_json,
)

PLAN_FORMAT = "soap-planner-plan"
PLAN_VERSION = 2

T = TypeVar("T")


@dataclass(frozen=True)
class ModelSummary:
    """What the report says about the model without re-tracing it."""

    name: str
    parameters: int
    parameter_bytes: int
    forward_flops: int
    ops: int
    tracer: str
    blocks: dict[str, int] = field(default_factory=dict)
    tokens_per_sample: int = 0


@dataclass(frozen=True)
class Plan:
    """A parallelization of one model's training step on one cluster.

    Attributes:
        model: the spec the model is rebuilt from inside torchrun (``None`` for a model
            passed as an object without a spec; such a plan can be reported, not compiled).
        cluster: the cluster it was planned for.
        mesh: the device mesh over the cluster's ranks.
        dp_flavour: how the ``dp`` axis keeps weights: ``ddp``, ``zero1``, ``zero2``, ``fsdp``.
        batch_size: the global batch of one step.
        inputs: placements of each user input by name (``None`` for non-tensor inputs).
        strategies: one ``NodeStrategy`` per traced op, in graph order.
        estimate: predicted step time and memory.
        recompute: activation recomputation: ``none``, ``selective`` or ``full``.
        pipeline: pipeline stages and schedule, or ``None``.
        fsdp_units: module paths sharded as separate FSDP units (the root is always one).
        precision: ``fp32`` (mixed precision comes with the simulator).
        optimizer: the optimizer the step uses (``adamw``).
        summary: a summary of the traced model, for the report.
        runners_up: the next best plans, for the report.
        warnings: things the planner noticed that the user should know.
        search_summary: how the strategy was found (searches, meshes, optimality, time).
        label: the strategy family for names and reports (``"soap"`` for searched plans,
            ``"megatron"``); empty for data-parallel plans, named by their flavour.
        graph: the traced model, kept in memory for simulation (not saved; a loaded plan
            re-traces its model spec on meta tensors when it needs it).
    """

    model: ModelSpec | None
    cluster: Cluster
    mesh: Mesh
    dp_flavour: str
    batch_size: int
    inputs: dict[str, Placements | None]
    strategies: tuple[NodeStrategy, ...]
    estimate: SimResult
    summary: ModelSummary
    recompute: str = "none"
    pipeline: PipelineConfig | None = None
    fsdp_units: tuple[str, ...] = ()
    precision: str = "fp32"
    optimizer: str = "adamw"
    runners_up: tuple[Alternative, ...] = ()
    warnings: tuple[str, ...] = ()
    search_summary: str = ""
    label: str = ""
    graph: OpGraph | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.dp_flavour not in DP_FLAVOURS:
            raise ValueError(f"dp_flavour must be one of {DP_FLAVOURS}, got '{self.dp_flavour}'")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got '{self.recompute}'")
        if self.mesh.size != self.cluster.world_size:
            raise ValueError(
                f"mesh {self.mesh} has {self.mesh.size} ranks but the cluster has {self.cluster.world_size} devices"
            )

    @property
    def world_size(self) -> int:
        return self.mesh.size

    @property
    def name(self) -> str:
        """Short name of the strategy, e.g. ``"fsdp (dp=4)"`` or ``"soap (dp=2 x tp=4)"``; one
        line, whatever a plan file's label holds."""
        return one_line(f"{self.label or self.dp_flavour} ({self.mesh})")

    def report(self) -> str:
        """A readable text report: cluster, mesh, strategy per layer, memory and time."""
        from planner.report import render_report

        return render_report(self)

    def save(self, path: str | Path) -> None:
        """Write the plan as versioned JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``PLAN_FORMAT`` version ``PLAN_VERSION``)."""
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "model": self.model.to_dict() if self.model else None,
            "cluster": self.cluster.to_dict(),
            "mesh": [[name, size] for name, size in self.mesh.axes],
            "dp_flavour": self.dp_flavour,
            "recompute": self.recompute,
            "pipeline": _pipeline_to_dict(self.pipeline),
            "precision": self.precision,
            "optimizer": self.optimizer,
            "batch_size": self.batch_size,
            "inputs": {name: placements_to_json(p) if p is not None else None for name, p in self.inputs.items()},
            "fsdp_units": list(self.fsdp_units),
            "summary": vars(self.summary),
            "estimate": self.estimate.to_dict(),
            "runners_up": [vars(alt) for alt in self.runners_up],
            "warnings": list(self.warnings),
            "search_summary": self.search_summary,
            "label": self.label,
            "strategies": [_strategy_to_dict(s) for s in self.strategies],
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> "Plan":
        """Validate and rebuild a plan from its JSON form; ``PlanFileError`` names the bad field."""
        reader = _Reader(data, source)
        fmt = reader.get("format", str)
        if fmt != PLAN_FORMAT:
            raise PlanFileError(f"{source}: field 'format' is '{fmt}', not a soap-planner plan ('{PLAN_FORMAT}')")
        version = reader.get("version", int)
        if version != PLAN_VERSION:
            raise PlanFileError(
                f"{source}: field 'version' is {version} but this soap-planner reads version {PLAN_VERSION}; "
                f"re-run `planner plan` with this version to regenerate the plan"
            )
        model = reader.convert("model", lambda d: None if d is None else ModelSpec.from_dict(d), SpecError, ValueError)
        cluster = reader.convert("cluster", Cluster.from_dict, ClusterError)
        mesh = reader.convert("mesh", lambda axes: Mesh(tuple((str(n), s) for n, s in axes)), ValueError, TypeError)
        estimate = _estimate_from(reader.child("estimate"))
        summary = reader.convert("summary", lambda d: ModelSummary(**d), TypeError)
        inputs = {
            name: None if value is None else placements_from_json(value, f"{source}: field 'inputs.{name}'")
            for name, value in reader.get("inputs", dict).items()
        }
        strategies = tuple(
            _strategy_from_dict(_Reader(item, source, f"strategies[{index}]"))
            for index, item in enumerate(reader.get("strategies", list))
        )
        try:
            return cls(
                model=model,
                cluster=cluster,
                mesh=mesh,
                dp_flavour=reader.get("dp_flavour", str),
                batch_size=reader.get("batch_size", int),
                inputs=inputs,
                strategies=strategies,
                estimate=estimate,
                summary=summary,
                recompute=reader.get("recompute", str),
                pipeline=reader.convert("pipeline", _pipeline_from_dict, TypeError, ValueError),
                fsdp_units=tuple(reader.get("fsdp_units", list)),
                precision=reader.get("precision", str),
                optimizer=reader.get("optimizer", str),
                runners_up=tuple(reader.convert("runners_up", lambda d: [Alternative(**a) for a in d], TypeError)),
                warnings=tuple(reader.get("warnings", list)),
                search_summary=reader.get("search_summary", str),
                label=reader.get("label", str),
            )
        except ValueError as error:
            raise PlanFileError(f"{source}: {one_line(error)}") from None


def load_plan(path: str | Path) -> Plan:
    """Read a plan written by ``Plan.save``. A relative ``model.source`` (a plan written by
    hand) is taken relative to the plan file's folder.

    Raises:
        PlanFileError: the file is missing, is not JSON, is of another version, or a field
            is invalid (the message names it).
    """
    path = Path(path)
    if not path.is_file():
        raise PlanFileError(f"plan file '{path}' does not exist; create one with `planner plan SPEC -o {path}`")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PlanFileError(f"plan file '{path}' is not valid JSON ({error}); regenerate it with `planner plan`") from None
    plan = Plan.from_dict(data, source=f"plan file '{path}'")
    if plan.model is not None and not plan.model.is_hf:
        # A relative model.source is relative to the plan file's folder, never to wherever
        # the user happens to run from (Plan.save writes absolute paths).
        plan = dataclasses.replace(plan, model=plan.model.resolved(path.resolve().parent))
    return plan


# ------------------------------------------------------------------------------ helpers


class _Reader:
    """Typed access to one JSON object that names the field in every error."""

    def __init__(self, data: Any, source: str, prefix: str = ""):
        if not isinstance(data, dict):
            where = f"field '{prefix}'" if prefix else "the top level"
            raise PlanFileError(f"{source}: {where} must be a JSON object, got {type(data).__name__}")
        self.data, self.source, self.prefix = data, source, prefix

    def _field(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def get(self, key: str, kind: type[T]) -> T:
        if key not in self.data:
            raise PlanFileError(f"{self.source}: field '{self._field(key)}' is missing")
        value = self.data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise PlanFileError(
                f"{self.source}: field '{self._field(key)}' must be {kind.__name__}, got {type(value).__name__}"
            )
        return value

    def child(self, key: str) -> "_Reader":
        if key not in self.data:
            raise PlanFileError(f"{self.source}: field '{self._field(key)}' is missing")
        return _Reader(self.data[key], self.source, self._field(key))

    def convert(self, key: str, build: Callable[[Any], T], *errors: type[Exception]) -> T:
        if key not in self.data:
            raise PlanFileError(f"{self.source}: field '{self._field(key)}' is missing")
        try:
            return build(self.data[key])
        except errors as error:
            raise PlanFileError(f"{self.source}: field '{self._field(key)}' is invalid: {one_line(error)}") from None


def _estimate_from(reader: _Reader) -> SimResult:
    """The saved ``SimResult``: every number checked and named, memory breakdowns in full."""

    def memory(memory_reader: _Reader) -> MemoryBreakdown:
        return MemoryBreakdown(**{name: memory_reader.get(name, int) for name in MemoryBreakdown.__dataclass_fields__})

    stages = reader.get("stage_memory", list)
    return SimResult(
        step_time_s=reader.get("step_time_s", float),
        compute_s=reader.get("compute_s", float),
        communication_s=reader.get("communication_s", float),
        memory=memory(reader.child("memory")),
        device_memory_bytes=reader.get("device_memory_bytes", int),
        method=reader.get("method", str),
        stage_memory=tuple(memory(_Reader(item, reader.source, f"{reader.prefix}.stage_memory[{i}]")) for i, item in enumerate(stages)),
        samples_per_s=reader.get("samples_per_s", float),
        tokens_per_s=reader.get("tokens_per_s", float),
        model_flops=reader.get("model_flops", float),
        tflops_per_device=reader.get("tflops_per_device", float),
        mfu=reader.get("mfu", float),
        bytes_per_axis={str(k): float(v) for k, v in reader.get("bytes_per_axis", dict).items()},
        bubble_fraction=reader.get("bubble_fraction", float),
    )


def _pipeline_to_dict(pipeline: PipelineConfig | None) -> dict | None:
    return vars(pipeline) if pipeline else None


def _pipeline_from_dict(data: Any) -> PipelineConfig | None:
    return None if data is None else PipelineConfig(**data)


def _strategy_to_dict(strategy: NodeStrategy) -> dict[str, Any]:
    if strategy.layout is not None:
        raise NotImplementedError("saving SUMMA and expert layouts comes with the search that emits them")
    return {
        "node": strategy.node,
        "op": strategy.op,
        "module": strategy.module,
        "inputs": [placements_to_json(p) for p in strategy.inputs],
        "outputs": [placements_to_json(p) for p in strategy.outputs],
        "params": {name: placements_to_json(p) for name, p in strategy.params.items()},
        "stage": strategy.stage,
        "cost": vars(strategy.cost),
        "produced": None if strategy.produced is None else [placements_to_json(p) for p in strategy.produced],
    }


def _strategy_from_dict(reader: _Reader) -> NodeStrategy:
    where = f"{reader.source}: field '{reader.prefix}"
    return NodeStrategy(
        node=reader.get("node", str),
        op=reader.get("op", str),
        module=reader.get("module", str),
        inputs=tuple(placements_from_json(p, f"{where}.inputs'") for p in reader.get("inputs", list)),
        outputs=tuple(placements_from_json(p, f"{where}.outputs'") for p in reader.get("outputs", list)),
        params={n: placements_from_json(p, f"{where}.params'") for n, p in reader.get("params", dict).items()},
        stage=reader.get("stage", int),
        cost=reader.convert("cost", lambda d: CostParts(**d), TypeError),
        produced=None if reader.data.get("produced") is None else tuple(
            placements_from_json(p, f"{where}.produced'") for p in reader.get("produced", list)
        ),
    )
