"""The JSON form of a plan's parts, read back with every field checked.

``FieldReader`` gives typed access to one JSON object and names the field in every error
(``PlanFileError``); the functions below turn each part of a ``Plan`` (mesh, estimate,
pipeline, expert layouts, per-op strategies) into JSON and back. ``planner.plans`` puts them
together into the plan file.

Vocabulary layer.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from planner.errors import PlanFileError, one_line
from planner.json_files import finite_number, record_from_json
from planner.strategy import (
    CostParts,
    ExpertLayout,
    ExpertPlacement,
    MemoryBreakdown,
    Mesh,
    NodeStrategy,
    PipelineConfig,
    Placements,
    SimResult,
    SummaLayout,
    placements_from_json,
    placements_str,
    placements_to_json,
)

# Mesh axes plans are made of: data, tensor and pipeline parallelism, SUMMA's grid.
MESH_AXES = ("dp", "tp", "pp", "row", "col", "dep")

T = TypeVar("T")


class FieldReader:
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
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            number = finite_number(value)  # None for inf, nan and integers beyond a float
            if number is None or number < 0:  # seconds, rates
                raise PlanFileError(
                    f"{self.source}: field '{self._field(key)}' must be a finite number >= 0, got "
                    f"{one_line(repr(value))[:40]}"
                )
            return number  # type: ignore[return-value]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise PlanFileError(
                f"{self.source}: field '{self._field(key)}' must be {kind.__name__}, got {type(value).__name__}"
            )
        if kind is int and value < 0:  # counts, bytes
            raise PlanFileError(
                f"{self.source}: field '{self._field(key)}' must be a finite number >= 0, got {one_line(repr(value))[:40]}"
            )
        return value

    def strings(self, key: str) -> list[str]:
        values = self.get(key, list)
        for index, value in enumerate(values):
            if not isinstance(value, str):
                raise PlanFileError(
                    f"{self.source}: field '{self._field(key)}[{index}]' must be str, got {type(value).__name__}"
                )
        return values

    def record(self, key: str, kind: type[T]) -> T:
        """The flat dataclass ``kind`` from field ``key``, each of its fields type-checked
        (``planner.json_files.record_from_json``)."""
        if key not in self.data:
            raise PlanFileError(f"{self.source}: field '{self._field(key)}' is missing")
        return record_from_json(kind, self.data[key], self.source, self._field(key), PlanFileError)

    def records(self, key: str, kind: type[T]) -> list[T]:
        """A list of ``kind`` records from field ``key``."""
        return [
            record_from_json(kind, item, self.source, f"{self._field(key)}[{index}]", PlanFileError)
            for index, item in enumerate(self.get(key, list))
        ]

    def child(self, key: str) -> "FieldReader":
        if key not in self.data:
            raise PlanFileError(f"{self.source}: field '{self._field(key)}' is missing")
        return FieldReader(self.data[key], self.source, self._field(key))

    def convert_value(self, build: Callable[[], T], *errors: type[Exception]) -> T:
        """``build()``, its errors named as this object's (the whole entry is invalid)."""
        try:
            return build()
        except errors as error:
            raise PlanFileError(f"{self.source}: field '{self.prefix}' is invalid: {one_line(error)}") from None

    def convert(self, key: str, build: Callable[[Any], T], *errors: type[Exception]) -> T:
        if key not in self.data:
            raise PlanFileError(f"{self.source}: field '{self._field(key)}' is missing")
        try:
            return build(self.data[key])
        except errors as error:
            raise PlanFileError(f"{self.source}: field '{self._field(key)}' is invalid: {one_line(error)}") from None


def timings_from(reader: FieldReader) -> dict[str, float]:
    """The optional ``timings`` field: seconds by phase (absent in older files)."""
    if "timings" not in reader.data:
        return {}
    timings = reader.get("timings", dict)
    for key, value in timings.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PlanFileError(f"{reader.source}: field 'timings.{key}' must be a number of seconds, got {value!r}")
    return {str(key): float(value) for key, value in timings.items()}


def mesh_from_json(axes: Any) -> Mesh:
    """``[["dp", 2], ["tp", 4]]`` -> ``Mesh``; ``ValueError`` names the bad axis."""
    if not isinstance(axes, list) or not axes or len(axes) > len(MESH_AXES):
        raise ValueError(
            f'expected a list of 1 to {len(MESH_AXES)} [name, size] pairs such as [["dp", 2]], got '
            f'{one_line(repr(axes))[:80]}'
        )
    pairs = []
    for index, axis in enumerate(axes):
        if not isinstance(axis, list) or len(axis) != 2:
            raise ValueError(f"'mesh[{index}]' must be a [name, size] pair, got {axis!r}")
        name, size = axis
        if name not in MESH_AXES:
            raise ValueError(f"'mesh[{index}]' names axis {name!r}, not one of {', '.join(MESH_AXES)}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"'mesh[{index}]' axis {name!r} must have a positive integer size, got {size!r}")
        pairs.append((name, size))
    return Mesh(tuple(pairs))


def check_placement_counts(
    mesh: Mesh, inputs: dict[str, Placements | None], strategies: tuple[NodeStrategy, ...], source: str
) -> None:
    """Every tensor has one placement per mesh axis (DTensor's convention)."""
    axes = len(mesh.axes)
    fields: list[tuple[str, Placements]] = [(f"inputs.{name}", p) for name, p in inputs.items() if p is not None]
    for index, strategy in enumerate(strategies):
        where = f"strategies[{index}]"
        fields += [(f"{where}.inputs[{i}]", p) for i, p in enumerate(strategy.inputs)]
        fields += [(f"{where}.outputs[{i}]", p) for i, p in enumerate(strategy.outputs)]
        fields += [(f"{where}.params.{name}", p) for name, p in strategy.params.items()]
        fields += [(f"{where}.produced[{i}]", p) for i, p in enumerate(strategy.produced or ())]
    for where, placements in fields:
        if len(placements) != axes:
            raise PlanFileError(
                f"{source}: field '{where}' has {len(placements)} placement(s) {placements_str(placements)} but the "
                f"mesh {mesh} has {axes} axis/axes; give one placement per mesh axis"
            )


def estimate_from(reader: FieldReader) -> SimResult:
    """The saved ``SimResult``: every number checked and named, memory breakdowns in full."""

    def memory(memory_reader: FieldReader) -> MemoryBreakdown:
        return MemoryBreakdown(**{name: memory_reader.get(name, int) for name in MemoryBreakdown.__dataclass_fields__})

    stages = reader.get("stage_memory", list)
    return SimResult(
        step_time_s=reader.get("step_time_s", float),
        compute_s=reader.get("compute_s", float),
        communication_s=reader.get("communication_s", float),
        memory=memory(reader.child("memory")),
        device_memory_bytes=reader.get("device_memory_bytes", int),
        method=reader.get("method", str),
        stage_memory=tuple(memory(FieldReader(item, reader.source, f"{reader.prefix}.stage_memory[{i}]")) for i, item in enumerate(stages)),
        samples_per_s=reader.get("samples_per_s", float),
        tokens_per_s=reader.get("tokens_per_s", float),
        model_flops=reader.get("model_flops", float),
        tflops_per_device=reader.get("tflops_per_device", float),
        mfu=reader.get("mfu", float),
        bytes_per_axis=_bytes_per_axis(reader),
        bubble_fraction=reader.get("bubble_fraction", float),
        host_wait_s=reader.get("host_wait_s", float) if "host_wait_s" in reader.data else 0.0,  # plans before it: 0
    )


def _bytes_per_axis(reader: FieldReader) -> dict[str, float]:
    """The estimate's bytes sent per mesh axis: finite numbers >= 0 by axis name."""
    volumes = reader.get("bytes_per_axis", dict)
    for axis, value in volumes.items():
        number = finite_number(value)
        if number is None or number < 0:
            raise PlanFileError(
                f"{reader.source}: field '{reader._field('bytes_per_axis')}.{one_line(axis)[:20]}' must be a finite "
                f"number of bytes >= 0, got {one_line(repr(value))[:40]}"
            )
    return {str(axis): float(value) for axis, value in volumes.items()}


def expert_layout_to_dict(layout: ExpertLayout) -> dict[str, Any]:
    """The JSON form of one MoE layer's layout (inside a plan's ``expert_layouts``)."""
    placement = layout.placement
    return {
        "module": layout.module,
        "mode": layout.mode,
        "experts": layout.experts,
        "top_k": layout.top_k,
        "capacity_factor": layout.capacity_factor,
        "axis": layout.axis,
        "all_to_all": layout.all_to_all,
        "placement": None if placement is None else {
            "devices": placement.devices,
            "replicas": [[[device, share] for device, share in copies] for copies in placement.replicas],
            "method": placement.method,
        },
        "routing": layout.routing,
        "expert_loads": list(layout.expert_loads),
        "cost": vars(layout.cost),
        "sharded_copies": layout.sharded_copies,
        # Written only when the experts are split (plans before expert tensor parallelism: 1).
        **({"tensor_parallel": layout.tensor_parallel} if layout.tensor_parallel != 1 else {}),
        "exposed_all_to_all_s": layout.exposed_all_to_all_s,
    }


def expert_layout_from_dict(reader: "FieldReader") -> ExpertLayout:
    """Validate and rebuild one ``expert_layouts`` entry; ``PlanFileError`` names the field."""
    placement = None
    if reader.data.get("placement") is not None:
        child = reader.child("placement")
        replicas = []
        for expert, copies in enumerate(child.get("replicas", list)):
            if not isinstance(copies, list) or not all(
                isinstance(c, list) and len(c) == 2 and type(c[0]) is int and finite_number(c[1]) is not None for c in copies
            ):
                raise PlanFileError(
                    f"{reader.source}: field '{child.prefix}.replicas[{expert}]' must be a list of [device, share] pairs"
                )
            replicas.append(tuple((device, float(share)) for device, share in copies))
        placement = child.convert_value(
            lambda: ExpertPlacement(child.get("devices", int), tuple(replicas), one_line(child.get("method", str))[:80]),
            ValueError, TypeError,
        )
    loads = reader.get("expert_loads", list)
    sharded_copies = reader.data.get("sharded_copies", False)  # absent in plans written before it existed
    if not isinstance(sharded_copies, bool):
        raise PlanFileError(f"{reader.source}: field '{reader.prefix}.sharded_copies' must be true or false")
    tensor_parallel = reader.data.get("tensor_parallel", 1)  # absent: whole experts
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int):
        raise PlanFileError(f"{reader.source}: field '{reader.prefix}.tensor_parallel' must be an integer >= 1")
    if not all(finite_number(load) is not None for load in loads):
        raise PlanFileError(f"{reader.source}: field '{reader.prefix}.expert_loads' must be a list of numbers")
    exposed = reader.data.get("exposed_all_to_all_s")  # absent in plans written before it existed
    if exposed is not None and (finite_number(exposed) is None or exposed < 0):
        raise PlanFileError(f"{reader.source}: field '{reader.prefix}.exposed_all_to_all_s' must be a number of "
                            f"seconds >= 0 or null")
    return reader.convert_value(
        lambda: ExpertLayout(
            module=reader.get("module", str),
            mode=reader.get("mode", str),
            experts=reader.get("experts", int),
            top_k=reader.get("top_k", int),
            capacity_factor=reader.get("capacity_factor", float),
            axis=reader.get("axis", str),
            all_to_all=reader.get("all_to_all", str),
            placement=placement,
            routing=reader.get("routing", str),
            expert_loads=tuple(float(load) for load in loads),
            cost=reader.record("cost", CostParts),
            sharded_copies=sharded_copies,
            tensor_parallel=tensor_parallel,
            exposed_all_to_all_s=None if exposed is None else float(exposed),
        ),
        ValueError, TypeError,
    )


def pipeline_to_dict(pipeline: PipelineConfig | None) -> dict | None:
    if pipeline is None:
        return None
    return {**vars(pipeline), "stage_recompute": list(pipeline.stage_recompute),
            "deepspeed_checkpointing": list(pipeline.deepspeed_checkpointing)}


def pipeline_from_dict(data: Any) -> PipelineConfig | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise TypeError(f"expected an object, got {type(data).__name__}")
    modes = data.get("stage_recompute", [])
    if not isinstance(modes, list):
        raise TypeError(f"stage_recompute must be a list of modes, got {type(modes).__name__}")
    options = data.get("deepspeed_checkpointing", [])
    if not isinstance(options, list):
        raise TypeError(f"deepspeed_checkpointing must be a list of options, got {type(options).__name__}")
    return PipelineConfig(**{**data, "stage_recompute": tuple(modes), "deepspeed_checkpointing": tuple(options)})


def strategy_to_dict(strategy: NodeStrategy) -> dict[str, Any]:
    if strategy.layout is not None and not isinstance(strategy.layout, SummaLayout):
        # Expert layouts live in Plan.expert_layouts, one per MoE layer, not on nodes.
        raise NotImplementedError("a node strategy saves a SUMMA layout only; expert layouts belong in Plan.expert_layouts")
    saved = {
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
    if strategy.layout is not None:
        saved["layout"] = strategy.layout.to_dict()
    return saved


def strategy_from_dict(reader: FieldReader) -> NodeStrategy:
    where = f"{reader.source}: field '{reader.prefix}"
    return NodeStrategy(
        node=reader.get("node", str),
        op=reader.get("op", str),
        module=reader.get("module", str),
        inputs=tuple(placements_from_json(p, f"{where}.inputs'") for p in reader.get("inputs", list)),
        outputs=tuple(placements_from_json(p, f"{where}.outputs'") for p in reader.get("outputs", list)),
        params={n: placements_from_json(p, f"{where}.params'") for n, p in reader.get("params", dict).items()},
        stage=reader.get("stage", int),
        cost=reader.record("cost", CostParts),
        produced=None if reader.data.get("produced") is None else tuple(
            placements_from_json(p, f"{where}.produced'") for p in reader.get("produced", list)
        ),
        layout=None if reader.data.get("layout") is None else reader.convert(
            "layout", SummaLayout.from_dict, ValueError, TypeError),
    )
