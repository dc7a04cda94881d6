"""``planner compare`` and ``planner calibrate`` on measured.json files written here, with the
values they must give worked out by hand."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

import planner
from cost_model.calibration import (
    CalibrationCase,
    calibration_values,
    fit_calibration,
    load_measured,
    measured_matmul_efficiency,
    measured_parts,
    op_class,
    predicted_parts,
    step_time_with,
    with_calibration,
)
from cost_model.calibration_fit import nnls
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
    with pytest.raises(PlanFileError, match="is not valid JSON"):
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
    with pytest.raises(PlanFileError, match="field 'ops' is missing"):
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


_START = {"matmul_efficiency": 0.7, "memory_efficiency": 0.5, "kernel_overhead_s": 5e-6, "dtensor_op_overhead_s": 0.0,
          "redistribute_overhead_s": 0.0, "link_latency_s": 1e-5, "link_bandwidth": 1e9}


def _formula(case, values):
    """A stand-in simulator, linear in the time coefficients like the real one: seconds =
    FLOPs / (1e10 x matmul eff.) + bytes / (1e9 x memory eff.) + ops x overhead + DTensor ops
    x their overhead + in-line collectives x theirs + collectives x latency + bytes sent /
    bandwidth."""
    flops, streamed, ops, dtensor_ops, in_line, collectives, sent = case.plan
    return (flops / (1e10 * values["matmul_efficiency"]) + streamed / (1e9 * values["memory_efficiency"])
            + ops * values["kernel_overhead_s"] + dtensor_ops * values["dtensor_op_overhead_s"]
            + in_line * values["redistribute_overhead_s"] + collectives * values["link_latency_s"]
            + sent / values["link_bandwidth"])


def _cases(truth, shapes):
    return [CalibrationCase(plan=shape, graph=None, measured_step_s=_formula(CalibrationCase(shape, None, 1), truth))
            for shape in shapes]


def test_fit_recovers_known_parameters() -> None:
    """Runs measured from known values of all seven parameters (a matmul efficiency above 1: a
    datasheet peak too low) are fitted back to them, from a start far off."""
    truth = {"matmul_efficiency": 2.5, "memory_efficiency": 0.3, "kernel_overhead_s": 2e-5, "dtensor_op_overhead_s": 8e-5,
             "redistribute_overhead_s": 2e-3, "link_latency_s": 1e-3, "link_bandwidth": 2e8}
    shapes = [  # (FLOPs, bytes streamed, ops, DTensor ops, in-line collectives, collectives, bytes sent):
        # DDP-, tp-, pp-like
        (1e9, 1e7, 1000, 0, 0, 3, 4e6), (1e9, 1e7, 1200, 0, 0, 56, 8e6), (1e9, 2e7, 1000, 900, 32, 36, 1.8e7),
        (5e8, 5e6, 600, 500, 0, 8, 1e6), (2e9, 1e7, 1500, 0, 0, 15, 8e6), (1e9, 3e7, 1400, 1300, 40, 44, 2.3e7),
        (3e9, 1e6, 200, 0, 0, 2, 1e5), (1e8, 1e6, 3000, 0, 0, 5, 2e5), (2e9, 2e7, 1800, 1700, 12, 12, 9e6),
    ]
    cases = _cases(truth, shapes)
    fit = fit_calibration(cases, _START, simulate=_formula, prior_weight=0)
    for name, value in truth.items():
        assert fit.values[name] == pytest.approx(value, rel=1e-3), name
    assert fit.loss_after < 1e-8 < 0.1 < fit.loss_before
    assert fit_calibration(cases, _START, simulate=_formula, prior_weight=0) == fit  # deterministic


def test_fit_holds_what_the_runs_do_not_see() -> None:
    """Runs without DTensor ops or collectives say nothing of their overhead, latency or
    bandwidth: the prior keeps those at the start, while the others are fitted."""
    truth = {**_START, "matmul_efficiency": 0.25, "kernel_overhead_s": 2e-5}
    cases = _cases(truth, [(1e9, 1e6, 10, 0, 0, 0, 0), (1e7, 1e6, 2000, 0, 0, 0, 0), (3e8, 1e6, 500, 0, 0, 0, 0)])
    fit = fit_calibration(cases, _START, simulate=_formula)
    assert fit.values["matmul_efficiency"] == pytest.approx(0.25, rel=0.05)
    assert fit.values["kernel_overhead_s"] == pytest.approx(2e-5, rel=0.05)
    for name in ("dtensor_op_overhead_s", "redistribute_overhead_s", "link_latency_s", "link_bandwidth"):
        assert fit.values[name] == pytest.approx(_START[name], rel=1e-6, abs=1e-12), name
    only = fit_calibration(cases, _START, simulate=_formula, parameters=("kernel_overhead_s",))
    assert only.values["matmul_efficiency"] == _START["matmul_efficiency"]  # not asked for


def test_nnls_by_hand() -> None:
    # min |A x - b|, x >= 0: unconstrained x = (1, -1) is infeasible; with x2 = 0, x1 = b.a1 / |a1|^2.
    matrix = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    target = np.array([1.0, -1.0, 0.0])
    assert nnls(matrix, target) == pytest.approx([0.5, 0.0])
    assert nnls(matrix, np.array([1.0, 2.0, 3.0])) == pytest.approx([1.0, 2.0])  # interior: exact


def test_calibrated_cluster_file_round_trip(tmp_path: Path) -> None:
    """Every fitted value is written to the cluster file and read back; an efficiency above 1
    is written as a raised peak (efficiency 1)."""
    base = Cluster.preset("cpu", devices_per_node=2)
    values = {"matmul_efficiency": 3.0, "memory_efficiency": 0.4, "kernel_overhead_s": 3e-6, "dtensor_op_overhead_s": 6e-5,
              "redistribute_overhead_s": 7e-4, "link_latency_s": 4e-4, "link_bandwidth": 3e8}
    cluster = with_calibration(base, values)
    path = tmp_path / "calibrated.toml"
    cluster.save(path)
    loaded = Cluster.load(path)
    device = loaded.nodes[0].device
    assert device.peak_flops["float32"] == pytest.approx(3.0 * base.nodes[0].device.peak_flops["float32"])
    assert device.matmul_efficiency == 1.0 and device.memory_efficiency == pytest.approx(0.4)
    assert device.kernel_overhead_s == pytest.approx(3e-6) and device.dtensor_op_overhead_s == pytest.approx(6e-5)
    assert loaded.nodes[0].intra_link.latency == pytest.approx(4e-4)
    assert loaded.nodes[0].intra_link.bandwidth == pytest.approx(3e8)
    assert device.redistribute_overhead_s == pytest.approx(7e-4)
    assert "dtensor_op_overhead_s" in path.read_text() and "redistribute_overhead_s" in path.read_text()
    assert calibration_values(loaded) == pytest.approx({**values, "matmul_efficiency": 1.0})


def test_dtensor_overhead_is_charged_to_graph_programs_only(ddp_plan) -> None:
    """A DDP program (plain module) does not pay DTensor dispatch; a tensor-parallel one (graph
    replayed on DTensors) pays it on each traced op, forward and backward, and on its
    optimizer's ops."""
    from cost_model.simulator import Simulator
    from planner import baselines

    values = {**calibration_values(ddp_plan.cluster), "dtensor_op_overhead_s": 1e-4}
    case = CalibrationCase(plan=ddp_plan, graph=ddp_plan.graph, measured_step_s=1.0)
    assert step_time_with(case, values) == pytest.approx(step_time_with(case, calibration_values(ddp_plan.cluster)))
    tp = baselines.megatron(ModelSpec(str(REPO / "examples/mlp.py"), MLP), "cpu:1x2", tp=2, precision="fp32")
    graph = ddp_plan.graph
    plain = Simulator(dataclasses.replace(tp, cluster=with_calibration(tp.cluster, {**values, "dtensor_op_overhead_s": 0.0})), graph)
    charged = Simulator(dataclasses.replace(tp, cluster=with_calibration(tp.cluster, values)), graph)
    graded = sum(1 for node in graph.nodes if any(meta.dtype.is_floating_point for meta in node.output_meta))
    added = sum(c.forward_s + c.backward_s for c in charged.costs.values()) - sum(c.forward_s + c.backward_s for c in plain.costs.values())
    assert added == pytest.approx((len(graph.nodes) + graded) * 1e-4)


def test_redistribute_overhead_is_charged_per_in_line_collective(ddp_plan) -> None:
    """Megatron tp on the 2-layer MLP issues two collectives in line: the all-reduce of the
    row-parallel layer's partial output before the loss (forward) and the all-reduce of the
    column-parallel layer's input gradient (backward, Megatron's f). At 1 ms of redistribute
    overhead each, the step grows by exactly 2 ms; the DDP program's bucketed all-reduce
    does not pay it."""
    from planner import baselines

    values = {**calibration_values(ddp_plan.cluster), "redistribute_overhead_s": 1e-3}
    ddp = CalibrationCase(plan=ddp_plan, graph=ddp_plan.graph, measured_step_s=1.0)
    assert step_time_with(ddp, values) == pytest.approx(step_time_with(ddp, calibration_values(ddp_plan.cluster)))
    tp = baselines.megatron(ModelSpec(str(REPO / "examples/mlp.py"), MLP), "cpu:1x2", tp=2, precision="fp32")
    case = CalibrationCase(plan=tp, graph=ddp_plan.graph, measured_step_s=1.0)
    added = step_time_with(case, values) - step_time_with(case, calibration_values(tp.cluster))
    assert added == pytest.approx(2e-3)


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
    after = planner.simulate(dataclasses.replace(ddp_plan, cluster=cluster)).step_time_s
    assert math.isclose(after, 3 * predicted, rel_tol=0.05)
    assert cli_main(["calibrate", str(measured), "--cluster", "cpu:1x2", "-o", str(tmp_path / "c.yaml")]) == 2
    assert "must end in .toml or .json" in capsys.readouterr().err
