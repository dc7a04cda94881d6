"""A measured file says which plan it measured (``planner.plan_identity``): ``compare`` refuses
a measurement of another plan or world size, ``calibrate`` one of another world size than
the cluster it fits, and a file whose recorded identity disagrees with the plan it holds is
refused as damaged; files from before fingerprints were recorded are still read."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import planner
from planner import baselines
from cost_model.calibration import load_measured
from planner.cluster import Cluster
from planner.errors import PlanFileError
from planner.model_spec import ModelSpec
from planner.plan_identity import plan_fingerprint
from planner.plans import load_plan
from user_errors import assert_api_error, assert_user_error

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "examples" / "mlp.py")


@pytest.fixture(scope="module")
def plans() -> dict[str, planner.Plan]:
    return {
        "ddp": planner.plan(MLP, "cpu:1x2", dp_flavour="ddp", progress=False),
        "fsdp": planner.plan(MLP, "cpu:1x2", dp_flavour="fsdp", progress=False),
        "ddp4": planner.plan(MLP, "cpu:1x4", dp_flavour="ddp", progress=False),
    }


def _measured(folder: Path, name: str, plan_data: dict, *, recorded: str | None = "compute", **extra) -> str:
    """A measured file as launch.py --profile writes it (``recorded``: its plan fingerprint;
    "compute" for the right one, None for a file from before fingerprints were recorded)."""
    record = {
        "format": "soap-planner-measured", "version": 1, "plan": plan_data, "world_size": 2, "backend": "gloo",
        "device": "cpu", "step_times_s": [0.009, 0.01, 0.011], "step_time_s": 0.01, "profiled_steps": 2,
        "ops": {"aten::mm": {"count": 8, "time_s": 0.004, "flops": 1e6}}, "collectives": [],
    }
    if recorded is not None:
        record["plan_fingerprint"] = plan_fingerprint(plan_data) if recorded == "compute" else recorded
    record.update(extra)
    (folder / name).write_text(json.dumps(record))
    return str(folder / name)


def test_the_fingerprint_names_the_program_not_its_description(plans, tmp_path: Path) -> None:
    """The same for a plan, its file, its compiled plan.json and the plan on a calibrated
    cluster with another estimate; different for another flavour or world size."""
    plan = plans["ddp"]
    fingerprint = plan_fingerprint(plan.to_dict())
    plan.save(tmp_path / "plan.json")
    program = planner.compile(plan, tmp_path / "out")
    assert plan_fingerprint(load_plan(tmp_path / "plan.json").to_dict()) == fingerprint
    assert plan_fingerprint(json.loads((program / "plan.json").read_text())) == fingerprint
    faster = Cluster.parse("cpu:1x2")
    moved = dataclasses.replace(plan, cluster=faster, warnings=("edited",), label="renamed")
    assert plan_fingerprint(moved.to_dict()) == fingerprint
    assert len({fingerprint, plan_fingerprint(plans["fsdp"].to_dict()), plan_fingerprint(plans["ddp4"].to_dict())}) == 3


@pytest.mark.parametrize("family", ["tp", "pp"])
def test_a_compiled_plan_keeps_its_fingerprint_in_every_family(family, tmp_path: Path) -> None:
    """What launch.py --profile records (from the program's plan.json) is what compare
    computes from the plan file, for tensor- and pipeline-parallel plans too."""
    gpt = ModelSpec(str(ROOT / "examples" / "gpt.py"),
                    {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64, "seq_len": 16, "batch_size": 8})
    plan = baselines.megatron(gpt, "cpu:1x4", tp=2, precision="fp32") if family == "tp" else \
        baselines.megatron(gpt, "cpu:1x4", pp=2, micro_batch=2, precision="fp32")
    plan.save(tmp_path / "plan.json")
    program = planner.compile(plan, tmp_path / "out")
    assert plan_fingerprint(json.loads((program / "plan.json").read_text())) == \
        plan_fingerprint(load_plan(tmp_path / "plan.json").to_dict()) == plan_fingerprint(plan.to_dict())


def test_compare_takes_a_measurement_of_its_plan_old_or_new(plans, tmp_path: Path, capsys) -> None:
    plans["ddp"].save(tmp_path / "plan.json")
    for name, recorded in (("new.json", "compute"), ("old.json", None)):
        measured = _measured(tmp_path, name, plans["ddp"].to_dict(), recorded=recorded)
        capsys.readouterr()
        assert planner.cli.main(["compare", str(tmp_path / "plan.json"), measured]) == 0, capsys.readouterr().err
        assert "predicted against measured" in capsys.readouterr().out


def test_compare_refuses_a_measurement_of_another_plan(plans, tmp_path: Path, capsys) -> None:
    plans["ddp"].save(tmp_path / "ddp.json")
    plans["ddp4"].save(tmp_path / "ddp4.json")
    other = _measured(tmp_path, "fsdp-measured.json", plans["fsdp"].to_dict())
    old_other = _measured(tmp_path, "old-fsdp-measured.json", plans["fsdp"].to_dict(), recorded=None)
    for measured in (other, old_other):
        assert_user_error(capsys, ["compare", str(tmp_path / "ddp.json"), measured],
                          "measured another plan", Path(measured).name, "ddp.json", "the plan it measured")
    assert_user_error(capsys, ["compare", str(tmp_path / "ddp4.json"), _measured(tmp_path, "m.json", plans["ddp"].to_dict())],
                      "was measured on 2 ranks but plan", "ddp4.json", "runs on 4", "--nproc_per_node 4")


def test_calibrate_refuses_another_world_size(plans, tmp_path: Path, capsys) -> None:
    measured = _measured(tmp_path, "m.json", plans["ddp"].to_dict())
    assert_user_error(capsys, ["calibrate", measured, "--cluster", "cpu:1x4", "-o", str(tmp_path / "c.toml")],
                      "m.json' was measured on 2 ranks but --cluster cpu:1x4 has 4 devices", "--cluster cpu:1x2")
    assert not (tmp_path / "c.toml").exists()


def test_a_measured_file_that_contradicts_itself_is_refused(plans, tmp_path: Path) -> None:
    data = plans["ddp"].to_dict()
    forged = _measured(tmp_path, "forged.json", data, recorded=plan_fingerprint(plans["fsdp"].to_dict()))
    assert_api_error(lambda: load_measured(forged), PlanFileError, "records plan fingerprint", "edited or damaged")
    resized = _measured(tmp_path, "resized.json", data, world_size=4)
    assert_api_error(lambda: load_measured(resized), PlanFileError, "measured on 4 ranks but holds a plan for 2")
    infinite = _measured(tmp_path, "infinite.json", data, world_size=float("inf"))
    assert_api_error(lambda: load_measured(infinite), PlanFileError, "infinite.json'", "field 'world_size' must be int")
    (tmp_path / "deep.json").write_text("[" * 200_000)
    assert_api_error(lambda: load_measured(tmp_path / "deep.json"), PlanFileError, "deep.json' is nested deeper than")
    negative = _measured(tmp_path, "negative.json", data, ops={"aten::mm": {"count": 1, "time_s": -0.5, "flops": 0}})
    assert_api_error(lambda: load_measured(negative), PlanFileError, "field 'ops.aten::mm.time_s' must be a finite number >= 0")
    no_time = _measured(tmp_path, "no-time.json", data, ops={"aten::mm": {"count": 1, "flops": 0}})
    assert_api_error(lambda: load_measured(no_time), PlanFileError, "field 'ops.aten::mm.time_s' is missing")
    painted = _measured(tmp_path, "painted.json", data,
                        collectives=[{"kind": "\x1b[2Jall good", "bytes": 4, "count": 1, "time_s": 0.001}])
    assert "\x1b" not in assert_api_error(lambda: load_measured(painted), PlanFileError, "is not a collective's name")
    hostile = _measured(tmp_path, "hostile.json", data, recorded="\x1b[2J" * 50)
    message = assert_api_error(lambda: load_measured(hostile), PlanFileError, "records plan fingerprint")
    assert "\x1b" not in message  # shown through repr, cut short


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
FIELDS = ["plan", "plan_fingerprint", "world_size", "step_time_s", "step_times_s", "ops", "collectives", "version"]


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=JSON, nested=st.sampled_from(["", "ops", "collectives"]),
       figure=st.sampled_from(["count", "time_s", "flops", "kind", "bytes"]))
def test_any_damage_to_a_measured_file_is_one_line_or_a_usable_run(plans, tmp_path_factory, field, value, nested,
                                                                   figure) -> None:
    """A field of a good measured file replaced by any JSON value (or an op's or collective's
    figures): ``load_measured`` either reads it or raises PlanFileError with one line, and
    what it reads can be compared (measured parts, the plan check) without an exception."""
    from cost_model.calibration import measured_parts
    from planner.compare import check_measured_plan

    folder = tmp_path_factory.mktemp("fuzz")
    data = plans["ddp"].to_dict()
    if nested == "ops":
        extra = {"ops": {"aten::mm": {"count": 1, "time_s": 0.001, "flops": 1.0, figure: value}}}
    elif nested == "collectives":
        extra = {"collectives": [{"kind": "all_reduce", "bytes": 4, "count": 1, "time_s": 0.001, figure: value}]}
    else:
        extra = {field: value}
    path = _measured(folder, "m.json", data, **extra)
    try:
        run = load_measured(path)
    except PlanFileError as error:
        assert "\n" not in str(error) and str(error)
        return
    measured_parts(run)
    try:
        check_measured_plan(plans["ddp"], "plan.json", run)
    except PlanFileError as error:
        assert "\n" not in str(error)
