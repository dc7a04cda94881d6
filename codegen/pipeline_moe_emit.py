"""MoE layers in pipeline programs: each layer's traced ops written as one call.

A pipeline plan of an MoE model (``plan.expert_layouts`` beside ``plan.pipeline``) runs each
MoE layer by its layout over its stage's ``dp`` ranks (``codegen.runtime.pipeline_moe``). The
writer (``codegen.pipeline_emit``) replays the traced graph op by op; here the ops of each
MoE layer (router, routing, dispatch, experts, combine, balance loss) are replaced by one
line at the point where the layer's first result is needed::

    view_3, mul_9 = self.moe_layer(p_blocks_0_moe_router_weight, layer_norm_2)

reading the layer's router (the stage's DTensor parameter) and its input, and defining its
two results: the output (rows split over dp) and the balance loss (the same on every rank).
The expert weights are read by no written op: the runtime builds the layer from them before
the stage frees the weights it does not read, and holds the experts itself.

A HuggingFace block (``planner.moe_blocks.HF_STACKED_EXPERTS``) keeps its own router, top-k
and weighting as traced ops; only its stacked experts' ops are replaced, by::

    sum_4 = self.moe_experts(p_model_layers_1_mlp_gate_weight, view_7, getitem_3, div_2)

reading the block's router (only to find the layer, as above), the tokens, each token's chosen
experts and their weights, and defining the experts' weighted sum per token (rows split over
the stage's ranks). A layer whose traced ops do not have these shapes (one activation in, a
router among its parameters, exactly one output and one scalar balance loss out; for a
HuggingFace block, tokens, an integer top-k index and float weights in, one output out) is
refused with its name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from torch.distributed.tensor import Replicate, Shard

from codegen.moe_folding_placement import folded_replicas
from codegen.source_text import comment, identifier, literal
from codegen.spmd_emit import GraphEmitter
from codegen.spmd_placements import Value
from planner.graph import OpGraph
from planner.expert_kernels import BATCHED_MATMUL, PER_EXPERT_LOOP, emitted_expert_kernel
from planner.moe_blocks import MoEBlock
from planner.plans import Plan


@dataclass(frozen=True)
class MoECall:
    """One MoE layer of the traced micro-batch graph, as the call that replaces its ops."""

    path: str
    nodes: frozenset[str]  # the layer's fx nodes
    at: str  # the node where the call is written (the first result in graph order)
    router: str  # the router's placeholder
    tokens: str  # the activation the layer reads
    output: str  # the layer's output node
    balance: str | None  # its balance-loss node (None for a HuggingFace block's experts)
    # A HuggingFace block's experts: the (top-k index, top-k weights) nodes its router made.
    choices: tuple[str, str] | None = None


def moe_calls(plan: Plan, graph: OpGraph) -> dict[str, MoECall]:
    """The MoE layers of ``plan.expert_layouts`` in ``graph`` (the traced micro-batch), by
    module path (see the module docstring); a HuggingFace block laid out data parallel is
    left out (its traced ops run it so on every dp rank).

    Raises:
        NotImplementedError: a layer's traced ops are not of the shape this writer replaces.
    """
    blocks = {block.module: block for block in graph.moe_blocks}
    gm = graph.graph_module
    by_name = {fx_node.name: fx_node for fx_node in gm.graph.nodes}
    placeholder_of = {}
    for node in graph.nodes:
        placeholder_of.update(zip(node.params, node.param_inputs))
    calls = {}
    for layout in plan.expert_layouts:
        block: MoEBlock = blocks[layout.module]
        # The kernels the layer's experts run on (planner.expert_kernels: the simulator prices the same).
        kernel = emitted_expert_kernel(block.runtime, layout.mode)
        if kernel == PER_EXPERT_LOOP:
            calls[block.module] = _stacked_experts_call(block, graph, by_name, placeholder_of)
        if kernel != BATCHED_MATMUL:  # model_experts: its traced ops run every expert on every dp rank
            continue
        nodes = frozenset(node.name for node in graph.moe_nodes(block.module))
        outside_in = _read_from_outside(nodes, by_name)
        router = placeholder_of.get(f"{block.module}.{block.router}")
        activations = [name for name in outside_in if by_name[name].op != "placeholder"]
        results = _results(nodes, by_name)
        scalars = [name for name in results if _dims(by_name[name]) == 0]
        order = [fx_node.name for fx_node in gm.graph.nodes if fx_node.name in results]
        if router not in outside_in or len(activations) != 1 or len(results) != 2 or len(scalars) != 1:
            raise NotImplementedError(
                f"MoE layer {block.module!r}: pipeline programs replace an MoE layer that reads one activation and its "
                f"router and returns its output and a scalar balance loss; its traced ops read {len(activations)} "
                f"activation(s) and return {len(results)} value(s)"
            )
        output = next(name for name in results if name not in scalars)
        calls[block.module] = MoECall(block.module, nodes, order[0], router, activations[0], output, scalars[0])
    return calls


def _stacked_experts_call(block: MoEBlock, graph: OpGraph, by_name: dict, placeholder_of: dict) -> MoECall:
    """The call replacing a HuggingFace block's stacked experts (``experts(tokens, top-k
    index, top-k weights)``), written where their output is made: every input is made before."""
    nodes = frozenset(node.name for node in graph.moe_nodes(f"{block.module}.experts"))
    activations = [name for name in _read_from_outside(nodes, by_name) if by_name[name].op != "placeholder"]
    integers = [name for name in activations if _dtype(by_name[name]) in (torch.int32, torch.int64)]
    floats = [name for name in activations if name not in integers]
    tokens = [name for name in floats if _shape(by_name[name])[-1:] == (block.hidden,)]
    weights = [name for name in floats if _shape(by_name[name])[-1:] == (block.top_k,) and name not in tokens]
    results = _results(nodes, by_name)
    router = placeholder_of.get(f"{block.module}.{block.router}")
    if not (len(integers) == len(tokens) == len(weights) == len(results) == 1 and len(floats) == 2 and router):
        raise NotImplementedError(
            f"MoE layer {block.module!r}: pipeline programs replace HuggingFace stacked experts that read tokens, an "
            f"integer top-k index and float top-k weights and return one output; its traced experts read "
            f"{len(activations)} activation(s) and return {len(results)} value(s)"
        )
    return MoECall(block.module, nodes, results[0], router, tokens[0], results[0], None, (integers[0], weights[0]))


def _read_from_outside(nodes: frozenset[str], by_name: dict) -> list[str]:
    """The nodes outside ``nodes`` that some of them read, in graph order of first reading."""
    found: dict[str, None] = {}
    for name, fx_node in by_name.items():  # graph order
        if name in nodes:
            found.update((arg.name, None) for arg in fx_node.all_input_nodes if arg.name not in nodes)
    return list(found)


def _results(nodes: frozenset[str], by_name: dict) -> list[str]:
    """The nodes of ``nodes`` read outside them, in graph order."""
    return [name for name in by_name if name in nodes and any(user.name not in nodes for user in by_name[name].users)]


def _shape(fx_node: torch.fx.Node) -> tuple[int, ...]:
    value = fx_node.meta.get("val")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _dtype(fx_node: torch.fx.Node):
    value = fx_node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


def _dims(fx_node: torch.fx.Node) -> int:
    value = fx_node.meta.get("val")
    return value.dim() if isinstance(value, torch.Tensor) else -1


class StageMoEEmitter(GraphEmitter):
    """A ``GraphEmitter`` that writes each MoE layer of ``calls`` as one call (see the
    module docstring) and every other op as it does."""

    def __init__(self, *args, calls: dict[str, MoECall], **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = calls
        self.call_of = {name: call for call in calls.values() for name in call.nodes}

    def _emit_nodes(self, fx_nodes, gm, indent: int, inner: bool = False) -> list[str]:
        if inner or not self.call_of:
            return super()._emit_nodes(fx_nodes, gm, indent, inner)
        lines: list[str] = []
        pending: list[torch.fx.Node] = []
        for fx_node in fx_nodes:
            call = self.call_of.get(fx_node.name)
            if call is None:
                pending.append(fx_node)
                continue
            if pending:
                lines += super()._emit_nodes(pending, gm, indent, inner)
                pending = []
            if fx_node.name == call.at:
                lines += self._moe_call(call, indent)
        if pending:
            lines += super()._emit_nodes(pending, gm, indent, inner)
        return lines

    def _moe_call(self, call: MoECall, indent: int) -> list[str]:
        pad = " " * (4 * indent)
        output = identifier(self._renames.get(call.output, call.output), "a traced graph node")
        router, tokens = self.values[call.router], self.values[call.tokens]
        inputs = [router, tokens] + [self.values[name] for name in call.choices or ()]
        if any(value.kind != "dt" for value in inputs):
            raise NotImplementedError(f"MoE layer {call.path!r}: its inputs and router must be DTensors in a pipeline stage")
        self.module = None  # the next op writes its module header again
        rows = (Shard(0),) + (Replicate(),) * (len(self.axes) - 1)  # as the runtime returns them
        self.values[call.output] = Value(output, "dt", rows)
        if call.choices is not None:  # a HuggingFace block: its router's ops stay, its experts run by the layout
            index, weights = (self.values[name].expr for name in call.choices)
            return [
                "",
                pad + comment(f"---- {call.path}.experts (MoE): run by its layout over this stage's ranks "
                              "(codegen.runtime.pipeline_stacked_experts; STAGE_EXPERTS)"),
                pad + f"{output} = self.moe_experts({router.expr}, {tokens.expr}, {index}, {weights})",
            ]
        balance = identifier(self._renames.get(call.balance, call.balance), "a traced graph node")
        self.values[call.balance] = Value(balance, "dt", (Replicate(),) * len(self.axes))
        return [
            "",
            pad + comment(f"---- {call.path} (MoE): routed and run by its layout over this stage's dp ranks "
                          "(dp x tp when folded; codegen.runtime.pipeline_moe; STAGE_EXPERTS)"),
            pad + f"{output}, {balance} = self.moe_layer({router.expr}, {tokens.expr})",
        ]


def stage_experts_table(plan: Plan, graph: OpGraph, stage_of: dict[str, int]) -> str:
    """``STAGE_EXPERTS``: each MoE layer's stage, mode, placement, top-k, capacity factor and
    parameter names (``codegen.runtime.pipeline_moe.build_stage_experts``), every value
    through ``literal`` (plan text enters the program as ``repr()`` only)."""
    blocks = {block.module: block for block in graph.moe_blocks}
    lines = [
        "# Each MoE layer: (stage, mode, placement (experts' (dp rank, share of tokens) copies) or None, top-k, capacity",
        "# factor, (router, expert in, expert out) relative to the layer, runtime: routed GELU layer or HuggingFace",
        "# stacked experts).",
        "STAGE_EXPERTS = {",
    ]
    for layout in plan.expert_layouts:
        if layout.module not in stage_of:
            continue  # written as its traced ops (moe_calls)
        block = blocks[layout.module]
        placement = layout.placement.replicas if layout.placement is not None else None
        if "moe-folding" in plan.sections:  # over the stage's dp x tp ranks, EDP copies included
            placement = folded_replicas(layout, plan.mesh.axis_size("dp") * plan.mesh.axis_size("tp"))
        names = (block.router, *block.expert_weights)
        entry = (stage_of[layout.module], layout.mode, placement, layout.top_k, float(layout.capacity_factor), names,
                 block.runtime)
        lines.append(f"    {literal(layout.module)}: {literal(entry)},")
    lines.append("}")
    return "\n".join(lines)
