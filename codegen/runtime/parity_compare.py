"""The comparison under ``launch.py --check``: how far each sharded tensor is from one device.

Shared by the check of graph, data-parallel and MoE programs (``codegen.runtime.parity``) and
the check of pipeline programs (``codegen.runtime.pipeline_parity``): the per-tensor
difference and its verdict over every rank, the single-device reference model, and the
single-device optimizer step that updated parameters are compared with.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from codegen.runtime.optimizers import make_optimizer
from codegen.runtime.precision import AUTOCAST_DTYPES, run_in_autocast, run_with_bf16_weights
from codegen.runtime.program import Program
from planner.program_shape import wraps_bf16_fsdp_units


@dataclass(frozen=True)
class TensorDiff:
    """How far one sharded tensor is from its single-device value."""

    name: str
    max_abs_err: float
    violation: float  # max of |a-b| / (atol + rtol*|b|); above 1 fails

    @property
    def ok(self) -> bool:
        return self.violation <= 1.0


@dataclass(frozen=True)
class ParityResult:
    """Outcome of a parity check over every compared tensor on every rank."""

    compared: int
    max_abs_err: float
    worst: TensorDiff
    randomness: str = ""  # what was switched off (RandomnessReport.line), printed before the verdict
    in_float64: bool = False  # both steps ran in float64 (check_parity's float64)
    float64_possible: bool = False  # an fp32 program --fp64 could check (named on failure)

    @property
    def ok(self) -> bool:
        return self.worst.ok

    def message(self, atol: float, rtol: float) -> str:
        if self.ok:
            where = " in float64" if self.in_float64 else ""
            return (f"parity ok: max_abs_err={self.max_abs_err:.3e} ({self.compared} tensors compared{where}, "
                    f"atol={atol}, rtol={rtol})")
        return (
            f"parity FAILED: worst tensor {self.worst.name}: max_abs_err={self.worst.max_abs_err:.3e} "
            f"({self.worst.violation:.1f}x the tolerance atol={atol}, rtol={rtol}{', in float64' if self.in_float64 else ''})"
            + ("; a model badly conditioned in fp32 (batch norm over a few values) can fail on rounding alone: "
               "--check --fp64 tells rounding from a bug" if self.float64_possible and not self.in_float64 else "")
        )


COMPARE_CHUNK = 1 << 22  # elements per float64 slice compare_tensor works on (32 MiB each)


def single_device_reference(program: Program, model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """A copy of ``model`` that runs the step on one device, in the plan's precision (a bf16
    plan's forward under the same autocast as its program and, where the program's FSDP2
    units compute with bf16 weights, with the same bf16 weights and input casts)."""
    reference = copy.deepcopy(model)
    dtype = AUTOCAST_DTYPES.get(program.plan.precision)
    if dtype is not None:
        run_in_autocast(reference, mesh.device_type, dtype)
    if wraps_bf16_fsdp_units(program.plan):
        run_with_bf16_weights(reference, program.plan.fsdp_units)
    return reference


def optimizer_step_from(
    optimizer: str, lr: float, initial: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The parameters after one single-device ``optimizer`` step from ``initial`` with ``grads``."""
    params = {name: torch.nn.Parameter(value.clone()) for name, value in initial.items()}
    for name, grad in grads.items():
        if name in params:
            params[name].grad = grad.detach()  # read, never written: AdamW and SGD write states and weights
    make_optimizer(optimizer, params.values(), lr).step()
    return {name: param.detach() for name, param in params.items()}


def compare_tensor(name: str, actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> TensorDiff:
    """``actual`` against ``expected`` elementwise, in float64: the largest error and its ratio to the tolerance.

    In chunks of ``COMPARE_CHUNK`` elements: whole, VGG-16's first fully connected weight
    (102M elements) would take five float64 temporaries of 820 MB at once on every rank."""
    if actual.shape != expected.shape:
        return TensorDiff(f"{name} (shape {tuple(actual.shape)} vs {tuple(expected.shape)})", float("inf"), float("inf"))
    flat_actual, flat_expected = actual.detach().reshape(-1), expected.detach().reshape(-1)
    largest_error, largest_violation = 0.0, 0.0
    for start in range(0, flat_actual.numel(), COMPARE_CHUNK):
        part_actual = flat_actual[start:start + COMPARE_CHUNK].double()
        part_expected = flat_expected[start:start + COMPARE_CHUNK].double()
        error = (part_actual - part_expected).abs()
        largest_error = _larger(largest_error, error.max().item())
        largest_violation = _larger(largest_violation, (error / (atol + rtol * part_expected.abs())).max().item())
    return TensorDiff(name, largest_error, largest_violation)


def _larger(a: float, b: float) -> float:
    """The larger of ``a`` and ``b``, NaN if either is (Python's ``max`` would drop a NaN ``b``)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def verdict_across_ranks(diffs: list[TensorDiff], randomness: str = "", in_float64: bool = False) -> ParityResult:
    """The check's result over every rank's ``diffs`` (collective: every rank calls it)."""
    worst = max(diffs, key=lambda d: d.violation)
    local = (len(diffs), max(d.max_abs_err for d in diffs), worst)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return ParityResult(
        compared=sum(item[0] for item in gathered),
        max_abs_err=max(item[1] for item in gathered),
        worst=max((item[2] for item in gathered), key=lambda d: d.violation),
        randomness=randomness,
        in_float64=in_float64,
    )


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a DTensor gathered, a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
