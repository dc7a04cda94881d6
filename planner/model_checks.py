"""Checks and warnings about a user's model and example inputs, before and after tracing: one
clear line for what cannot be planned (nothing to train, an empty input), and warnings for what
will be planned with a caveat (ops with no sharding rule or no FLOP formula, BatchNorm)."""

from __future__ import annotations

from typing import Any

import torch

from planner.errors import PlanningError


def check_trainable(model: torch.nn.Module) -> None:
    """A training planner needs something to train."""
    parameters = list(model.parameters())
    if not any(parameter.requires_grad and parameter.numel() > 0 for parameter in parameters):
        has = (
            "it has none" if not parameters
            else f"its {len(parameters)} parameter(s) all have requires_grad=False or no elements"
        )
        raise PlanningError(
            f"the model has no parameters to train ({type(model).__name__}: {has}); soap-planner plans training, "
            f"so give the model at least one trainable parameter"
        )


def check_no_empty_inputs(args: tuple, kwargs: dict) -> None:
    """An example input with a dimension of size 0 (e.g. ``--set seq_len=0``) would plan a
    step that computes nothing."""
    from torch.utils._pytree import keystr, tree_flatten_with_path

    for kind, tree in (("positional input", tuple(args)), ("keyword input", dict(kwargs))):
        for path, value in tree_flatten_with_path(tree)[0]:
            if isinstance(value, torch.Tensor) and value.numel() == 0:
                raise PlanningError(
                    f"example {kind} {keystr(path)} is empty (shape {tuple(value.shape)}); every input of the "
                    f"example batch needs at least one element per dimension, e.g. a positive seq_len"
                )


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """Example inputs as (args, kwargs): a dict is keyword inputs, a tuple or list positional ones,
    anything else one positional input."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def unknown_op_warnings(unknown: dict[str, int]) -> list[str]:
    """One warning naming the ops that have no sharding rule (they run whole on every rank),
    from their node counts (``search.rules.unknown_ops``)."""
    if not unknown:
        return []
    return [
        f"{sum(unknown.values())} op(s) have no sharding rule, so plans other than data parallelism run them "
        f"whole on every rank: {_listed(unknown)}; rules live in search/rules/"
    ]


def _listed(counts: dict[str, int]) -> str:
    """Ops with their node counts, for a warning: ``topk.default (2 nodes), ...``."""
    return ", ".join(f"{op.removeprefix('aten.')} ({count} node{'s' if count > 1 else ''})" for op, count in counts.items())


def uncounted_op_warnings(graph) -> list[str]:
    """One warning naming the custom ops counted at 0 FLOPs (``planner.flop_formulas``)."""
    from planner.flop_formulas import uncounted_custom_ops

    uncounted = uncounted_custom_ops(graph)
    if not uncounted:
        return []
    return [
        f"custom op(s) with no FLOP formula are priced by the bytes they move only: {_listed(uncounted)}; if they multiply "
        f"matrices, register a formula with torch.utils.flop_counter.register_flop_formula before planning"
    ]


def model_warnings(model: torch.nn.Module) -> list[str]:
    """Warnings about the model itself, before tracing: BatchNorm layers, whose statistics compiled
    data-parallel programs all-reduce outside the simulated step."""
    notes = []
    batch_norms = [name for name, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if batch_norms:
        notes.append(
            f"{len(batch_norms)} BatchNorm layer(s) (first: '{batch_norms[0]}'): compiled data-parallel programs "
            f"all-reduce their batch statistics over dp to match one device (two small all-reduces per layer and "
            f"pass, not in the simulated step time)"
        )
    return notes
