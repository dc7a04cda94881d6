"""A first analytic step-time estimate for data-parallel plans.

Compute is a per-op roofline, time = max(FLOPs / (peak · e_matmul), bytes / (bw · e_mem))
+ kernel overhead, forward plus backward (2× forward) on the local batch, plus a
memory-bound AdamW step. Communication is α–β (``cost_model.collectives``): DDP all-reduces
gradients overlapped with backward (the last bucket is exposed); FSDP all-gathers weights in
forward and backward and reduce-scatters gradients, overlapped by prefetch. The execution
simulator (next) replaces this with an event-by-event schedule.
"""

from __future__ import annotations

from cost_model import defaults
from cost_model.collectives import all_gather_time, group_link, reduce_scatter_time, ring_all_reduce_time
from cost_model.memory import data_parallel_memory
from planner.cluster import Cluster, DeviceSpec
from planner.graph import OpGraph, OpNode
from planner.strategy import Estimate


def op_forward_time(node: OpNode, device: DeviceSpec, dtype: str, shards: int = 1) -> float:
    """Roofline time of one op on ``1/shards`` of its work (seconds)."""
    if node.is_view:
        return 0.0
    compute = node.flops / shards / (device.flops_for(dtype) * defaults.MATMUL_EFFICIENCY)
    memory = node.bytes_moved / shards / (device.memory_bandwidth * defaults.MEMORY_EFFICIENCY)
    return max(compute, memory) + defaults.KERNEL_OVERHEAD_S


def data_parallel_estimate(
    graph: OpGraph, cluster: Cluster, dp_flavour: str, unit_bytes: list[int] | None = None, dtype: str = "float32"
) -> Estimate:
    """Predicted step time and per-device memory of pure data parallelism over all devices.

    Args:
        unit_bytes: for FSDP, parameter bytes of each FSDP unit in forward order (root first);
            each unit pays its own collective latency.
    """
    unit_bytes = unit_bytes or [graph.parameter_bytes]
    dp = cluster.world_size
    # The slowest device bounds a synchronous step (heterogeneous clusters).
    device = min((cluster.device_of(r) for r in range(dp)), key=lambda d: d.flops_for(dtype))
    forward = sum(op_forward_time(node, device, dtype, shards=dp) for node in graph.nodes)
    backward = defaults.BACKWARD_TO_FORWARD * forward
    memory = data_parallel_memory(graph, dp, dp_flavour, max(unit_bytes))
    optimizer = (
        (memory.weights + memory.gradients + memory.optimizer_states) * defaults.ADAM_BYTES_ACCESSED_PER_PARAM_BYTE / 4
    ) / (device.memory_bandwidth * defaults.MEMORY_EFFICIENCY)

    if dp_flavour == "fsdp" and dp > 1:
        # FSDP2 copies each all-gathered unit out of the flat buffer (forward and backward)
        # and copies gradients into the reduce-scatter buffer: 3 passes, read + write each.
        copies = 3 * 2 * graph.parameter_bytes / (device.memory_bandwidth * defaults.MEMORY_EFFICIENCY)
        forward += copies / 3
        backward += 2 * copies / 3
    link = group_link(cluster, list(range(dp)))
    grad_bytes = graph.parameter_bytes
    if dp_flavour == "fsdp":
        gathers = [all_gather_time(size, dp, link) for size in unit_bytes]
        scatters = [reduce_scatter_time(size, dp, link) for size in unit_bytes]
        forward_comm = sum(gathers)
        backward_comm = sum(gathers) + sum(scatters)
        # Prefetch hides every collective behind compute except the first unit's gather and
        # the reduce-scatter of the root, which finishes backward.
        exposed = gathers[0] + scatters[0] + max(0.0, forward_comm - forward) + max(0.0, backward_comm - backward)
    else:
        all_reduce = ring_all_reduce_time(grad_bytes, dp, link)
        last_bucket = ring_all_reduce_time(min(grad_bytes, defaults.DDP_BUCKET_BYTES), dp, link)
        exposed = max(0.0, all_reduce - backward) + last_bucket if dp > 1 else 0.0
        if dp_flavour in ("zero1", "zero2"):
            exposed += all_gather_time(grad_bytes, dp, link)  # updated weight shards re-gathered
    return Estimate(
        step_time_s=forward + backward + optimizer + exposed,
        compute_s=forward + backward + optimizer,
        communication_s=exposed,
        memory=memory,
        device_memory_bytes=cluster.min_device_memory,
        method="analytic",
    )
