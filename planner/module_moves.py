"""Moves of a model's own modules inside its forward (``self.head.to(x.dtype)``), while tracing.

Some models call ``.to()`` on a submodule in their forward to keep it on the device or in the
dtype of the input (``self.head.to(x.device)``). Run for real that is a no-op once the model
sits where its inputs are, but ``torch.export`` cannot trace it: moving a module swaps its
parameters, which export's fake tensors refuse (an error about swapping ``Linear.weight``, or
"co_varnames is too small" deeper in the tracer). :func:`module_moves_traced` makes such a
call what it is when it moves nothing: the module itself, unchanged, so the model traces. A
call that would move or cast something while tracing (another device, another dtype) is not
what the traced program computes: it raises a :class:`~planner.errors.TraceError` that names
the module and the call.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from planner.errors import TraceError

__all__ = ["module_moves_traced"]


@contextlib.contextmanager
def module_moves_traced(model: nn.Module) -> Iterator[None]:
    """While active, ``.to(...)`` on ``model`` or one of its modules returns the module
    unchanged when it would move and cast nothing, and raises a ``TraceError`` naming the
    module when it would (calls on other modules run as usual)."""
    names = {id(module): name for name, module in model.named_modules()}
    original = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        if id(self) not in names:
            return original(self, *args, **kwargs)
        try:
            device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)  # Module.to's own parsing
        except Exception:  # noqa: BLE001 - Module.to would raise the same: let it say why
            return original(self, *args, **kwargs)
        changed = _what_would_change(self, device, dtype)
        if changed is None:
            return self
        where = names[id(self)] or "the model itself"
        raise TraceError(
            f"the forward calls .to() on module '{where}' ({type(self).__name__}), which would {changed} while "
            f"tracing; a traced program cannot move or cast its own weights. Fix: move or cast the model before "
            f"training (outside forward), or cast the input instead of the module"
        )

    nn.Module.to = to  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]


def _what_would_change(module: nn.Module, device: torch.device | None, dtype: torch.dtype | None) -> str | None:
    """What ``module.to(device, dtype)`` would change (None: nothing), as ``Module.to`` does it:
    every tensor to ``device``, floating-point ones to ``dtype``."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if device is not None and not _same_device(tensor.device, device):
            return f"move its weights from {tensor.device} to {device}"
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            return f"cast its weights from {tensor.dtype} to {dtype}"
    return None


def _same_device(have: torch.device, wanted: torch.device) -> bool:
    return have.type == wanted.type and (wanted.index is None or have.index is None or have.index == wanted.index)
