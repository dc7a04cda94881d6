"""Follow one mesh axis's sharding through the graph, op by op.

Given the placement of every graph input and parameter on one mesh axis, ``propagate``
derives each op's input and output placements on that axis: of the op's candidates in the
per-op registry (``search.rules.axis_candidates``, plus Megatron-LM's program conventions
when the layout's program implements them), it takes the one the incoming placements reach
most cheaply (``search.rules.choice.follow``, whose docstring states the rule). When an op
cannot take its inputs' sharding (a softmax over the sharded dimension, an op no rule
knows), it takes ``Replicate`` inputs and the edge pays a gather: the cost model reads that
from the mismatch between the producer's output and the consumer's input placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from planner.graph import OpGraph, OpNode, TensorMeta
from search.rules.choice import follow

R = Replicate()


ParamChooser = Callable[[OpNode, tuple[Placement, ...]], dict[str, Placement]]
# A partial-sum tensor's metadata -> the placement its reader takes it in, or None.
PartialReducer = Callable[[TensorMeta], Placement | None]


@dataclass(frozen=True)
class AxisPlacements:
    """Placements of one node on one mesh axis."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    params: dict[str, Placement]
    produced: tuple[Placement, ...] | None = None  # what the op makes before an override reshards it


def propagate(
    graph: OpGraph,
    axis_size: int,
    input_placements: dict[str, Placement],
    param_placements: dict[str, Placement] | None = None,
    choose_params: ParamChooser | None = None,
    overrides: dict[str, Placement] | None = None,
    batch_local: bool = False,
    conventions: bool = False,
    reduce_partial_sums: PartialReducer | None = None,
) -> dict[str, AxisPlacements]:
    """Placements on one mesh axis of every node of ``graph``.

    Args:
        axis_size: the number of ranks on the axis (the registry's candidates depend on it).
        input_placements: graph input name -> placement (e.g. ``Shard(0)`` for the batch).
        param_placements: parameter name -> placement (missing: ``Replicate``).
        choose_params: decides the placements of a node's parameters from its incoming
            placements, when first met (Megatron: column or row parallel by data flow).
        overrides: node name -> output placement imposed on that node (e.g. the residual
            stream sharded on the sequence under sequence parallelism); the op's own output
            is kept as ``produced`` and resharded into the override (e.g. partial sums
            reduce-scattered).
        batch_local: the axis is plain data parallelism (DDP, ZeRO, FSDP run the model's
            own modules on each rank's slice of the batch): an op without a rule keeps the
            batch split instead of gathering it, as those programs do.
        conventions: the layout's program implements Megatron-LM's conventions
            (``search.rules.conventions``: vocabulary-parallel embedding and cross entropy,
            fused projection splits, the row-parallel bias added once).
        reduce_partial_sums: where the layout's program reduces partial sums as soon as they
            are made: given a tensor arriving as ``Partial(sum)``, the placement its reader
            takes it in (its edge pays the all-reduce or reduce-scatter), or None to let the
            reader choose. Megatron-LM reduces a row-parallel matmul's output before the
            dropout and residual add that read it (``search.layouts.megatron_layout``).

    Returns:
        node name -> its input, output and parameter placements on this axis.
    """
    params_fixed: dict[str, Placement] = dict(param_placements or {})
    overrides = overrides or {}
    placement_of: dict[str, Placement] = dict(input_placements)
    param_of_input: dict[str, str] = {}
    result: dict[str, AxisPlacements] = {}
    for node in graph.nodes:
        param_of_input.update(zip(node.param_inputs, node.params))
        activations = tuple(placement_of.get(name, R) for name in node.inputs)
        if reduce_partial_sums is not None:
            activations = tuple(
                _reduced(placement, meta, reduce_partial_sums) for placement, meta in zip(activations, node.input_meta)
            )
        if choose_params is not None:
            for param, placement in choose_params(node, activations).items():
                params_fixed.setdefault(param, placement)
        incoming = tuple(
            params_fixed.get(param_of_input[name], R) if name in param_of_input else activation
            for name, activation in zip(node.inputs, activations)
        )
        fixed = {i for i, name in enumerate(node.inputs) if name in param_of_input and param_of_input[name] in params_fixed}
        wanted, outputs = follow(node, incoming, axis_size, fixed, conventions)
        gathers_all = (wanted, outputs) == (tuple(R for _ in incoming), tuple(R for _ in node.output_meta))
        if batch_local and gathers_all and incoming != wanted:
            wanted, outputs = _batch_local(node, incoming, wanted, outputs)
        produced = None
        if node.name in overrides:
            forced = tuple(overrides[node.name] for _ in outputs)
            if forced != outputs:
                produced, outputs = outputs, forced
        params = {param_of_input[name]: p for name, p in zip(node.inputs, wanted) if name in param_of_input}
        result[node.name] = AxisPlacements(inputs=wanted, outputs=outputs, params=params, produced=produced)
        if outputs:
            placement_of[node.name] = outputs[0]
    return result


# ----------------------------------------------------------------------------- helpers


def _reduced(placement: Placement, meta: TensorMeta, reducer: PartialReducer) -> Placement:
    # Only sums: an average (a mean loss over split columns) is no pending reduction of a
    # matmul's output, and stays for its reader to decide.
    if isinstance(placement, Partial) and placement.reduce_op == "sum":
        return reducer(meta) or placement
    return placement


def _batch_local(node: OpNode, incoming, wanted, outputs):
    """An op the rules would gather, run on each rank's slice of the batch instead: inputs
    split on dim 0 stay so, and outputs whose dim 0 is one of those batch slices are split
    too. Any split input counts, not only the first: a gather by index
    (``x[token_of_choice]``, how HuggingFace's MoE blocks sort each token's expert choices)
    has as many rows as its split index, not as its split source."""
    batches = {meta.shape[0] for meta, p in zip(node.input_meta, incoming)
               if isinstance(p, Shard) and p.dim == 0 and meta.shape}
    if not batches or any(isinstance(p, Shard) and p.dim != 0 for p in incoming):
        return wanted, outputs
    kept = tuple(p if isinstance(p, Shard) else R for p in incoming)
    split = tuple(Shard(0) if meta.shape and meta.shape[0] in batches else R for meta in node.output_meta)
    return kept, split
