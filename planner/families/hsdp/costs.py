"""HSDP's part of a simulated step (cost-model layer): FSDP's, over the shard group, and the
gradient shards all-reduced across the groups.

A HSDP plan is an fsdp plan on ``dp`` alone whose ranks form ``replicate x shard`` groups
(``planner.families.hsdp.section``). FSDP2 on that 2-D mesh runs exactly FSDP's schedule
inside each group of ``shard`` consecutive ranks (``cost_model.data_parallel_step``: weights
all-gathered one unit ahead of its forward and again for backward, gradients
reduce-scattered per unit, weights, gradients and optimizer states divided by the group),
then, after each unit's reduce-scatter, all-reduces the 1/shard gradient shard it holds over
the ``replicate`` ranks that hold the same shard (one per group). So ``HybridShardingStep``
composes the data-parallel contributor over a view of the step whose ``dp`` is the shard
group (``ShardGroupView``) and adds one all-reduce task per unit after its reduce-scatter.

The groups are priced as the mesh ``replicate x shard`` would be
(``cost_model.step_context.axis_group``): a shard group is ``shard`` consecutive ranks inside
a node, beside the node's other groups; a replicate group takes one rank of every group,
so it crosses the nodes, beside the ``shard - 1`` other replicate groups on the same links.
"""

from __future__ import annotations

from cost_model.data_parallel_step import DataParallelStep
from cost_model.step_context import StepContext, axis_group
from cost_model.step_contributor import ALL_REDUCE_STREAM, ParameterSharding, StepContributor, fsdp2_stream
from planner.strategy import Mesh

SHARD, REPLICATE = "shard", "replicate"


class ShardGroupView:
    """``context`` as FSDP inside one shard group sees it: ``dp`` is the group's size and a
    collective over ``"dp"`` runs in the group, one over ``"replicate"`` across the groups
    (``StepContext.collective`` over these groups, with a cache of its own); everything else
    is ``context``'s."""

    collective = StepContext.collective

    def __init__(self, context: StepContext, shard: int) -> None:
        self._context = context
        replicate = context.dp // shard
        mesh = Mesh(((REPLICATE, replicate), (SHARD, shard)))
        self.dp = shard
        self.replicate = replicate
        self.groups = {**context.groups, "dp": axis_group(mesh, context.cluster, 1, SHARD),
                       REPLICATE: axis_group(mesh, context.cluster, 1, REPLICATE)}
        self.comm_cache: dict[tuple, float] = {}

    def __getattr__(self, name: str):
        return getattr(self._context, name)


class _TasksView:
    """The task graph being built, its context seen through a ``ShardGroupView``."""

    def __init__(self, tasks, view: ShardGroupView) -> None:
        self._tasks, self.context = tasks, view

    def __getattr__(self, name: str):
        return getattr(self._tasks, name)


class _HybridReduction:
    """One backward pass's reductions: FSDP's reduce-scatter of each unit over its shard
    group, then the all-reduce of the unit's gradient shard over ``replicate``, on FSDP2's
    all-reduce stream (``foreach_reduce``: ``all_reduce_stream.wait_stream(reduce_scatter_stream)``),
    so the next unit's reduce-scatter does not queue behind it (on gloo, blocking:
    ``fsdp2_stream``)."""

    def __init__(self, inner, tasks, device: str, view: ShardGroupView) -> None:
        self.inner, self.tasks, self.device, self.view = inner, tasks, device, view

    def segment_done(self, segment, last: int, final: bool, deferred, sync_after: dict[str, list[int]]) -> None:
        if deferred is not None:  # reductions held until backward ends: pipelines, which HSDP plans have not
            raise ValueError("HSDP reduces gradients as each unit's backward ends; a plan that defers them is not HSDP")
        scattered: dict[str, list[int]] = {}
        self.inner.segment_done(segment, last, final, None, scattered)
        view = self.view
        shard_bytes = sum(segment.params[name] for name in segment.dp_synced) * view.reduced_gradient_bytes() / view.dp
        for task in scattered.get(self.device, []):
            seconds = view.collective("all_reduce", shard_bytes, REPLICATE)
            stream = (self.device, fsdp2_stream(view, ALL_REDUCE_STREAM))
            sync_after.setdefault(self.device, []).append(self.tasks.graph.add(
                f"all-reduce grad shard over replicate ({segment.name})", stream, seconds, deps=[task], kind="comm",
            ))


class HybridShardingStep(StepContributor):
    """The costs part of the ``hsdp`` family (``planner.families``): on a plan with a
    ``"hsdp"`` section it takes the data-parallel contributor's place (``takes_over``) and
    runs it over the shard group, adding the all-reduces across groups (module docstring)."""

    takes_over = (DataParallelStep,)

    def __init__(self) -> None:
        self.inner = DataParallelStep()
        self._last: ShardGroupView | None = None

    def _view(self, context: StepContext) -> ShardGroupView:
        # The view of the plan being simulated (its collective times memoised in it): built
        # once per context and not kept beyond the next one, which would hold every graph.
        if self._last is None or self._last._context is not context:
            self._last = ShardGroupView(context, context.plan.sections["hsdp"].shard)
        return self._last

    def reduces_every_micro_batch(self, context) -> bool:
        return self.inner.reduces_every_micro_batch(self._view(context))

    def gathers_every_pass(self, context) -> bool:
        return self.inner.gathers_every_pass(self._view(context))

    def forward_gather(self, tasks, device, segment, issue_after):
        return self.inner.forward_gather(_TasksView(tasks, self._view(tasks.context)), device, segment, issue_after)

    def backward_gather(self, tasks, device, segment, issue_after):
        return self.inner.backward_gather(_TasksView(tasks, self._view(tasks.context)), device, segment, issue_after)

    def copy_out(self, tasks, device, segment, backward, gathered):
        return self.inner.copy_out(_TasksView(tasks, self._view(tasks.context)), device, segment, backward, gathered)

    def gradient_reduction(self, tasks, device, sync):
        view = self._view(tasks.context)
        inner = self.inner.gradient_reduction(_TasksView(tasks, view), device, sync)
        return None if inner is None else _HybridReduction(inner, tasks, device, view)

    def after_optimizer(self, tasks, device, segments, step) -> None:
        self.inner.after_optimizer(_TasksView(tasks, self._view(tasks.context)), device, segments, step)

    def parameter_sharding(self, context) -> ParameterSharding | None:
        return self.inner.parameter_sharding(self._view(context))

    def communication_buffer_bytes(self, context, segments, elements, weight_bytes, gradient_bytes) -> float:
        return self.inner.communication_buffer_bytes(self._view(context), segments, elements, weight_bytes,
                                                     gradient_bytes)

    def add_axis_bytes(self, context, segment, totals: dict[str, float]) -> None:
        """FSDP's traffic inside the group, and the all-reduce of each gradient shard across
        the groups (a ring all-reduce sends 2 (r - 1) / r of its size), both on ``dp``'s ranks."""
        view = self._view(context)
        self.inner.add_axis_bytes(view, segment, totals)
        if not segment.dp_synced:
            return
        reductions = context.micro_batches if self.reduces_every_micro_batch(context) else 1
        shard_bytes = sum(segment.params[n] for n in segment.dp_synced) * context.reduced_gradient_bytes() / view.dp
        totals["dp"] = totals.get("dp", 0.0) + reductions * shard_bytes * 2 * (view.replicate - 1) / view.replicate
