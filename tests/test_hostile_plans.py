"""Hostile plans: no string in a plan file ever runs as code.

A plan.json is shared between people, so ``compile`` must treat every string in it as data.
This test starts from real plans of every program kind (DDP, ZeRO-1, ZeRO-2, FSDP; a
Megatron tensor-parallel graph program, the same with every block recomputed, a
two-stage pipeline, an MoE plan with expert-parallel layouts, and for the refused rows of
its expert layouts a pipeline whose stages run them), puts payloads into every string field
of the plan JSON, and compiles.
Each row of the table is one (field, payload) pair, and says what must happen:

- ``refused``: ``planner compile`` exits 2 with one ``error:`` line naming the field (the
  field names something the model does not have, or a value no program can use);
- ``inert``: the program is written, and the payload in it is data: every generated file
  parses, every token holding a piece of the payload is a string or a comment, no raw
  line-breaking or control character is in the file, the program imports (``load_program``,
  ``launch.py``) and passes ``--check`` parity in one torchrun launch at world size 2.

Payloads try to break out of each context a generated file has: docstrings (three double
or single quotes and a newline), comments (newline, carriage return, form feed and other
line separators, NUL), quoted strings (a quote, a backslash), and run
``__import__('pathlib').Path('PWNED_<tag>').touch()`` or an ``os.system('touch
PWNED_SH_<tag>')``, where the tag names the row. Finally no marker file may exist anywhere
the programs ran (the working folder, the output folders, the temporary folder, the repo).
Two controls show the test can fail (``test_source_text_rules.py``): the payloads pasted raw
(as the compiler once did) are caught by the same checks, and one pasted as the old FSDP
emitter did really runs.

Cost: compiling is fast for data-parallel plans; inert rows are grouped, one compile per
(plan kind, payload) for two plan kinds per payload (each plan kind sees several payloads,
each payload every field), and every program of a group runs in ONE torchrun launch.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

import planner
from planner import baselines
from planner.cli import main
from planner.errors import PlannerError
from codegen.runtime import load_program
from moe_plans import MOE_EXAMPLE, moe_pipeline_plan, moe_plan
from planner.model_spec import ModelSpec
from hostile_payloads import PAYLOADS, breakouts, marker_files, printable  # on sys.path under pytest
from test_parity import REPO, check_many, result_of

NOTED_GPT = REPO / "tests" / "models" / "noted_gpt.py"

# ------------------------------------------------------------------------------ plan kinds

DATA_PARALLEL = ("ddp", "zero1", "zero2", "fsdp")
GRAPH = ("tp", "tp_recompute", "pp")
KINDS = DATA_PARALLEL + GRAPH
# examples/moe.py with expert-parallel layouts: only the expert_layouts fields are tried on it.
MOE = ("moe",)
# The refused expert_layouts fields are also tried on a pipeline plan whose stages run the MoE
# layers expert parallel (pp=2 x dp=2: compiled only, so its world of 4 never runs here).
MOE_REFUSED = MOE + ("moe_pp",)
ALL_KINDS = KINDS + MOE
WORLD = 2


def _base_plans() -> dict[str, planner.Plan]:
    spec = str(NOTED_GPT)
    return {
        "ddp": baselines.ddp(spec, "cpu:1x2"),
        "zero1": baselines.zero(spec, "cpu:1x2", stage=1),
        "zero2": baselines.zero(spec, "cpu:1x2", stage=2),
        "fsdp": baselines.fsdp(spec, "cpu:1x2"),
        "tp": baselines.megatron(spec, "cpu:1x2", tp=2, precision="fp32"),
        "tp_recompute": baselines.megatron(spec, "cpu:1x2", tp=2, recompute="full", precision="fp32"),
        "pp": baselines.megatron(spec, "cpu:2x1", pp=2, micro_batch=2, precision="fp32"),
        "moe": moe_plan(WORLD, "expert_parallel", "skewed"),
        "moe_pp": moe_pipeline_plan(ModelSpec(str(MOE_EXAMPLE), {"n_expert": 4}), 4),
    }


# ---------------------------------------------------------------------------------- fields


@dataclass(frozen=True)
class Field:
    """A string field of the plan JSON and what a payload in it must lead to.

    ``poison(plan_dict, payload, context)`` writes the payload; ``refused(payload)`` says
    whether compile must refuse it (else the payload must be inert), naming ``names``;
    ``reaches_code``: whether the field's text appears in the generated program (True: it
    must, as inert text; False: it must not; None: it may).
    """

    name: str
    poison: Callable[[dict, str, "Context"], None]
    refused: Callable[[str], bool]
    names: str = ""
    kinds: tuple[str, ...] = KINDS
    reaches_code: bool | None = False

    @property
    def tag(self) -> str:
        return re.sub(r"\W+", "_", self.name).strip("_")


@dataclass
class Context:
    """Where poisoned plans put what they need: hostile source folders."""

    root: Path
    sources: dict[str, Path] = field(default_factory=dict)

    def hostile_source(self, payload: str) -> str:
        """A real model file in a folder named by the payload (a file name holds anything but
        ``/`` and NUL), so a plan naming it compiles and runs: its path must stay inert."""
        if "\x00" in payload or "/" in payload:
            return f"{self.root / payload / 'model.py'}:build"
        folder = self.root / "sources" / payload
        folder.mkdir(parents=True, exist_ok=True)
        shim = folder / "model.py"
        shim.write_text(
            '"""noted_gpt.py, from a folder whose name is a payload."""\n'
            "import importlib.util\n\n"
            f"_spec = importlib.util.spec_from_file_location('_hostile_folder_noted_gpt', {str(NOTED_GPT)!r})\n"
            "_module = importlib.util.module_from_spec(_spec)\n"
            "_spec.loader.exec_module(_module)\n"
            "build = _module.build\n"
        )
        return f"{shim}:build"


def _always(_: str) -> bool:
    return True


def _never(_: str) -> bool:
    return False


def _unprintable(payload: str) -> bool:
    return not printable(payload)


def _has_nul(payload: str) -> bool:
    return "\x00" in payload


def _set(*path):
    """A poison that sets the value at ``path`` (keys and indexes) to the payload."""

    def poison(plan: dict, payload: str, _: Context) -> None:
        target = plan
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = payload

    return poison


def _rename_key(*path, which: Callable[[dict], str] = lambda d: next(iter(d))):
    """A poison that renames a key of the dict at ``path`` (the first, by default) to the payload."""

    def poison(plan: dict, payload: str, _: Context) -> None:
        target = plan
        for key in path:
            target = target[key]
        old = which(target)
        items = [(payload if key == old else key, value) for key, value in target.items()]
        target.clear()
        target.update(items)

    return poison


def _add_key(*path, value):
    def poison(plan: dict, payload: str, _: Context) -> None:
        target = plan
        for key in path:
            target = target[key]
        target[payload] = value

    return poison


def _source(plan: dict, payload: str, context: Context) -> None:
    plan["model"]["source"] = context.hostile_source(payload)


def _fsdp_unit(plan: dict, payload: str, _: Context) -> None:
    plan["fsdp_units"] = [payload, *plan["fsdp_units"][1:]]


def _every_module(plan: dict, payload: str, _: Context) -> None:
    for strategy in plan["strategies"]:
        strategy["module"] = payload


def _param_key(plan: dict, payload: str, _: Context) -> None:
    strategy = next(s for s in plan["strategies"] if s["params"])
    name = next(iter(strategy["params"]))
    strategy["params"] = {payload if key == name else key: value for key, value in strategy["params"].items()}


def _has_line_break(payload: str) -> bool:
    return "\n" in payload or "\r" in payload


def _replica_device(plan: dict, payload: str, _: Context) -> None:
    plan["expert_layouts"][0]["placement"]["replicas"][0][0][0] = payload


def _runner_up(plan: dict, payload: str, _: Context) -> None:
    plan["runners_up"] = [{"name": payload, "step_time_s": 1.0, "memory_bytes": 1, "fits": True, "note": payload}]


FIELDS = [
    # Fields whose text appears in the program: it must be there, and inert.
    Field("model.source", _source, _has_nul, "model", reaches_code=True),
    Field("model.overrides value", _set("model", "overrides", "note"), _never, reaches_code=True),
    Field("cluster.name", _set("cluster", "name"), _unprintable, "cluster", reaches_code=True),
    # Empty for data-parallel plans, whose flavour names them; a label makes a plan a graph program.
    Field("label", _set("label"), _never, kinds=GRAPH, reaches_code=True),
    Field("strategies[*].module", _every_module, _never, reaches_code=None),
    # Fields no program reads: compiled, and absent from the program.
    Field("cluster device name", _set("cluster", "nodes", 0, "device", "name"), _unprintable, "cluster"),
    Field("warnings", lambda plan, payload, _: plan.__setitem__("warnings", [payload, "a plain warning"]), _never),
    Field("search_summary", _set("search_summary"), _never),
    Field("summary.name", _set("summary", "name"), _never),
    Field("summary.tracer", _set("summary", "tracer"), _never),
    Field("summary.blocks key", _add_key("summary", "blocks", value=2), _never),
    Field("estimate.method", _set("estimate", "method"), _never),
    Field("estimate.bytes_per_axis key", _add_key("estimate", "bytes_per_axis", value=1.0), _never),
    Field("runners_up name and note", _runner_up, _never),
    # Fields that name something in the model, or a value from a fixed set: refused, named.
    Field("model.overrides key", _add_key("model", "overrides", value=1), _always, "field 'model'"),
    Field("cluster.backend", _set("cluster", "backend"), _always, "field 'cluster'"),
    Field("mesh axis name", _set("mesh", 0, 0), _always, "'mesh[0]'"),
    Field("fsdp_units[0]", _fsdp_unit, _always, "'fsdp_units[0]'"),
    Field("inputs key", _rename_key("inputs"), _always, "'inputs'"),
    Field("inputs placement", _set("inputs", "idx", 0), _always, "inputs.idx"),
    Field("strategies[0].node", _set("strategies", 0, "node"), _always, "'strategies[0].node'"),
    Field("strategies[0].op", _set("strategies", 0, "op"), _always, "'strategies[0].op'"),
    Field("strategies[*].params key", _param_key, _always, ".params'"),
    Field("strategies[0].layout (a SUMMA layout given text)", _set("strategies", 0, "layout"), _always, "strategies[0].layout"),
    Field("dp_flavour", _set("dp_flavour"), _always, "dp_flavour"),
    Field("recompute", _set("recompute"), _always, "recompute"),
    Field("precision", _set("precision"), _always, "'precision'"),
    Field("optimizer", _set("optimizer"), _always, "'optimizer'"),
    Field("optimizer_implementation", _set("optimizer_implementation"), _always, "'optimizer_implementation'"),
    Field("loss_implementation", _set("loss_implementation"), _always, "'loss_implementation'"),
    Field("expert_implementation", _set("expert_implementation"), _always, "'expert_implementation'"),
    Field("gradient_clipping", _set("gradient_clipping"), _always, "'gradient_clipping'"),
    Field("fused_chains", _set("fused_chains"), _always, "'fused_chains'"),
    Field("metric_cross_entropies (a count given text)", _set("metric_cross_entropies"), _always,
          "'metric_cross_entropies'"),
    Field("fused_splits_local (a bool given text)", _set("fused_splits_local"), _always, "'fused_splits_local'"),
    Field("tp_comm_overlap (a bool given text)", _set("tp_comm_overlap"), _always, "'tp_comm_overlap'"),
    Field("megatron_distributed_optimizer (a bool given text)", _set("megatron_distributed_optimizer"), _always,
          "'megatron_distributed_optimizer'"),
    Field("moe_a2a_overlap (a bool given text)", _set("moe_a2a_overlap"), _always, "'moe_a2a_overlap'"),
    Field("half_precision_weights (a bool given text)", _set("half_precision_weights"), _always,
          "'half_precision_weights'"),
    Field("pipeline.schedule", _set("pipeline", "schedule"), _always, "field 'pipeline'", kinds=("pp",)),
    Field(
        "pipeline.stage_recompute[0]", lambda plan, payload, _: plan["pipeline"].__setitem__("stage_recompute", [payload]),
        _always, "field 'pipeline'", kinds=("pp",),
    ),
    Field("pipeline.blocking_p2p", _set("pipeline", "blocking_p2p"), _always, "field 'pipeline'", kinds=("pp",)),
    Field("pipeline.partitioned_p2p", _set("pipeline", "partitioned_p2p"), _always, "field 'pipeline'", kinds=("pp",)),
    Field("pipeline.gradient_accumulation", _set("pipeline", "gradient_accumulation"), _always, "field 'pipeline'",
          kinds=("pp",)),
    Field("pipeline.overlap_grad_reduce", _set("pipeline", "overlap_grad_reduce"), _always, "field 'pipeline'",
          kinds=("pp",)),
    Field("pipeline.block_overhead_s (a number given text)", _set("pipeline", "block_overhead_s"), _always,
          "field 'pipeline'", kinds=("pp",)),
    Field(
        "pipeline.deepspeed_checkpointing[0]",
        lambda plan, payload, _: plan["pipeline"].__setitem__("deepspeed_checkpointing", [payload]),
        _always, "field 'pipeline'", kinds=("pp",),
    ),
    Field("summary.parameter_bytes (a number given text)", _set("summary", "parameter_bytes"), _always, "'summary.parameter_bytes'"),
    # Expert layouts of MoE layers: module paths are checked against the model's MoE layers
    # (codegen.plan_checks), the rest against fixed sets; a routing source is one line of
    # report text, never code; a placement's method is one line in a comment.
    Field("expert_layouts[0].module", _set("expert_layouts", 0, "module"), _always, "'expert_layouts[0].module'", kinds=MOE),
    Field("expert_layouts[1].module", _set("expert_layouts", 1, "module"), _always, "'expert_layouts[1].module'", kinds=MOE),
    Field("expert_layouts[0].mode", _set("expert_layouts", 0, "mode"), _always, "'expert_layouts[0]'", kinds=MOE),
    Field("expert_layouts[0].axis", _set("expert_layouts", 0, "axis"), _always, "runs over axis", kinds=MOE),
    Field("expert_layouts[0].all_to_all", _set("expert_layouts", 0, "all_to_all"), _always, "'expert_layouts[0]'", kinds=MOE),
    Field("expert_layouts[0].sharded_copies (a bool given text)", _set("expert_layouts", 0, "sharded_copies"), _always,
          "'expert_layouts[0].sharded_copies' must be true or false", kinds=MOE),
    Field(
        "expert_layouts[0].placement.replicas device", _replica_device, _always,
        "'expert_layouts[0].placement.replicas[0]'", kinds=MOE,
    ),
    Field("expert_layouts[0].routing", _set("expert_layouts", 0, "routing"), _has_line_break, "'expert_layouts[0]'", kinds=MOE),
    Field("expert_layouts[0].placement.method", _set("expert_layouts", 0, "placement", "method"), _never, kinds=MOE,
          reaches_code=None),
]



@dataclass(frozen=True)
class Row:
    field: Field
    payload: str  # key of PAYLOADS

    @property
    def tag(self) -> str:
        return f"{self.field.tag}_{self.payload}"

    @property
    def text(self) -> str:
        return PAYLOADS[self.payload](self.tag)

    @property
    def refused(self) -> bool:
        return self.field.refused(self.text)

    @property
    def id(self) -> str:
        return f"{self.field.tag}-{self.payload}-{'refused' if self.refused else 'inert'}"


ROWS = [Row(f, p) for f in FIELDS for p in PAYLOADS]
KINDS_PER_PAYLOAD = 2  # inert rows: plan kinds each payload is compiled in (len(KINDS) for all)


def _refusing_kind(row: Row) -> str:
    """The plan kind a refused row is tried on: its field's kinds, rotated by the row."""
    kinds = row.field.kinds
    index = FIELDS.index(row.field) + list(PAYLOADS).index(row.payload)
    if row.field.name == "fsdp_units[0]":
        kinds = ("fsdp", "zero2")
    if row.field.name == "strategies[*].params key":
        kinds = GRAPH
    if kinds == MOE:
        kinds = MOE_REFUSED
    return kinds[index % len(kinds)]


def _groups() -> list[tuple[str, str]]:
    """(plan kind, payload) pairs compiled with every inert field poisoned at once: each
    payload in ``KINDS_PER_PAYLOAD`` kinds, plus one more where a field's own kinds
    (``label``: graph programs) would otherwise not see that payload."""
    chosen: list[tuple[str, str]] = []
    for index, payload in enumerate(PAYLOADS):
        for step in range(KINDS_PER_PAYLOAD):
            chosen.append((KINDS[(index * KINDS_PER_PAYLOAD + step) % len(KINDS)], payload))
    for row in ROWS:
        if not row.refused and not any(k in row.field.kinds for k, p in chosen if p == row.payload):
            kinds = row.field.kinds
            chosen.append((kinds[list(PAYLOADS).index(row.payload) % len(kinds)], row.payload))
    return list(dict.fromkeys(chosen))


def _import_file(path: Path, name: str) -> None:
    """Import ``path`` as a module (its top level runs; ``launch.py``'s main does not)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


@dataclass
class Compiled:
    """One group: its folder, and what went wrong compiling or importing it (None: nothing)."""

    folder: Path
    error: str | None = None
    launch: object = None


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The working folder of everything here: compiles, imports and torchrun run in it, so
    a payload's relative marker would land in it."""
    return tmp_path_factory.mktemp("hostile")


@pytest.fixture(scope="module")
def base_plans(workdir) -> dict[str, dict]:
    plans = {}
    for kind, plan in _base_plans().items():
        path = workdir / "base" / f"{kind}.json"
        path.parent.mkdir(exist_ok=True)
        plan.save(path)
        plans[kind] = json.loads(path.read_text())
    return plans


def _write_plan(base: dict, poisons: list[tuple[Field, str]], path: Path, context: Context) -> Path:
    data = copy.deepcopy(base)
    for field_, payload in poisons:
        field_.poison(data, payload, context)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def groups(workdir, base_plans) -> dict[tuple[str, str], Compiled]:
    """Every inert group compiled (in process, cwd = workdir), imported, then parity-checked
    in one torchrun launch."""
    context = Context(workdir)
    compiled: dict[tuple[str, str], Compiled] = {}
    previous = Path.cwd()
    os.chdir(workdir)
    try:
        for kind, payload in _groups():
            poisons = [
                (row.field, row.text) for row in ROWS
                if row.payload == payload and not row.refused and kind in row.field.kinds
            ]
            name = f"{kind}-{payload}"
            path = _write_plan(base_plans[kind], poisons, workdir / "plans" / f"{name}.json", context)
            folder = workdir / "programs" / name
            result = Compiled(folder)
            try:
                planner.compile(planner.load_plan(path), folder)
                load_program(folder)  # imports model_spmd.py
                _import_file(folder / "launch.py", f"hostile_launch_{kind}_{payload}")
            except PlannerError as error:
                result.error = f"{type(error).__name__}: {error}"
            compiled[(kind, payload)] = result
        ready = [c.folder for c in compiled.values() if c.error is None]
        launch = check_many(WORLD, ready, workdir) if ready else None
        for result in compiled.values():
            result.launch = launch
    finally:
        os.chdir(previous)
    return compiled


# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("row", [r for r in ROWS if r.refused], ids=lambda r: r.id)
def test_refused_with_one_line_naming_the_field(row: Row, workdir, base_plans, capsys, monkeypatch):
    monkeypatch.chdir(workdir)
    kind = _refusing_kind(row)
    path = _write_plan(base_plans[kind], [(row.field, row.text)], workdir / "refused" / f"{row.id}.json", Context(workdir))
    out = workdir / "refused" / f"{row.id}-out"
    status = main(["compile", str(path), "-o", str(out)])
    _, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if not line.startswith("importing model file /")]
    assert status == 2, f"{kind}: {err}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{kind}: not one error line:\n{err}"
    assert lines[0].isprintable(), lines[0]
    assert row.field.names in lines[0], f"{kind}: the error does not name {row.field.names}: {lines[0]}"
    assert not (out / "model_spmd.py").exists()
    assert not marker_files(workdir), marker_files(workdir)


@pytest.mark.distributed
@pytest.mark.parametrize("row", [r for r in ROWS if not r.refused], ids=lambda r: r.id)
def test_inert_payload_compiles_imports_and_passes_parity(row: Row, groups):
    mine = {key: value for key, value in groups.items() if key[1] == row.payload and key[0] in row.field.kinds}
    assert mine, f"no group compiles {row.id}"
    for (kind, _), result in mine.items():
        assert result.error is None, f"{kind}: {result.error}"
        texts = {name: (result.folder / name).read_text() for name in ("model_spmd.py", "launch.py")}
        for name, text in texts.items():
            assert not breakouts(text), f"{kind}/{name}: {breakouts(text)}"
        appears = row.tag in texts["model_spmd.py"]
        if row.field.reaches_code is not None:
            assert appears == row.field.reaches_code, f"{kind}: {row.field.name} {'missing from' if not appears else 'in'} the program"
        assert row.tag not in texts["launch.py"]
        assert result_of(result.launch, result.folder).startswith("ok"), f"{kind}: {result_of(result.launch, result.folder)}"
        # Rank 0 named the model file it imported, once, on one line.
        said = [line for line in result.launch.stderr.splitlines() if line.endswith(f"(model.source of {result.folder.resolve()}/plan.json)")]
        assert len(said) == 1 and said[0].startswith("importing model file /"), said


@pytest.mark.distributed
def test_no_payload_ran_anywhere(groups, workdir):
    """After every compile, import and launch of this module: no marker file anywhere."""
    assert len(groups) >= len(PAYLOADS) * KINDS_PER_PAYLOAD
    assert set(kind for kind, _ in groups) == set(ALL_KINDS)
    assert not marker_files(workdir), marker_files(workdir)
