"""Per-device memory of a data-parallel training step, by kind (first analytic model).

Weights, gradients and optimizer states follow the ZeRO paper (Rajbhandari et al., SC'20,
section 5): ZeRO-1 shards optimizer states, ZeRO-2 also gradients, ZeRO-3/FSDP also
weights, each over the data-parallel degree. Activations are counted as every non-view
op's output kept for backward, split over the batch-sharded ranks: an upper bound that the
simulator's lifetime analysis replaces.
"""

from __future__ import annotations

from cost_model import defaults
from planner.graph import OpGraph
from planner.strategy import MemoryBreakdown


def saved_activation_bytes(graph: OpGraph) -> int:
    """Bytes of forward outputs kept for backward, whole batch (upper bound: every non-view op)."""
    return sum(meta.nbytes for node in graph.nodes if not node.is_view for meta in node.output_meta)


def data_parallel_memory(
    graph: OpGraph, dp_degree: int, dp_flavour: str, largest_unit_bytes: int = 0
) -> MemoryBreakdown:
    """Memory per device when the whole model is replicated or ZeRO-sharded over ``dp_degree``.

    Args:
        graph: the traced model.
        dp_degree: number of data-parallel ranks (the batch is split over them).
        dp_flavour: ``ddp``, ``zero1``, ``zero2`` or ``fsdp``.
        largest_unit_bytes: for FSDP, bytes of the largest FSDP unit; it and the next one
            (prefetched) are unsharded at the same time.
    """
    param_bytes = graph.parameter_bytes
    optimizer_bytes = defaults.ADAM_STATES_PER_PARAM * 4 * graph.parameter_count  # fp32 states
    shard_optimizer = dp_flavour in ("zero1", "zero2", "fsdp")
    shard_gradients = dp_flavour in ("zero2", "fsdp")
    shard_weights = dp_flavour == "fsdp"
    if dp_flavour == "fsdp":
        buffers = 2 * largest_unit_bytes  # the unit in use and the one being prefetched
    elif dp_degree > 1:
        buffers = min(defaults.DDP_BUCKET_BYTES, param_bytes)  # one gradient bucket in flight
    else:
        buffers = 0
    buffer_bytes = sum(meta.nbytes for meta in graph.buffers.values())
    return MemoryBreakdown(
        weights=_ceil_div(param_bytes, dp_degree if shard_weights else 1) + buffer_bytes,
        gradients=_ceil_div(param_bytes, dp_degree if shard_gradients else 1),
        optimizer_states=_ceil_div(optimizer_bytes, dp_degree if shard_optimizer else 1),
        activations=_ceil_div(saved_activation_bytes(graph), dp_degree),
        communication_buffers=buffers,
    )


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)
