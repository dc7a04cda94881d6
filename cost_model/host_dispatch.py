"""The host's share of a step on GPUs: issuing ops runs ahead of the kernels, and binds
when the kernels are shorter than the host's time per op.

A GPU program is issued by one CPU thread: each ATen op costs the host its dispatch (Python,
PyTorch's dispatcher, autograd; on DTensors also sharding propagation) and a kernel launch,
then the kernel runs on the GPU while the host issues the next ops. The GPU waits only when
the host falls behind: a run of ops takes the longer of the two timelines,

    time = max(sum of device time (kernels and in-line collectives), sum of host time)

which the simulator applies per segment (``cost_model.segments``): within a block the host
runs ahead during long kernels and the queue drains during short ones. (Across segments
the host can run further ahead, so a segment that alone is host-bound may be less so in a
step: per-segment is the pessimistic side of the bound.) A host synchronisation inside a
segment (an MoE layer's token dispatch reading its split sizes) drains that lead: the segment
is split there and the ops after it replayed from no lead (``cost_model.host_syncs``). On
CPU devices the host *is* the device, so the host's time adds to the op's instead
(``StepContext.dtensor_dispatch`` in ``cost_model.step_context``, from ``dtensor_dispatch``
below: the same defaults when the device is not calibrated).

Host time per op: ``kernel_overhead_s`` (dispatch and launch, ``cost_model.defaults``; the
device side charges it too, as the gap between kernels) plus, on the DTensors of a graph
program, DTensor's dispatch: the device's calibrated ``dtensor_op_overhead_s`` or, without
one, ``DTENSOR_FORWARD_DISPATCH_S`` / ``DTENSOR_BACKWARD_DISPATCH_S``, measured by
``benchmarks/host_dispatch.py`` (host work, the same whatever device runs the kernels).
A plan that prices Megatron-Core's distributed optimizer is Megatron-Core's own program, on
plain tensors: its host pays the launch alone (``cost_model.step_context``). An op that stands
for several kernels the host launches one by one pays a launch for each beside its own
dispatch: a laid-out MoE layer's anchor op, for the experts' per-expert GEMMs and the
memory-bound kernels around them (``cost_model.grouped_gemm``, ``cost_model.node_costs``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.compute import efficiencies
from planner.cluster import Cluster, DeviceSpec

# DTensor's own dispatch per ATen op on the host (DTensor minus plain tensors), forward with
# autograd recording and backward: measured by ``python benchmarks/host_dispatch.py`` (an MLP
# block on a one-rank mesh, median of 7 rounds of 300 steps, 1 thread) on this project's
# reference machine, an x86_64 Intel Xeon VM, torch 2.13.0: 8.7 us and 12.5 us. A faster
# host CPU lowers both; ``planner calibrate`` fits the device's own ``dtensor_op_overhead_s``.
DTENSOR_FORWARD_DISPATCH_S = 8.7e-6
DTENSOR_BACKWARD_DISPATCH_S = 12.5e-6


@dataclass(frozen=True)
class HostDispatch:
    """Host seconds to issue one op's forward and one op's backward."""

    forward_s: float
    backward_s: float


def dtensor_dispatch(device: DeviceSpec) -> HostDispatch:
    """DTensor's own host seconds per op of a graph program (beyond a plain tensor's): the
    device's calibrated ``dtensor_op_overhead_s``, else the measured defaults above. The same
    host work whichever device runs the kernels: on GPUs it runs ahead of them
    (``host_dispatch``), on CPUs it adds to each op (``cost_model.step_context``)."""
    calibrated = device.dtensor_op_overhead_s
    forward = DTENSOR_FORWARD_DISPATCH_S if calibrated is None else calibrated
    backward = DTENSOR_BACKWARD_DISPATCH_S if calibrated is None else calibrated
    return HostDispatch(forward, backward)


def host_dispatch(cluster: Cluster, device: DeviceSpec, graph_program: bool) -> HostDispatch | None:
    """The host's time per op where it runs ahead of the device (GPU clusters), else None
    (on CPUs the host's time adds to each op instead)."""
    if cluster.backend != "nccl":
        return None
    overhead = efficiencies(device)[2]
    if not graph_program:
        return HostDispatch(overhead, overhead)
    dtensor = dtensor_dispatch(device)
    return HostDispatch(overhead + dtensor.forward_s, overhead + dtensor.backward_s)


def host_wait(device_s: float, host_s: float) -> float:
    """Seconds the device waits for the host in a run of ops taking ``device_s`` on the
    device and ``host_s`` to issue."""
    return max(0.0, host_s - device_s)
