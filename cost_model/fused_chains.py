"""A block's normalisations and rotary embeddings priced as one fused kernel each, as another
system's run computes them (``Plan.fused_chains``), where the traced program runs them as
chains of eager ATen kernels.

Why: a model traced from Hugging Face transformers runs its RMSNorm eagerly (Qwen3-MoE's
``Qwen3MoeRMSNorm``: an fp32 upcast, ``pow``, ``mean``, ``+ eps``, ``rsqrt``, two products, a
downcast: each a kernel streaming the tensor) and its rotary embedding eagerly
(``apply_rotary_pos_emb``: ``q * cos``, a slice, ``neg``, ``cat``, ``* sin``, ``add``: five
kernels for q and five for k), and the simulator prices every one of them
(``cost_model.memory_kernels``). A Megatron-Core run with Transformer Engine computes each norm
as one kernel (``TENorm`` and ``TELayerNormColumnParallelLinear`` in
``get_gpt_layer_with_transformer_engine_spec``, megatron/core/models/gpt/gpt_layer_specs.py at
NVIDIA/Megatron-LM 1e057005; TE's rmsnorm launchers, transformer_engine/common/normalization/)
and each rotary embedding of q and of k as one kernel (TE's fused RoPE, on unless
``--no-rope-fusion``: ``apply_rope_fusion``, megatron/training/arguments.py at 1e057005).

What one fused kernel costs (the simulator's own pricing, no new constant):

* a norm: one ``aten.rms_norm`` (``aten.layer_norm`` for a LayerNorm) reading the chain's input
  and the weight and writing a tensor of the input's shape and dtype, priced by
  ``cost_model.compute.op_times`` as every fused norm is (``memory_kernels.FUSED_NORM_EFFICIENCY``;
  its backward at the default twice the forward's bytes);
* a rotary embedding: one pass reading the rotated tensor and writing its result, forward
  and backward alike, at the contiguous pointwise kernel's share of the bandwidth
  (``memory_kernels.STREAMING_EFFICIENCY``): TE's ``fused_rope_forward_kernel`` reads ``src``
  and writes ``dst``, its ``fused_rope_backward_kernel`` reads the output's gradient and
  writes the input's (NVIDIA/TransformerEngine transformer_engine/common/fused_rope/
  fused_rope.cu at 01b5648e; the ``freqs`` table it also reads is one row per position, small
  beside the tensor, and not counted). No measurement of TE's kernel is used.

The chain's last op carries the fused kernel; its other ops cost nothing, device or host (the
run launches none of them). Recomputation runs the segment's ops again, so it runs the fused
kernel again, not the eager chain. The activations saved for backward stay as traced: the
eager chain's saved tensors (an fp32 copy of the input, the ``rsqrt`` row statistics) are
kept where TE's norm keeps its input and the row statistics only; the step's memory is not
re-priced here.

A norm module already traced as one fused op (``nn.LayerNorm``'s ``aten.layer_norm``, as the
GPT example's) is priced so already and left as it is.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from cost_model.compute import PRECISIONS, op_times, roofline_time
from cost_model.memory_kernels import kind_memory_efficiency
from cost_model.simulation_cache import graph_facts
from planner.cluster import DeviceSpec
from planner.graph import OpGraph, OpNode, TensorMeta

# ``Plan.fused_chains`` values (planner.run_settings.FUSED_CHAINS) -> what each fuses.
FUSES_NORMS = ("norms", "norms_rope")
FUSES_ROPE = ("norms_rope",)

# The ops of transformers' eager ``apply_rotary_pos_emb`` (``q * cos + rotate_half(q) * sin``,
# ``rotate_half`` a slice, a negation and a concatenation), by ATen op without its overload.
ROPE_OPS = ("aten.mul", "aten.neg", "aten.cat", "aten.add")


@dataclass(frozen=True)
class FusedKernel:
    """The one kernel that stands for a chain of eager ops: a ``"norm"`` (an ``aten.rms_norm``
    or ``aten.layer_norm`` of ``tensor`` with ``weight_bytes`` of weights) or a ``"rope"``
    (one pass over ``tensor``)."""

    kind: str
    op: str
    tensor: TensorMeta
    weight_bytes: int = 0


def is_norm_module_op(node: OpNode) -> bool:
    """Whether ``node`` was issued by a normalisation module (its class's name ends in
    ``Norm``: ``Qwen3MoeRMSNorm``, ``LlamaRMSNorm``, ``LayerNorm``)."""
    return (node.module_type or "").endswith("Norm")


def norm_chains(graph: OpGraph) -> list[list[OpNode]]:
    """The kernels (views left out) of each normalisation module's call that runs more than
    one: the blocks' norms, the q/k norms inside attention, the final norm. A module traced
    as one op (a fused ``aten.layer_norm``) is already one kernel and is left out."""
    members: dict[str, list[OpNode]] = defaultdict(list)
    for node in graph.nodes:
        if is_norm_module_op(node) and not node.is_view:
            members[node.module].append(node)
    return [ops for ops in members.values() if len(ops) > 1]


def fused_norm(graph: OpGraph, ops: list[OpNode]) -> FusedKernel:
    """The fused kernel of a norm module's ``ops``: the first op's input (what the chain reads)
    normalised, the weights its ops read moved once."""
    weights = {name for op in ops for name in op.params if name in graph.parameters}
    weight_bytes = sum(graph.parameters[name].nbytes for name in weights)
    kind = ops[0].module_type or ""
    op = "aten.layer_norm.default" if kind.endswith("LayerNorm") and "RMS" not in kind else "aten.rms_norm.default"
    return FusedKernel("norm", op, ops[0].input_meta[0], weight_bytes)


def rope_chains(graph: OpGraph) -> list[list[OpNode]]:
    """Each rotary embedding a block applies in its attention module (one for q, one for k):
    an ``add`` of the attention module's own ops (not a submodule's) on a 4-D tensor, and the
    ``ROPE_OPS`` of that module it is computed from, walked back through their inputs (views
    between them followed, views not listed), among them ``rotate_half``'s ``neg`` and ``cat``
    (so an eager attention's ``scores * scale + mask`` is not taken for one)."""
    facts = graph_facts(graph)

    def rope_op(node: OpNode, module: str) -> bool:
        return (node.module == module and node.op.rsplit(".", 1)[0] in ROPE_OPS
                and bool(node.input_meta) and len(node.input_meta[0].shape) == 4)

    chains = []
    for end in graph.nodes:
        if end.block is None or not end.module.endswith("attn") or not end.op.startswith("aten.add.") \
                or not rope_op(end, end.module):
            continue
        chain, frontier = {end.name}, [end]
        while frontier:
            for source in frontier.pop().inputs:
                node = facts.nodes.get(source)
                if node is None or node.name in chain or node.module != end.module:
                    continue
                if node.is_view or rope_op(node, end.module):
                    chain.add(node.name)
                    frontier.append(node)
        ops = [node for node in graph.nodes if node.name in chain and not node.is_view]
        kinds = {node.op.rsplit(".", 1)[0] for node in ops}
        if {"aten.neg", "aten.cat"} <= kinds:  # rotate_half's: not an eager attention's scaled, masked scores
            chains.append(ops)
    return chains


def chain_kernels(graph: OpGraph, fused_chains: str) -> dict[str, FusedKernel | None]:
    """Op name -> what prices it under ``fused_chains`` (``Plan.fused_chains``): the last op
    of each fused chain -> its ``FusedKernel``, the chain's other ops -> None (no kernel);
    ops outside every chain are absent. Empty for "" (each op as traced). Taken once per
    graph and setting."""
    if not fused_chains:
        return {}
    facts = graph_facts(graph)
    known = facts.fused_chains.get(fused_chains)
    if known is not None:
        return known
    kernels: dict[str, FusedKernel | None] = {}
    if fused_chains in FUSES_NORMS:
        for ops in norm_chains(graph):
            kernels.update({op.name: None for op in ops})
            kernels[ops[-1].name] = fused_norm(graph, ops)
    if fused_chains in FUSES_ROPE:
        for ops in rope_chains(graph):
            kernels.update({op.name: None for op in ops})
            kernels[ops[-1].name] = FusedKernel("rope", "te.fused_rope", ops[-1].output_meta[0])
    facts.fused_chains[fused_chains] = kernels
    return kernels


def fused_kernel_times(kernel: FusedKernel, work_fraction: float, device: DeviceSpec,
                       precision: str) -> tuple[float, float]:
    """(forward, backward) seconds of ``kernel`` doing ``work_fraction`` of its work (module
    docstring): a norm as ``op_times`` prices a fused norm op of its tensor and weights, a
    rotary embedding as one contiguous pass over its tensor each way."""
    tensor = kernel.tensor
    if kernel.kind == "norm":
        node = OpNode(name="fused_norm", op=kernel.op, inputs=(), input_meta=(tensor,), output_meta=(tensor,),
                      bytes_moved=2 * tensor.nbytes + kernel.weight_bytes)
        return op_times(node, work_fraction, device, precision)
    dtype, element_bytes = PRECISIONS[precision]
    moved = 2 * tensor.numel * min(tensor.dtype.itemsize, element_bytes) * work_fraction
    one_pass = roofline_time(0.0, moved, device, dtype, kind_memory_efficiency("streaming", device))
    return one_pass, one_pass


def chain_op_times(node: OpNode, kernels: dict[str, FusedKernel | None], work_fraction: float,
                   device: DeviceSpec, precision: str, **priced) -> tuple[float, float]:
    """(forward, backward) seconds of ``node`` where ``kernels`` (``chain_kernels``) names
    what prices it: its chain's fused kernel, nothing, or (absent) ``op_times`` with
    ``priced``'s keywords."""
    if node.name not in kernels:
        return op_times(node, work_fraction, device, precision, **priced)
    kernel = kernels[node.name]
    return (0.0, 0.0) if kernel is None else fused_kernel_times(kernel, work_fraction, device, precision)
