"""Pipeline stages on devices of different types: each op priced on its own stage's device
(cost-model layer).

The simulator prices every op on the slowest device of the cluster (``StepContext.device``):
right when every rank does the same work on the same kind of device, too slow for a
pipeline whose stages run on different device groups (Metis, ATC'24). ``StageDeviceStep``
adds, to every op of stage ``s``, the difference between its roofline time on stage ``s``'s
device and on the slowest device, at the same share of the op's work
(``cost_model.compute.op_times``): a stage on H100s runs its ops at H100 speed while the
overheads the simulator adds per op (DTensor dispatch, the host) stay as they were.
Collectives, memory and the schedule are the pipeline's, unchanged.

A stage is the ranks of one ``pp`` coordinate (``pp`` is the mesh's first axis: stage ``s``
holds ranks ``s * world / pp`` onwards), and under interleaving stage module ``m`` runs on
coordinate ``m % pp``; the section's ``check`` guarantees every rank of a stage has the same
device, so its first rank's device is the stage's.
"""

from __future__ import annotations

import math

from torch.distributed.tensor import Shard

from cost_model.compute import op_times
from cost_model.step_contributor import StepContributor
from planner.cluster import DeviceSpec

__all__ = ["StageDeviceStep", "stage_device", "work_share"]


def stage_device(plan, stage: int) -> DeviceSpec:
    """The device stage module ``stage`` of ``plan`` runs on (its pp coordinate's first rank;
    under stages of different widths, the first rank of the stage, ``section.stage_ranks``)."""
    section = plan.sections.get("hetero-pp")
    if section is not None and section.widths:
        return plan.cluster.device_of(section.stage_ranks(plan)[stage][0])
    pp = plan.mesh.axis_size("pp")
    return plan.cluster.device_of((stage % pp) * (plan.cluster.world_size // pp))


def work_share(mesh, strategy, micro_batches: int) -> float:
    """The share of an op's traced work one rank does per micro-batch: the traced work over
    the ranks of every non-pp axis on which some operand is split, and over the
    micro-batches (the simulator's rule, ``cost_model.node_costs``)."""
    tensors = (*strategy.inputs, *strategy.outputs)
    split = math.prod(size for index, (axis, size) in enumerate(mesh.axes)
                      if axis != "pp" and any(isinstance(p[index], Shard) for p in tensors))
    return 1.0 / (split * micro_batches)


class StageDeviceStep(StepContributor):
    """The costs part of the ``hetero-pp`` family (``planner.families``): every op of a
    stage priced on that stage's device (module docstring). It adds to op costs only."""

    def node_cost(self, context, node, strategy, cost) -> None:
        if node.is_view:
            return
        device = stage_device(context.plan, strategy.stage)
        if device == context.device:
            return
        work = work_share(context.mesh, strategy, context.micro_batches)
        precision = context.plan.precision
        slow_forward, slow_backward = op_times(node, work, context.device, precision)
        forward, backward = op_times(node, work, device, precision)
        # Kept at zero or more: the simulator's per-op overheads are already in the cost.
        cost.forward_s = max(0.0, cost.forward_s + forward - slow_forward)
        cost.backward_s = max(0.0, cost.backward_s + backward - slow_backward)
