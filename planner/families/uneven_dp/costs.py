"""Uneven data parallelism's part of a simulated step (cost-model layer): every op priced on
the slowest rank's device, at that rank's share of the batch.

The simulator prices one representative device per pipeline stage (``cost_model.simulator``):
under an even split every rank does the same work, and ``StepContext.device`` is the slowest
device. Under uneven shares the ranks differ in both device and work, and the step waits for
the rank that finishes its forward and backward last. So ``UnevenShareStep`` first finds
that rank (``critical_rank``: the largest compute time over the ranks, each priced on its
own device at its own share: ``compute_seconds``) and then re-prices every op for it
(``node_cost``): an op whose operands are split over ``dp`` does ``share / B`` of the traced
work instead of ``1 / dp``, on that rank's device; its saved activations are those of the
largest share (memory is reported on the fullest device). The
gradient reduction is unchanged: gradients have the same size on every rank whatever its
share, and the data-parallel contributor prices their all-reduce (or reduce-scatter) on the
cluster's actual links, so the step is the slowest rank's compute plus the communication it
leaves exposed, as a task graph. A plan with ``state_shares`` runs other collectives:
``UnevenShareStep`` hands those hooks to ``StateSharesStep`` (below).

States by memory (``state_shares``): what ``state_runtime`` runs, priced in place of
ZeRO-1's collectives.

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

``share_time_model`` gives the search the line ``fixed + share * per_sample`` seconds of one
rank's compute, fitted through two shares on its device, which ``shares.balanced_shares``
balances exactly.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.tensor import Shard

from cost_model.autocast_activations import autocast_activation_times
from cost_model.compute import op_times
from cost_model.data_parallel_step import DataParallelStep
from cost_model.simulator import Simulator
from cost_model.step_contributor import ParameterSharding, StepContributor
from cost_model.step_memory import stage_memory
from planner.cluster import DeviceSpec
from planner.device_groups import rank_devices
from planner.families.uneven_dp.shares import micro_batch_sizes
from planner.families.uneven_dp.state_shares import bucket_ranges, exchange_elements, state_parts
from planner.graph import OpGraph
from planner.strategy import NodeStrategy

JSON_KEY = "uneven"


def split_over_dp(mesh, strategy: NodeStrategy) -> bool:
    """Whether ``dp`` splits the op's work: some operand is ``Shard`` on it (the simulator's
    rule for an op's work share, ``cost_model.node_costs``)."""
    index = mesh.names.index("dp")
    return any(isinstance(p[index], Shard) for p in (*strategy.inputs, *strategy.outputs))


def compute_seconds(plan, graph: OpGraph, device: DeviceSpec, share: float, steps: int | None = None) -> float:
    """Forward and backward seconds of one rank of ``plan`` (a data-parallel plan on ``dp``
    alone) on ``device`` taking ``share`` samples of the global batch in ``steps``
    micro-batches (the plan's ``accumulation_steps`` when None): ``steps`` times each op's
    roofline time (``cost_model.compute.op_times``) at ``share / (steps B)`` of its traced
    work when ``dp`` splits it, ``1 / steps`` otherwise (the simulator's rule for a
    micro-batch, ``node_cost`` below)."""
    steps = plan.accumulation_steps if steps is None else steps
    strategies = {s.node: s for s in plan.strategies}
    total = 0.0
    for node in graph.nodes:
        work = share / plan.batch_size if split_over_dp(plan.mesh, strategies[node.name]) else 1.0
        forward, backward = op_times(node, work / steps, device, plan.precision)
        total += steps * (forward + backward)
    return total


def share_time_model(plan, graph: OpGraph, device: DeviceSpec, steps: int = 1) -> tuple[float, float]:
    """``(fixed, per_sample)``: one rank's compute seconds on ``device`` as ``fixed + share *
    per_sample``, the line through the even share and twice it (roofline times are piecewise
    linear in the work; between these shares, where balanced shares fall, the line is close),
    in ``steps`` micro-batches (each repeats the fixed part). ``per_sample`` is kept positive."""
    even = max(1, plan.batch_size // plan.mesh.axis_size("dp"))
    low = compute_seconds(plan, graph, device, even, steps)
    high = compute_seconds(plan, graph, device, 2 * even, steps)
    # Positive so every further sample costs something: the greedy then never piles samples
    # onto a rank whose (all overhead) line looks flat. 1e-12 s is no measured figure, a floor.
    per_sample = max((high - low) / even, 1e-12)
    return max(0.0, low - even * per_sample), per_sample


def critical_rank(plan, graph: OpGraph) -> int:
    """The rank of ``plan`` (with an ``"uneven"`` section) whose compute takes longest: its
    device and share are the ones the step waits for (lowest rank on ties)."""
    shares = plan.sections[JSON_KEY].shares
    devices = rank_devices(plan.cluster)
    seconds: dict[tuple, float] = {}
    for rank, share in enumerate(shares):
        key = (devices[rank], share)
        if key not in seconds:
            seconds[key] = compute_seconds(plan, graph, devices[rank], share)
    return max(range(len(shares)), key=lambda rank: (seconds[(devices[rank], shares[rank])], -rank))


class UnevenShareStep(StepContributor):
    """The costs part of the ``uneven`` family (``planner.families``): on a plan with an
    ``"uneven"`` section every op is priced for the slowest rank (module docstring). The
    collectives, sharding and memory are the flavour's (``DataParallelStep``), or, on a plan
    with ``state_shares``, those of the uneven state parts (``StateSharesStep``):
    it takes the data-parallel contributor over and hands each hook to one of the two."""

    takes_over = (DataParallelStep,)

    def __init__(self) -> None:
        self._last: tuple[object, int, DeviceSpec] | None = None
        self._flavour = DataParallelStep()
        self._state_shares = StateSharesStep()

    def _sync(self, context) -> StepContributor:
        """Who prices the collectives and memory of this plan."""
        return self._state_shares if context.plan.sections[JSON_KEY].state_shares else self._flavour

    def reduces_every_micro_batch(self, context) -> bool:
        return self._sync(context).reduces_every_micro_batch(context)

    def gathers_every_pass(self, context) -> bool:
        return self._sync(context).gathers_every_pass(context)

    def forward_gather(self, tasks, device, segment, issue_after):
        return self._sync(tasks.context).forward_gather(tasks, device, segment, issue_after)

    def backward_gather(self, tasks, device, segment, issue_after):
        return self._sync(tasks.context).backward_gather(tasks, device, segment, issue_after)

    def copy_out(self, tasks, device, segment, backward, gathered):
        return self._sync(tasks.context).copy_out(tasks, device, segment, backward, gathered)

    def gradient_reduction(self, tasks, device, sync):
        return self._sync(tasks.context).gradient_reduction(tasks, device, sync)

    def after_optimizer(self, tasks, device, segments, step) -> None:
        self._sync(tasks.context).after_optimizer(tasks, device, segments, step)

    def parameter_sharding(self, context):
        return self._sync(context).parameter_sharding(context)

    def communication_buffer_bytes(self, context, segments, elements, weight_bytes, gradient_bytes) -> float:
        return self._sync(context).communication_buffer_bytes(context, segments, elements, weight_bytes,
                                                               gradient_bytes)

    def add_axis_bytes(self, context, segment, totals) -> None:
        self._sync(context).add_axis_bytes(context, segment, totals)

    def rank_memory(self, context, costs, memory):
        return self._sync(context).rank_memory(context, costs, memory)

    def _critical(self, context) -> tuple[int, DeviceSpec]:
        # Found once per simulated plan, not kept beyond the next one (it would hold its graph).
        if self._last is None or self._last[0] is not context:
            rank = critical_rank(context.plan, context.graph)
            self._last = (context, rank, rank_devices(context.cluster)[rank])
        return self._last[1], self._last[2]

    def node_cost(self, context, node, strategy, cost) -> None:
        if node.is_view:
            return
        rank, device = self._critical(context)
        share = context.plan.sections[JSON_KEY].shares[rank]
        split = split_over_dp(context.mesh, strategy)
        work = (share / context.plan.batch_size if split else 1.0) / context.micro_batches
        cost.forward_s, cost.backward_s = op_times(node, work, device, context.plan.precision)
        # as the simulator's own term adds them for even plans, on the critical rank's share
        forward, backward = autocast_activation_times(context, node, work, device)
        cost.forward_s += forward
        cost.backward_s += backward
        if split:
            # Its saved activations: those of the largest micro-batch of the rank with the most
            # rows (the simulator reports memory on the fullest device; the candidates capped
            # every share by its memory), not the even micro-batch's B / (dp k) rows.
            steps = context.micro_batches
            most = micro_batch_sizes(max(context.plan.sections[JSON_KEY].shares), steps)[0]
            cost.saved_bytes *= most * context.dp * steps / context.plan.batch_size


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


def largest_bucket(parts: tuple[int, ...]) -> int:
    """Elements of the largest exchange of the flat vector: the gradients the program's step
    copies out at once."""
    return max(sum(bucket) for bucket in bucket_sizes(parts))


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
    slices = len(bucket_sizes(parts))  # each exchange holds 1 / slices of every part, rounded up
    return EXCHANGED_BYTES * (largest_bucket(parts) + context.dp * -(-part // slices))


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
