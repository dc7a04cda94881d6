"""Step contributors: where a parallelism family adds its part to the simulated step.

The simulator's core prices ops under their placements (``cost_model.node_costs``), groups
them into segments (``cost_model.segments``), lays the pipeline schedule's passes out as tasks
(``cost_model.step_tasks``) and sums memory (``cost_model.step_memory``). What a family adds
on top (its collectives as tasks, its extra cost on some ops, how it shards weights, gradients
and optimizer states, the bytes it sends) it adds through the hooks of one
``StepContributor``, called with the ``StepContext`` (``cost_model.step_context``) at fixed
points; the scheduler has no branch for any family. The registry
(``cost_model.contributor_registry.step_contributors``) lists the contributors in the order
they are called, which fixes the order of their tasks on a stream.

Hooks (each default adds nothing):

- ``node_cost(context, node, strategy, cost)``: add to one op's ``NodeCost`` (one
  micro-batch on one device). It may read only what ``simulation_cache.costing_key`` covers
  (graph, cluster, mesh, precision, micro-batches, placements, MoE layouts): plans that differ
  elsewhere (dp flavour, recomputation) share their node costs.
- Task graph (``tasks``: the ``StepTasks`` being built, with ``tasks.context``,
  ``tasks.graph``, the ``TaskGraph`` to add to, ``tasks.micro_batch``, the micro-batch whose
  pass is being added, and ``tasks.segments_of(device)``, a device's segments):

  - ``forward_gather(tasks, device, segment, issue_after)`` /
    ``backward_gather(tasks, device, segment, issue_after)``: a task id the segment's pass
    waits for (FSDP's weight gathers), or None. ``issue_after``: the task ids after which
    FSDP2 issues that gather (``step_tasks.prefetch_after``: one unit ahead of the pass).
  - ``copy_out(tasks, device, segment, backward, gathered)``: a task on the compute stream
    that the segment's pass (``backward`` or forward) waits for, itself after ``gathered``
    (the gathers above): FSDP2's copy of the gathered weights into the parameters; or None.
  - ``gradient_reduction(tasks, device, sync)``: per backward pass (``sync``: gradients are
    reduced after this micro-batch), None or an object whose
    ``segment_done(segment, last, final, deferred, sync_after)`` adds the reduction of what
    that segment's backward produced, after task ``last`` (``final``: the pass's last
    segment); it appends the reduction's task id to ``sync_after[device]`` (the optimizer
    step waits for those), or, where ``deferred`` is a list (reductions after the whole
    backward), appends ``launch(after) -> task id`` there instead.
  - ``after_optimizer(tasks, device, segments, step)``: tasks after the optimizer step
    (ZeRO's weight broadcasts).
  - ``reduces_every_micro_batch(context)`` / ``gathers_every_pass(context)``: whether the
    scheduler must give each segment its own backward task after every micro-batch.
- Memory and traffic: ``parameter_sharding(context)`` (the first contributor that returns a
  ``ParameterSharding`` owns the weights, gradients and optimizer states),
  ``communication_buffer_bytes(context, segments, elements, weight_bytes, gradient_bytes)``
  (summed), ``add_axis_bytes(context, segment, totals)`` (adds to one stage's bytes per axis),
  ``rank_memory(context, costs, memory)`` (per rank, where the ranks of a plan without
  pipeline stages hold different amounts: uneven tensor shares; the simulator reports the
  rank closest to its own device's capacity).

Example: a family that all-reduces every segment's gradients over a ``rep`` axis as soon as
that segment's backward has produced them (in each backward whose gradients are reduced),
registered by appending ``ReplicaSync()`` to ``_CONTRIBUTORS`` in the registry (the test
``tests/test_step_contributors.py`` runs it; ``cost_model.data_parallel_step`` is the full
example, the data-parallel flavours)::

    class ReplicaSync(StepContributor):
        def gradient_reduction(self, tasks, device, sync):
            context = tasks.context
            if not sync or "rep" not in context.mesh.names:
                return None
            return _RepReduction(tasks, device)

    class _RepReduction:
        def __init__(self, tasks, device):
            self.tasks, self.device = tasks, device

        def segment_done(self, segment, last, final, deferred, sync_after):
            grads = sum(segment.params.values()) * 2  # bf16 gradients
            seconds = self.tasks.context.collective("all_reduce", grads, "rep")
            sync_after.setdefault(self.device, []).append(self.tasks.graph.add(
                f"all-reduce grads over rep ({segment.name})", (self.device, "collective"), seconds,
                deps=[last], kind="comm"))
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.sharded_states_layout import sliced_dim
# A device's streams besides ``"compute"``, as FSDP2 creates them (``FSDPCommContext.lazy_init``
# in torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py): weight all-gathers on their own
# stream, so a gather never queues behind a gradient reduction; gradient reductions (FSDP2's
# reduce-scatters, DDP's buckets, ...) on ``REDUCE_STREAM``; HSDP's all-reduces of gradient
# shards on a third, beside both.
GATHER_STREAM = "all_gather"
REDUCE_STREAM = "collective"
ALL_REDUCE_STREAM = "all_reduce"


def fsdp2_stream(context, stream: str) -> str:
    """The stream FSDP2 runs a collective of ``stream`` on (``GATHER_STREAM`` or
    ``REDUCE_STREAM``): that one on NCCL; on gloo the compute stream, since FSDP2 issues its
    all-gathers and reduce-scatters with ``async_op=False`` (``foreach_all_gather``,
    ``foreach_reduce``) and a CPU collective so issued holds the thread that runs the model
    until it is done: nothing overlaps them."""
    return "compute" if context.cluster.backend == "gloo" else stream


@dataclass(frozen=True)
class ParameterSharding:
    """How the owner of the parameters splits what each device holds of the shardable ones
    (all but an MoE layout's per-rank experts): the divisors of their weights, gradients and
    optimizer states; whether the parameters are DTensors (FSDP2), so the optimizer's ops pay
    DTensor's dispatch; whether the optimizer steps plain-tensor pieces of the local weights
    instead (ZeRO-1's ``ShardedStatesOptimizer``: a piece of every tensor, never a DTensor,
    even in a graph program whose weights are DTensors). Those pieces are cut only from
    weights with a dimension ``states`` divides (``planner.sharded_states_layout``): the
    others keep whole states (``whole_state_elements``)."""

    weights: int = 1
    gradients: int = 1
    states: int = 1
    dtensor_parameters: bool = False
    steps_local_pieces: bool = False

    def whole_state_elements(self, params: dict[str, float], shapes: dict[str, tuple[int, ...]],
                             per_rank: set[str]) -> float:
        """Elements of the shardable ``params`` (name -> local elements; ``shapes``: their
        local shapes where known) whose optimizer states are not divided by ``states``: under
        ZeRO-1's pieces, the weights with no dimension it divides; otherwise none."""
        if not self.steps_local_pieces:
            return 0.0
        return sum(count for name, count in params.items()
                   if name not in per_rank and name in shapes and sliced_dim(shapes[name], self.states) is None)


class StepContributor:
    """One family's part of a simulated step (module docstring); every hook adds nothing.
    ``takes_over``: the contributor classes this one replaces on the plans it applies to
    (``cost_model.contributor_registry.step_contributors``)."""

    takes_over: tuple[type, ...] = ()

    def node_cost(self, context, node, strategy, cost) -> None:
        """Add to ``cost`` (one micro-batch of ``node`` under ``strategy`` on one device)."""

    def reduces_every_micro_batch(self, context) -> bool:
        """Whether gradients are reduced after every micro-batch, not only the last."""
        return False

    def gathers_every_pass(self, context) -> bool:
        """Whether every backward pass needs a task per segment (gathers before each)."""
        return False

    def forward_gather(self, tasks, device: str, segment, issue_after: list[int]) -> int | None:
        """A task ``segment``'s forward waits for, or None."""
        return None

    def backward_gather(self, tasks, device: str, segment, issue_after: list[int]) -> int | None:
        """A task ``segment``'s backward waits for, or None."""
        return None

    def copy_out(self, tasks, device: str, segment, backward: bool, gathered: list[int]) -> int | None:
        """A compute-stream task ``segment``'s pass waits for after its gathers, or None."""
        return None

    def gradient_reduction(self, tasks, device: str, sync: bool):
        """None, or the reduction of one backward pass's gradients (module docstring)."""
        return None

    def after_optimizer(self, tasks, device: str, segments: list, step: int) -> None:
        """Add the tasks that follow the optimizer step ``step`` on ``device``."""

    def parameter_sharding(self, context) -> ParameterSharding | None:
        """How this contributor shards the parameters, if it owns them."""
        return None

    def communication_buffer_bytes(self, context, segments: list, elements: float, weight_bytes: float,
                                   gradient_bytes: float) -> float:
        """Bytes of buffers this contributor's collectives hold on one device of a stage
        holding ``segments`` (``elements``: their local parameter elements)."""
        return 0.0

    def add_axis_bytes(self, context, segment, totals: dict[str, float]) -> None:
        """Add to ``totals`` (a stage's bytes sent per step, by mesh axis) for ``segment``."""

    def rank_memory(self, context, costs: dict, memory) -> tuple | None:
        """Per rank in rank order, the ``MemoryBreakdown`` of a plan without pipeline stages
        whose ranks hold different amounts, from ``memory`` (the simulator's breakdown of one
        device holding every parameter it reads whole) and ``costs`` (each node's
        ``NodeCost``); None where every rank holds alike."""
        return None


def overriding(contributors, hook: str) -> tuple:
    """The bound ``hook`` methods of those ``contributors`` whose class overrides it: the
    others add nothing, and skipping them keeps the per-segment and per-op loops short."""
    default = getattr(StepContributor, hook)
    return tuple(getattr(contributor, hook) for contributor in contributors
                 if getattr(type(contributor), hook) is not default)
