"""Rewrite in-place writes into tensors a forward makes itself as functional ops.

Some models build a tensor and then fill it in place: DeepSeek-V3's attention makes a buffer
with ``new_empty`` and writes the rope and non-rope parts of the keys into slices of it
(``buffer[..., :128].copy_(k_nope)``). In the exported graph such a write is an op on a
*view* (``slice``) whose effect is only visible through the base tensor that later ops read. A per-rank program that holds the base as a
DTensor and its views as local tensors, or that redistributes the view before writing into
it, writes into a copy: later readers of the base miss the write, and autograd refuses to
record in-place writes into the outputs of ``to_local``. No emitter can make that sound op
by op, so the graph is made functional before anyone reads it: every such write becomes an
out-of-place op and the base is rebuilt from the written view (``slice_scatter``,
``select_scatter``, ...), which DTensor shards like any other op.

PyTorch's functionalization (``ExportedProgram.run_decompositions({})``, an empty
decomposition table: ``linear``, attention and the other composites the rules know stay
whole) does the rewrite; it is applied only to graphs that need it, because it also
renames a few ops everywhere (``to.dtype`` becomes ``_to_copy``, ``reshape`` becomes
``view``, ``contiguous`` becomes ``clone``) and inlines ``torch.no_grad()`` regions.
Its functional ``copy(dst, src)`` has no derivative, so each one is replaced by what it
computes: ``src`` cast to ``dst``'s dtype and broadcast to ``dst``'s shape. A buffer whose
slices along one dim are all written (every value of it overwritten) becomes one ``cat`` of
the written parts, which the rules split on any other dim and DTensor differentiates.

A write into a fresh tensor that only the write's own result is read through (a router's
``zeros_like(scores).scatter_(...)``, a residual ``h += x``) is plain data flow already and
keeps its graph as exported. Writes into the model's own inputs, parameters and buffers
(BatchNorm's running statistics) are left alone: they are state updates, not data flow, and
functionalizing them would add graph outputs that the model does not return.
"""

from __future__ import annotations

import operator
import warnings

import torch
import torch.fx

__all__ = ["aliased_writes", "functional_program"]

_aten = torch.ops.aten


def aliased_writes(graph_module: torch.fx.GraphModule) -> list[str]:
    """Names of the in-place writes into tensors the forward made itself whose effect later
    ops see through another handle than the write's own result, in graph order; empty when
    the graph has none.

    A node writes in place when its ATen schema marks an argument as written
    (``Tensor(a!)``). Such a write needs the functional form when the written tensor is a
    view of another tensor (``buffer[..., :n].copy_(x)``: later ops read ``buffer``), or when
    another view aliases it (``first = h[:, 0]`` taken before ``h.add_(1)``). A write into
    a fresh tensor that nothing else reads (``h = conv(x); h += residual``: export points
    later readers at the write's result) is plain data flow already and is left as it is,
    and so are writes into the model's inputs, parameters and buffers (module docstring).
    """
    found = []
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if any(_is_aliased(node, written) for written in _written_arguments(node)):
                found.append(node.name)
    return found


def _is_aliased(write: torch.fx.Node, written: torch.fx.Node) -> bool:
    """Whether the write into ``written`` is seen through another handle (see ``aliased_writes``)."""
    origin = _origin(written)
    if origin.op == "placeholder":
        return False
    if origin is not written:
        return True
    return any(reader is not write and (_is_view(reader.target) or reader.target is operator.getitem) for reader in written.users)


def functional_program(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` itself when it has no aliased writes (``aliased_writes``), else its
    functional equivalent (see the module docstring).

    Functionalization inlines ``torch.no_grad()`` regions without their grad mode, so a
    program whose no-grad region reads a parameter (its gradient would then flow there) is
    returned unchanged too. The functional program is kept only if it updates no more inputs, parameters or
    buffers than ``program`` does; otherwise (a model whose graph both fills its own
    tensors and updates state such as BatchNorm's running statistics) ``program`` is
    returned unchanged, as it is when functionalization fails: the graph is then planned as
    exported, as it was before this rewrite existed.
    """
    if not aliased_writes(program.graph_module) or _no_grad_region_reads_parameters(program):
        return program
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own deprecation notices, nothing the user can act on
            functional = program.run_decompositions({})
    except Exception:  # noqa: BLE001 - an op functionalization cannot take: plan the graph as exported
        return program
    if _state_updates(functional) != _state_updates(program):
        return program
    graph_module = functional.graph_module
    _replace_functional_copies(graph_module)
    _whole_fills_as_cat(graph_module)
    graph_module.graph.lint()
    graph_module.recompile()
    return functional


def _no_grad_region_reads_parameters(program: torch.export.ExportedProgram) -> bool:
    """Whether a ``torch.no_grad()`` region of ``program`` (``wrap_with_set_grad_enabled``
    with grad off) reads a value computed from a parameter."""
    parameters = set(program.graph_signature.inputs_to_parameters)
    for node in program.graph_module.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "wrap_with_set_grad_enabled" \
                and node.args and node.args[0] is False and _reads_any(node, parameters):
            return True
    return False


def _reads_any(node: torch.fx.Node, placeholders: set[str]) -> bool:
    """Whether ``node`` depends on any of the named placeholders."""
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current.name in seen:
            continue
        seen.add(current.name)
        if current.op == "placeholder" and current.name in placeholders:
            return True
        stack.extend(current.all_input_nodes)
    return False


def _written_arguments(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensors ``node`` writes into in place (by its ATen schema)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    written = []
    for position, argument in enumerate(node.target._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
        if isinstance(value, torch.fx.Node):
            written.append(value)
    return written


def _origin(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage ``node`` views: followed back through view ops and ``getitem``."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        if node.target is operator.getitem or _is_view(node.target):
            node = node.args[0]
        else:
            break
    return node


def _is_view(target: object) -> bool:
    """Whether an ATen op returns a view of its first argument (an alias it does not write)."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return False
    alias = target._schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _state_updates(program: torch.export.ExportedProgram) -> list[str]:
    """The inputs, parameters and buffers ``program`` reports as written."""
    kinds = (torch.export.graph_signature.OutputKind.BUFFER_MUTATION, torch.export.graph_signature.OutputKind.USER_INPUT_MUTATION)
    return sorted(str(spec.target) for spec in program.graph_signature.output_specs if spec.kind in kinds)


def _replace_functional_copies(graph_module: torch.fx.GraphModule) -> None:
    """Replace each ``aten.copy(dst, src)`` (no derivative, no DTensor rule) by ``src`` cast
    to ``dst``'s dtype and expanded to ``dst``'s shape: the value it computes."""
    graph = graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _aten.copy.default:
            continue
        destination, source = node.args[0], node.args[1]
        target_value, value = destination.meta.get("val"), source.meta.get("val")
        if not isinstance(target_value, torch.Tensor) or not isinstance(value, torch.Tensor):
            continue  # no shapes to rebuild it from: leave the copy (DTensor says so if it runs)
        replacement = source
        with graph.inserting_before(node):
            if value.dtype != target_value.dtype:
                replacement = _new_node(graph, node, _aten._to_copy.default, (replacement,), {"dtype": target_value.dtype})
                value = replacement.meta["val"]
            if tuple(value.shape) != tuple(target_value.shape):
                replacement = _new_node(graph, node, _aten.expand.default, (replacement, list(target_value.shape)), {})
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        _erase_unread_views(graph, destination)


def _whole_fills_as_cat(graph_module: torch.fx.GraphModule) -> None:
    """Replace a chain of ``slice_scatter`` writes that together cover a tensor along one dim
    (the tensor's own values all overwritten: DeepSeek-V3's key buffer) by one ``cat`` of
    the written parts in order.

    The chain is what a buffer filled by slices becomes once functional; a ``cat`` is the
    same value, which DTensor shards and differentiates like any other op (DTensor's
    backward of ``slice_scatter`` into a tensor that needs a gradient mixes plain and
    distributed tensors, and the program would have to gather the buffer whole for it).
    """
    graph = graph_module.graph
    for base in list(graph.nodes):
        found = _covering_chain(base)
        if found is None:
            continue
        chain, dim, parts = found
        last = chain[-1]
        with graph.inserting_before(last):
            joined = _new_node(graph, last, _aten.cat.default, (parts, dim), {})
        last.replace_all_uses_with(joined)
        for write in reversed(chain):
            graph.erase_node(write)
        if not base.users and base.op == "call_function":
            graph.erase_node(base)


def _covering_chain(base: torch.fx.Node) -> tuple[list[torch.fx.Node], int, list[torch.fx.Node]] | None:
    """The ``slice_scatter`` writes starting at ``base``, each read only by the next, that
    together cover ``base`` along one dim in disjoint step-1 slices of its dtype: ``(the
    writes, the dim, the written parts in the order of their slices)``; else ``None``."""
    value = base.meta.get("val")
    if not isinstance(value, torch.Tensor) or len(base.users) != 1:
        return None
    chain, node = [], base
    while len(node.users) == 1:
        (reader,) = node.users
        if reader.target is not _aten.slice_scatter.default or reader.args[0] is not node:
            break
        chain.append(reader)
        node = reader
    if not chain or len({write.args[2] if len(write.args) > 2 else 0 for write in chain}) != 1:
        return None
    dim = chain[0].args[2] % value.dim() if len(chain[0].args) > 2 else 0
    bounds = [_slice_bounds(write, value.shape[dim]) for write in chain]
    if None in bounds:
        return None
    ordered = sorted(zip(bounds, chain), key=lambda pair: pair[0])
    spans = [span for span, _ in ordered]
    covers = spans[0][0] == 0 and spans[-1][1] == value.shape[dim] and all(
        earlier[1] == later[0] for earlier, later in zip(spans, spans[1:]))
    parts = [write.args[1] for _, write in ordered]
    alike = all(isinstance(part.meta.get("val"), torch.Tensor) and part.meta["val"].dtype == value.dtype for part in parts)
    return (chain, dim, parts) if covers and alike else None


def _slice_bounds(write: torch.fx.Node, size: int) -> tuple[int, int] | None:
    """``(start, end)`` of a ``slice_scatter``'s slice clamped to ``size``; ``None`` for a step
    other than 1 (or bounds that are not plain integers)."""
    args = list(write.args) + [None] * (6 - len(write.args))
    start, end, step = args[3] if args[3] is not None else 0, args[4], args[5] if args[5] is not None else 1
    if step != 1 or not isinstance(start, int) or not (end is None or isinstance(end, int)):
        return None
    end = size if end is None else end
    start, end = (start + size if start < 0 else start), (end + size if end < 0 else end)
    return min(max(start, 0), size), min(max(end, 0), size)


def _erase_unread_views(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erase ``node`` and the views it was taken through while nothing reads them (the
    slice a replaced ``copy`` wrote into is read by nothing else)."""
    while node.op == "call_function" and not node.users and _is_view(node.target):
        base = node.args[0]
        graph.erase_node(node)
        if not isinstance(base, torch.fx.Node):
            return
        node = base


def _new_node(graph: torch.fx.Graph, like: torch.fx.Node, target: torch._ops.OpOverload, args: tuple, kwargs: dict) -> torch.fx.Node:
    """A call of ``target`` with ``like``'s metadata (module stack, source) and its own value."""
    node = graph.call_function(target, args, kwargs)
    node.meta.update({key: value for key, value in like.meta.items() if key not in ("val", "tensor_meta")})
    values = torch.fx.node.map_arg((args, kwargs), lambda arg: arg.meta["val"])
    node.meta["val"] = target(*values[0], **values[1])
    return node
