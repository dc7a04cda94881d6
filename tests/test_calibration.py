"""``planner compare`` and ``planner calibrate`` on measured.json files written here, with the
values they must give worked out by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import planner
from cost_model.calibration import (
    CalibrationCase,
    fit_calibration,
    load_measured,
    measured_matmul_efficiency,
    measured_parts,
    op_class,
    predicted_parts,
    step_time_with,
)
from cost_model.compute import op_times
from planner.cli import main as cli_main
from planner.cluster import Cluster
from planner.errors import PlanFileError
from planner.model_spec import ModelSpec

REPO = Path(__file__).resolve().parent.parent
MLP = {"batch_size": 16, "in_features": 32, "hidden": 64, "out_features": 8, "layers": 2}


def _measured(plan_data: dict, step_s: float, **extra) -> dict:
    record = {
        "format": "soap-planner-measured", "version": 1, "plan": plan_data, "world_size": 2, "backend": "gloo",
        "device": "cpu", "step_times_s": [step_s * 0.9, step_s, step_s * 1.2], "step_time_s": step_s, "profiled_steps": 2,
        "ops": {}, "collectives": [],
    }
    record.update(extra)
    return record


@pytest.fixture(scope="module")
def ddp_plan():
    return planner.plan(ModelSpec(str(REPO / "examples/mlp.py"), MLP), "cpu:1x2", dp_flavour="ddp")


def test_measured_parts_and_matmul_efficiency_by_hand(tmp_path: Path) -> None:
    ops = {
        "aten::mm": {"count": 6, "time_s": 0.002, "flops": 1.0e8},
        "aten::addmm": {"count": 2, "time_s": 0.003, "flops": 2.0e8},
        "aten::relu": {"count": 2, "time_s": 0.001, "flops": 0.0},
        "aten::_foreach_add_": {"count": 1, "time_s": 0.0005, "flops": 0.0},
        "optimizer.step": {"count": 1, "time_s": 0.0008, "flops": 0.0},  # the foreach op + 0.3 ms of "other"
    }
    collectives = [
        {"kind": "all_reduce", "bytes": 4096, "count": 1, "time_s": 0.004},
        {"kind": "all_reduce", "bytes": 1024, "count": 2, "time_s": 0.001},
        {"kind": "all_reduce", "bytes": 0, "count": 3, "time_s": 0.0007},
    ]
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(_measured({"any": "plan"}, 0.02, ops=ops, collectives=collectives)))
    run = load_measured(path)
    parts = measured_parts(run)
    assert parts == pytest.approx({
        "step": 0.02, "compute: matmul": 0.005, "compute: other": 0.0007, "compute: optimizer": 0.0008,
        "all_reduce": 0.005, "collectives: all": 0.005, "sync": 0.0007,
    })
    # 3e8 FLOPs in 5 ms = 6e10 FLOP/s, over a 1e11 peak.
    assert measured_matmul_efficiency(run, 1e11) == pytest.approx(0.6)
    assert run.noise == pytest.approx((1.2 - 0.9) / 1.0)
    assert [op_class(name) for name in ("aten.mm.default", "aten::bmm", "aten.gelu.default", "aten::_foreach_mul_")] == [
        "matmul", "matmul", "other", "optimizer"]


def test_bad_measured_files_are_one_line(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text("{not json")
    with pytest.raises(PlanFileError, match="is not JSON"):
        load_measured(path)
    path.write_text(json.dumps({"format": "soap-planner-plan"}))
    with pytest.raises(PlanFileError, match="not a soap-planner measured file"):
        load_measured(path)
    path.write_text(json.dumps({**_measured({}, 0.01), "version": 99}))
    with pytest.raises(PlanFileError, match="version 99"):
        load_measured(path)
    record = _measured({}, 0.01)
    del record["ops"]
    path.write_text(json.dumps(record))
    with pytest.raises(PlanFileError, match="missing or invalid field"):
        load_measured(path)
    with pytest.raises(PlanFileError, match="does not exist"):
        load_measured(tmp_path / "none.json")


def test_predicted_parts_split_the_simulated_compute_by_op_class(ddp_plan) -> None:
    graph = ddp_plan.graph
    device = ddp_plan.cluster.device_of(0)
    parts = predicted_parts(ddp_plan, graph)
    # DDP on 2 ranks: each op does half its traced work; forward + backward of each.
    by_class = {"matmul": 0.0, "other": 0.0}
    for node in graph.nodes:
        forward, backward = op_times(node, 0.5, device, ddp_plan.precision)
        by_class[op_class(node.op)] += forward + backward
    assert parts["compute: matmul"] == pytest.approx(by_class["matmul"])
    assert parts["compute: other"] == pytest.approx(by_class["other"])
    assert parts["step"] == pytest.approx(planner.simulate(ddp_plan).step_time_s)
    assert parts["all_reduce"] > 0  # DDP's gradient all-reduce, on the collective stream


def test_fit_recovers_known_parameters() -> None:
    """Cases whose 'simulator' is a formula in two parameters; measured from known values."""
    truth = {"matmul_efficiency": 0.25, "kernel_overhead_s": 2e-5}

    def formula(case, values):  # seconds = FLOPs / (1e10 x efficiency) + kernels x overhead
        flops, kernels = case.plan
        return flops / (1e10 * values["matmul_efficiency"]) + kernels * values["kernel_overhead_s"]

    cases = [CalibrationCase(plan=(flops, kernels), graph=None, measured_step_s=formula(CalibrationCase((flops, kernels), None, 1), truth))
             for flops, kernels in ((1e9, 10), (1e7, 2000), (3e8, 500))]
    start = {"matmul_efficiency": 0.7, "memory_efficiency": 0.5, "kernel_overhead_s": 5e-6, "link_latency_s": 1e-5,
             "link_bandwidth": 1e9}
    fit = fit_calibration(cases, start, simulate=formula, parameters=("matmul_efficiency", "kernel_overhead_s"), prior_weight=0)
    assert fit.values["matmul_efficiency"] == pytest.approx(0.25, rel=0.05)
    assert fit.values["kernel_overhead_s"] == pytest.approx(2e-5, rel=0.05)
    assert fit.loss_after < 1e-3 < fit.loss_before
    assert fit.values["link_bandwidth"] == start["link_bandwidth"]  # not asked for
    again = fit_calibration(cases, start, simulate=formula, parameters=("matmul_efficiency", "kernel_overhead_s"), prior_weight=0)
    assert again == fit  # deterministic
    # With the prior, a parameter the runs do not depend on stays where it started.
    held = fit_calibration(cases, start, simulate=formula)
    assert held.values["link_bandwidth"] == start["link_bandwidth"] and held.values["memory_efficiency"] == 0.5
    assert held.values["matmul_efficiency"] == pytest.approx(0.25, rel=0.1)


def test_cli_compare_and_calibrate(ddp_plan, tmp_path: Path, capsys) -> None:
    """A run measured 3x slower than predicted: compare shows -67% on the step; the
    calibrated cluster predicts it within 5%, and the planner reads that file."""
    ddp_plan.save(tmp_path / "plan.json")
    predicted = planner.simulate(ddp_plan).step_time_s
    measured = tmp_path / "measured.json"
    ops = {"aten::mm": {"count": 8, "time_s": predicted, "flops": 0.0}}
    measured.write_text(json.dumps(_measured(ddp_plan.to_dict(), 3 * predicted, ops=ops)))
    assert cli_main(["compare", str(tmp_path / "plan.json"), str(measured)]) == 0
    table = capsys.readouterr().out
    step_row = next(line for line in table.splitlines() if line.startswith("step "))
    assert step_row.split()[-1] == "-67%", table
    output = tmp_path / "calibrated.toml"
    assert cli_main(["calibrate", str(measured), "--cluster", "cpu:1x2", "-o", str(output)]) == 0
    assert "wrote" in capsys.readouterr().out
    cluster = Cluster.load(output)
    assert cluster.nodes[0].device.calibration  # the fitted efficiencies are in the file
    after = step_time_with(CalibrationCase(plan=ddp_plan, graph=ddp_plan.graph, measured_step_s=3 * predicted),
                           {"matmul_efficiency": cluster.nodes[0].device.matmul_efficiency,
                            "memory_efficiency": cluster.nodes[0].device.memory_efficiency,
                            "kernel_overhead_s": cluster.nodes[0].device.kernel_overhead_s,
                            "link_latency_s": cluster.nodes[0].intra_link.latency,
                            "link_bandwidth": cluster.nodes[0].intra_link.bandwidth})
    assert math.isclose(after, 3 * predicted, rel_tol=0.05)
    assert cli_main(["calibrate", str(measured), "--cluster", "cpu:1x2", "-o", str(tmp_path / "c.yaml")]) == 2
    assert "must end in .toml or .json" in capsys.readouterr().err
