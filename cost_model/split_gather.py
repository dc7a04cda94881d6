"""What a split along a dim its input holds split sends: the fused q|k|v (or gate|up)
projection's ``split`` under Megatron's layout.

``search.propagation`` keeps each piece split on the cut dim, as Megatron-LM does by laying
the fused weight out per rank (each rank's rows hold its part of every piece). The compiled
program holds whole rows of the weight as the model built it (rank r holds rows r/n to
(r+1)/n of q|k|v, not its part of each of q, k and v: materialising, checkpointing and
checking the weights all read a rank's shard as one block), so DTensor's ``split`` gathers
its input first and the pieces come out whole; their readers then keep their slice of each
(no communication) and, in backward, all-gather each piece's gradient (a slice's dual). Per
axis of n ranks splitting the cut dim, for an input of S bytes on this rank's rows:

    forward    all-gather of the input      (n-1)/n · S
    backward   all-gather of every piece    (n-1)/n · S in all

and the whole gradient left behind by the split's backward needs nothing more to go back to
the producer's shard (a slice). Searched plans never split a cut dim (``search.rules.shapes``
asks for it whole, an edge priced like any other); this prices the baselines' layout as the
program runs it.
"""

from __future__ import annotations

import math

from torch.distributed.tensor import Shard

from planner.graph import OpNode
from planner.strategy import NodeStrategy

_SPLITS = ("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default")


def cut_dim(node: OpNode) -> int | None:
    """The dim a split op cuts (normalised), or None for another op."""
    if node.op not in _SPLITS or not node.input_meta:
        return None
    rank = len(node.input_meta[0].shape)
    dim = node.attrs[2] if len(node.attrs) > 2 and node.attrs[2] is not None else 0
    return dim % rank if rank else None


def add_split_gather(context, node: OpNode, strategy: NodeStrategy, cost) -> None:
    """Charge ``cost`` (a ``NodeCost``) the gathers of a split that keeps its pieces split on
    the dim it cuts (module docstring), on every axis that does so."""
    dim = cut_dim(node)
    if dim is None or not strategy.inputs or not strategy.outputs or context.plan.fused_splits_local:
        return  # (a plan whose fused weights are laid out per rank splits locally)
    meta = node.input_meta[0]
    for index, (axis, size) in enumerate(context.mesh.axes):
        held = strategy.inputs[0][index]
        if axis == "pp" or size == 1 or not (isinstance(held, Shard) and held.dim == dim):
            continue
        if not all(isinstance(p[index], Shard) and p[index].dim == dim for p in strategy.outputs):
            continue  # pieces read whole: the edge into the split prices the gather
        others = math.prod(
            s for j, (a, s) in enumerate(context.mesh.axes) if j != index and a != "pp" and isinstance(strategy.inputs[0][j], Shard)
        )
        whole = meta.nbytes * context.activation_scale / others / context.micro_batches
        pieces = [piece.nbytes * context.activation_scale / others / context.micro_batches for piece in node.output_meta]
        # The simulator's collective time (StepContext.collective) on the axis's process group (as cost_model.summa_node).
        cost.forward_comm_s += context.collective("all_gather", whole, axis) + context.redistribute_overhead_s
        sent = whole * (size - 1) / size
        if meta.dtype.is_floating_point:
            cost.backward_comm_s += sum(
                context.collective("all_gather", piece, axis) + context.redistribute_overhead_s for piece in pieces
            )
            sent += sum(pieces) * (size - 1) / size
        cost.axis_bytes[axis] = cost.axis_bytes.get(axis, 0.0) + sent
