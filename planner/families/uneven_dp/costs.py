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
leaves exposed, as a task graph. A plan with ``state_shares`` runs other collectives
(``state_costs``): ``UnevenShareStep`` hands those hooks to ``StateSharesStep``.

``share_time_model`` gives the search the line ``fixed + share * per_sample`` seconds of one
rank's compute, fitted through two shares on its device, which ``shares.balanced_shares``
balances exactly.
"""

from __future__ import annotations

from torch.distributed.tensor import Shard

from cost_model.compute import op_times
from cost_model.data_parallel_step import DataParallelStep
from cost_model.step_contributor import StepContributor
from planner.cluster import DeviceSpec
from planner.device_groups import rank_devices
from planner.families.uneven_dp.shares import micro_batch_sizes
from planner.families.uneven_dp.state_costs import StateSharesStep
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
    with ``state_shares``, those of the uneven state parts (``state_costs.StateSharesStep``):
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
        if split:
            # Its saved activations: those of the largest micro-batch of the rank with the most
            # rows (the simulator reports memory on the fullest device; the candidates capped
            # every share by its memory), not the even micro-batch's B / (dp k) rows.
            steps = context.micro_batches
            most = micro_batch_sizes(max(context.plan.sections[JSON_KEY].shares), steps)[0]
            cost.saved_bytes *= most * context.dp * steps / context.plan.batch_size
