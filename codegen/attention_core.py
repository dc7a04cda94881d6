"""Selective activation recomputation: which ops of each repeated block are its attention core.

Megatron-LM's selective recomputation (Korthikanti et al., 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 5) keeps every activation of a transformer
layer for backward except those of the attention core -- the QK^T scores, the softmax, the
attention dropout and the scores x V matmul -- whose (seq, seq) tensors are large and cheap
to compute again; backward runs the core's forward again instead. The simulator
(``cost_model.simulator``) prices it from the ops whose output ends in (seq, seq): their
saved bytes are dropped and their forward runs again in backward.

Codegen finds the same region in the traced graph. In each repeated block, a core starts at a
matmul-like op whose output ends in (seq, seq) (the scores) and ends at the first matmul-like
op after it that reads a value of the core (scores x V); every op between them, in graph order,
belongs to it (scaling, masking, softmax, dropout, dtype casts). A block may hold several
cores (self- and cross-attention). Programs run each core under ``torch.utils.checkpoint``.

A model whose attention is one fused op (``F.scaled_dot_product_attention``, FlashAttention)
has no core: that op keeps no (seq, seq) tensor for backward (only its inputs, output and a
(seq,)-sized log-sum-exp per head), so the simulator's ``score_bytes`` is 0 for it and
selective recomputation keeps everything, as no recomputation does. Programs say so in a
comment and recompute nothing.

Differences from the simulator's pricing, both small: the scores x V matmul is recomputed
(its output is not (seq, seq), so its forward time is not charged again), and the simulator
also counts ops whose output ends in (seq, seq) only because the head size equals the
sequence length (q/k/v transposes); codegen starts a core at a matmul only.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlanningError
from planner.graph import OpGraph, OpNode

_MATMULS = ("aten.matmul.", "aten.bmm.", "aten.baddbmm.", "aten.einsum.")


@dataclass(frozen=True)
class AttentionCore:
    """One attention core: the block it is in and its ops (OpGraph node names, in order)."""

    block: tuple[str, int]
    nodes: tuple[str, ...]

    @property
    def label(self) -> tuple[str, int, str]:
        """The region label the checkpoint writers use (``codegen.spmd_recompute``)."""
        return (self.block[0], self.block[1], "attention")


def attention_cores(graph: OpGraph, seq: int) -> list[AttentionCore]:
    """The attention cores of ``graph``'s repeated blocks (see the module docstring), in
    graph order; empty when attention is a fused op or ``seq`` is unknown (0)."""
    if seq <= 0:
        return []
    cores: list[AttentionCore] = []
    nodes = list(graph.nodes)
    position = 0
    while position < len(nodes):
        start = nodes[position]
        if start.block is None or not _is_matmul(start) or not _ends_in(start, seq):
            position += 1
            continue
        members = {start.name}
        end = None
        for later in range(position + 1, len(nodes)):
            node = nodes[later]
            if node.block != start.block:
                break
            members.add(node.name)
            if _is_matmul(node) and any(source in members for source in node.inputs):
                end = later
                break
        if end is None:  # scores that never meet a second matmul in this block: not attention
            position += 1
            continue
        cores.append(AttentionCore(start.block, tuple(node.name for node in nodes[position : end + 1])))
        position = end + 1
    return cores


def core_module(graph: OpGraph, core: AttentionCore) -> str | None:
    """The module path that holds exactly one core for a module-level program to checkpoint:
    the deepest module containing every op of the core, when no op under it reads a
    parameter (so checkpointing it recomputes the core and cheap glue, never a projection);
    ``None`` when the core is computed inline in a module with weights."""
    paths = [(graph.node(name).module or "").split(".") for name in core.nodes]
    common: list[str] = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    module = ".".join(common)
    if not module:
        return None
    under = [node for node in graph.nodes if node.module and (node.module == module or node.module.startswith(module + "."))]
    if any(node.params for node in under):
        return None
    return module


def _is_matmul(node: OpNode) -> bool:
    return node.op.startswith(_MATMULS)


def _ends_in(node: OpNode, seq: int) -> bool:
    """Whether ``node``'s first output ends in (seq, seq): attention scores or probabilities."""
    return bool(node.output_meta) and len(node.output_meta[0].shape) >= 2 and tuple(node.output_meta[0].shape[-2:]) == (seq, seq)


def selective_table(plan) -> str:
    """The ``RECOMPUTED_BLOCKS`` table of a module-level (DDP/ZeRO/FSDP) program with
    ``recompute="selective"``: the module of each attention core, which the program
    checkpoints as it checkpoints whole blocks for ``"full"`` (``codegen.emit``).

    Raises:
        NotImplementedError: a core is computed inline in a module with weights (HF's eager
            attention), so no module holds it alone; graph programs compile it.
    """
    graph = plan.graph
    if graph is None or graph.graph_module is None:
        from codegen.graph_facts import build_meta_model, trace_model

        graph = trace_model(*build_meta_model(plan))
    if not graph.blocks:
        raise PlanningError(
            "this plan recomputes activations, but the model has no repeated blocks to checkpoint; plan it again "
            "(recomputation only applies to repeated blocks)"
        )
    cores = attention_cores(graph, plan.summary.tokens_per_sample)
    modules = []
    for core in cores:
        module = core_module(graph, core)
        if module is None:
            raise NotImplementedError(
                f"selective recomputation in a data-parallel program checkpoints each attention core as a module of its "
                f"own, but the core of {core.block[0]}.{core.block[1]} ({core.nodes[0]} .. {core.nodes[-1]}) is computed "
                f"inside a module with weights; compile it as a graph program (plan with --search auto) or recompute='full'"
            )
        modules.append(module)
    header = "from codegen.runtime.recompute import recompute_in_backward\n\n"
    if not modules:
        return header + "".join(line + "\n" for line in NO_CORE_COMMENT) + "RECOMPUTED_BLOCKS = ()\n\n"
    rows = "".join(f"    {path!r},\n" for path in modules)  # module paths checked against the model's (core_module)
    return (
        header
        + "# Selective recomputation (Megatron-LM's): each block's attention core (scores, softmax, dropout,\n"
        + "# scores x V) keeps nothing for backward and runs again there; the rest of the block keeps its\n"
        + "# activations. Each core is its own module without weights, checkpointed here.\n"
        + f"RECOMPUTED_BLOCKS = (\n{rows})\n\n"
    )


# Why a selective plan of a model with fused attention recomputes nothing (a comment).
NO_CORE_COMMENT = (
    "# Selective recomputation (Megatron-LM's: recompute each block's attention core in backward)",
    "# has nothing to recompute here: no block makes (seq, seq) attention scores as tensors",
    "# (attention is one fused op, e.g. scaled_dot_product_attention, which keeps no (seq, seq)",
    "# scores for backward). Every activation is kept, as without recomputation; the simulator",
    "# prices it so too (no op output ends in (seq, seq)).",
)
