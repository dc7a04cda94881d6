"""A cheap structural fingerprint of a model and its example batch.

A plan stores the fingerprint of the model it was planned for. ``compile``, ``simulate``
and a compiled program's ``launch.py`` rebuild the model from the plan's spec and compare:
when the model file or its overrides changed since planning, the spec now builds another
model, and the plan's strategies (made for other ops and shapes) must not be applied to it.

The fingerprint is a sha256 over the model's class name, its parameters and buffers (sorted
names, shapes, dtypes) and the example inputs (their pytree paths, shapes and dtypes, and
the value of plain scalars). Nothing is traced or computed, so a model built on the meta
device gives the same fingerprint as the same model on a GPU, in milliseconds.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

FINGERPRINT_LENGTH = 64  # hex digits of a sha256


def model_fingerprint(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None) -> str:
    """The sha256 (hex) of ``model``'s structure and of its example inputs' structure.

    Args:
        model: the model (any device, meta included).
        args, kwargs: one example batch, as the model's factory returned it.

    Returns:
        64 hex digits; equal for two builds of the same spec, different when a parameter,
        a buffer, the class or an input's shape or dtype changes.
    """
    description = {
        # __qualname__, not the module: a model file is imported under a name derived from
        # its absolute path, which differs between machines.
        "class": type(model).__qualname__,
        "parameters": sorted(_tensor_entry(name, value) for name, value in model.named_parameters()),
        "buffers": sorted(_tensor_entry(name, value) for name, value in model.named_buffers()),
        "inputs": _input_entries(args, kwargs or {}),
    }
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def describe_model(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None) -> str:
    """``"MLP, 4,808 parameters, batch 16"``: what a fingerprint mismatch message shows."""
    parameters = sum(value.numel() for value in model.parameters())
    return f"{type(model).__name__}, {parameters:,} parameters, batch {example_batch_size(args, kwargs or {})}"


def example_batch_size(args: tuple, kwargs: dict) -> int | None:
    """Dim 0 of the first tensor input with at least one dimension (the tracer's rule), or
    None when there is none."""
    leaves, _ = tree_flatten_with_path((tuple(args), dict(kwargs)))
    for _, value in leaves:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None


def _tensor_entry(name: str, value: torch.Tensor) -> tuple[str, list[int], str]:
    return (name, [int(size) for size in value.shape], str(value.dtype))


def _input_entries(args: tuple, kwargs: dict) -> list[list[Any]]:
    leaves, _ = tree_flatten_with_path((tuple(args), dict(kwargs)))
    entries: list[list[Any]] = []
    for path, value in leaves:
        where = keystr(path)
        if isinstance(value, torch.Tensor):
            entries.append([where, "tensor", [int(size) for size in value.shape], str(value.dtype)])
        elif value is None or isinstance(value, (bool, int, float, str)):
            entries.append([where, type(value).__name__, repr(value)])  # a flag or size changes the graph
        else:
            entries.append([where, type(value).__name__])
    return entries
