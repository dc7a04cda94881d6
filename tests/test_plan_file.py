"""Tests of the plan file (planner/plans.py): versioned JSON, validated on load, never pickle."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest

import planner
from planner.errors import PlanFileError, PlannerError
from planner.plans import PLAN_FORMAT, PLAN_VERSION, Plan, load_plan

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")


@pytest.fixture(scope="module")
def gpt_plan() -> Plan:
    return planner.plan(GPT, "cpu:1x2", search="dp")


@pytest.fixture
def plan_dict(gpt_plan) -> dict:
    return json.loads(json.dumps(gpt_plan.to_dict()))  # a deep, JSON-only copy


def write(tmp_path: Path, data, name: str = "plan.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_round_trip(gpt_plan, tmp_path, monkeypatch):
    # Saving and loading never goes through pickle.
    def no_pickle(*args, **kwargs):
        raise AssertionError("plan files must not use pickle")

    for name in ("dump", "dumps", "load", "loads"):
        monkeypatch.setattr(pickle, name, no_pickle)
    path = tmp_path / "plan.json"
    gpt_plan.save(path)
    loaded = load_plan(path)
    assert loaded == gpt_plan
    assert loaded.report() == gpt_plan.report()

    text = path.read_text()
    data = json.loads(text)  # plain JSON text
    assert data["format"] == PLAN_FORMAT and data["version"] == PLAN_VERSION
    assert data["mesh"] == [["dp", 2]]
    assert data["inputs"] == {"idx": ["S(0)"], "targets": ["S(0)"]}
    assert data["model"]["source"] == f"{GPT}:build"


def test_loaded_plan_keeps_placements(gpt_plan, tmp_path):
    gpt_plan.save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    loss = loaded.strategies[-1]
    assert loss.op == "aten.cross_entropy_loss.default"
    assert loss.describe() == "(S(0)), (S(0)) -> (P(avg))"


def test_missing_file(tmp_path):
    with pytest.raises(PlanFileError, match=r"plan file '.*nothing\.json' does not exist"):
        load_plan(tmp_path / "nothing.json")


def test_not_json(tmp_path):
    path = write(tmp_path, "{ this is not json")
    with pytest.raises(PlanFileError, match="is not valid JSON"):
        load_plan(path)


def test_pickle_is_rejected(gpt_plan, tmp_path):
    path = tmp_path / "plan.pkl"
    path.write_bytes(pickle.dumps(gpt_plan.to_dict()))
    with pytest.raises(PlanFileError, match="not valid JSON"):
        load_plan(path)


def test_top_level_not_an_object(tmp_path):
    with pytest.raises(PlanFileError, match="top level must be a JSON object"):
        load_plan(write(tmp_path, [1, 2]))


def test_wrong_format(plan_dict, tmp_path):
    plan_dict["format"] = "something-else"
    with pytest.raises(PlanFileError, match="field 'format' is 'something-else'"):
        load_plan(write(tmp_path, plan_dict))


def test_wrong_version(plan_dict, tmp_path):
    plan_dict["version"] = PLAN_VERSION + 1
    with pytest.raises(PlanFileError) as info:
        load_plan(write(tmp_path, plan_dict))
    assert f"field 'version' is {PLAN_VERSION + 1}" in str(info.value)
    assert f"reads version {PLAN_VERSION}" in str(info.value)


@pytest.mark.parametrize("field", ["mesh", "cluster", "strategies", "dp_flavour", "estimate", "batch_size"])
def test_missing_field(plan_dict, tmp_path, field):
    del plan_dict[field]
    with pytest.raises(PlanFileError, match=f"field '{field}' is missing"):
        load_plan(write(tmp_path, plan_dict))


def test_missing_nested_field(plan_dict, tmp_path):
    del plan_dict["estimate"]["memory"]["weights"]
    with pytest.raises(PlanFileError, match=r"field 'estimate\.memory\.weights' is missing"):
        load_plan(write(tmp_path, plan_dict))


def test_wrong_type(plan_dict, tmp_path):
    plan_dict["batch_size"] = "eight"
    with pytest.raises(PlanFileError, match="field 'batch_size' must be int, got str"):
        load_plan(write(tmp_path, plan_dict))


def test_bad_placement_in_strategies(plan_dict, tmp_path):
    plan_dict["strategies"][3]["inputs"][0] = ["X(0)"]
    with pytest.raises(PlanFileError) as info:
        load_plan(write(tmp_path, plan_dict))
    assert "field 'strategies[3].inputs'" in str(info.value)
    assert "'X(0)' is not a placement" in str(info.value)


def test_bad_placement_in_inputs(plan_dict, tmp_path):
    plan_dict["inputs"]["idx"] = "S(0)"  # a string, not a list of placements
    with pytest.raises(PlanFileError, match=r"field 'inputs\.idx' must be a list of placements"):
        load_plan(write(tmp_path, plan_dict))


def test_mesh_size_must_match_cluster(plan_dict, tmp_path):
    plan_dict["mesh"] = [["dp", 4]]  # the cluster (cpu:1x2) has 2 devices
    with pytest.raises(PlanFileError, match="mesh dp=4 has 4 ranks but the cluster has 2 devices"):
        load_plan(write(tmp_path, plan_dict))


def test_invalid_cluster(plan_dict, tmp_path):
    plan_dict["cluster"]["backend"] = "mpi"
    with pytest.raises(PlanFileError, match="field 'cluster' is invalid"):
        load_plan(write(tmp_path, plan_dict))


def test_invalid_dp_flavour(plan_dict, tmp_path):
    plan_dict["dp_flavour"] = "zero9"
    with pytest.raises(PlanFileError, match="field 'dp_flavour' must be one of"):
        load_plan(write(tmp_path, plan_dict))


def test_plan_file_errors_are_planner_errors():
    assert issubclass(PlanFileError, PlannerError)


def test_searched_and_pipeline_plans_round_trip(tmp_path):
    # A searched plan (tensor-parallel placements, label, search summary) and a pipelined
    # Megatron plan (stages, schedule, sequence-parallel 'produced' placements) survive JSON.
    from planner import baselines

    searched = planner.plan(GPT, "cpu:1x2", search="ilp", time_budget_s=10)
    pipelined = baselines.megatron(GPT, "cpu:1x4", tp=2, pp=2, micro_batch=2, sequence_parallel=True, precision="fp32")
    assert any(s.produced is not None for s in pipelined.strategies)
    for plan in (searched, pipelined):
        path = tmp_path / "plan.json"
        plan.save(path)
        assert load_plan(path) == plan


def test_stage_recompute_round_trips_and_is_checked(tmp_path):
    # Each pipeline stage's own recomputation survives JSON; a plan file whose modes are
    # unknown, miscounted or lighter than the plan's says is refused with the field named.
    import dataclasses

    from planner import baselines

    plan = baselines.megatron(GPT, "cpu:1x2", pp=2, micro_batch=2, recompute="full", precision="fp32")
    mixed = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, stage_recompute=("full", "none")))
    assert [mixed.recompute_at(stage) for stage in (0, 1)] == ["full", "none"]
    path = tmp_path / "plan.json"
    mixed.save(path)
    assert load_plan(path) == mixed
    data = json.loads(path.read_text())
    for modes, message in (
        (["full", "sometimes"], "stage_recompute must list modes among"),
        (["full"], "stage_recompute has 1 modes but there are 2 stage modules"),
        ("full", "stage_recompute must be a list of modes"),
        (["selective", "none"], "field 'recompute' is 'full' but the heaviest of the pipeline's stage_recompute"),
    ):
        data["pipeline"]["stage_recompute"] = modes
        with pytest.raises(PlanFileError, match=message):
            load_plan(write(tmp_path, data))


def test_runners_up_keep_their_route_and_mfu_and_refuse_wrong_types(gpt_plan, plan_dict, tmp_path):
    assert gpt_plan.runners_up and all(alt.route == "data parallel" and alt.mfu > 0 for alt in gpt_plan.runners_up[:3])
    assert load_plan(write(tmp_path, plan_dict)).runners_up == gpt_plan.runners_up
    for field, value in (("mfu", "high"), ("route", 3), ("fits", "yes"), ("step_time_s", None)):
        broken = json.loads(json.dumps(plan_dict))
        broken["runners_up"][0][field] = value
        with pytest.raises(PlanFileError, match=re.escape(f"field 'runners_up[0].{field}' must be")):
            load_plan(write(tmp_path, broken))
    # Plans saved before the field was renamed from "family" read it as the route.
    renamed = json.loads(json.dumps(plan_dict))
    for alt in renamed["runners_up"]:
        alt["family"] = alt.pop("route")
    assert load_plan(write(tmp_path, renamed)).runners_up == gpt_plan.runners_up
    # Plans saved before runners-up had a route and an MFU still load.
    older = json.loads(json.dumps(plan_dict))
    for alt in older["runners_up"]:
        del alt["mfu"], alt["route"]
    assert [alt.route for alt in load_plan(write(tmp_path, older)).runners_up] == [""] * len(older["runners_up"])


def test_expert_layouts_round_trip_and_are_checked(gpt_plan, tmp_path):
    # An MoE layer's mode, placement (a hot expert copied on two devices), loads and cost
    # survive JSON; a layout whose placement does not fit the mesh, names an unknown mode, or
    # whose loads do not sum to 1 is refused with the field named.
    import dataclasses

    from planner.strategy import CostParts, ExpertLayout, ExpertPlacement

    placement = ExpertPlacement(2, (((0, 1.0),), ((0, 0.5), (1, 0.5)), ((1, 1.0),), ((1, 1.0),)), "balanced")
    layout = ExpertLayout(
        "transformer.h.1.moe", "expert_parallel", experts=4, top_k=2, capacity_factor=1.25, placement=placement,
        routing="zipf:1.2", expert_loads=(0.1, 0.5, 0.3, 0.1), cost=CostParts(compute_s=1e-3, communication_s=2e-3),
    )
    plan = dataclasses.replace(gpt_plan, expert_layouts=(layout,))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert load_plan(path) == plan
    data = json.loads(path.read_text())
    for change, message in (
        (lambda e: e["placement"].__setitem__("devices", 4), "places experts on 4 devices but axis dp has 2 ranks"),
        (lambda e: e["placement"]["replicas"].__setitem__(1, [[0, 0.5], [1, 0.4]]), "shares of its copies sum to 0.9"),
        (lambda e: e["placement"]["replicas"].__setitem__(1, [["0", 1.0]]), r"replicas\[1\]' must be a list of"),
        (lambda e: e.__setitem__("mode", "everywhere"), "expert mode must be one of"),
        (lambda e: e.__setitem__("expert_loads", [0.5, 0.5, 0.5, 0.5]), "expert_loads must sum to 1"),
        (lambda e: e.__setitem__("axis", "tp"), "runs over axis 'tp', which mesh"),
        (lambda e: e.__setitem__("routing", "a\nb"), "routing must be one line"),
        (lambda e: e.__setitem__("placement", None), "needs a placement"),
    ):
        broken = json.loads(json.dumps(data))
        change(broken["expert_layouts"][0])
        with pytest.raises(PlanFileError, match=message):
            load_plan(write(tmp_path, broken))


def test_sharded_expert_copies_round_trip_and_old_plans_load(gpt_plan, tmp_path):
    # Each expert's copies sharded (expert data parallelism): the flag survives JSON; a plan
    # written before the field existed loads with it off; a placement whose copies do not form
    # a grid, or a flag that is not a boolean, is refused with the field named.
    import dataclasses

    from planner.strategy import ExpertLayout, ExpertPlacement

    grid = ExpertPlacement(2, (((0, 0.5), (1, 0.5)), ((0, 0.5), (1, 0.5))), "round-robin copies")
    layout = ExpertLayout("transformer.h.1.moe", "expert_parallel", experts=2, top_k=1, capacity_factor=0.0,
                          placement=grid, sharded_copies=True)
    plan = dataclasses.replace(gpt_plan, expert_layouts=(layout,))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert load_plan(path) == plan
    data = json.loads(path.read_text())
    assert data["expert_layouts"][0]["sharded_copies"] is True
    old = json.loads(json.dumps(data))
    del old["expert_layouts"][0]["sharded_copies"]
    assert load_plan(write(tmp_path, old)).expert_layouts[0] == dataclasses.replace(layout, sharded_copies=False)
    for change, message in (
        (lambda e: e.__setitem__("sharded_copies", "yes"), "sharded_copies' must be true or false"),
        # Expert 1 whole on device 1 only: its copies are not expert 0's devices.
        (lambda e: e["placement"]["replicas"].__setitem__(1, [[1, 1.0]]), "sharded_copies needs an expert_parallel"),
    ):
        broken = json.loads(json.dumps(data))
        change(broken["expert_layouts"][0])
        with pytest.raises(PlanFileError, match=message):
            load_plan(write(tmp_path, broken))


def _with_summa_node(data: dict, layout: dict, mesh: list) -> dict:
    data["mesh"] = mesh
    width = len(mesh)
    for strategy in data["strategies"]:
        strategy["inputs"] = [["R"] * width for _ in strategy["inputs"]]
        strategy["outputs"] = [["R"] * width for _ in strategy["outputs"]]
        strategy["params"] = {name: ["R"] * width for name in strategy["params"]}
    data["inputs"] = {name: ["R"] * width for name in data["inputs"]}
    data["strategies"][0]["layout"] = layout
    data["dp_flavour"] = "ddp"
    devices = 1
    for _, size in mesh:
        devices *= size
    data["cluster"]["nodes"] = [{**data["cluster"]["nodes"][0], "devices": devices}]
    return data


def test_summa_layouts_round_trip_and_must_fit_the_mesh(plan_dict, tmp_path):
    # A SUMMA layout is saved on its node and read back; its family sets the mesh it needs.
    three_d = {"kind": "summa", "q": 2, "d": 2, "family": "3d", "swapped": True}
    data = _with_summa_node(plan_dict, three_d, [["row", 2], ["col", 2], ["dep", 2]])
    loaded = load_plan(write(tmp_path, data))
    layout = loaded.strategies[0].layout
    assert (layout.q, layout.d, layout.family, layout.swapped, layout.hidden_axis) == (2, 2, "3d", True, "row")
    assert Plan.from_dict(json.loads(json.dumps(loaded.to_dict()))) == loaded
    # keep_gathered is written only when set, and read back.
    assert "keep_gathered" not in loaded.to_dict()["strategies"][0]["layout"]
    data = _with_summa_node(plan_dict, {**three_d, "keep_gathered": True}, [["row", 2], ["col", 2], ["dep", 2]])
    kept = load_plan(write(tmp_path, data, "kept.json"))
    assert kept.strategies[0].layout.keep_gathered and kept.to_dict()["strategies"][0]["layout"]["keep_gathered"] is True

    # The same layout on a 2.5-D mesh order (depth outermost) is refused, naming the order.
    data = _with_summa_node(plan_dict, three_d, [["dep", 2], ["row", 2], ["col", 2]])
    with pytest.raises(PlanFileError, match="order row x col x dep"):
        load_plan(write(tmp_path, data, "order.json"))
    # A 2.5-D depth larger than q, an unknown family, a missing axis: one line each.
    for layout, mesh, message in (
        ({"kind": "summa", "q": 2, "d": 4, "family": "2.5d"}, [["dep", 4], ["row", 2], ["col", 2]], "2 <= d <= q"),
        ({"kind": "summa", "q": 2, "d": 1, "family": "4d"}, [["row", 2], ["col", 2]], "family must be one of"),
        ({"kind": "summa", "q": 2, "d": 1, "family": "2d"}, [["dp", 2], ["tp", 2]], "needs mesh axes"),
        ({"kind": "summa", "q": "2"}, [["row", 2], ["col", 2]], "must be integers"),
        ({"kind": "summa", "q": 2, "d": 1, "family": "2d", "keep_gathered": True}, [["row", 2], ["col", 2]],
         "only 3d SUMMA layouts keep"),
        ({**three_d, "keep_gathered": "yes"}, [["row", 2], ["col", 2], ["dep", 2]], "keep_gathered booleans"),
    ):
        data = _with_summa_node(json.loads(json.dumps(plan_dict)), layout, mesh)
        with pytest.raises(PlanFileError, match=message) as error:
            load_plan(write(tmp_path, data, "bad.json"))
        assert "\n" not in str(error.value)
