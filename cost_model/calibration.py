"""Closing the loop: measured runs (``launch.py --profile measured.json``) against the cost
model, and the cost model's efficiencies fitted to them.

Two pieces:

* ``predicted_parts`` / ``measured_parts``: one step of a plan split the same way on both
  sides: the step; compute by op class (``matmul``: matmul-like kernels; ``other``: every
  other op; ``optimizer``: the optimizer step); communication by collective kind. Predicted
  figures are rank 0's device (the simulator's node costs times the micro-batches, and the
  simulated timeline's collective tasks); measured ones are rank 0's profile.

* ``fit_calibration``: the parameters the cost model reads from a cluster file (a device's
  ``matmul_efficiency``, ``memory_efficiency``, ``kernel_overhead_s`` and
  ``dtensor_op_overhead_s``, the DTensor dispatch a graph program pays per op;
  ``redistribute_overhead_s``, what it pays more per collective issued in line; the intra-node
  link's latency and bandwidth, i.e. the collectives' alpha and beta) chosen so the
  simulated step times of the measured plans match their measured ones in relative error
  (a plan of 40 ms weighs like one of 400 ms). The start is the cluster's own values, with
  the matmul efficiency measured directly from the profiles (profiled FLOPs of matmul
  kernels over their time, over the peak). The fit is Gauss-Newton with non-negative least
  squares on the parameters written as time coefficients, in which the simulated step is
  piecewise linear (``cost_model.calibration_fit``): it counts simulations, never seconds,
  so the same files give the same cluster on any machine.

Measured step times on a shared machine are noisy; the measured figure is the median of
the run's clean steps (``codegen.runtime.profiling``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cost_model import defaults
from cost_model.calibration_fit import gauss_newton_fit, prior_penalty
from cost_model.compute import PRECISIONS
from planner.cluster import Cluster, LinkSpec, NodeSpec
from planner.errors import PlanFileError, one_line
from planner.json_files import finite_number, read_json
from planner.plan_identity import plan_fingerprint, plan_world_size

MEASURED_FORMAT = "soap-planner-measured"
MEASURED_VERSION = 1
_OP_FIGURES = ("count", "time_s", "flops")  # per op and step, in every measured file
_COLLECTIVE_KIND = re.compile(r"[a-z][a-z0-9_]{0,39}")
OP_CLASSES = ("matmul", "other", "optimizer")
# Matmul-like kernels (measured ``aten::name`` and traced ``aten.name.overload`` share the name).
MATMUL_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution", "mkldnn_convolution",
    "convolution_backward", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_attention_math", "einsum",
})
# The optimizer step's kernels: torch.optim's foreach implementations, and the single-tensor
# ops of AdamW/SGD.
OPTIMIZER_OPS_PREFIX = "_foreach_"
# Names of the simulated collective tasks ("all-gather blocks.0") -> collective kind.
_TASK_KINDS = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
               "all-to-all": "all_to_all", "broadcast": "broadcast", "send": "send_recv", "recv": "send_recv",
               "p2p": "send_recv"}
ALL_COLLECTIVES = "collectives: all"
TP_COLLECTIVES = "tensor-parallel collectives"
OPTIMIZER_STEP = "optimizer.step"  # the profile's whole optimizer step (codegen.runtime.profiling)
PARAMETERS = ("matmul_efficiency", "memory_efficiency", "kernel_overhead_s", "dtensor_op_overhead_s",
              "redistribute_overhead_s", "link_latency_s", "link_bandwidth")


@dataclass(frozen=True)
class MeasuredRun:
    """One ``measured.json``: the plan (as saved), its step times and rank 0's profile."""

    source: str
    plan_data: dict
    world_size: int
    step_time_s: float
    step_times_s: tuple[float, ...]
    ops: dict[str, dict[str, float]]
    collectives: tuple[dict[str, Any], ...]
    plan_fingerprint: str = ""  # of ``plan_data`` (planner.plan_identity)

    @property
    def noise(self) -> float:
        """Spread of the clean steps: (max - min) / median."""
        return (max(self.step_times_s) - min(self.step_times_s)) / self.step_time_s if self.step_times_s else 0.0


def load_measured(path: str | Path) -> MeasuredRun:
    """Read a ``measured.json`` written by ``launch.py --profile``.

    Raises:
        PlanFileError: the file is missing, not JSON, of another format or version, or a
            field is missing or of the wrong type (the message names it).
    """
    path = Path(path)
    where = f"measured file '{path}'"
    again = "write it again with launch.py --profile"
    data = read_json(path, where, again, PlanFileError,
                     missing=f"does not exist; write one with `torchrun ... launch.py --steps 10 --profile {path}`")
    if not isinstance(data, dict) or data.get("format") != MEASURED_FORMAT:
        raise PlanFileError(f"{where} is not a soap-planner measured file (no \"format\": \"{MEASURED_FORMAT}\"); "
                            f"write one with launch.py --profile")
    if data.get("version") != MEASURED_VERSION:
        raise PlanFileError(f"{where} is version {one_line(data.get('version'))[:20]}; this soap-planner reads version "
                            f"{MEASURED_VERSION}; measure again with this version's launch.py --profile")

    def number(value: Any, name: str) -> float:
        # Every figure is a count, bytes or seconds: a finite number >= 0 (JSON's 1e999 reads as inf).
        number = finite_number(value)  # None for inf, nan, text and integers beyond a float
        if number is None or number < 0:
            raise PlanFileError(f"{where}: field '{one_line(name)[:80]}' must be a finite number >= 0, got "
                                f"{one_line(repr(value))[:40]}; {again}")
        return number

    def field(table: Any, key: str, kind: type, prefix: str = "") -> Any:
        if not isinstance(table, dict) or key not in table:
            raise PlanFileError(f"{where}: field '{one_line(prefix + key)[:80]}' is missing; {again}")
        if not isinstance(table[key], kind) or isinstance(table[key], bool):
            raise PlanFileError(f"{where}: field '{prefix}{key}' must be {kind.__name__}, got "
                                f"{type(table[key]).__name__}; {again}")
        return table[key]

    def figure(table: Any, key: str, prefix: str = "") -> float:
        if not isinstance(table, dict) or key not in table:
            raise PlanFileError(f"{where}: field '{prefix}{key}' is missing; {again}")
        return number(table[key], prefix + key)

    world_size = field(data, "world_size", int)
    if world_size < 1:
        raise PlanFileError(f"{where}: field 'world_size' must be >= 1, got {world_size}; {again}")
    ops = {}
    for name, figures in field(data, "ops", dict).items():
        figures = field(data["ops"], name, dict, "ops.")
        ops[name] = {key: number(value, f"ops.{name}.{key}") for key, value in figures.items()}
        for key in _OP_FIGURES:  # every op has its count, time and FLOPs
            figure(figures, key, f"ops.{name}.")
    collectives = []
    for index, item in enumerate(field(data, "collectives", list)):
        at = f"collectives[{index}]."
        collectives.append({"kind": field(item, "kind", str, at),
                            **{key: figure(item, key, at) for key in ("bytes", "count", "time_s")}})
    run = MeasuredRun(
        source=str(path), plan_data=dict(field(data, "plan", dict)), world_size=world_size,
        step_time_s=figure(data, "step_time_s"),
        step_times_s=tuple(number(value, f"step_times_s[{i}]") for i, value in enumerate(field(data, "step_times_s", list))),
        ops=ops, collectives=tuple(collectives),
    )
    if not run.step_time_s > 0:
        raise PlanFileError(f"{where}: step_time_s must be a positive number, got {run.step_time_s!r}")
    for item in run.collectives:  # a kind names a row of `planner compare`'s table: a plain word
        if not _COLLECTIVE_KIND.fullmatch(item["kind"]):
            raise PlanFileError(f"{where}: collective kind {one_line(item['kind'])[:40]!r} is not a collective's name "
                                f"(such as all_reduce); {again}")
    return dataclasses.replace(run, plan_fingerprint=_checked_plan_identity(run, data.get("plan_fingerprint"), where))


def _checked_plan_identity(run: MeasuredRun, recorded: Any, where: str) -> str:
    """The fingerprint of the plan a measured file holds, checked against what the file
    recorded: its world size, and its plan fingerprint when it has one (files written before
    fingerprints were recorded have none; the plan they hold identifies them)."""
    planned = plan_world_size(run.plan_data)
    if planned is not None and planned != run.world_size:  # a plan without a mesh is refused when read as a plan
        raise PlanFileError(
            f"{where} was measured on {run.world_size} ranks but holds a plan for {planned}; the file was edited or "
            f"damaged: measure again with launch.py --profile"
        )
    fingerprint = plan_fingerprint(run.plan_data)
    if recorded is not None and recorded != fingerprint:
        raise PlanFileError(
            f"{where} records plan fingerprint {str(recorded)[:40]!r} but holds a plan whose fingerprint is "
            f"{fingerprint}; the file was edited or damaged: measure again with launch.py --profile"
        )
    return fingerprint


def op_class(name: str) -> str:
    """``matmul``, ``optimizer`` or ``other`` for an op name (``aten::mm`` or ``aten.mm.default``)."""
    base = name.removeprefix("aten::").removeprefix("aten.").split(".")[0]
    if base in MATMUL_OPS:
        return "matmul"
    if base.startswith(OPTIMIZER_OPS_PREFIX):
        return "optimizer"
    return "other"


def measured_parts(run: MeasuredRun) -> dict[str, float]:
    """Rank 0's measured seconds per step: ``step``, ``compute: <class>``, ``<collective kind>``
    (collectives of whole tensors), and ``sync`` (0-byte collectives: barriers, scalars)."""
    parts: dict[str, float] = defaultdict(float)
    parts["step"] = run.step_time_s
    for name, figures in run.ops.items():
        if name != OPTIMIZER_STEP:
            parts[f"compute: {op_class(name)}"] += figures["time_s"]
    if OPTIMIZER_STEP in run.ops:
        # The whole step as torch.optim annotates it; its single-tensor ops (CPU AdamW) were
        # counted as "other" above, its foreach ops as "optimizer".
        whole = run.ops[OPTIMIZER_STEP]["time_s"]
        parts["compute: other"] = max(0.0, parts["compute: other"] - max(0.0, whole - parts["compute: optimizer"]))
        parts["compute: optimizer"] = whole
    for item in run.collectives:
        if item["bytes"] > 0:
            parts[item["kind"]] += item["time_s"]
            parts[ALL_COLLECTIVES] += item["time_s"]
        else:
            parts["sync"] += item["time_s"]
    return dict(parts)


def measured_matmul_efficiency(run: MeasuredRun, peak_flops: float) -> float | None:
    """Profiled FLOPs of matmul kernels over their self time, as a fraction of ``peak_flops``
    (None when the profile holds no matmul FLOPs)."""
    flops = sum(figures.get("flops", 0.0) for name, figures in run.ops.items() if op_class(name) == "matmul")
    seconds = sum(figures["time_s"] for name, figures in run.ops.items() if op_class(name) == "matmul" and figures.get("flops"))
    return flops / seconds / peak_flops if flops > 0 and seconds > 0 else None


def predicted_parts(plan, graph) -> dict[str, float]:
    """The simulator's seconds per step for ``plan``, split as ``measured_parts``: rank 0's
    device (pipeline stage 0)."""
    from cost_model.simulator import Simulator

    simulator = Simulator(plan, graph)
    result = simulator.run()
    micro_batches = simulator.context.micro_batches
    stages = {strategy.node: strategy.stage for strategy in plan.strategies}
    parts: dict[str, float] = defaultdict(float)
    parts["step"] = result.step_time_s
    for node in graph.nodes:
        if stages.get(node.name, 0) != 0:
            continue
        cost = simulator.costs[node.name]
        parts[f"compute: {op_class(node.op)}"] += (cost.forward_s + cost.backward_s) * micro_batches
    device = "stage 0"
    for event in result.timeline:
        if event.device != device:
            continue
        if event.name.startswith("optimizer"):
            parts["compute: optimizer"] += event.duration_s
        elif event.stream != "compute":
            kind = _TASK_KINDS.get(event.name.split(" ")[0])
            parts[kind or "other collectives"] += event.duration_s
            parts[ALL_COLLECTIVES] += event.duration_s
        elif event.name.endswith("tp-comm"):
            # Tensor-parallel collectives sit on the critical path of the compute stream; the
            # task does not say which kind, so they count in the total only.
            parts[TP_COLLECTIVES] += event.duration_s
            parts[ALL_COLLECTIVES] += event.duration_s
    return dict(parts)


# ---------------------------------------------------------------- the fit

def calibration_values(cluster: Cluster) -> dict[str, float]:
    """The parameters ``fit_calibration`` fits, as ``cluster`` (its first node) sets them now."""
    node = cluster.nodes[0]
    device = node.device
    return {
        "matmul_efficiency": device.matmul_efficiency or defaults.MATMUL_EFFICIENCY,
        "memory_efficiency": device.memory_efficiency or defaults.MEMORY_EFFICIENCY,
        "kernel_overhead_s": defaults.KERNEL_OVERHEAD_S if device.kernel_overhead_s is None else device.kernel_overhead_s,
        "dtensor_op_overhead_s": device.dtensor_op_overhead_s or 0.0,
        "redistribute_overhead_s": device.redistribute_overhead_s or 0.0,
        "link_latency_s": node.intra_link.latency,
        "link_bandwidth": node.intra_link.bandwidth,
    }


def with_calibration(cluster: Cluster, values: dict[str, float]) -> Cluster:
    """``cluster`` with every device's calibration and every node's intra-node link set to
    ``values`` (the names of ``PARAMETERS``).

    An efficiency above 1 means the device is faster than its datasheet figure (the ``cpu``
    preset's peak is a round guess, not this machine's): the figure is raised by that factor
    and the efficiency written as 1, so the cluster file states the measured peak.

    The result keeps ``cluster.derived_from``: on a preset with measured NCCL curves, the
    calibrated intra-node link scales them (``planner.cluster_edits``) instead of replacing
    them with the α–β model.
    """
    def scaled_device(device):
        matmul, memory = values["matmul_efficiency"], values["memory_efficiency"]
        return dataclasses.replace(
            device,
            peak_flops={key: peak * max(1.0, matmul) for key, peak in device.peak_flops.items()},
            memory_bandwidth=device.memory_bandwidth * max(1.0, memory),
            matmul_efficiency=min(1.0, matmul), memory_efficiency=min(1.0, memory),
            kernel_overhead_s=values["kernel_overhead_s"], dtensor_op_overhead_s=values["dtensor_op_overhead_s"],
            redistribute_overhead_s=values["redistribute_overhead_s"],
        )

    nodes = tuple(
        NodeSpec(
            device=scaled_device(node.device), devices=node.devices,
            intra_link=LinkSpec(bandwidth=values["link_bandwidth"], latency=values["link_latency_s"]),
        )
        for node in cluster.nodes
    )
    return dataclasses.replace(cluster, nodes=nodes)


@dataclass(frozen=True)
class CalibrationCase:
    """One measured run ready to simulate: its plan, traced graph and measured step time."""

    plan: Any
    graph: Any
    measured_step_s: float
    name: str = ""


@dataclass(frozen=True)
class CalibrationFit:
    """The fitted parameters, the objective before and after, and the simulations it took."""

    values: dict[str, float]
    start: dict[str, float]
    loss_before: float
    loss_after: float
    simulations: int


def step_time_with(case: CalibrationCase, values: dict[str, float]) -> float:
    """The simulated step time of ``case``'s plan on its own cluster calibrated with ``values``."""
    from cost_model.simulator import Simulator

    plan = dataclasses.replace(case.plan, cluster=with_calibration(case.plan.cluster, values))
    return Simulator(plan, case.graph).run(trace=False).step_time_s


def fit_loss(cases: Sequence[CalibrationCase], values: dict[str, float], simulate: Callable = step_time_with) -> float:
    """Mean squared log ratio of predicted to measured step time over ``cases``."""
    return sum(math.log(simulate(case, values) / case.measured_step_s) ** 2 for case in cases) / len(cases)


# Weight of the pull towards the start, per parameter (``cost_model.calibration_fit``): with
# a few runs and six parameters, one the runs cannot pin down (a bandwidth no collective is
# sensitive to) would otherwise wander to a bound. 1e-4 costs a 10x move of a coefficient
# 5e-4 (``prior_penalty``), small beside a 10% step-time miss (1e-2 per run): the prior only
# decides what the runs leave open. (Of 1e-3, 1e-4 and 1e-5, 1e-3 held the link latency
# and DTensor overhead visibly short of what CPU runs need; 1e-4 and 1e-5 scored alike in
# benchmarks/measured_vs_predicted.py.)
PRIOR_WEIGHT = 1e-4


def fit_calibration(
    cases: Sequence[CalibrationCase], start: dict[str, float], simulate: Callable = step_time_with,
    parameters: Sequence[str] = PARAMETERS, prior_weight: float = PRIOR_WEIGHT,
) -> CalibrationFit:
    """``parameters`` fitted to the measured step times of ``cases``: Gauss-Newton with
    non-negative least squares on the relative error (``cost_model.calibration_fit``).

    Args:
        cases: the measured runs.
        start: a value for each of ``PARAMETERS`` (the prior's centre too).
        simulate: (case, values) -> predicted step seconds (the simulator; tests pass a formula).
        parameters: which of ``PARAMETERS`` to fit (the others stay at ``start``).
        prior_weight: see ``PRIOR_WEIGHT``; 0 for a plain least-squares fit.
    Returns:
        The fit (``loss_before``/``loss_after``: the mean squared log error of the step times
        alone); deterministic for the same inputs.
    """
    if not cases:
        raise PlanFileError("calibration needs at least one measured run; pass measured.json files")
    def observe(case, values):
        return [simulate(case, values)]

    values, trace = gauss_newton_fit(cases, start, observe, [[case.measured_step_s] for case in cases],
                                     [[1.0] for _ in cases], parameters, prior_weight)
    return CalibrationFit(values=values, start=dict(start), loss_before=fit_loss(cases, start, simulate),
                          loss_after=fit_loss(cases, values, simulate), simulations=trace.simulations + 2 * len(cases))


def precision_dtype(plan) -> str:
    """The peak-FLOPs key of ``plan``'s precision."""
    return PRECISIONS[plan.precision][0]
