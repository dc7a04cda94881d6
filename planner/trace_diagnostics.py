"""Diagnostics of tracing: which module was running, and where in the model's code a tracer failed.

A model neither ``torch.export`` nor ``torch.fx.symbolic_trace`` can take gets one
``TraceError`` line that names the innermost module running when export failed
(:class:`ModuleTracker`, forward hooks on every module), the line of the model's own code
that raised (:func:`failing_construct`: the innermost frame outside torch, this package and
the standard library), each tracer's first line of error, and what to do.
"""

from __future__ import annotations

import functools
import os
import sysconfig
import traceback
from typing import Any, Callable

import torch

from planner.errors import TraceError, one_line

__all__ = ["ModuleTracker", "failing_construct", "trace_error"]


class ModuleTracker:
    """Keeps the stack of modules whose forward is running, to name the one that failed."""

    def __init__(self, model: torch.nn.Module, on_progress: Callable[[str, float], None] | None = None):
        self._model = model
        self._on_progress = on_progress
        self._total = sum(1 for _ in model.modules())
        self._entered = 0
        self._stack: list[tuple[str, str]] = []
        self._deepest_at_failure: tuple[str, str] | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> "ModuleTracker":
        for name, module in self._model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._push(name, module)))
            self._handles.append(module.register_forward_hook(self._pop))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for handle in self._handles:
            handle.remove()

    def _push(self, name: str, module: torch.nn.Module):
        def hook(*_: Any) -> None:
            self._stack.append((name or "<root>", type(module).__name__))
            self._deepest_at_failure = self._stack[-1]
            if self._on_progress is not None and self._entered < self._total:
                self._entered += 1
                self._on_progress(f"tracing {name or type(module).__name__}", self._entered / self._total)

        return hook

    def _pop(self, *_: Any) -> None:
        if self._stack:
            self._stack.pop()

    def current_path(self) -> str:
        """The path of the innermost module running now (``""``: the model itself, or none)."""
        path = self._stack[-1][0] if self._stack else ""
        return "" if path == "<root>" else path

    def failed_module(self) -> tuple[str, str] | None:
        """The innermost module still running when tracing raised, if any."""
        return self._stack[-1] if self._stack else None


def trace_error(
    model: torch.nn.Module, export_failure: tuple[tuple[str, str] | None, BaseException], fx_error: BaseException
) -> TraceError:
    """The ``TraceError`` for a model neither tracer took: the module that was running when
    ``torch.export`` failed, the line of the model's code that failed (the construct), both
    tracers' first lines, and what to do."""
    where, export_error = export_failure
    location = f"in module '{where[0]}' ({where[1]})" if where else f"in {type(model).__name__}.forward"
    export_construct, fx_construct = failing_construct(export_error), failing_construct(fx_error)
    export_at = f" at {export_construct}" if export_construct else ""
    fx_at = f" at {fx_construct}" if fx_construct and fx_construct != export_construct else ""
    return TraceError(
        f"cannot trace {type(model).__name__}: torch.export failed {location}{export_at} with "
        f"{type(export_error).__name__}: {_first_line(export_error)}; the torch.fx.symbolic_trace "
        f"fallback failed{fx_at} with {type(fx_error).__name__}: {_first_line(fx_error)}. Fix: make that "
        f"forward traceable (no Python branching on tensor values: use torch.where or torch.cond; "
        f"no .item()/.tolist(); no moving or casting modules inside forward), and check the example inputs "
        f"match the model's signature"
    )


def failing_construct(error: BaseException) -> str | None:
    """Where in the model's own code ``error`` was raised, as ``file:line (`source`)``: the
    innermost frame outside torch, this package and the standard library, in the original
    exception of its chain first (torch re-raises wrapped errors). None when there is none."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    for exception in reversed(chain):  # the original first
        for frame in reversed(traceback.extract_tb(exception.__traceback__)):
            if _is_model_code(frame.filename):
                source = one_line((frame.line or "").strip())
                source = source if len(source) <= 120 else source[:117] + "..."
                shown = f" (`{source}`)" if source else ""
                return f"{one_line(os.path.basename(frame.filename))}:{frame.lineno}{shown}"
    return None


@functools.lru_cache(maxsize=1)
def _code_roots() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Folders whose code is never the model's (torch, this repository's packages), the
    standard library's, and the installed packages' (a model's code may live there:
    transformers), which may lie inside the standard library's folder."""
    repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = tuple(os.path.join(repository, package) for package in ("planner", "codegen", "search", "cost_model"))
    paths = sysconfig.get_paths()
    never = (os.path.dirname(os.path.realpath(torch.__file__)), *ours)
    stdlib = (os.path.realpath(paths["stdlib"]), os.path.realpath(paths["platstdlib"]))
    installed = (os.path.realpath(paths["purelib"]), os.path.realpath(paths["platlib"]))
    return never, stdlib, installed


def _is_model_code(filename: str) -> bool:
    if filename.startswith("<"):
        return False  # generated code: <string>, <frozen ...>, fx's <eval_with_key>
    path = os.path.realpath(filename)
    never, stdlib, installed = _code_roots()
    if any(_under(path, root) for root in never):
        return False
    return not any(_under(path, root) for root in stdlib) or any(_under(path, root) for root in installed)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= 200 else line[:197] + "..."
