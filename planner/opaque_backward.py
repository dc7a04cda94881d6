"""Find what in a model defines its own backward, while it is traced.

The traced graph holds the forward's ATen ops only; a graph program (tensor-parallel or
pipeline) replays them on DTensors and lets autograd differentiate them. That is right only
when the model's backward *is* the autograd of its forward. These break it, silently:

- a custom ``torch.autograd.Function`` (``Function.apply``): export inlines its forward and
  drops its ``backward`` (a straight-through estimator would get the gradient of ``round``,
  zero, instead of the one it passes through);
- ``Tensor.register_hook`` called in forward (the hook is not an op of the graph);
- module backward hooks (``register_full_backward_hook``, ``register_full_backward_pre_hook``,
  the old ``register_backward_hook``, and their global versions);
- hooks on parameters (``register_hook``, ``register_post_accumulate_grad_hook``): a graph
  program holds its own DTensor copies of the weights, which carry none.

``watch_backward`` patches ``Function.apply`` and ``Tensor.register_hook`` while the model is
traced and records the innermost running module for each call; the hooks are found on the
model itself. The tracer stores the result as ``OpGraph.opaque_backward``: a list of
``(module path, what)`` pairs. Data-parallel programs run the model's own modules, so its
backward runs as written; graph programs of such a model are refused (``planner.plan`` keeps
it to data-parallel plans, ``compile`` names the module).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

__all__ = ["OpaqueBackward", "describe", "watch_backward"]


class OpaqueBackward:
    """What a traced model does that its traced graph cannot replay, in the order found."""

    def __init__(self) -> None:
        self.found: list[tuple[str, str]] = []

    def add(self, module: str, what: str) -> None:
        if (module, what) not in self.found:
            self.found.append((module, what))


def describe(found: list[tuple[str, str]]) -> str:
    """One line naming the first place found (and how many more): ``module 'blocks.0.quant'
    runs custom autograd Function RoundSTE (and 1 more place)``."""
    from planner.errors import one_line

    module, what = found[0]
    where = f"module '{one_line(module)}'" if module else "the model"
    more = f" (and {len(found) - 1} more place{'s' if len(found) > 2 else ''})" if len(found) > 1 else ""
    return f"{where} runs {one_line(what)}{more}"


@contextlib.contextmanager
def watch_backward(model: torch.nn.Module, current_module: Callable[[], str]) -> Iterator[OpaqueBackward]:
    """While tracing ``model``: record custom autograd Functions and tensor hooks that its
    forward calls (naming the module ``current_module()`` says is running), and the backward
    hooks its modules and parameters carry."""
    opaque = OpaqueBackward()
    _static_hooks(model, opaque)
    # The attributes as defined (a classmethod, a function), so they are put back as they were.
    function_apply = vars(torch.autograd.Function)["apply"]
    tensor_register_hook = vars(torch.Tensor)["register_hook"]

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith("torch."):  # PyTorch's own Functions differentiate their forward
            opaque.add(current_module(), f"custom autograd Function {cls.__qualname__}")
        return function_apply.__func__(cls, *args, **kwargs)

    def register_hook(tensor, hook):
        opaque.add(current_module(), f"Tensor.register_hook({getattr(hook, '__qualname__', type(hook).__name__)})")
        return tensor_register_hook(tensor, hook)

    torch.autograd.Function.apply = classmethod(apply)
    torch.Tensor.register_hook = register_hook
    try:
        yield opaque
    finally:
        torch.autograd.Function.apply = function_apply
        torch.Tensor.register_hook = tensor_register_hook


def _static_hooks(model: torch.nn.Module, opaque: OpaqueBackward) -> None:
    """Backward hooks already on the model: on its modules, global ones, on its parameters."""
    from torch.nn.modules import module as module_globals

    for kind, table in (
        ("global module backward hook", getattr(module_globals, "_global_backward_hooks", {})),
        ("global module backward pre-hook", getattr(module_globals, "_global_backward_pre_hooks", {})),
    ):
        if table:
            opaque.add("", kind)
    for path, module in model.named_modules():
        for kind, table in (("backward hook", module._backward_hooks), ("backward pre-hook", module._backward_pre_hooks)):
            for hook in table.values():
                opaque.add(path, f"module {kind} {getattr(hook, '__qualname__', type(hook).__name__)}")
    for name, parameter in model.named_parameters():
        hooks = [*(getattr(parameter, "_backward_hooks", None) or {}).values(),
                 *(getattr(parameter, "_post_accumulate_grad_hooks", None) or {}).values()]
        for hook in hooks:
            opaque.add(name.rpartition(".")[0], f"a hook on parameter {name} ({getattr(hook, '__qualname__', type(hook).__name__)})")
