"""Gradients of parameters replicated over an axis whose ranks saw different samples.

A parameter replicated over a mesh axis on which the op's output is split (its rows, the
batch or the sequence) gets a different partial gradient on each rank of that axis: the
program's gradient hook all-reduces it there once per step (``codegen.runtime.spmd``). This
happens on any mesh: 2.5-D SUMMA's weights over depth and bias or norm chunks over the ranks
holding other rows, a layer norm's weight under sequence parallelism, or every weight of a
plan that splits the batch over ``tp`` (data parallelism under another axis name). The
data-parallel flavours' sync covers ``dp`` only (``cost_model.data_parallel_step``); this one,
a step contributor too (``cost_model.contributor_registry``), is charged once per step
(``NodeCost.axis_sync_s``) and overlaps the rest of the backward on the collective stream,
as the data-parallel sync does.
"""

from __future__ import annotations

import math

from torch.distributed.tensor import Replicate, Shard


def add_replica_gradient_sync(context, node, strategy, cost, gradient_bytes: int) -> None:
    """Charge ``cost`` (one micro-batch of ``node``) the all-reduce of its parameters'
    gradients over every non-``dp``, non-``pp`` axis on which a parameter is replicated while
    the op's output is split there (module docstring). ``gradient_bytes``: bytes of one
    gradient element."""
    output = strategy.outputs[0] if strategy.outputs else None
    if output is None:
        return
    for name, placements in strategy.params.items():
        meta = context.graph.parameters.get(name)
        if meta is None:
            continue
        shards = math.prod(size for (_, size), p in zip(context.mesh.axes, placements) if isinstance(p, Shard))
        local = meta.numel / shards * gradient_bytes
        for index, (axis, size) in enumerate(context.mesh.axes):
            if axis in ("dp", "pp") or size == 1:
                continue
            if isinstance(placements[index], Replicate) and isinstance(output[index], Shard):
                cost.axis_sync_s += context.collective("all_reduce", local, axis)
                cost.axis_bytes[axis] = cost.axis_bytes.get(axis, 0.0) + 2 * (size - 1) / size * local / context.micro_batches
