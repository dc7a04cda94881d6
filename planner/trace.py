"""Front end: turn a model and one global batch into an ``OpGraph``.

``torch.export.export(..., strict=False)`` gives an ATen-level fx graph with FakeTensor
metadata on every node and works on current HuggingFace models. When export cannot take a
model, ``torch.fx.symbolic_trace`` plus shape propagation on meta tensors is the fallback
(its nodes are torch-level: modules, functions and methods rather than ATen ops). A model
neither can trace gets a ``TraceError`` naming the innermost module that was running when
tracing failed, and what to do.

Tracing never allocates weights when the model lives on the meta device: FLOPs are counted
by running each op on meta tensors under ``torch.utils.flop_counter.FlopCounterMode``.
"""

from __future__ import annotations

import contextlib
import operator
import os
import re
import sys
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch.utils.flop_counter import FlopCounterMode

from planner.attention_masks import attention_mask_kinds
from planner.errors import TraceError
from planner.fingerprint import model_fingerprint
from planner.flop_formulas import register_grouped_matmul_formulas
from planner.functionalize import functional_program
from planner.graph import VIEW_OPS, BlockRun, GraphInput, OpGraph, OpNode, TensorMeta
from planner.module_moves import module_moves_traced
from planner.moe_blocks import find_moe_blocks
from planner.node_names import name_nodes_by_content
from planner.opaque_backward import watch_backward
from planner.trace_diagnostics import ModuleTracker, trace_error
from planner.trace_stamp import BlockStack, ExportedParts, NotStampable, cut_stacks, plan_stamping, stamp_blocks

__all__ = ["trace"]

# Composite ops that FlopCounterMode only sees after they decompose on meta tensors; ops
# outside this set and the flop registry are not run for counting (they do no matmul work).
_COMPOSITE_MATMUL_OPS = frozenset(
    {
        "aten.linear.default",
        "aten.matmul.default",
        "aten.einsum.default",
        "aten.bilinear.default",
        "aten.scaled_dot_product_attention.default",
        "aten.conv1d.default",
        "aten.conv2d.default",
        "aten.conv3d.default",
        "aten.conv_transpose1d.input",
        "aten.conv_transpose2d.input",
        "aten.conv_transpose3d.input",
    }
)
_BLOCK_PATH = re.compile(r"^(?P<group>.+?)\.(?P<index>\d+)(?:\.|$)")


def trace(
    model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None, on_progress: Callable[[str, float], None] | None = None,
    *, copy_blocks: bool = True,
) -> OpGraph:
    """Trace ``model(*args, **kwargs)`` (one global batch) into an ``OpGraph``.

    Args:
        model: the model, typically built under ``torch.device("meta")``.
        args: positional example inputs; dim 0 of tensor inputs is the global batch.
        kwargs: keyword example inputs.
        on_progress: called with (the module being traced, fraction of the model's modules
            entered so far) as tracing goes, for progress bars on deep models.
        copy_blocks: export a stack of alike blocks cut to its first few and copy the rest
            (``planner.trace_stamp``: the same graph, faster); False exports every block.

    Returns:
        The forward program with shapes, dtypes, parameters, module paths, FLOPs, bytes
        and repeated blocks.

    Raises:
        TraceError: when neither ``torch.export`` nor ``torch.fx.symbolic_trace`` can trace
            the model; the message names the module that failed and the fix.
    """
    kwargs = dict(kwargs or {})
    register_grouped_matmul_formulas()  # the model's imports may have defined such an op
    graph = _trace(model, args, kwargs, on_progress, copy_blocks)
    # Stored in plans, so compile/simulate/launch can tell when the spec builds another model.
    graph.model_fingerprint = model_fingerprint(model, args, kwargs)
    # The cost model prices these layers by their layout, the search chooses it.
    graph.moe_blocks = find_moe_blocks(model)
    return graph


def _trace(model: torch.nn.Module, args: tuple, kwargs: dict, on_progress, copy_blocks: bool) -> OpGraph:
    was_training = model.training
    model.train()  # plan the training program: dropout and friends must appear
    stacks, note = plan_stamping(model) if copy_blocks else ([], "")
    try:
        # Custom autograd Functions and backward hooks are recorded while tracing: the graph
        # keeps their forward's ops only (planner.opaque_backward).
        # A forward that moves its own modules (self.head.to(x.device)) traces when the move is a
        # no-op (planner.module_moves).
        with ModuleTracker(model, on_progress) as tracker, watch_backward(model, tracker.current_path) as opaque, \
                module_moves_traced(model):
            graph = _trace_either(model, args, kwargs, tracker, stacks)
        copied = stacks and graph.tracer == "export" and not graph.trace_note
        if copied and any(path.startswith(f"{stack.path}.") for path, _ in opaque.found for stack in stacks):
            # What defines its own backward is found per module as it runs, and copied blocks never ran.
            graph = _trace(model, args, kwargs, on_progress, copy_blocks=False)
            graph.trace_note = "every block traced: a block defines its own backward"
            return graph
        graph.opaque_backward = list(opaque.found)
        if copied or graph.tracer == "export" and not graph.trace_note:
            graph.trace_note = note
        return graph
    finally:
        model.train(was_training)


def _trace_either(model: torch.nn.Module, args: tuple, kwargs: dict, tracker: ModuleTracker,
                  stacks: list[BlockStack]) -> OpGraph:
    """``torch.export``, else ``torch.fx.symbolic_trace``, else a ``TraceError``."""
    try:
        return _trace_with_export(model, args, kwargs, stacks)
    except TraceError:
        raise  # a construct of the model's own named by this package: the fallback cannot take it either
    except Exception as export_error:  # noqa: BLE001 - any failure triggers the fallback
        export_failure = (tracker.failed_module(), export_error)
    try:
        return _trace_with_symbolic_trace(model, args, kwargs)
    except Exception as fx_error:  # noqa: BLE001
        raise trace_error(model, export_failure, fx_error) from export_failure[1]


# --------------------------------------------------------------------------- export path


def _trace_with_export(model: torch.nn.Module, args: tuple, kwargs: dict, stacks: list[BlockStack]) -> OpGraph:
    parts, constants, note = _exported_parts(model, args, kwargs, stacks)
    graph_module = parts.graph_module
    # Plans name ops by node name: names after what each op computes, not the trace order,
    # which can differ between processes (planner.node_names).
    name_nodes_by_content(graph_module, _module_path, constants)
    # Tied weights (an embedding shared with the head) appear once per alias in the
    # signature; name each by its first alias so it is counted and sharded once.
    canonical = _canonical_names(model)
    to_parameter = {name: canonical.get(fqn, fqn) for name, fqn in parts.to_parameter.items()}
    to_buffer = {name: canonical.get(fqn, fqn) for name, fqn in parts.to_buffer.items()}
    placeholder_to_state = {**to_parameter, **to_buffer}
    placeholder_to_state.update(parts.to_constant)
    placeholders = {node.name: node for node in graph_module.graph.nodes if node.op == "placeholder"}

    parameters = {fqn: _meta_of(placeholders[name].meta.get("val")) for name, fqn in to_parameter.items()}
    buffers = {fqn: _meta_of(placeholders[name].meta.get("val")) for name, fqn in to_buffer.items()}
    user_inputs = [(name, placeholders[name].meta.get("val")) for name in parts.user_inputs]
    graph_inputs, batch_size = _graph_inputs(user_inputs)

    flop_cache: dict[tuple, int] = {}
    # What each attention op's mask allows (a causal LM's explicit mask is priced and compiled
    # as the causal kernel a real run takes).
    mask_kinds = attention_mask_kinds(graph_module, constants)
    nodes = []
    for fx_node in graph_module.graph.nodes:
        if fx_node.op != "call_function":
            continue
        input_nodes = [arg for arg in _flat_nodes(fx_node) if _metas_of(arg.meta.get("val"))]
        module, module_type = _innermost_module(fx_node)
        op = _op_name(fx_node.target)
        output_meta = _metas_of(fx_node.meta.get("val"))
        input_meta = tuple(_input_meta(fx_node, arg) for arg in input_nodes)
        nodes.append(
            OpNode(
                name=fx_node.name,
                op=op,
                inputs=tuple(arg.name for arg in input_nodes),
                input_meta=input_meta,
                output_meta=output_meta,
                params=tuple(placeholder_to_state[arg.name] for arg in input_nodes if arg.name in placeholder_to_state),
                param_inputs=tuple(arg.name for arg in input_nodes if arg.name in placeholder_to_state),
                attrs=_attrs_of(fx_node),
                module=module,
                module_type=module_type,
                flops=_count_flops(fx_node, op, flop_cache),
                bytes_moved=_bytes_moved(op, input_meta, output_meta),
                attention_mask_kind=mask_kinds.get(fx_node.name),
            )
        )
    graph = OpGraph(
        nodes=nodes,
        inputs=graph_inputs,
        parameters=parameters,
        buffers=buffers,
        batch_size=batch_size,
        tracer="export",
        graph_module=graph_module,
        constants=constants,
        trace_note=note,
    )
    _mark_repeated_blocks(graph)
    return graph


def _exported_parts(model: torch.nn.Module, args: tuple, kwargs: dict,
                    stacks: list[BlockStack]) -> tuple[ExportedParts, dict[str, torch.Tensor], str]:
    """The exported program's parts, its lifted constants, and what was traced: the stacks
    cut to their first blocks and the rest copied (``planner.trace_stamp``) where the graph
    allows it, else the whole model."""
    note = ""
    if stacks:
        try:
            with cut_stacks(stacks):
                program = _functional_export(model, args, kwargs)
            parts = stamp_blocks(ExportedParts.of(program), stacks, _module_path)
            return parts, _lifted_constants(program), ""
        except NotStampable as why:
            note = f"every block traced: {why}"
        except Exception:  # noqa: BLE001 - the whole model's export decides, with its own error
            note = "every block traced: the cut model did not export"
    program = _functional_export(model, args, kwargs)
    return ExportedParts.of(program), _lifted_constants(program), note


def _functional_export(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    # In-place writes into tensors the forward makes (a buffer filled by slices) become
    # functional ops, so every later stage sees plain data flow (planner.functionalize).
    return functional_program(_export(model, args, kwargs))


def _export(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    """``torch.export`` (non-strict) of one forward; on fake CPU tensors where meta ones lose data.

    Tensors a forward makes from Python data (``torch.tensor([...])``, ``x[..., [-2]]``)
    become *lifted tensor constants* of the exported program. Made on the meta device (the
    model's), they hold no values, and made on the CPU without a device they cannot meet
    the meta inputs at all. Exporting with the parameters and inputs as fake tensors that
    claim the CPU (no memory either) keeps every constant's values and lets CPU constants
    mix with the inputs, as they do when the model runs on a CPU; a model that fails there
    is exported on meta.
    """
    if not _on_meta(model, args, kwargs):
        return _quiet_export(model, args, kwargs)
    # Fake CPU tensors first: a meta export would have to be redone on them whenever the
    # forward makes a tensor from Python data (most HuggingFace models do), and each export
    # of a large model takes seconds (14 s for DeepSeek-V3).
    try:
        return _export_on_fake_cpu(model, args, kwargs)
    except Exception as fake_error:  # noqa: BLE001 - the meta export decides, with its own error
        program = _quiet_export(model, args, kwargs)
        if any(isinstance(value, torch.Tensor) and value.device.type == "meta" for value in program.constants.values()):
            raise fake_error from None  # the meta program's constants hold no values
        return program


def _quiet_export(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    with warnings.catch_warnings(), _stderr_silenced():
        warnings.simplefilter("ignore")
        return torch.export.export(model, tuple(args), kwargs, strict=False)


def _on_meta(model: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    tensors = [*model.parameters(), *model.buffers(), *torch.utils._pytree.tree_leaves((args, kwargs))]
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors)


def _export_on_fake_cpu(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    """Export with every meta parameter, buffer and input swapped for a fake tensor on the CPU
    (the model's own tensors are put back afterwards)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def on_fake_cpu(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.device.type != "meta":
            return value
        shell = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        return FakeTensor(mode, shell, torch.device("cpu"))

    swapped: list[tuple[dict, str, torch.Tensor]] = []
    # One fake per tensor: a weight tied between modules (an embedding and its head, one
    # norm shared by blocks) stays one parameter of the exported program.
    fakes: dict[int, torch.Tensor] = {}
    try:
        for module in model.modules():
            for table, is_parameter in ((module._parameters, True), (module._buffers, False)):
                for name, value in list(table.items()):
                    if value is None or value.device.type != "meta":
                        continue
                    swapped.append((table, name, value))
                    if id(value) not in fakes:
                        fake = on_fake_cpu(value)
                        fakes[id(value)] = torch.nn.Parameter(fake, requires_grad=value.requires_grad) if is_parameter else fake
                    table[name] = fakes[id(value)]
        fake_args, fake_kwargs = torch.utils._pytree.tree_map(on_fake_cpu, (tuple(args), dict(kwargs)))
        return _quiet_export(model, fake_args, fake_kwargs)
    finally:
        for table, name, value in reversed(swapped):
            table[name] = value


def _lifted_constants(program: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """Placeholder name -> value of each lifted tensor constant that holds data (a CPU copy)."""
    constants = {}
    for placeholder, target in program.graph_signature.inputs_to_lifted_tensor_constants.items():
        value = program.constants.get(target)
        if isinstance(value, torch.Tensor) and type(value) is torch.Tensor and value.device.type != "meta":
            constants[placeholder] = value.detach().to("cpu").clone()
    return constants


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Silence file descriptor 2: export prints the whole graph there when it fails, and
    our TraceError already says what went wrong in one line."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _attrs_of(fx_node: torch.fx.Node) -> tuple:
    """Positional arguments with every node (tensor) replaced by ``None``."""
    return tuple(torch.fx.node.map_arg(tuple(fx_node.args), lambda _: None))


def _input_meta(fx_node: torch.fx.Node, source: torch.fx.Node) -> TensorMeta:
    """Metadata of the tensor ``fx_node`` reads from ``source`` (one element of a list output
    for ``getitem``, e.g. after ``split``)."""
    metas = _metas_of(source.meta.get("val"))
    if fx_node.target is operator.getitem and isinstance(fx_node.args[1], int) and fx_node.args[1] < len(metas):
        return metas[fx_node.args[1]]
    return metas[0]


def _canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter/buffer alias -> the first name under which the tensor appears."""
    first: dict[int, str] = {}
    canonical: dict[str, str] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        canonical[name] = first.setdefault(id(tensor), name)
    return canonical


def _op_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # "aten.mm.default"
    return getattr(target, "__name__", str(target))


def _innermost_module(fx_node: torch.fx.Node) -> tuple[str, str]:
    stack = fx_node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, module_type = list(stack.values())[-1]
    module_type = module_type if isinstance(module_type, str) else getattr(module_type, "__qualname__", "")
    return _clean_module_path(path), module_type.rsplit(".", 1)[-1]


def _module_path(fx_node: torch.fx.Node) -> str:
    return _innermost_module(fx_node)[0]


def _clean_module_path(path: str) -> str:
    # Strict-mode stacks spell paths as "L['self'].layers[0]"; normalise to "layers.0".
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.removeprefix("self.").strip(".")


def _count_flops(fx_node: torch.fx.Node, op: str, cache: dict[tuple, int]) -> int:
    """Forward FLOPs of one ATen node, counted by running it on meta tensors."""
    target = fx_node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0
    from torch.utils.flop_counter import flop_registry

    if target.overloadpacket not in flop_registry and op not in _COMPOSITE_MATMUL_OPS:
        return 0
    args, kwargs = torch.fx.node.map_arg((fx_node.args, fx_node.kwargs), _meta_tensor_for)
    key = (op, _shape_signature(args), _shape_signature(kwargs))
    if key not in cache:
        counter = FlopCounterMode(display=False)
        try:
            with counter:
                target(*args, **kwargs)
            cache[key] = counter.get_total_flops()
        except Exception:  # noqa: BLE001 - an op meta cannot run costs what we cannot count
            cache[key] = 0
    return cache[key]


def _meta_tensor_for(node: torch.fx.Node) -> Any:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def _shape_signature(tree: Any) -> tuple:
    leaves = torch.utils._pytree.tree_leaves(tree)
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in leaves)


# ------------------------------------------------------------------- symbolic_trace path


def _trace_with_symbolic_trace(model: torch.nn.Module, args: tuple, kwargs: dict) -> OpGraph:
    graph_module = torch.fx.symbolic_trace(model)
    name_nodes_by_content(graph_module, _module_path)  # as on the export path
    placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
    inputs = list(args) + [kwargs[node.target] for node in placeholders[len(args):] if node.target in kwargs]
    device = next((p.device for p in model.parameters()), torch.device("meta"))
    recorder = _ShapeAndFlopRecorder(graph_module)
    with torch.device(device):
        recorder.run(*inputs)

    parameters = {name: _meta_of(p) for name, p in model.named_parameters()}
    buffers = {name: _meta_of(b) for name, b in model.named_buffers()}
    user_inputs = [(node.target, value) for node, value in zip(placeholders, inputs)]
    graph_inputs, batch_size = _graph_inputs(user_inputs)
    modules = dict(model.named_modules())

    nodes = []
    for fx_node in graph_module.graph.nodes:
        if fx_node.op in ("placeholder", "output"):
            continue
        output_meta = _metas_of(recorder.values.get(fx_node.name))
        input_nodes = [arg for arg in _flat_nodes(fx_node) if _metas_of(recorder.values.get(arg.name))]
        input_meta = tuple(_metas_of(recorder.values.get(arg.name))[0] for arg in input_nodes)
        params: tuple[str, ...] = ()
        module = ""
        module_type = ""
        if fx_node.op == "call_module":
            op = f"module:{type(modules[fx_node.target]).__name__}"
            module, module_type = fx_node.target, type(modules[fx_node.target]).__name__
            params = tuple(f"{fx_node.target}.{name}" for name, _ in modules[fx_node.target].named_parameters())
        elif fx_node.op == "get_attr":
            op, params = "get_attr", (fx_node.target,)
        elif fx_node.op == "call_method":
            op = f"method:{fx_node.target}"
        else:
            op = f"function:{getattr(fx_node.target, '__name__', fx_node.target)}"
        nodes.append(
            OpNode(
                name=fx_node.name,
                op=op,
                inputs=tuple(arg.name for arg in input_nodes),
                input_meta=input_meta,
                output_meta=output_meta,
                params=params,
                module=module,
                module_type=module_type,
                flops=recorder.flops.get(fx_node.name, 0),
                bytes_moved=_bytes_moved(op, input_meta, output_meta),
            )
        )
    graph = OpGraph(
        nodes=nodes,
        inputs=graph_inputs,
        parameters=parameters,
        buffers=buffers,
        batch_size=batch_size,
        tracer="symbolic_trace",
        graph_module=graph_module,
    )
    _mark_repeated_blocks(graph)
    return graph


class _ShapeAndFlopRecorder(torch.fx.Interpreter):
    """Runs a symbolically traced module, recording each node's value and FLOPs."""

    def __init__(self, module: torch.fx.GraphModule):
        super().__init__(module)
        self.values: dict[str, Any] = {}
        self.flops: dict[str, int] = {}

    def run_node(self, node: torch.fx.Node) -> Any:
        counter = FlopCounterMode(display=False)
        with counter:
            value = super().run_node(node)
        self.values[node.name] = value
        self.flops[node.name] = counter.get_total_flops()
        return value


# ------------------------------------------------------------------------------ shared


def _graph_inputs(user_inputs: list[tuple[str, Any]]) -> tuple[list[GraphInput], int]:
    """User inputs with their batch dimension; the batch is dim 0 of the first tensor input."""
    tensors = [value for _, value in user_inputs if isinstance(value, torch.Tensor) and value.dim() > 0]
    if not tensors:
        raise TraceError(
            "the example inputs contain no tensor with a batch dimension; pass at least one "
            "tensor whose dim 0 is the global batch"
        )
    batch_size = int(tensors[0].shape[0])
    graph_inputs = []
    for name, value in user_inputs:
        meta = _meta_of(value)
        batch_dim = 0 if meta is not None and meta.shape and meta.shape[0] == batch_size else None
        graph_inputs.append(GraphInput(name=name, meta=meta, batch_dim=batch_dim))
    return graph_inputs, batch_size


def _flat_nodes(fx_node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((fx_node.args, fx_node.kwargs), found.append)
    return list(dict.fromkeys(found))  # unique, in order


def _meta_of(value: Any) -> TensorMeta | None:
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(int(d) for d in value.shape), value.dtype)
    return None


def _metas_of(value: Any) -> tuple[TensorMeta, ...]:
    leaves = torch.utils._pytree.tree_leaves(value)
    return tuple(meta for meta in (_meta_of(leaf) for leaf in leaves) if meta is not None)


def _bytes_moved(op: str, inputs: tuple[TensorMeta, ...], outputs: tuple[TensorMeta, ...]) -> int:
    if op in VIEW_OPS or op.startswith("method:view") or op == "get_attr":
        return 0
    return sum(meta.nbytes for meta in inputs) + sum(meta.nbytes for meta in outputs)


def _mark_repeated_blocks(graph: OpGraph) -> None:
    """Mark nodes of stacks of same-structured blocks, e.g. ``layers.0`` .. ``layers.31``.

    In each stack, every run of two or more consecutive blocks that issue the same op
    sequence on the same shapes is a ``BlockRun`` (DeepSeek-V3: its 3 dense layers, then its
    58 MoE layers), so search may solve one block of a kind and reuse it, and recomputation
    and pipeline stages cover every run. A block alike to neither neighbour (T5's first,
    with its position bias) stays ordinary ops, as the embedding is.
    """
    members: dict[str, dict[int, list[OpNode]]] = {}
    for node in graph.nodes:
        match = _BLOCK_PATH.match(node.module)
        if match:
            members.setdefault(match["group"], {}).setdefault(int(match["index"]), []).append(node)
    runs = []
    for group, blocks in members.items():
        if len(blocks) < 2:
            continue
        signature = {
            index: tuple((n.op, n.module.split(f"{group}.{index}", 1)[1], n.input_meta, n.output_meta) for n in nodes)
            for index, nodes in blocks.items()
        }
        kinds: list[tuple] = []
        for run in _alike_runs(sorted(blocks), signature):
            if signature[run[0]] not in kinds:
                kinds.append(signature[run[0]])
            runs.append(BlockRun(group, run[0], len(run), kinds.index(signature[run[0]])))
            for index in run:
                for node in blocks[index]:
                    node.block = (group, index)
    graph.block_runs = tuple(runs)


def _alike_runs(indices: list[int], signature: dict[int, tuple]) -> list[list[int]]:
    """The maximal runs of at least two consecutive indices with equal signatures, in order."""
    runs: list[list[int]] = []
    run: list[int] = []
    for index in indices:
        if run and index == run[-1] + 1 and signature[index] == signature[run[-1]]:
            run.append(index)
        else:
            run = [index]
            runs.append(run)
    return [run for run in runs if len(run) >= 2]
