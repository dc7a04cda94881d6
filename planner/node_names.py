"""Names of traced ops that depend on what each op computes, not on the order it was traced in.

Plans name each op by its node name (``NodeStrategy.node``), and ``compile`` re-traces the
model in another process to apply them. The tracers name nodes by their order of creation
(``add``, ``add_1``, ...), and that order can change between processes even for the same
model: a forward that builds its masks while iterating a ``set`` of strings runs them in
the order of Python's string hashing, which ``PYTHONHASHSEED`` changes in every process. The
same names then stand for other ops, and a plan's strategies land on the wrong ops (or
do not fit them: "places 2 tensor(s) but op ... has 3").

:func:`name_nodes_by_content` renames every op of an fx graph after its content: the op's
base name (``add``) and a short digest of what it computes: its target, its module path, its
non-tensor arguments and, recursively, the digests of the values it reads (parameters,
buffers and inputs by their names, lifted constants by their values). Two processes that trace
the same computation in different orders give every op the same name. Ops that compute
exactly the same thing from the same values (the digest cannot tell them apart) are
numbered in trace order: they are interchangeable, so whichever gets which strategy, the
program computes the same values (it reshards where placements differ).
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from typing import Any, Mapping

import torch
import torch.fx

__all__ = ["name_nodes_by_content"]

# Hex digits of the digest in a name: 16.7 million names per base; a clash between two
# different digests is resolved by the full digest's order (see _unique_names).
DIGEST_CHARS = 6
_COUNTER = re.compile(r"_\d+$")
_RENAMED = ("call_function", "call_module", "call_method", "get_attr")


def name_nodes_by_content(graph_module: torch.fx.GraphModule, module_of: Any,
                          constants: Mapping[str, torch.Tensor] | None = None) -> None:
    """Rename every op node of ``graph_module`` (in place; its code is regenerated) to
    ``<base>_<digest>`` (see the module docstring). ``module_of(node)`` gives the module path
    that issued a node; ``constants`` maps placeholder names of lifted tensor constants to
    their values (a constant is known by its values, its placeholder by creation order)."""
    constants = constants or {}
    digests: dict[torch.fx.Node, str] = {}
    for node in graph_module.graph.nodes:
        digests[node] = _digest(node, digests, graph_module, module_of, constants)
    wanted = _unique_names([node for node in graph_module.graph.nodes if node.op in _RENAMED], digests)
    for node, name in wanted.items():
        # fx keeps a name unique within the graph; old names (base_N) never take the digest form.
        node._rename(name)
    graph_module.recompile()


def _digest(node: torch.fx.Node, digests: dict[torch.fx.Node, str], graph_module: torch.fx.GraphModule, module_of: Any,
            constants: Mapping[str, torch.Tensor]) -> str:
    if node.op == "placeholder":
        value = constants.get(node.name)
        content: Any = ("constant", _tensor_digest(value)) if value is not None else ("placeholder", node.name)
    elif node.op == "get_attr":
        content = ("get_attr", _attribute_content(graph_module, str(node.target)))
    else:
        content = (node.op, _target_name(node.target), module_of(node), _canonical((node.args, node.kwargs), digests))
    return hashlib.sha256(repr(content).encode()).hexdigest()


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target  # a module path or method name
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', None) or getattr(target, '__name__', None) or str(target)}"


def _attribute_content(graph_module: torch.fx.GraphModule, target: str) -> Any:
    """A get_attr node's content: a nested graph (a control-flow branch) by its code, which
    names its own nodes locally; a tensor by its shape and dtype; else the attribute's path."""
    value: Any = graph_module
    for part in target.split("."):
        value = getattr(value, part, None)
    if isinstance(value, torch.fx.GraphModule):
        return ("graph", value.code)
    if isinstance(value, torch.Tensor):
        return ("tensor", target, tuple(value.shape), str(value.dtype))
    return target


def _tensor_digest(value: torch.Tensor) -> str:
    shape, dtype = tuple(value.shape), str(value.dtype)
    if value.device.type == "meta":
        return repr((shape, dtype))
    data = value.detach().to("cpu").contiguous().flatten().view(torch.uint8).numpy().tobytes() if value.numel() else b""
    return repr((shape, dtype, hashlib.sha256(data).hexdigest()))


def _canonical(value: Any, digests: dict[torch.fx.Node, str]) -> Any:
    """``value`` as plain, process-independent data: nodes by their digests, torch values by
    their text, other objects by their type (never their address)."""
    if isinstance(value, torch.fx.Node):
        return ("node", digests[value])
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_canonical(item, digests) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(key), _canonical(item, digests)) for key, item in value.items())))
    if isinstance(value, slice):
        return ("slice", _canonical((value.start, value.stop, value.step), digests))
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", _tensor_digest(value))
    return ("object", type(value).__module__, type(value).__qualname__)


def _unique_names(nodes: list[torch.fx.Node], digests: dict[torch.fx.Node, str]) -> dict[torch.fx.Node, str]:
    """``<base>_<first DIGEST_CHARS of the digest>`` per node; nodes that would share a name
    are ordered by full digest, then trace order, and all but the first get ``_2``, ``_3``..."""
    by_name: dict[str, list[tuple[str, int, torch.fx.Node]]] = defaultdict(list)
    for position, node in enumerate(nodes):
        base = _COUNTER.sub("", node.name) or "op"
        by_name[f"{base}_{digests[node][:DIGEST_CHARS]}"].append((digests[node], position, node))
    names = {}
    for name, members in by_name.items():
        for rank, (_, _, node) in enumerate(sorted(members, key=lambda member: member[:2])):
            names[node] = name if rank == 0 else f"{name}_{rank + 1}"
    return names
