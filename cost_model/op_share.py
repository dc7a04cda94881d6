"""How many ranks share one op's work under a strategy."""

from __future__ import annotations

import math

from torch.distributed.tensor import Shard

from planner.strategy import NodeStrategy


def work_split(mesh, strategy: NodeStrategy) -> int:
    """Ranks an op's work is divided over: the axes (not ``pp``) on which some operand is
    split. An axis where the op only reads or makes partial sums (all operands whole-size)
    leaves every rank the whole computation (the rule registry's ``shards_work``)."""
    tensors = (*strategy.inputs, *strategy.outputs)
    return math.prod(size for index, (axis, size) in enumerate(mesh.axes)
                     if axis != "pp" and any(isinstance(p[index], Shard) for p in tensors))
