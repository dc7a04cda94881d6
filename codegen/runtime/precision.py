"""Mixed precision for compiled programs: bf16 compute, fp32 weights, gradients and
optimizer states (what the simulator prices as ``precision="bf16"``).

A program of a bf16 plan runs its module's forward under ``torch.autocast`` with bfloat16:
matmuls and convolutions compute in bf16, numerically sensitive ops (softmax, norms, losses)
in fp32, and the weights the optimizer steps stay fp32. The same autocast wraps the
single-device reference of ``launch.py --check``, whose tolerances widen to bf16's
(``parity_tolerances``). fp16 would also need loss scaling; it is not compiled.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

AUTOCAST_DTYPES = {"bf16": torch.bfloat16}

# (atol, rtol) of --check. bf16 keeps 8 bits of mantissa (~4e-3 relative): a sharded
# matmul rounds its partial sums separately, so results differ from one device by a few
# bf16 steps; a missing or doubled collective is off by O(1) and still fails.
TOLERANCES = {"fp32": (1e-5, 1e-4), "bf16": (1e-2, 1e-2)}


def run_in_autocast(module: nn.Module, device_type: str, dtype: torch.dtype) -> nn.Module:
    """Make ``module``'s forward run under ``torch.autocast(device_type, dtype)``; returns it.
    Call it before DDP/FSDP2 wrap the module, so their hooks stay outside."""
    forward = module.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    module.forward = autocast_forward
    return module


def parity_tolerances(precision: str, atol: float | None = None, rtol: float | None = None) -> tuple[float, float]:
    """(atol, rtol) of ``launch.py --check``: those given, else the defaults of the plan's precision."""
    default_atol, default_rtol = TOLERANCES.get(precision, TOLERANCES["fp32"])
    return (default_atol if atol is None else atol, default_rtol if rtol is None else rtol)
