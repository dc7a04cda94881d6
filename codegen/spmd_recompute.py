"""Activation recomputation in graph programs: each repeated block (``recompute="full"``), or
each block's attention core (``"selective"``), becomes a nested function run under
``torch.utils.checkpoint.checkpoint``.

The plan's ``recompute="full"`` means what the simulator prices: every repeated block
(a transformer layer) keeps only the values it reads from outside for backward, and runs
its forward again (collectives included) when backward reaches it; the ops around the
blocks (embeddings, head, loss) keep their activations.

The forward's lines are written first, block by block; which names a block must hand to
the rest of the forward is read from the written code itself (names it assigns that later
lines read), so whatever the emitter wrote inside a block (redistributed copies, inlined
autocast regions) is handled alike. The nested function reads everything else from the
enclosing forward (parameters, earlier values): non-reentrant checkpointing keeps those
alive, so they need not be passed as arguments. ``codegen.pipeline_emit`` uses the same
pieces inside each pipeline stage.

``recompute="selective"`` (``codegen.attention_core``) checkpoints only the attention core of
each block, from the scores matmul to the scores x V matmul: backward keeps everything else
and runs the core again, dropping its (seq, seq) tensors.
"""

from __future__ import annotations

import ast
import textwrap
from typing import TYPE_CHECKING, Sequence

import torch.fx

from codegen.attention_core import NO_CORE_COMMENT, AttentionCore
from codegen.source_text import comment, derived_identifier
from planner.errors import PlanningError
from planner.graph import OpGraph

if TYPE_CHECKING:
    from codegen.spmd_emit import GraphEmitter

Block = tuple[str, int]  # a repeated block; (group, index, "attention") labels its attention core
_INDENT = 2  # the forward's body
_PAD = " " * (4 * _INDENT)


# What a checkpoint call of a block recomputed keeping its exchanges adds (recompute
# "full_keep_a2a"), and the import it needs.
KEEPING_ARGUMENT = ", context_fn=keeping_exchanges"
KEEPING_IMPORT = "from codegen.runtime.kept_exchanges import keeping_exchanges"


def checkpointed_body(emitter: "GraphEmitter", gm: torch.fx.GraphModule) -> list[str]:
    """The forward's body lines with every repeated block checkpointed."""
    runs = block_runs(emitter.graph, gm.graph.nodes)
    require_blocks(runs)
    written = [(block, emitter._emit_nodes(nodes, gm, indent=_INDENT + (block is not None))) for block, nodes in runs]
    return checkpoint_blocks(written)


def require_blocks(runs: Sequence[tuple[Block | None, object]]) -> None:
    """Refuse full recomputation of a forward with no repeated block to checkpoint."""
    if all(block is None for block, _ in runs):
        raise PlanningError(
            "this plan recomputes activations, but the model has no repeated blocks to checkpoint; plan it again "
            "(recomputation only applies to repeated blocks)"
        )


def selective_body(emitter: "GraphEmitter", gm: torch.fx.GraphModule, cores: list[AttentionCore]) -> list[str]:
    """The forward's body lines with every attention core checkpointed (``recompute="selective"``);
    with no core (fused attention), the plain body after a comment saying why."""
    if not emitter.graph.blocks:
        raise PlanningError(
            "this plan recomputes activations, but the model has no repeated blocks to checkpoint; plan it again "
            "(recomputation only applies to repeated blocks)"
        )
    runs = core_runs(cores, gm.graph.nodes)
    written = [(label, emitter._emit_nodes(nodes, gm, indent=_INDENT + (label is not None))) for label, nodes in runs]
    if not cores:
        return [_PAD + line for line in NO_CORE_COMMENT] + written[0][1]
    return checkpoint_blocks(written)



def core_runs(cores: list[AttentionCore], nodes: Sequence[torch.fx.Node]) -> list[tuple[Block | None, list[torch.fx.Node]]]:
    """``nodes`` cut into runs: each attention core (labelled ``AttentionCore.label``), from its
    first op to its last, and the runs between them (``None``)."""
    first = {core.nodes[0]: core for core in cores}
    runs: list[tuple[Block | None, list[torch.fx.Node]]] = []
    current, remaining = None, set()
    for fx_node in nodes:
        if fx_node.name in first:
            current = first[fx_node.name]
            remaining = set(current.nodes)
            runs.append((current.label, []))
        elif (current is not None and not remaining) or not runs:
            current = None
            runs.append((None, []))
        remaining.discard(fx_node.name)
        runs[-1][1].append(fx_node)
    return runs


def block_runs(graph: OpGraph, nodes: Sequence[torch.fx.Node]) -> list[tuple[Block | None, list[torch.fx.Node]]]:
    """``nodes`` cut into consecutive runs of one repeated block (or of none). Nodes the op
    graph does not list (getitem, export's checks) go with the run they follow; the output
    always ends the forward outside any block."""
    runs: list[tuple[Block | None, list[torch.fx.Node]]] = []
    current: Block | None = None
    for fx_node in nodes:
        if fx_node.op == "output":
            current = None
        elif fx_node.op == "call_function" and graph.has_node(fx_node.name):
            current = graph.node(fx_node.name).block
        if not runs or runs[-1][0] != current:
            runs.append((current, []))
        runs[-1][1].append(fx_node)
    return runs


def checkpoint_blocks(written: list[tuple[Block | None, list[str]]], also_read: set[str] = frozenset(),
                      keep_exchanges: bool = False) -> list[str]:
    """Written runs joined into one body, each block run (written one level deeper) wrapped
    in a checkpointed nested function that returns what the other runs (or ``also_read``
    lines) read of it; with ``keep_exchanges`` (``recompute="full_keep_a2a"``) its MoE
    layers' collectives hand back in the recomputation what they returned in forward."""
    stored = [names_in(lines, ast.Store) for _, lines in written]
    loaded = [names_in(lines, ast.Load) for _, lines in written]
    body: list[str] = []
    for position, (block, lines) in enumerate(written):
        if block is None:
            body += lines
            continue
        clash = stored[position] & set().union(*(stored[i] for i in range(len(written)) if i != position))
        if clash:
            raise NotImplementedError(
                f"cannot checkpoint {_what(block)}: the names {sorted(clash)[:3]} are assigned inside it and "
                f"elsewhere in the forward; plan without recomputation"
            )
        outside = set(also_read).union(*(loaded[i] for i in range(len(written)) if i != position))
        outputs = [name for name in assigned_in_order(lines) if name in outside]
        body += checkpointed_block(block, lines, outputs, keep_exchanges)
    return body


def checkpointed_block(block: Block, lines: list[str], outputs: list[str], keep_exchanges: bool = False) -> list[str]:
    """``lines`` (one level deeper than the forward's body) as a nested function run under
    ``checkpoint``, assigning ``outputs`` in the enclosing forward (``keep_exchanges``: as
    ``checkpoint_blocks`` says)."""
    core = len(block) > 2
    function = derived_identifier(f"{block[0]}_{block[1]}" + ("_attention" if core else ""), prefix="_", fallback="block")
    returned = ", ".join(outputs) + ("," if len(outputs) == 1 else "")
    if core:
        why = [
            _PAD + comment(f"---- {_what(block)}: recomputed in backward (selective recomputation). Backward keeps"),
            _PAD + "# the block's other activations but not the (seq, seq) scores and probabilities made here;",
            _PAD + "# it runs this function again when it reaches them: less memory for a little more compute.",
        ]
    elif keep_exchanges:
        why = [
            _PAD + comment(f"==== {_what(block)}: recomputed in backward (activation checkpointing). Backward keeps"),
            _PAD + "# what the block reads from outside it and what its MoE layers' collectives returned, and runs",
            _PAD + "# this function again without communicating (codegen.runtime.kept_exchanges) when it reaches it.",
        ]
    else:
        why = [
            _PAD + comment(f"==== {_what(block)}: recomputed in backward (activation checkpointing). Backward keeps"),
            _PAD + "# only what the block reads from outside it and runs this function again, collectives",
            _PAD + "# included, when it reaches the block: less activation memory for one more forward.",
        ]
    return [
        "",
        *why,
        _PAD + f"def {function}():",
        *lines,
        _PAD + f"    return ({returned})",
        "",
        _PAD + f"({returned}) = checkpoint({function}, use_reentrant=False{KEEPING_ARGUMENT if keep_exchanges else ''})",
    ]


def _what(block: Block) -> str:
    """``blocks.0`` or ``the attention core of blocks.0``, for comments and messages."""
    return f"the attention core of {block[0]}.{block[1]}" if len(block) > 2 else f"block {block[0]}.{block[1]}"


def names_in(lines: list[str], context: type) -> set[str]:
    """Names the code in ``lines`` assigns (``ast.Store``) or reads (``ast.Load``)."""
    tree = ast.parse(textwrap.dedent("\n".join(lines)) or "pass")
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, context)}


def assigned_in_order(lines: list[str]) -> list[str]:
    """Names assigned in ``lines``, in the order they are first assigned."""
    tree = ast.parse(textwrap.dedent("\n".join(lines)) or "pass")
    stores = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    return list(dict.fromkeys(n.id for n in sorted(stores, key=lambda n: (n.lineno, n.col_offset))))
