"""``planner compare plan.json measured.json`` and ``planner calibrate measured.json ... --cluster C
-o calibrated.toml``: predicted against measured, and the cost model fitted to measurements.

The measured side comes from ``launch.py --steps N --profile measured.json``
(``codegen.runtime.profiling``); the split into parts and the fit are
``cost_model.calibration``'s. A calibrated cluster file is an ordinary cluster file: the
planner reads it with ``--cluster calibrated.toml``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from cost_model.calibration import (
    ALL_COLLECTIVES,
    PARAMETERS,
    CalibrationCase,
    CalibrationFit,
    MeasuredRun,
    calibration_values,
    fit_calibration,
    load_measured,
    measured_matmul_efficiency,
    measured_parts,
    precision_dtype,
    predicted_parts,
    with_calibration,
)
from planner.cluster import Cluster
from planner.errors import ClusterError, PlanFileError
from planner.plan_identity import plan_fingerprint


@dataclass(frozen=True)
class ComparedPart:
    """One row of the comparison: seconds per step on rank 0, predicted and measured."""

    name: str
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float | None:
        """predicted / measured - 1 (None when nothing was measured)."""
        return self.predicted_s / self.measured_s - 1 if self.measured_s > 0 else None


_GRAPHS: dict[str, object] = {}  # traced graphs by model spec, within one process


def plan_and_graph(plan_data: dict, source: str, cluster: Cluster | None = None):
    """A plan from its saved form (on ``cluster`` when given) and its model's traced graph.

    Raises:
        PlanFileError: the plan is invalid, or ``cluster`` has another world size.
    """
    from planner.api import build_planned_model, check_plan_against_graph
    from planner.plans import Plan
    from planner.trace import trace

    plan = Plan.from_dict(plan_data, source=source)
    if cluster is not None:
        if cluster.world_size != plan.cluster.world_size:
            raise PlanFileError(
                f"--cluster has {cluster.world_size} devices but the plan in {source} was made for "
                f"{plan.cluster.world_size}; give a cluster of {plan.cluster.world_size} devices"
            )
        plan = dataclasses.replace(plan, cluster=cluster)
    key = json.dumps(plan_data.get("model"), sort_keys=True)
    graph = _GRAPHS.get(key)
    if graph is None:
        graph = _GRAPHS[key] = trace(*build_planned_model(plan))
    check_plan_against_graph(plan, graph)
    return plan, graph


def check_measured_plan(plan, plan_source: str, run: MeasuredRun) -> None:
    """Refuse, with one line naming both files, a measured file of another plan or world size
    than ``plan`` (read from ``plan_source``): its figures would be set beside predictions
    for a program that did not run.

    Raises:
        PlanFileError: the world sizes or the plan fingerprints (``planner.plan_identity``) differ.
    """
    world = plan.cluster.world_size
    if run.world_size != world:
        raise PlanFileError(
            f"measured file '{run.source}' was measured on {run.world_size} ranks but plan '{plan_source}' runs on "
            f"{world}; compare a measurement of this plan (torchrun --nproc_per_node {world} ... --profile)"
        )
    fingerprint = plan_fingerprint(plan.to_dict())
    if run.plan_fingerprint != fingerprint:
        raise PlanFileError(
            f"measured file '{run.source}' measured another plan (fingerprint {run.plan_fingerprint}) than "
            f"'{plan_source}' (fingerprint {fingerprint}); compare it with the plan it measured (its program's "
            f"plan.json), or measure this plan with its own launch.py --profile"
        )


def check_runs_fit_cluster(runs: list[MeasuredRun], cluster: Cluster, cluster_name: str) -> None:
    """Refuse, with one line, a measured file of another world size than the cluster being
    calibrated: the fitted link and overheads hold at the process count they were measured at.

    Raises:
        PlanFileError: naming the first such file and both sizes.
    """
    for run in runs:
        if run.world_size != cluster.world_size:
            raise PlanFileError(
                f"measured file '{run.source}' was measured on {run.world_size} ranks but --cluster {cluster_name} has "
                f"{cluster.world_size} devices; calibrate a cluster of the size the runs were measured at (e.g. "
                f"--cluster cpu:1x{run.world_size}), or measure at {cluster.world_size}"
            )


def compare(plan, graph, run: MeasuredRun) -> list[ComparedPart]:
    """Predicted and measured seconds per step of every part either side has, step first."""
    predicted = predicted_parts(plan, graph)
    measured = measured_parts(run)
    def order(name: str) -> tuple:  # step, compute, all collectives, each kind, sync
        rank = 0 if name == "step" else 1 if name.startswith("compute") else 2 if name == ALL_COLLECTIVES else 4 if name == "sync" else 3
        return rank, name

    names = sorted(set(predicted) | set(measured), key=order)
    return [ComparedPart(name, predicted.get(name, 0.0), measured.get(name, 0.0)) for name in names]


def format_comparison(parts: list[ComparedPart], run: MeasuredRun, plan_name: str) -> str:
    """The comparison as a table, with a note on how noisy the measurement was."""
    lines = [
        f"plan {plan_name}: predicted against measured (rank 0, per step; measured: median of "
        f"{len(run.step_times_s)} clean steps, spread {run.noise:.0%}; parts from {run.source}'s profile)",
        f"{'part':<28}{'predicted':>12}{'measured':>12}{'error':>9}",
    ]
    for part in parts:
        error = f"{part.error:+.0%}" if part.error is not None else "-"
        lines.append(f"{part.name:<28}{part.predicted_s * 1e3:>10.3f}ms{part.measured_s * 1e3:>10.3f}ms{error:>9}")
    lines.append(
        "error = predicted / measured - 1; profiled parts include the profiler's own overhead, and "
        "'sync' is the 0-byte collectives (barriers, scalar reductions) the model does not price"
    )
    return "\n".join(lines)


def calibration_cases(runs: list[MeasuredRun]) -> list[CalibrationCase]:
    """Each run's plan (on its own cluster), graph and measured step time."""
    cases = []
    for run in runs:
        plan, graph = plan_and_graph(run.plan_data, run.source)
        cases.append(CalibrationCase(plan=plan, graph=graph, measured_step_s=run.step_time_s, name=plan.name))
    return cases


def calibrate(runs: list[MeasuredRun], cluster: Cluster, cases: list[CalibrationCase] | None = None
              ) -> tuple[Cluster, CalibrationFit]:
    """``cluster`` with its efficiencies and link fitted to ``runs`` (``cost_model.calibration``).

    The start point is ``cluster``'s own values with the matmul efficiency measured from the
    profiles (the median over runs; above 1 where the datasheet peak is too low, which
    ``with_calibration`` writes as a raised peak).
    """
    if not runs:
        raise PlanFileError("calibrate needs at least one measured.json; write them with launch.py --profile")
    cases = cases if cases is not None else calibration_cases(runs)
    start = calibration_values(cluster)
    peak = cluster.nodes[0].device.flops_for(precision_dtype(cases[0].plan))
    direct = sorted(value for value in (measured_matmul_efficiency(run, peak) for run in runs) if value)
    if direct:
        start["matmul_efficiency"] = min(100.0, direct[len(direct) // 2])
    fit = fit_calibration(cases, start)
    return with_calibration(cluster, fit.values), fit


def format_fit(fit: CalibrationFit, cases: list[CalibrationCase]) -> str:
    """The fitted parameters beside the start, and each run's step time before and after."""
    from cost_model.calibration import step_time_with

    units = {"kernel_overhead_s": 1e6, "dtensor_op_overhead_s": 1e6, "redistribute_overhead_s": 1e6,
             "link_latency_s": 1e6, "link_bandwidth": 1e-9}
    shown = {"kernel_overhead_s": "kernel overhead (us)", "dtensor_op_overhead_s": "DTensor op overhead (us)",
             "redistribute_overhead_s": "redistribute overhead (us)",
             "link_latency_s": "link latency (us)", "link_bandwidth": "link bandwidth (GB/s)"}
    lines = [f"{'parameter':<24}{'start':>12}{'fitted':>12}"]
    for name in PARAMETERS:
        scale = units.get(name, 1.0)
        lines.append(f"{shown.get(name, name):<24}{fit.start[name] * scale:>12.4g}{fit.values[name] * scale:>12.4g}")
    lines.append(f"{'run':<32}{'measured':>11}{'before':>11}{'after':>11}")
    for case in cases:
        before, after = step_time_with(case, fit.start), step_time_with(case, fit.values)
        lines.append(f"{case.name[:31]:<32}{case.measured_step_s * 1e3:>9.2f}ms{before * 1e3:>9.2f}ms{after * 1e3:>9.2f}ms")
    lines.append(f"mean squared log error {fit.loss_before:.3f} -> {fit.loss_after:.3f} ({fit.simulations} simulations)")
    return "\n".join(lines)


def load_runs(paths: list[str]) -> list[MeasuredRun]:
    """Every ``measured.json`` in ``paths`` (PlanFileError naming a bad one)."""
    return [load_measured(path) for path in paths]


def check_cluster_output(path: str | Path, force: bool) -> Path:
    """The calibrated cluster file's path, checked before any work (ClusterError/OutputError)."""
    from planner.cluster import is_cluster_file_we_wrote
    from planner.outputs import check_output_file

    output = Path(path)
    if output.suffix.lower() not in (".toml", ".json"):
        raise ClusterError(f"cluster file {output} must end in .toml or .json, got {output.suffix!r}")
    check_output_file(output, what="cluster file", is_ours=is_cluster_file_we_wrote, force=force)
    return output
