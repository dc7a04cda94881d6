"""How values of the traced graph are written as Python source in a graph program.

Op arguments, placements, op names, the model's output structure and the tensor constants a
forward makes all reach ``model_spmd.py`` through here: plain values with ``repr()``, names as
validated identifiers (``codegen.source_text``), never as code taken from a plan or a trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Partial
from torch.utils._pytree import TreeSpec

from codegen.source_text import identifier
from planner.errors import PlanningError


@dataclass(frozen=True)
class Code:
    """An argument written as given (e.g. ``self.training``)."""

    text: str


def structure(spec: TreeSpec, leaves) -> str:
    """Python source rebuilding the output structure ``spec`` from leaf expressions."""
    if spec.is_leaf():
        return next(leaves)
    children = [structure(child, leaves) for child in spec_children(spec)]
    kind = spec.type
    if kind is tuple:
        return "(" + ", ".join(children) + ("," if len(children) == 1 else "") + ")"
    if kind is list:
        return "[" + ", ".join(children) + "]"
    if kind is type(None):
        return "None"
    if kind is dict:
        return "{" + ", ".join(f"{key!r}: {child}" for key, child in zip(spec.context, children)) + "}"
    if "<locals>" in kind.__qualname__ or "." in kind.__qualname__:
        raise NotImplementedError(f"graph codegen cannot import the model's output type {kind.__module__}.{kind.__qualname__}")
    type_name = identifier(kind.__qualname__, "the model output type")
    if isinstance(spec.context, (list, tuple)) and all(isinstance(k, str) for k in spec.context) and issubclass(kind, dict):
        fields = [identifier(key, f"a field of the model output {type_name}") for key in spec.context]
        return f"{type_name}(" + ", ".join(f"{key}={child}" for key, child in zip(fields, children)) + ")"
    if issubclass(kind, tuple):  # a namedtuple
        return f"{type_name}(" + ", ".join(children) + ")"
    raise NotImplementedError(f"graph codegen cannot rebuild an output of type {kind.__qualname__}")


def callee_source(target: torch._ops.OpOverload) -> str:
    namespace, name, overload = (identifier(part, f"a part of op {str(target)!r}") for part in str(target).split("."))
    return f"aten.{name}.{overload}" if namespace == "aten" else f"torch.ops.{namespace}.{name}.{overload}"


def placement_source(placement) -> str:
    from torch.distributed.tensor import Shard

    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Partial):
        return "Partial()" if placement.reduce_op == "sum" else f"Partial({placement.reduce_op!r})"
    return "Replicate()"


def literal_argument(value: Any) -> str:
    """Python source of a non-tensor argument of an op."""
    if isinstance(value, Code):
        return value.text
    if isinstance(value, torch.device):
        return "self.device"  # traced on meta: run on this rank's device
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return repr(value)
    if isinstance(value, float):
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        if math.isnan(value):
            return 'float("nan")'
        return repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(literal_argument(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    raise NotImplementedError(f"graph codegen cannot write the argument {value!r} ({type(value).__name__})")


def dotted(name: str, field: str) -> str:
    """A dotted module name (``transformers.modeling_outputs``), each part an identifier."""
    return ".".join(identifier(part, field) for part in str(name).split("."))


# Elements of a tensor constant written into the program as a literal at most; bigger ones
# belong in the model as buffers (they are then loaded, not written out).


MAX_CONSTANT_ELEMENTS = 4096


def tensor_literal(value: torch.Tensor, name: str) -> str:
    """Python source that rebuilds ``value`` (a tensor constant of the traced forward) on this
    rank's device: its elements written with ``repr`` (via ``literal_argument``), never as code.

    Raises:
        PlanningError: the constant is too big to write out, or of a dtype that has no
            Python literal (e.g. complex).
    """
    if value.numel() > MAX_CONSTANT_ELEMENTS:
        raise PlanningError(
            f"the model's forward makes a tensor constant '{name}' of {value.numel()} elements (e.g. torch.tensor(...)); "
            f"compiled programs write constants of at most {MAX_CONSTANT_ELEMENTS}: register it as a buffer instead"
        )
    if value.is_complex() or value.dtype not in _LITERAL_DTYPES:
        raise PlanningError(
            f"the model's forward makes a tensor constant '{name}' of dtype {value.dtype}, which compiled programs "
            f"cannot write out; register it as a buffer instead"
        )
    elements = value.detach().cpu().tolist()
    return f"torch.tensor({literal_argument(elements)}, dtype={value.dtype}, device=self.device)"


_LITERAL_DTYPES = frozenset(
    {
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool,
    }
)


def spec_children(spec: TreeSpec) -> list[TreeSpec]:
    return list(spec.children()) if hasattr(spec, "children") else list(spec.children_specs)
