"""The training loss in whatever a model's forward returns (``extract_loss``): used while
planning (the traced backward), by ``--check``'s single-device reference and by every
generated program's step, so it imports nothing from ``planner`` but :mod:`planner.errors`
and :mod:`planner.messages` (generated programs import it inside ``torchrun``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from planner.errors import SpecError
from planner.messages import value_kind

__all__ = ["extract_loss"]

def extract_loss(output: Any) -> torch.Tensor:
    """The training loss in a model's output.

    Tried in order:

    1. a 0-dim floating tensor is the loss itself;
    2. a dict or object (e.g. a HuggingFace ``ModelOutput``) with a non-None ``loss``;
    3. a tuple/list whose first element is a 0-dim floating tensor;
    4. otherwise a *surrogate*: the mean of the first floating tensor found, depth first
       (e.g. a base model's ``last_hidden_state``). It is not a real training objective but
       it has the same forward and backward graph shape, which is all planning and parity
       checks need.

    Args:
        output: whatever ``model(*args, **kwargs)`` returned.

    Returns:
        A 0-dim tensor to call ``backward()`` on.

    Raises:
        SpecError: the output holds no floating tensor at all.
    """
    if _is_scalar_float(output):
        return output
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss if loss.dim() == 0 else loss.mean()
    if isinstance(output, (tuple, list)) and output and _is_scalar_float(output[0]):
        return output[0]
    tensor = _first_floating_tensor(output, depth=0)
    if tensor is None:
        raise SpecError(
            f"the model returned {value_kind(output)} with no floating tensor to use as a loss; "
            f"make forward return the loss (a 0-dim tensor) or an output with .loss"
        )
    return tensor.mean()


def _is_scalar_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def _first_floating_tensor(value: Any, depth: int) -> torch.Tensor | None:
    if depth > 8:  # outputs are shallow; this only guards against self-referencing objects
        return None
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, Mapping):
        children: Iterable[Any] = value.values()
    elif isinstance(value, (tuple, list)):
        children = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = (getattr(value, f.name) for f in dataclasses.fields(value))
    else:
        return None
    for child in children:
        found = _first_floating_tensor(child, depth + 1)
        if found is not None:
            return found
    return None
