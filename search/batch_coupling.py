"""Where a model's step mixes the samples of its batch.

Most models treat the samples of a batch independently until the loss averages them, so a
step on slices of the batch, averaged, is the step on the whole batch: data-parallel
programs (DDP, ZeRO, FSDP wrapping the model on each rank's slice), gradient accumulation and
pipeline micro-batches all rely on it. Some models do not: an MoE router's capacity and its
running count of tokens per expert (a ``cumsum`` over all the tokens of the batch), its
load-balancing loss (a product of two batch means), a batch norm's statistics. Run on slices,
such a model computes a different step, silently. Graph programs are not affected: they run
every op on the whole (distributed) batch, gathering where an op needs it.

``batch_coupled_ops`` finds those ops by following the batch split through the graph as
a data-parallel program runs it (``search.propagation.propagate`` with ``batch_local``: an
op with no rule runs on each rank's slice): an op whose rule needs the whole batch (a gather
of a batch-split tensor, or the full value of a partial batch mean or sum) where linear
algebra cannot make do with slices is where the samples mix. Ops the rules do not know
(``topk``, ``one_hot``) cannot be judged; they count as per-sample, as data-parallel
programs run them, and the graph's warnings name them. Adding or scaling an average by a value
every rank holds alike stays exact (the mean of x_i + c is the mean of x_i, plus c), so the
loss terms that make up a training loss do not count. Batch norm is not listed: data-parallel
programs synchronise its statistics (``codegen.runtime.batch_norm``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard

from planner.graph import OpGraph
from search.layouts import batch_input_placements
from search.propagation import propagate
from search.rules import rule_for
from search.rules.choice import follow

# The batch is followed as split over two ranks: the fewest that can split it.
_SLICES = 2
# Ops that stay exact on an average or sum when every other operand is the same on all ranks.
_LINEAR_IN_ONE_OPERAND = ("aten.add.", "aten.sub.", "aten.mul.", "aten.div.", "aten.neg.", "aten.to.", "aten._to_copy.")
_SYNCHRONISED = ("aten.batch_norm.", "aten._native_batch_norm_legit", "aten.native_batch_norm.", "aten.cudnn_batch_norm.")


@dataclass(frozen=True)
class CoupledOp:
    """An op at which the samples of the batch mix: its name, ATen op and module."""

    node: str
    op: str
    module: str

    def describe(self) -> str:
        return f"{self.op.removeprefix('aten.')} in {self.module or 'the model'}"


def batch_coupled_ops(graph: OpGraph) -> list[CoupledOp]:
    """The ops at which running the model on slices of its batch changes the step (see the
    module docstring), in graph order; empty for a model whose samples stay independent."""
    placements = propagate(graph, _SLICES, batch_input_placements(graph), {}, batch_local=True)
    produced: dict[str, object] = {}
    coupled = []
    for node in graph.nodes:
        have = tuple(produced.get(name, Replicate()) for name in node.inputs)
        # What the op's rule needs, before the batch-local fallback lets an op the rules do
        # not know run on each slice (data-parallel programs run it so; we cannot tell).
        wanted, _ = follow(node, have, _SLICES)
        needs_whole = any(
            isinstance(had, (Shard, Partial)) and isinstance(want, Replicate) for had, want in zip(have, wanted)
        )
        if needs_whole and rule_for(node.op) is not None and not node.op.startswith(_SYNCHRONISED) and not _exact_on_slices(node.op, have):
            coupled.append(CoupledOp(node.name, node.op, node.module))
        outputs = placements[node.name].outputs
        if outputs:
            produced[node.name] = outputs[0]
    return coupled


def coupled_modules(coupled: list[CoupledOp]) -> list[str]:
    """The modules where the samples mix, each once, in graph order."""
    return list(dict.fromkeys(op.module or "the model's top level" for op in coupled))


def coupling_warning(coupled: list[CoupledOp], moe_layouts: bool = False) -> str:
    """The one-line warning a plan carries for a model whose samples mix, naming the
    modules where they do; with ``moe_layouts``, they all lie in MoE layers, which plans
    that run each MoE layer by its layout may still split the batch around (and into
    micro-batches, each routed on its own)."""
    modules = coupled_modules(coupled)
    shown = ", ".join(modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
    if moe_layouts:
        return (
            f"the model mixes the samples of its batch in {shown} (a router's expert capacity counts the tokens "
            f"routed together): data parallelism runs only with the MoE layers run by their layouts, whose runtime "
            f"routes each micro-batch over all ranks as one device does; plans with gradient accumulation or "
            f"pipeline micro-batches route each micro-batch on its own, as MoE trainers do, and --check's "
            f"single-device reference runs the same micro-batches"
        )
    return (
        f"the model mixes the samples of its batch in {shown}, so a step on slices of the batch would differ "
        f"from the step on the whole batch: only programs over the whole batch were planned (no DDP/ZeRO/FSDP "
        f"wrappers, no gradient accumulation, no pipeline micro-batches)"
    )


def _exact_on_slices(op: str, have: list) -> bool:
    """One partial (an average or sum over the batch) combined linearly with values every
    rank holds alike: exact on slices."""
    partials = [p for p in have if isinstance(p, Partial)]
    if not op.startswith(_LINEAR_IN_ONE_OPERAND) or len(partials) != 1 or any(isinstance(p, Shard) for p in have):
        return False
    if op.startswith("aten.div.") and not isinstance(have[0], Partial):
        return False  # c / mean(x) is not the mean of c / x
    if op.startswith(("aten.add.", "aten.sub.")):
        return partials[0].reduce_op == "avg"  # a sum over ranks would count c once per rank
    return True
