"""Whole-model layouts built from per-axis propagation: data parallel and Megatron-LM.

A layout fixes the placements of the graph inputs and parameters on each mesh axis; the
placements of every op follow by propagation (``search.propagation``), one axis at a time,
and are combined into ``NodeStrategy`` tuples (one placement per mesh axis). The pipeline
axis ``pp`` shards nothing: it assigns ops to stages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from planner.errors import PlanningError
from planner.graph import OpGraph, OpNode, TensorMeta
from planner.strategy import Mesh, NodeStrategy, Placements
from search.propagation import AxisPlacements, propagate

R = Replicate()
_SCALAR = TensorMeta((), torch.float32)
_MATMULS_WITH_WEIGHT = ("aten.linear.", "aten.addmm.", "aten.mm.", "aten.matmul.")


def batch_input_placements(graph: OpGraph) -> dict[str, Placement]:
    """Every tensor input whose dim 0 is the batch is ``Shard(0)``; the rest are replicated."""
    return {i.name: Shard(0) if i.batch_dim == 0 else R for i in graph.inputs if i.meta}


def combine(
    graph: OpGraph, mesh: Mesh, per_axis: dict[str, dict[str, AxisPlacements]], stage_of: dict[str, int] | None = None
) -> tuple[tuple[NodeStrategy, ...], dict[str, Placements | None]]:
    """Per-axis placements -> one ``NodeStrategy`` per node, and the inputs' placements."""
    stage_of = stage_of or {}

    strategies = []
    for node in graph.nodes:
        by_axis = {axis: per_axis[axis][node.name] for axis in per_axis}
        inputs = tuple(
            tuple(by_axis[a].inputs[i] if a in by_axis else R for a in mesh.names) for i in range(len(node.inputs))
        )
        outputs = tuple(
            tuple(by_axis[a].outputs[i] if a in by_axis else R for a in mesh.names) for i in range(len(node.output_meta))
        )
        params = {
            name: tuple(by_axis[a].params.get(name, R) if a in by_axis else R for a in mesh.names) for name in node.params
        }
        produced = None
        if any(by_axis[a].produced is not None for a in by_axis):
            produced = tuple(
                tuple(
                    (by_axis[a].produced or by_axis[a].outputs)[i] if a in by_axis else R for a in mesh.names
                )
                for i in range(len(node.output_meta))
            )
        strategies.append(
            NodeStrategy(
                node=node.name,
                produced=produced,
                op=node.op,
                module=node.module,
                inputs=inputs,
                outputs=outputs,
                params=params,
                stage=stage_of.get(node.name, 0),
            )
        )
    inputs = {
        i.name: tuple(_input_placement(per_axis, a, i.name, graph) for a in mesh.names) if i.meta else None
        for i in graph.inputs
    }
    return tuple(strategies), inputs


def restrict_axes(
    strategies: tuple[NodeStrategy, ...], inputs: dict[str, Placements | None], keep: Sequence[int]
) -> tuple[tuple[NodeStrategy, ...], dict[str, Placements | None]]:
    """A layout (``combine``'s result) on the mesh axes at positions ``keep`` only: what
    ``combine`` gives on that smaller mesh, since every axis is propagated on its own."""

    def pick(placements: Placements) -> Placements:
        return tuple(placements[k] for k in keep)

    narrowed = tuple(
        dataclasses.replace(
            s,
            inputs=tuple(pick(p) for p in s.inputs),
            outputs=tuple(pick(p) for p in s.outputs),
            params={name: pick(p) for name, p in s.params.items()},
            produced=None if s.produced is None else tuple(pick(p) for p in s.produced),
        )
        for s in strategies
    )
    return narrowed, {name: None if p is None else pick(p) for name, p in inputs.items()}


def _input_placement(per_axis, axis: str, name: str, graph: OpGraph) -> Placement:
    # The placement an input is fed in: what its first consumer on this axis reads it as.
    for node in graph.nodes:
        if name in node.inputs and axis in per_axis:
            return per_axis[axis][node.name].inputs[node.inputs.index(name)]
    return R


def data_parallel_layout(graph: OpGraph, mesh: Mesh) -> tuple[tuple[NodeStrategy, ...], dict[str, Placements | None]]:
    """The batch split over ``dp``, every parameter replicated (DDP/ZeRO/FSDP keep that view)."""
    per_axis = {}
    if "dp" in mesh.names:
        per_axis["dp"] = propagate(graph, mesh.axis_size("dp"), batch_input_placements(graph), {}, batch_local=True)
    return combine(graph, mesh, per_axis)


def megatron_layout(
    graph: OpGraph,
    mesh: Mesh,
    sequence_parallel: bool = False,
    virtual_stages: int = 1,
    layers_per_stage: Sequence[int] | None = None,
) -> tuple[tuple[NodeStrategy, ...], dict[str, Placements | None]]:
    """Megatron-LM's layout on a ``(pp, dp, tp)`` mesh (Shoeybi et al. 2019; Narayanan et al. 2021).

    On ``tp``: each block's first matmuls after a replicated input are column parallel
    (weights split on output features), the matmul that consumes split features is row
    parallel (weights split on input features, partial sums all-reduced), attention runs
    on split heads; the embedding is vocabulary parallel and the head column parallel.
    Column/row is decided by data flow, so it works for any decoder or encoder whose blocks
    follow the norm -> projections -> attention -> projection -> MLP pattern
    (``examples/gpt.py``, ``hf:gpt2``, ``hf:llama``, ``hf:bert``). With
    ``sequence_parallel`` the residual stream between blocks is split on the sequence: the
    all-reduces become reduce-scatters plus all-gathers (Korthikanti et al. 2022).
    A row-parallel matmul's partial sums are reduced as soon as they are made, before the
    dropout and residual add that read them, as Megatron-Core's ``RowParallelLinear``
    all-reduces (or reduce-scatters, under sequence parallelism) its output before
    ``TransformerLayer`` runs ``self_attn_bda``/``mlp_bda`` on it
    (``megatron/core/tensor_parallel/layers.py``, ``megatron/core/transformer/
    transformer_layer.py``, core_v0.8.0): the dropout runs on the whole residual-stream
    tensor, or on 1/tp of it under sequence parallelism (``_partial_sums_reducer``).
    On ``pp``: the repeated blocks are split evenly over ``pp * virtual_stages`` stages, or
    as ``layers_per_stage`` says (one count per virtual stage, ``uneven_stages``).
    On ``dp``: the batch, as data parallelism.

    Raises:
        PlanningError: no repeated blocks, or sizes that ``tp``/``pp`` do not divide.
    """
    per_axis: dict[str, dict[str, AxisPlacements]] = {}
    if "dp" in mesh.names:
        per_axis["dp"] = propagate(graph, mesh.axis_size("dp"), batch_input_placements(graph), {})
    tp = mesh.axis_size("tp") if "tp" in mesh.names else 1
    if tp > 1:
        overrides = _sequence_parallel_overrides(graph) if sequence_parallel else {}
        per_axis["tp"] = propagate(
            graph, tp, {i.name: R for i in graph.inputs if i.meta}, choose_params=_megatron_params(graph, tp),
            overrides=overrides, conventions=True,
            reduce_partial_sums=_partial_sums_reducer(graph, sequence_parallel),
        )
        _check_divisible(graph, per_axis["tp"], tp)
    pp = mesh.axis_size("pp") if "pp" in mesh.names else 1
    stage_of = {}
    if pp > 1:
        if layers_per_stage is None:
            stage_of = even_stages(graph, pp * virtual_stages)
        else:
            stage_of = uneven_stages(graph, layers_per_stage, stages=pp * virtual_stages)
    return combine(graph, mesh, per_axis, stage_of)


def _megatron_params(graph: OpGraph, tp: int):
    """Choose tp placements of a node's weights from the placement of its activation input."""
    tables = [n.params[0] for n in graph.nodes if n.op.startswith("aten.embedding.") and n.params]
    word_embedding = max(tables, key=lambda name: graph.parameters[name].shape[0], default=None)

    def choose(node: OpNode, activations: tuple[Placement, ...]) -> dict[str, Placement]:
        matrices = [name for name in node.params if len(graph.parameters.get(name, _SCALAR).shape) == 2]
        if not matrices:
            return {}
        weight_name = matrices[0]
        weight = graph.parameters[weight_name]
        if node.op.startswith("aten.embedding."):
            # Only the word embedding is vocabulary parallel; position/type tables stay whole.
            return {weight_name: Shard(0)} if weight_name == word_embedding and weight.shape[0] % tp == 0 else {}
        if not node.op.startswith(_MATMULS_WITH_WEIGHT):
            return {}
        act_index = 1 if node.op.startswith("aten.addmm.") else 0
        act = activations[act_index] if act_index < len(activations) else R
        act_rank = len(node.input_meta[act_index].shape)
        out_dim = 0 if node.op.startswith("aten.linear.") else 1
        if isinstance(act, Shard) and act.dim % act_rank == act_rank - 1:
            return {weight_name: Shard(1 - out_dim)}  # row parallel
        if weight.shape[out_dim] % tp == 0:
            return {weight_name: Shard(out_dim)}  # column parallel
        return {}

    return choose


def _sequence_parallel_overrides(graph: OpGraph) -> dict[str, Placement]:
    """Split the residual stream on the sequence (dim 1) from where it starts: the first op
    whose output has the shape of the first block's input (the word embedding), so its
    partial sums are reduce-scattered rather than all-reduced, as in Megatron-LM."""
    first_block = next((n for n in graph.nodes if n.block is not None), None)
    if first_block is None or not first_block.input_meta:
        return {}
    stream = first_block.input_meta[0]
    start = next((n for n in graph.nodes if n.output_meta and n.output_meta[0] == stream), None)
    return {start.name: Shard(1)} if start is not None else {}


def _partial_sums_reducer(graph: OpGraph, sequence_parallel: bool):
    """Where Megatron-LM reduces partial sums of the residual stream's shape (a row-parallel
    projection's output): all-reduced to ``Replicate``, or reduce-scattered to the sequence
    split (dim 1, as ``_sequence_parallel_overrides``) under sequence parallelism, on the edge
    into their first reader. Other partial sums are left to their readers."""
    first_block = next((n for n in graph.nodes if n.block is not None), None)
    if first_block is None or not first_block.input_meta:
        return None
    stream_shape = first_block.input_meta[0].shape
    reduced = Shard(1) if sequence_parallel else R

    def reduce(meta: TensorMeta) -> Placement | None:
        return reduced if meta.shape == stream_shape else None

    return reduce


def _check_divisible(graph: OpGraph, placements: dict[str, AxisPlacements], size: int) -> None:
    for node in graph.nodes:
        for meta, placement in zip(node.output_meta, placements[node.name].outputs):
            if isinstance(placement, Shard) and meta.shape and meta.shape[placement.dim % len(meta.shape)] % size:
                raise PlanningError(
                    f"tensor parallelism of degree {size} splits dim {placement.dim} of {node.name} "
                    f"({node.module or 'root'}, shape {meta.shape}) unevenly; choose tp dividing the heads "
                    f"and hidden sizes"
                )


def even_stages(graph: OpGraph, stages: int) -> dict[str, int]:
    """Assign nodes to ``stages`` pipeline (virtual) stages: blocks split evenly, ops before
    the first block on stage 0, ops after the last block on the last stage."""
    blocks = sum(graph.blocks.values())
    if not blocks:
        raise PlanningError("pipeline parallelism needs repeated blocks (layers) to split, and this model has none")
    if blocks % stages:
        raise PlanningError(
            f"{blocks} layers do not split evenly over {stages} pipeline stages; "
            f"choose pp (x virtual stages) dividing {blocks}"
        )
    return uneven_stages(graph, (blocks // stages,) * stages)


def nearly_even_layers(blocks: int, stages: int) -> tuple[int, ...]:
    """``blocks`` over ``stages`` as evenly as they go; when they do not divide, the first and
    last stages (which also hold the embedding and the head) are the ones left a block
    short, as Megatron-Core's ``--decoder-first/last-pipeline-num-layers`` allow."""
    base, extra = divmod(blocks, stages)
    counts = [base] * stages
    for position in [*range(1, stages - 1), 0, stages - 1][:extra]:
        counts[position] += 1
    return tuple(counts)


def uneven_stages(graph: OpGraph, layers_per_stage: Sequence[int], stages: int | None = None) -> dict[str, int]:
    """Assign nodes to pipeline (virtual) stages holding ``layers_per_stage[s]`` consecutive
    blocks each: ops before the first block on stage 0, ops after the last block on the last
    stage, ops between two blocks on the earlier block's stage. The first and last stages may
    hold no block (only the embedding or the head); every other stage holds at least one. ``stages``, when given, is how many (virtual)
    stages the pipeline has: one count each.

    Raises:
        PlanningError: the model has no blocks, or the counts are not one per stage adding
            up to its blocks.
    """
    blocks = list(graph.block_ids())
    if not blocks:
        raise PlanningError("pipeline parallelism needs repeated blocks (layers) to split, and this model has none")
    check_layers_per_stage(layers_per_stage, len(blocks), stages)
    stage_of_block = {}
    position = 0
    for stage, count in enumerate(layers_per_stage):
        for block in blocks[position:position + count]:
            stage_of_block[block] = stage
        position += count
    last = len(layers_per_stage) - 1
    stage_of: dict[str, int] = {}
    # Ops between two blocks (an MoE model summing each layer's balance loss) stay with the
    # block before them, so the stages still follow each other in graph order.
    final = max(index for index, node in enumerate(graph.nodes) if node.block is not None)
    current = 0
    for index, node in enumerate(graph.nodes):
        if node.block is not None:
            current = stage_of_block[node.block]
        stage_of[node.name] = last if index > final else current
    return stage_of


def check_layers_per_stage(layers_per_stage: Sequence[int], blocks: int, stages: int | None = None) -> None:
    """Raise a one-line ``PlanningError`` unless ``layers_per_stage`` is a list of block
    counts (``stages`` of them when given), at least one for every stage but the first and
    last, adding up to ``blocks``."""
    counts = tuple(layers_per_stage) if isinstance(layers_per_stage, (list, tuple)) else None
    if counts is None or not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise PlanningError(
            f"layers_per_stage must be a non-empty list of block counts (integers >= 0), got {layers_per_stage!r}"
        )
    if stages is not None and len(counts) != stages:
        raise PlanningError(
            f"layers_per_stage {list(counts)} has {len(counts)} entries but the pipeline has {stages} (virtual) stages; "
            f"give one count per stage"
        )
    if sum(counts) != blocks:
        raise PlanningError(
            f"layers_per_stage {list(counts)} holds {sum(counts)} layers but the model has {blocks}; "
            f"give counts that add up to {blocks}"
        )
    empty_inside = [stage for stage, count in enumerate(counts) if count == 0 and 0 < stage < len(counts) - 1]
    if empty_inside:
        raise PlanningError(
            f"layers_per_stage {list(counts)} leaves stage(s) {', '.join(map(str, empty_inside))} without a layer; "
            f"only the first and last stages may hold none (they hold the embedding and the head)"
        )
