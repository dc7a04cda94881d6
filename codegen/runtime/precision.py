"""Mixed precision for compiled programs: bf16 compute, fp32 weights, gradients and
optimizer states (what the simulator prices as ``precision="bf16"``:
``cost_model.mixed_precision``).

A program of a bf16 plan runs its module's forward under ``torch.autocast`` with bfloat16:
matmuls and convolutions compute in bf16, numerically sensitive ops (softmax, norms, losses)
in fp32, and the weights the optimizer steps stay fp32. Where FSDP2 shards the weights
(zero2, fsdp, HSDP), its units also take ``BF16_FSDP_POLICY``, torchtitan's policy: the
sharded weights stay fp32, the all-gathers move bf16 and the gathered weights inside a unit
are bf16, so autocast has no weight left to cast there; gradients are reduced in fp32. The
single-device reference of ``launch.py --check`` runs under the same autocast and, for such
programs, with the same bf16 weights and input casts (``run_with_bf16_weights``), so its
tolerances are bf16's (``parity_tolerances``) and no wider. fp16 would also need loss
scaling; it is not compiled.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

AUTOCAST_DTYPES = {"bf16": torch.bfloat16}

# (atol, rtol) of --check. bf16 keeps 8 bits of mantissa (~4e-3 relative): a sharded
# matmul rounds its partial sums separately, so results differ from one device by a few
# bf16 steps; a missing or doubled collective is off by O(1) and still fails.
TOLERANCES = {"fp32": (1e-5, 1e-4), "bf16": (1e-2, 1e-2)}

# FSDP2's mixed precision in a bf16 program, as torchtitan sets it (``apply_fsdp`` in
# torchtitan/models/llama3/infra/parallelize.py, commit 81c12433:
# ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)``, its defaults
# ``training.mixed_precision_param = "bfloat16"``, ``mixed_precision_reduce = "float32"``):
# bf16 all-gathers and unsharded weights, fp32 gradient reduction into fp32 shards. The
# default ``cast_forward_inputs=True`` casts each unit's floating inputs to bf16.
BF16_FSDP_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


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


def run_with_bf16_weights(module: nn.Module, units: Iterable[str], dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Make ``module`` (one device's copy of a model) compute as FSDP2 units under
    ``BF16_FSDP_POLICY`` do, for ``launch.py --check``'s reference; returns it.

    Every parameter is used in ``dtype`` through a differentiable cast of the fp32 weight (as
    FSDP2's unsharded weights are the cast of its fp32 shards), so each gradient is computed
    in ``dtype`` and lands in fp32 on the weight, as FSDP2's reduce in fp32 leaves it; and
    the floating inputs of the root and of every module in ``units`` are cast to ``dtype``
    before their forward, as ``cast_forward_inputs`` does. Buffers keep their dtype (FSDP2
    has no buffer dtype). Call it after ``run_in_autocast``, as the program wraps autocast
    inside its units."""
    for unit in units:
        module.get_submodule(unit).register_forward_pre_hook(
            lambda _, args, kwargs: _cast_floating((args, kwargs), dtype), with_kwargs=True
        )
    forward = module.forward
    inside = []  # set while the module runs with the cast weights (functional_call calls forward again)

    @functools.wraps(forward)
    def forward_with_cast_weights(*args, **kwargs):
        if inside:
            return forward(*args, **kwargs)
        args, kwargs = _cast_floating((args, kwargs), dtype)
        weights = {name: param.to(dtype) if param.is_floating_point() else param
                   for name, param in module.named_parameters()}
        inside.append(True)
        try:
            return torch.func.functional_call(module, weights, args, kwargs)
        finally:
            inside.pop()

    module.forward = forward_with_cast_weights
    return module


def _cast_floating(value, dtype: torch.dtype):
    """``value`` (nested tuples, lists, dicts) with its floating tensors cast to ``dtype``."""
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor, value
    )
