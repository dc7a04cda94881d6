"""The simulated step of a plan whose optimizer states are split by ``state_shares``
(cost-model layer): what ``state_runtime`` runs, priced in place of ZeRO-1's collectives.

- No gradient sync in backward (the weights are not wrapped): once the last backward of the
  step is done, a reduce-scatter-v of the flat fp32 gradient (``StateShards.reduce_gradients``
  casts it to fp32), then after the optimizer step an all-gather-v of the fp32 parts, each
  one exchange per bucket of the flat vector (``state_shares.bucket_ranges``: a slice of
  every rank's part in each), one after another. An exchange runs as
  ``all_to_all_single`` with split sizes, whose busiest rank moves
  ``state_shares.exchange_elements`` of the bucket's parts; priced as the cluster's pairwise
  all-to-all (``cost_model.collectives``: ``(n - 1) / n * S / bandwidth + (n - 1) latency``,
  ``S`` the bytes each rank sends) with ``S`` set so that ``(n - 1) / n * S`` is those
  elements' bytes.
- Memory, per rank (``rank_memory``): weights and gradients whole, as ZeRO-1's; optimizer
  states for its own part of the flat vector (the even breakdown's states times ``dp`` times
  ``p_r / N``); activations of its own largest micro-batch; and the step's buffers: one
  bucket of the flat fp32 gradient and what it receives of it (``dp`` times its elements of
  the bucket), 4 bytes an element (``state_runtime`` exchanges bucket by bucket). Those
  exist only in the optimizer step, after backward has freed the activations, so a rank
  needs them only where they exceed its activations (PyTorch's caching allocator hands the
  freed blocks to the next allocations; a fragmented cache would need more).
"""

from __future__ import annotations

import dataclasses

from cost_model.simulator import Simulator
from cost_model.step_contributor import ParameterSharding, StepContributor
from cost_model.step_memory import stage_memory
from planner.families.uneven_dp.shares import micro_batch_sizes
from planner.families.uneven_dp.state_shares import bucket_ranges, exchange_elements, state_parts

JSON_KEY = "uneven"
# StateShards.reduce_gradients and UnevenStatesOptimizer exchange fp32 (torch.float32: 4 bytes).
EXCHANGED_BYTES = 4


def flat_elements(context) -> int:
    """Elements of the flat vector of trainable parameters the program splits (a plan of
    ``dp`` alone holds them all, each tied weight once: ``module.parameters()``)."""
    return int(context.graph.parameter_count)


def parts_of(context) -> tuple[int, ...]:
    """Each rank's part of the flat vector (``state_shares.state_parts`` of the plan's weights)."""
    return state_parts(flat_elements(context), context.plan.sections[JSON_KEY].state_shares)


def exchange_seconds(context, parts: tuple[int, ...]) -> float:
    """Seconds of one reduce-scatter-v or all-gather-v of ``parts`` fp32 elements over ``dp``
    (module docstring), in one exchange."""
    ranks = len(parts)
    moved = exchange_elements(parts) * EXCHANGED_BYTES
    if moved <= 0:
        return 0.0
    return context.collective("all_to_all", moved * ranks / (ranks - 1), "dp")


def bucket_sizes(parts: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Each rank's elements in each of the program's exchanges (``state_shares.bucket_ranges``)."""
    return [tuple(stop - start for start, stop in ranges) for ranges in bucket_ranges(parts)]


def bucketed_exchange_seconds(context, parts: tuple[int, ...]) -> float:
    """Seconds of the program's reduce-scatter-v or all-gather-v of ``parts``: its exchanges
    (``bucket_sizes``), one after another."""
    return sum(exchange_seconds(context, sizes) for sizes in bucket_sizes(parts))


def largest_bucket(parts: tuple[int, ...]) -> tuple[int, int]:
    """(elements, the most any rank owns) of the largest exchange of the flat vector: what
    the program's step buffers hold at once."""
    sizes = bucket_sizes(parts)
    return max(sum(bucket) for bucket in sizes), max(max(bucket) for bucket in sizes)


class StateSharesStep(StepContributor):
    """The collectives, sharding and per-rank memory of a plan with ``state_shares``
    (module docstring); ``costs.UnevenShareStep`` hands it those hooks for such plans."""

    def gradient_reduction(self, tasks, device: str, sync: bool):
        return _ReduceScatterV(tasks, device) if sync else None

    def after_optimizer(self, tasks, device: str, segments, step: int) -> None:
        parts = parts_of(tasks.context)
        tasks.graph.add("all-gather-v updated parts (state shares)", (device, "collective"),
                        bucketed_exchange_seconds(tasks.context, parts), deps=[step], kind="comm")

    def parameter_sharding(self, context) -> ParameterSharding:
        """Weights and gradients whole; states split over ``dp`` (evenly in this view of the
        fullest device; ``rank_memory`` gives each rank its own part)."""
        return ParameterSharding(weights=1, gradients=1, states=context.dp)

    def communication_buffer_bytes(self, context, segments, elements: float, weight_bytes: float,
                                   gradient_bytes: float) -> float:
        """The step's buffers on the rank of the largest part: one bucket of fp32 gradients
        and what it receives of it from every rank."""
        return _step_buffer_bytes(context, max(parts_of(context)))

    def add_axis_bytes(self, context, segment, totals: dict[str, float]) -> None:
        """The busiest rank's bytes of both exchanges, this segment's fraction of them."""
        parts = parts_of(context)
        if sum(parts) == 0:
            return
        moved = 2 * exchange_elements(parts) * EXCHANGED_BYTES * segment.shardable_elements() / sum(parts)
        totals["dp"] = totals.get("dp", 0.0) + moved

    def rank_memory(self, context, costs, memory):
        """Each rank's memory (module docstring)."""
        section = context.plan.sections[JSON_KEY]
        parts = parts_of(context)
        total = sum(parts) or 1
        steps = context.micro_batches
        largest = [micro_batch_sizes(share, steps)[0] for share in section.shares]
        fullest_buffer = self.communication_buffer_bytes(context, [], 0, 0, 0)
        by_rank = []
        for rank, part in enumerate(parts):
            activations = int(memory.activations * largest[rank] / max(largest))
            step_buffers = _step_buffer_bytes(context, part)
            by_rank.append(dataclasses.replace(
                memory,
                optimizer_states=int(memory.optimizer_states * context.dp * part / total),
                activations=activations,
                communication_buffers=int(memory.communication_buffers - fullest_buffer
                                          + max(0, step_buffers - activations)),
            ))
        return tuple(by_rank)


def _step_buffer_bytes(context, part: int) -> int:
    """Bytes of a rank's step buffers whose part is ``part``: the bucket of fp32 gradients it
    sends and the ``dp`` copies of its own slice of that bucket it receives (the largest
    exchange's, at most ``part``)."""
    parts = parts_of(context)
    bucket, _ = largest_bucket(parts)
    slices = max(1, len(bucket_sizes(parts)))
    return EXCHANGED_BYTES * (bucket + context.dp * -(-part // slices))


class _ReduceScatterV:
    """One backward pass's reduce-scatter-v: after its final segment, of the whole flat vector."""

    def __init__(self, tasks, device: str) -> None:
        self.tasks, self.device = tasks, device

    def segment_done(self, segment, last: int, final: bool, deferred: list | None,
                     sync_after: dict[str, list[int]]) -> None:
        if not final:
            return
        seconds = bucketed_exchange_seconds(self.tasks.context, parts_of(self.tasks.context))

        def launch(after: int) -> int:
            return self.tasks.graph.add("reduce-scatter-v grads (state shares)", (self.device, "collective"),
                                        seconds, deps=[after], kind="comm")

        if deferred is not None:
            deferred.append(launch)
        else:
            sync_after.setdefault(self.device, []).append(launch(last))


def plan_rank_bytes(plan, graph) -> tuple[int, ...]:
    """Each rank's predicted bytes of ``plan`` (with ``state_shares``), as its simulation
    prices them (``StateSharesStep.rank_memory``); the simulation keeps only the fullest."""
    simulator = Simulator(plan, graph)
    whole = stage_memory(simulator.context, simulator.contributors, 0, simulator.segments())
    return tuple(memory.total for memory in StateSharesStep().rank_memory(simulator.context, simulator.costs, whole))
