"""What a vocabulary-parallel cross entropy sends: a loss reading logits split over the
classes (``Shard(1)``) on a mesh axis.

The program runs it with PyTorch's ``loss_parallel`` (``codegen.runtime.loss_parallel``),
which, in forward, all-reduces over that axis three values per row of logits this rank
holds (as Megatron-LM's vocabulary-parallel cross entropy does):

    the row's maximum                 (N, 1) in the computation dtype (float32, float64 for float64 logits)
    the row's sum of exponentials     (N, 1) in the computation dtype
    the target's log-probability      (N, 1) in the logits' dtype (the rank holding the class gives it, the others 0)

and computes its slice of the gradient locally in backward (nothing sent). N is the rows
of the logits (all dims but the classes) this rank holds in one micro-batch: split by the
other axes that split them.
"""

from __future__ import annotations

import math

from torch.distributed.tensor import Shard

from planner.graph import OpNode
from planner.strategy import NodeStrategy

CROSS_ENTROPY = "aten.cross_entropy_loss.default"
_CLASS_DIM = 1


def class_axis(node: OpNode, strategy: NodeStrategy) -> int | None:
    """Index of the mesh axis that splits the logits' classes of a cross entropy the program
    runs by ``loss_parallel``, or None (class weights and label smoothing run through
    DTensor's own rule, which gathers the logits inside the op: not priced here)."""
    if node.op != CROSS_ENTROPY or not strategy.inputs or len(node.input_meta[0].shape) < 2:
        return None
    smoothing = node.attrs[5] if len(node.attrs) > 5 and node.attrs[5] is not None else 0.0
    if len(node.inputs) > 2 or smoothing != 0.0:
        return None
    split = [index for index, p in enumerate(strategy.inputs[0]) if isinstance(p, Shard) and p.dim == _CLASS_DIM]
    return split[0] if len(split) == 1 else None


def add_vocabulary_parallel_loss(context, node: OpNode, strategy: NodeStrategy, cost) -> None:
    """Charge ``cost`` (a ``NodeCost``) the three forward all-reduces of a vocabulary-parallel
    cross entropy (module docstring), if ``node`` is one under ``strategy``."""
    index = class_axis(node, strategy)
    if index is None:
        return
    axis, size = context.mesh.axes[index]
    logits = node.input_meta[0]
    rows_split = math.prod(
        s for j, (a, s) in enumerate(context.mesh.axes)
        if j != index and a != "pp" and isinstance(strategy.inputs[0][j], Shard)
    )
    rows = logits.numel / logits.shape[_CLASS_DIM] / rows_split / context.micro_batches
    logits_bytes = logits.dtype.itemsize * context.activation_scale  # the plan's activation precision
    computation_bytes = max(logits_bytes, 4)  # half and bfloat16 logits are reduced in float32
    for size_bytes in (rows * computation_bytes, rows * computation_bytes, rows * logits_bytes):
        # The simulator's collective time (StepContext.collective) on the axis's process group (as cost_model.summa_node).
        cost.forward_comm_s += context.collective("all_reduce", size_bytes, axis) + context.redistribute_overhead_s
        cost.axis_bytes[axis] = cost.axis_bytes.get(axis, 0.0) + size_bytes * 2 * (size - 1) / size
