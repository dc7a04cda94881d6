"""Repeated blocks traced once per kind and stamped: the full graph at a fraction of the export.

``torch.export`` and its functionalization cost seconds per decoder block of a large model
(DeepSeek-V3's 61 blocks take about 25 s of CPU on meta tensors), yet the blocks of a
decoder stack (``model.layers``, an ``nn.ModuleList``) mostly compute the same thing on
other weights. Here the stack is cut to its first blocks for the export, and the graph of
each remaining block is copied from a traced block of the same kind, its parameters renamed
(``model.layers.5.mlp...`` becomes ``model.layers.40.mlp...``). The graph the rest of the
planner sees is the one a full export gives: the same nodes in the same order, with the
same shapes, parameters, module paths and metadata (``tests/test_trace_stamp.py`` checks
that against full traces of HuggingFace decoders).

When blocks are alike. Two blocks are of one *kind* when their modules have the same
classes, parameters and buffers (names, shapes, dtypes), the same attributes (values of
plain data, the same object otherwise) except a position counter (an integer attribute
that equals the block's index plus a constant, such as HuggingFace's ``layer_idx``, which
training uses only for its key/value cache), and the same entries of per-layer config lists
(``config.layer_types[i]``). A block is copied only from a traced block whose predecessor is
of the same kind as its own predecessor, so the values it reads from the block before
correspond one to one. The cut keeps the first blocks until every pair of kinds that is
copied has been traced twice: the later of the two traced copies is checked to be the
earlier one renamed (op for op, with shapes and module paths), which catches a forward
that depends on its block's position in a way its attributes do not show, and it is the one
copied.

Everything else traces whole (``plan_stamping`` says why, in one line): hooks on a block's
modules or global module hooks, weights or modules shared between blocks or with the rest
of the model, blocks of different kinds with nothing to copy, fewer blocks than the cut
would keep. So does a graph in which ops outside a block read a block other than the last
(a loss over every layer's router logits), a block reads anything but the block before it
and values made before the stack, or a block reads constants the forward made itself
(``stamp_blocks`` raises ``NotStampable`` and the tracer exports the whole model).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx
from torch import nn

__all__ = ["BlockStack", "ExportedParts", "NotStampable", "cut_stacks", "plan_stamping", "stamp_blocks"]

# Hook tables of a module: a block carrying any traces whole (a hook may act per layer).
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")
# A module's own tables, compared through its parameters, buffers and submodules instead.
_TABLES = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", *_HOOK_TABLES})
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


class NotStampable(Exception):
    """The traced graph does not let the cut blocks be copied; the message says why."""


@dataclass(frozen=True)
class BlockStack:
    """One stack of blocks (an ``nn.ModuleList``) whose later blocks are copied.

    ``traced`` blocks (0 .. traced - 1) are exported; block ``j >= traced`` is copied from
    block ``template[j]``, whose twin ``checked[template[j]]`` (an earlier traced block of
    the same pair of kinds) it is checked against first.
    """

    path: str
    modules: nn.ModuleList = field(repr=False, compare=False)
    traced: int
    template: dict[int, int]
    checked: dict[int, int]

    @property
    def size(self) -> int:
        return len(self.template) + self.traced


@dataclass
class ExportedParts:
    """What the tracer reads from an exported program: its graph module, which placeholder is
    which parameter, buffer or lifted constant (by qualified name), and the user inputs."""

    graph_module: torch.fx.GraphModule
    to_parameter: dict[str, str]
    to_buffer: dict[str, str]
    to_constant: dict[str, str]
    user_inputs: list[str]

    @classmethod
    def of(cls, program: torch.export.ExportedProgram) -> "ExportedParts":
        signature = program.graph_signature
        return cls(program.graph_module, dict(signature.inputs_to_parameters), dict(signature.inputs_to_buffers),
                   dict(getattr(signature, "inputs_to_lifted_tensor_constants", {})), list(signature.user_inputs))


# ------------------------------------------------------------------------- which stacks


def plan_stamping(model: nn.Module) -> tuple[list[BlockStack], str]:
    """The stacks of ``model`` whose later blocks can be copied, and one line saying what is
    traced (``model.layers: 6 of 61 blocks traced, 55 copied``) or why every block is."""
    from torch.nn.modules import module as module_globals

    if any(getattr(module_globals, table, None) for table in
           ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks")):
        return [], "every block traced: global module hooks are set"
    stacks, reasons = [], []
    for path, stack in _outermost_stacks(model):
        try:
            stacks.append(_stack_plan(model, path, stack))
        except NotStampable as why:
            reasons.append(f"{path}: {why}")
    words = [f"{s.path}: {s.traced} of {s.size} blocks traced, {s.size - s.traced} copied" for s in stacks]
    return stacks, "; ".join(words + [f"every block traced ({reason})" for reason in reasons])


def _outermost_stacks(model: nn.Module) -> Iterator[tuple[str, nn.ModuleList]]:
    """ModuleLists of three or more modules of one class, not inside another such list."""
    taken: list[str] = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 3 or any(path.startswith(f"{t}.") for t in taken):
            continue
        if len({type(block) for block in module}) == 1:
            taken.append(path)
            yield path, module


def _stack_plan(model: nn.Module, path: str, stack: nn.ModuleList) -> BlockStack:
    _check_nothing_shared(model, path)
    raw = [_block_facts(block, f"{path}.{index}") for index, block in enumerate(stack)]
    counters = _position_counters(raw)
    lists = _per_layer_fields(model, stack)
    keys = []
    for index, facts in enumerate(raw):
        keys.append((tuple((name, "position" if name in counters else value) for name, value in facts),
                     tuple(values[index] for values in lists)))
    kinds = [keys.index(key) for key in keys]
    traced = _traced_count(kinds)
    pairs = {j: (kinds[j - 1], kinds[j]) for j in range(1, len(kinds))}
    template, checked = {}, {}
    for j in range(traced, len(kinds)):
        twins = [i for i in range(1, traced) if pairs[i] == pairs[j]]
        template[j] = twins[-1]
        checked[twins[-1]] = twins[-2]
    return BlockStack(path, stack, traced, template, checked)


def _traced_count(kinds: list[int]) -> int:
    """The fewest first blocks to trace: every pair (kind before, kind) of a copied block
    traced twice, and the last traced block of the last block's kind (what follows the stack
    reads it)."""
    size = len(kinds)
    pairs = [None] + [(kinds[j - 1], kinds[j]) for j in range(1, size)]
    for last in range(2, size - 1):
        seen = pairs[1:last + 1]
        if kinds[last] == kinds[-1] and all(seen.count(pairs[j]) >= 2 for j in range(last + 1, size)):
            return last + 1
    raise NotStampable("no kind of block repeats often enough to copy one")


def _check_nothing_shared(model: nn.Module, path: str) -> None:
    """Blocks must own their weights and modules: a copy renames them."""
    owners: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        owners.setdefault(id(tensor), []).append(name)
    for name, module in model.named_modules(remove_duplicate=False):
        owners.setdefault(id(module), []).append(name)
    for names in owners.values():
        if len(names) > 1 and any(name.startswith(f"{path}.") for name in names):
            raise NotStampable(f"{names[0]} is shared with {names[1]}")


def _block_facts(block: nn.Module, where: str) -> list[tuple[tuple, Any]]:
    """What makes a block trace as it does, as ((module, attribute), value) pairs."""
    facts: list[tuple[tuple, Any]] = []
    for name, module in block.named_modules(remove_duplicate=False):
        if any(getattr(module, table, None) for table in _HOOK_TABLES):
            raise NotStampable(f"{where}{'.' + name if name else ''} has a hook")
        facts.append(((name, "class"), type(module)))
        facts.append(((name, "parameters"), tuple((key, _value_key(value)) for key, value in module._parameters.items())))
        facts.append(((name, "buffers"), tuple((key, _value_key(value), key in module._non_persistent_buffers_set)
                                               for key, value in module._buffers.items())))
        for key, value in vars(module).items():
            if key not in _TABLES:
                facts.append(((name, key), _value_key(value)))
    return facts


def _value_key(value: Any) -> Any:
    """Plain data by value, tensors by their kind and shape, anything else by identity."""
    if isinstance(value, torch.Tensor):
        return ("tensor", type(value), tuple(value.shape), value.dtype, value.device, value.requires_grad)
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_value_key(item) for item in value))
    if isinstance(value, dict):
        return (type(value), tuple((repr(key), _value_key(item)) for key, item in value.items()))
    return ("object", id(value))


def _position_counters(raw: list[list[tuple[tuple, Any]]]) -> set[tuple]:
    """Integer attributes that count the blocks (``layer_idx``: the index plus a constant)."""
    counters = set()
    for position, (name, first) in enumerate(raw[0]):
        if not isinstance(first, int) or isinstance(first, bool):
            continue
        values = [facts[position] if position < len(facts) else None for facts in raw]
        if all(item is not None and item[0] == name and isinstance(item[1], int) and item[1] - index == first
               for index, item in enumerate(values)):
            counters.add(name)
    return counters


def _per_layer_fields(model: nn.Module, stack: nn.ModuleList) -> list[list[Any]]:
    """Fields of the configs the model and its blocks hold that list one value per block
    (``config.layer_types``): each block's entry is part of its kind."""
    configs = {id(value): value for holder in (model, *stack.modules()) for value in vars(holder).values()
               if not isinstance(value, (nn.Module, torch.Tensor, *_PLAIN, tuple, list, dict, type))
               and isinstance(getattr(value, "__dict__", None), dict)}
    found = []
    for config in configs.values():
        for value in config.__dict__.values():
            if isinstance(value, (list, tuple)) and len(value) == len(stack):
                found.append([_value_key(item) for item in value])
    return found


@contextlib.contextmanager
def cut_stacks(stacks: list[BlockStack]) -> Iterator[None]:
    """While active, each stack holds only its traced blocks, yet its ``len()`` is still
    the whole stack's: a forward that derives a value from the depth (a residual scale)
    traces it as the full model does, and one that indexes every block (``self.layers[i]``
    for ``i`` in ``range(len(self.layers))``) fails, so the whole model is exported."""
    saved = [(stack.modules, stack.modules._modules, type(stack.modules)) for stack in stacks]
    try:
        for stack in stacks:
            kept = list(stack.modules._modules.items())[:stack.traced]
            stack.modules._modules = type(stack.modules._modules)(kept)
            stack.modules.__class__ = _cut_class(type(stack.modules), stack.size)
        yield
    finally:
        for modules, table, kind in saved:
            modules._modules = table
            modules.__class__ = kind


def _cut_class(kind: type, size: int) -> type:
    """``kind`` whose ``len()`` is ``size`` (the stack's length before the cut)."""
    return type(kind.__name__, (kind,), {"__len__": lambda self: size, "__module__": kind.__module__})


# --------------------------------------------------------------------------- stamping


def stamp_blocks(parts: ExportedParts, stacks: list[BlockStack], module_of: Any) -> ExportedParts:
    """The exported ``parts`` of the cut model with every stack's copied blocks added, as a
    full export would have them; ``module_of(node)`` is a node's module path.

    Raises:
        NotStampable: the graph does not allow the copy (module docstring).
    """
    for stack in stacks:
        _Stamper(parts, stack, module_of).run()
    parts.graph_module.graph.lint()
    parts.graph_module.recompile()
    return parts


class _Stamper:
    def __init__(self, parts: ExportedParts, stack: BlockStack, module_of: Any):
        self.parts, self.stack, self.graph = parts, stack, parts.graph_module.graph
        pattern = re.compile(rf"^{re.escape(stack.path)}\.(\d+)(?:\.|$)")
        self.blocks: dict[int, list[torch.fx.Node]] = {}
        self.block_of: dict[torch.fx.Node, int] = {}
        self.position: dict[torch.fx.Node, int] = {}
        for node in self.graph.nodes:
            match = pattern.match(module_of(node)) if node.op == "call_function" else None
            if match:
                index = int(match[1])
                self.position[node] = len(self.blocks.setdefault(index, []))
                self.blocks[index].append(node)
                self.block_of[node] = index
        self.state = {name: fqn for name, fqn in [*parts.to_parameter.items(), *parts.to_buffer.items()]}
        self.constants = set(parts.to_constant)
        self.placeholders_of: dict[int, list[torch.fx.Node]] = {}

    def run(self) -> None:
        stack = self.stack
        if sorted(self.blocks) != list(range(stack.traced)):
            raise NotStampable(f"the traced graph has ops of blocks {sorted(self.blocks)}, not 0..{stack.traced - 1}")
        order = {node: position for position, node in enumerate(self.graph.nodes)}
        for index, nodes in self.blocks.items():
            self._check_block(index, nodes, order)
            if index and order[nodes[0]] != order[self.blocks[index - 1][-1]] + 1:
                raise NotStampable(f"ops outside the blocks run between {stack.path}.{index - 1} and {stack.path}.{index}")
        last = stack.traced - 1
        after = [node for node in self.graph.nodes if order[node] > order[self.blocks[last][-1]]]
        for node in after:
            for read in node.all_input_nodes:
                if read in self.block_of and self.block_of[read] != last:
                    raise NotStampable(f"{node.name} after the stack reads block {self.block_of[read]}, not the last")
        for twin, earlier in stack.checked.items():
            self._check_twin(earlier, twin)
        self._add_placeholders()
        anchor = self.blocks[last][-1]
        for j in range(stack.traced, stack.size):
            anchor = self._copy(stack.template[j], j, anchor)
        final = self.blocks[stack.size - 1]
        for node in after:
            node.args, node.kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda read: self._last_read(read, final))

    def _last_read(self, read: torch.fx.Node, final: list[torch.fx.Node]) -> torch.fx.Node:
        return final[self.position[read]] if self.block_of.get(read) == self.stack.traced - 1 else read

    def _check_block(self, index: int, nodes: list[torch.fx.Node], order: dict) -> None:
        if order[nodes[-1]] - order[nodes[0]] + 1 != len(nodes):
            raise NotStampable(f"ops of {self.stack.path}.{index} are interleaved with other ops")
        for node in nodes:
            for read in node.all_input_nodes:
                owner = self.block_of.get(read)
                if owner is not None and owner not in (index, index - 1):
                    raise NotStampable(f"{self.stack.path}.{index} reads block {owner}")
                if read.name in self.constants:
                    raise NotStampable(f"{self.stack.path}.{index} reads a constant its forward made ({read.name})")

    # ----------------------------------------------------------------- correspondence

    def _prefix(self, index: int) -> str:
        return f"{self.stack.path}.{index}."

    def _renamed_fqn(self, fqn: str, source: int, target: int) -> str:
        return self._prefix(target) + fqn[len(self._prefix(source)):]

    def _block_placeholders(self, index: int) -> list[torch.fx.Node]:
        """The placeholders of block ``index``'s parameters and buffers, in graph order."""
        if index not in self.placeholders_of:
            prefix = self._prefix(index)
            self.placeholders_of[index] = [node for node in self.graph.nodes if node.op == "placeholder"
                                           and self.state.get(node.name, "").startswith(prefix)]
        return self.placeholders_of[index]

    def _mapping(self, source: int, target: int, placeholders: dict[str, torch.fx.Node]) -> dict[torch.fx.Node, torch.fx.Node]:
        """Source block's reads -> the target block's: the block before each, and its weights."""
        mapping = {}
        if source > 0:
            before, target_before = self.blocks[source - 1], self.blocks[target - 1]
            if len(before) != len(target_before):
                raise NotStampable(f"blocks {source - 1} and {target - 1} differ in length")
            mapping.update(zip(before, target_before))
        for node in self._block_placeholders(source):
            renamed = self._renamed_fqn(self.state[node.name], source, target)
            if renamed not in placeholders:
                raise NotStampable(f"{renamed} has no placeholder")
            mapping[node] = placeholders[renamed]
        return mapping

    def _module_stack(self, node: torch.fx.Node, source: int, target: int) -> Any:
        """``node``'s module stack with block ``source``'s paths (and keys) as ``target``'s."""
        stack = node.meta.get("nn_module_stack")
        if stack is None:
            return None
        # Keys spell paths behind a prefix ("L__self__model.layers.3"), values plainly.
        pattern = re.compile(rf"(?<![0-9A-Za-z.]){re.escape(self.stack.path)}\.{source}(?=\.|$)")
        replacement = f"{self.stack.path}.{target}"
        return {pattern.sub(replacement, key): (pattern.sub(replacement, path), kind) for key, (path, kind) in stack.items()}

    def _check_twin(self, earlier: int, twin: int) -> None:
        """Block ``twin`` must be block ``earlier`` renamed, op for op."""
        placeholders = {self.state[node.name]: node for node in self._block_placeholders(twin)}
        mapping = self._mapping(earlier, twin, placeholders)
        first, second = self.blocks[earlier], self.blocks[twin]
        if len(first) != len(second):
            raise NotStampable(f"blocks {earlier} and {twin} trace to {len(first)} and {len(second)} ops")
        mapping.update(zip(first, second))
        for a, b in zip(first, second):
            args = torch.fx.node.map_arg((a.args, a.kwargs), lambda read: mapping.get(read, read))
            if a.target != b.target or args != (b.args, b.kwargs) or _shapes(a) != _shapes(b) \
                    or self._module_stack(a, earlier, twin) != b.meta.get("nn_module_stack"):
                raise NotStampable(f"block {twin} does not trace as block {earlier} renamed ({a.name} vs {b.name})")

    # ------------------------------------------------------------------------ copying

    def _add_placeholders(self) -> None:
        """Placeholders of the copied blocks' weights, after those of the last traced block,
        named as export names them (``p_model_layers_7_mlp_...``)."""
        last = self.stack.traced - 1
        self.placeholders: dict[str, torch.fx.Node] = {}
        for table in (self.parts.to_parameter, self.parts.to_buffer):
            sources = [node for node in self._block_placeholders(last) if node.name in table]
            if not sources:
                continue
            anchor = sources[-1]
            for j in range(self.stack.traced, self.stack.size):
                template = self.stack.template[j]
                for node in (n for n in self._block_placeholders(template) if n.name in table):
                    fqn = self._renamed_fqn(table[node.name], template, j)
                    old, new = _flat(self._prefix(template)), _flat(self._prefix(j))
                    if old not in node.name:
                        raise NotStampable(f"placeholder {node.name} does not name {self._prefix(template)}")
                    with self.graph.inserting_after(anchor):
                        anchor = self.graph.placeholder(node.name.replace(old, new, 1))
                    anchor.meta.update(node.meta)
                    table[anchor.name] = fqn
                    self.state[anchor.name] = fqn
                    self.placeholders[fqn] = anchor
        for table_name in ("to_parameter", "to_buffer"):
            table = getattr(self.parts, table_name)
            order = {node.name: position for position, node in enumerate(self.graph.nodes)}
            setattr(self.parts, table_name, dict(sorted(table.items(), key=lambda item: order[item[0]])))

    def _copy(self, template: int, target: int, anchor: torch.fx.Node) -> torch.fx.Node:
        """Block ``target`` copied from ``template`` after ``anchor``; returns its last op."""
        mapping = self._mapping(template, target, self.placeholders)
        copies = []
        for node in self.blocks[template]:
            with self.graph.inserting_after(anchor):
                anchor = self.graph.node_copy(node, lambda read: mapping.get(read, read))
            anchor.meta = dict(node.meta)
            stack = self._module_stack(node, template, target)
            if stack is not None:
                anchor.meta["nn_module_stack"] = stack
            mapping[node] = anchor
            self.position[anchor] = len(copies)
            self.block_of[anchor] = target
            copies.append(anchor)
        self.blocks[target] = copies
        return anchor


def _flat(prefix: str) -> str:
    """A module path as export spells it inside placeholder names (dots as underscores)."""
    return prefix.replace(".", "_")


def _shapes(node: torch.fx.Node) -> Any:
    value = node.meta.get("val")
    leaves = torch.utils._pytree.tree_leaves(value)
    return tuple((tuple(leaf.shape), leaf.dtype, tuple(leaf.stride())) if isinstance(leaf, torch.Tensor) else repr(leaf)
                 for leaf in leaves)
