"""The data-parallel flavours' part of a simulated step (a ``StepContributor``).

Over the ``dp`` axis, each flavour (``Plan.dp_flavour``) shards and moves the parameters
its own way:

- **DDP**: every rank holds everything; gradients are all-reduced in buckets filled in
  backward order (1 MiB, then 25 MiB: torch DDP's defaults), each bucket's all-reduce starting
  when the segment that fills it finishes its backward.
- **ZeRO-1** (codegen's ``ShardedStatesOptimizer``, for every program): optimizer states
  sharded; gradients all-reduced as DDP's (or a graph program's hooks); each rank steps its
  1/dp slice of every weight (plain-tensor views, so no DTensor dispatch), then all-gathers
  each sliced weight's updated pieces: one all-gather per weight, of its whole local tensor,
  issued one after another (gloo and NCCL alike: synchronous calls). A weight with no
  dimension dp divides (``planner.sharded_states_layout.sliced_dim``) is stepped whole on
  every rank and never gathered.
- **ZeRO-2** (FSDP2 units with ``reshard_after_forward=False``): gradients and states
  sharded; each unit's weights all-gathered before its forward as FSDP's (the units are
  resharded after every backward, so every micro-batch gathers them again) and kept through
  backward; gradients reduce-scattered per unit after every micro-batch.
- **FSDP** (FSDP2): weights, gradients and states sharded; each unit's weights all-gathered
  before its forward and, what was freed, again before its backward; gradients
  reduce-scattered per unit.

How FSDP2 orders these (torch/distributed/fsdp/_fully_shard/ at pytorch commit 002a76f), and
the model of it here and in ``cost_model.step_tasks``:

- Streams (``FSDPCommContext.lazy_init`` in _fsdp_param_group.py): all-gathers on an
  all-gather stream (their copy-in on a copy-in stream), reduce-scatters on a reduce-scatter
  stream, HSDP's all-reduces on an all-reduce stream. Modelled: gathers on ``GATHER_STREAM``,
  reductions on ``REDUCE_STREAM``, HSDP's all-reduces on ``ALL_REDUCE_STREAM``: a gather never
  queues behind a reduce-scatter.
- Forward prefetch (implicit): ``FSDPParamGroup.pre_forward`` issues the unit's own
  ``unshard``, which the host reaches while the previous unit still computes; in
  ``wait_for_unshard`` the gather streams wait for the copy-out of the unit before it
  (``_wait_all_gather_streams_on_event``, the deferred free of
  [Note: Overlapping all-gather copy-in and all-gather]). Modelled as depth 1: a unit's gather
  may start once the unit two before it has finished its forward, so it overlaps the previous
  unit's forward (``step_tasks.prefetch_after``). With the host far ahead, FSDP2 lets the
  gather start one unit earlier still (holding a third unit's gather output); the model does
  not, and its memory counts two gathered units.
- Backward prefetch (explicit, default): ``pre_backward`` gathers the unit (a no-op if
  prefetched), waits for it (the gather streams then wait for its copy-out) and
  ``_backward_prefetch`` issues the gather of the next unit in reverse post-forward order:
  depth 1, the same rule. The first unit of backward is gathered as soon as autograd
  reaches it, behind the forward's gathers.
- ``reshard_after_forward``: FSDP (True) frees a unit's gathered weights after its forward
  and gathers them again in backward; ZeRO-2 (False) keeps them until its backward. The
  root is not resharded after forward (``fsdp_root_elements``).
- Reduce-scatter (``foreach_reduce`` in _fsdp_collectives.py): after each unit's backward,
  on the reduce-scatter stream, in the reduce dtype (``MixedPrecisionPolicy.reduce_dtype``:
  fp32 in a bf16 program, as torchtitan sets it; ``StepContext.reduced_gradient_bytes``);
  its all-gathers in the parameter dtype (bf16 under the policy:
  ``cost_model.mixed_precision.gathered_weight_bytes``); HSDP's all-reduce waits for the
  reduce-scatter on the all-reduce stream.
- Copies: ``foreach_all_gather_copy_out`` (in ``wait_for_unshard``) copies each gathered
  unit into its parameters on the compute stream before the unit runs: modelled as a
  memory-bound copy (``DataParallelStep.copy_out``); ``foreach_reduce``'s ``_chunk_cat`` of a
  unit's gradients into the reduce-scatter input, cast to the reduce dtype, on the
  reduce-scatter stream before the reduce-scatter (``_reduce_scatter_copy_in``); the copy-in
  of each all-gather's input (this rank's shard, 1/dp of the unit, cast to the gathered dtype)
  on the copy-in stream before the gather (``_gather_copy_in``). Not modelled:
  ``post_backward``'s wait of the compute stream for the previous unit's reduce-scatter
  (one reduce-scatter in flight), which delays compute only when reductions are the
  bottleneck, where the reduce stream sets the step's end anyway.
- On gloo every one of these collectives is issued with ``async_op=False`` and holds the
  host thread that runs the model: they run on the compute stream (``fsdp2_stream``).

On gloo (no reduce-scatter of one tensor) FSDP2 all-reduces the whole gradient and keeps its
shard. A graph program (searched or Megatron layouts) reduces each parameter's gradient in its
own hook, one collective per parameter. Memory: the shardable parameters' weights, gradients
and states divided by ``dp`` as the flavour shards them; FSDP's two gathered units (the one
running and the one prefetched) or DDP's bucket as communication buffers.

ZeRO-1 as Megatron-Core runs it (``Plan.megatron_distributed_optimizer``) reduce-scatters fp32
gradients once per step in Megatron's buckets and gathers the weights during the next forward
(``cost_model.megatron_grad_sync``).

A plan whose flavour is not one of ``FLAVOURS`` gets nothing from this contributor: a flavour
added as a family of its own (hybrid sharding, say) brings its own contributor.
"""

from __future__ import annotations

from functools import partial

from cost_model import defaults
from cost_model.compute import PRECISIONS, roofline_time
from cost_model.megatron_grad_sync import (
    bucket_cap_bytes, bucket_checks_time, runs_megatron_sync, weight_gather, zero_buffer_time,
)
from cost_model.mixed_precision import gathered_weight_bytes, holds_fp32_weights
from cost_model.parameter_bytes import PARAM_BYTES
from cost_model.segments import Segment
from cost_model.step_context import StepContext
from cost_model.step_contributor import GATHER_STREAM, REDUCE_STREAM, ParameterSharding, StepContributor, fsdp2_stream
from planner.strategy import WHOLE_BLOCK_RECOMPUTE

FLAVOURS = ("ddp", "zero1", "zero2", "fsdp")  # what this contributor runs; others have their own
SHARDED_STATES = ("zero1", "zero2", "fsdp")  # flavours that shard the optimizer states over dp
SHARDED_GRADIENTS = ("zero2", "fsdp")
FSDP2_FLAVOURS = ("zero2", "fsdp")  # run by FSDP2: DTensor parameters, per-unit reduce-scatters
GATHER_COPY_IN_STREAM = "all_gather copy-in"  # FSDP2's all-gather copy-in stream (FSDPCommContext)


class GradientBuckets:
    """DDP's gradient buckets, filled in backward order: 1 MiB for the first bucket, then
    25 MiB (torch DDP's ``_DEFAULT_FIRST_BUCKET_BYTES`` and ``bucket_cap_mb``). A bucket's
    all-reduce starts when the segment that fills it finishes its backward (segments are
    the simulator's granularity). FSDP reduce-scatters each unit (segment) on its own."""

    def __init__(self, cap: float | None = None) -> None:
        """``cap``: every bucket's bytes, where the program sizes them all alike (Megatron's
        ``cost_model.megatron_grad_sync.bucket_cap_bytes``); by default DDP's."""
        self.cap = defaults.DDP_FIRST_BUCKET_BYTES if cap is None else cap
        self.next_cap = defaults.DDP_BUCKET_BYTES if cap is None else cap
        self.pending = 0.0

    def fill(self, size: float, per_unit: bool, flush: bool) -> list[tuple[float, int]]:
        """Buckets ready to reduce after adding ``size`` bytes of gradients, as (bucket
        bytes, how many such buckets): a segment of a large model fills thousands of equal
        buckets at once, which are counted rather than listed."""
        if per_unit:
            return [(size, 1)] if size else []
        ready = []
        self.pending += size
        if self.pending >= self.cap and self.cap != self.next_cap:
            ready.append((self.cap, 1))
            self.pending -= self.cap
            self.cap = self.next_cap
        if self.pending >= self.cap:
            full = int(self.pending // self.cap)
            ready.append((self.cap, full))
            self.pending -= full * self.cap
        if flush and self.pending > 0:
            ready.append((self.pending, 1))
            self.pending = 0.0
        return ready


def _fsdp(context: StepContext) -> bool:
    return context.plan.dp_flavour == "fsdp" and context.dp > 1


def _fsdp2(context: StepContext) -> bool:
    """Whether FSDP2 runs the plan's data parallelism (FSDP, or ZeRO-2: FSDP2 units with
    ``reshard_after_forward=False``)."""
    return context.plan.dp_flavour in FSDP2_FLAVOURS and context.dp > 1


def fsdp_root_elements(context: StepContext, segment: Segment) -> float:
    """Local elements of ``segment``'s shardable parameters that FSDP2's root unit holds:
    those under none of ``Plan.fsdp_units`` (all of them when the plan names no units).
    FSDP2 never reshards its root after forward (backward starts right after it), so the
    root's weights are gathered once per micro-batch and the units' twice, in forward and
    again in backward (``codegen.emit``'s FSDP program; counted by
    ``codegen.runtime.comm_audit``)."""
    units = tuple(unit + "." for unit in context.plan.fsdp_units)
    return sum(count for name, count in segment.params.items()
               if name not in segment.per_rank and not name.startswith(units))


def fsdp_regathered_elements(context: StepContext, segment: Segment) -> float:
    """Local elements of ``segment``'s dp-sharded weights that FSDP gathers a second time,
    for backward. A program that wraps modules (``Plan.fsdp_units``: FSDP2 over the model's
    own modules) regathers its units but not its root (``fsdp_root_elements``). A graph
    program (no units) gathers each weight where an op reads it and autograd keeps the
    gathered weight for backward, except in a fully recomputed block, whose replay in
    backward gathers its weights again (``codegen`` compiles FSDP graph programs with full
    recomputation only). A pipeline's stages gather for both passes."""
    shardable = segment.shardable_elements()
    if context.plan.pipeline is not None:
        return shardable
    if context.plan.fsdp_units:
        return shardable - fsdp_root_elements(context, segment)
    return shardable if segment.block and context.plan.recompute_at(segment.stage) in WHOLE_BLOCK_RECOMPUTE else 0.0


def largest_fsdp_unit(context: StepContext, segments: list[Segment]) -> float:
    """Local parameter elements of the largest FSDP unit: a repeated block (a segment),
    or, in a model without blocks whose plan wraps each layer (``Plan.fsdp_units``), the
    largest of those layers and the root's remaining parameters."""
    largest = max((s.shardable_elements() for s in segments), default=0.0)
    units = context.plan.fsdp_units
    if not units or any(s.block for s in segments):
        return largest
    sizes = dict.fromkeys((*units, ""), 0.0)
    for segment in segments:
        for name, count in segment.params.items():
            if name not in segment.per_rank:
                sizes[next((u for u in units if name.startswith(u + ".")), "")] += count
    return max(sizes.values())


def _fsdp_gather(tasks, device: str, segment: Segment, deps: list[int], name: str, elements: float | None = None) -> int:
    """All-gather of ``elements`` of ``segment``'s weights (default: all it shards), after
    FSDP2's copy-in of this rank's shard where a compiled FSDP2 program runs one
    (``_gather_copy_in``)."""
    context = tasks.context
    elements = segment.shardable_elements() if elements is None else elements
    if _copies_in(context):
        deps = [_gather_copy_in(tasks, device, name, elements, deps)]
    size = elements * gathered_weight_bytes(context.plan)
    return tasks.graph.add(name, (device, fsdp2_stream(context, GATHER_STREAM)),
                           context.collective("all_gather", size, "dp"), deps=deps, kind="comm")


def _copies_in(context: StepContext) -> bool:
    """Whether the plan's gathers and reduce-scatters go through FSDP2's copy-ins: a compiled
    FSDP2 program (FSDP, ZeRO-2; not a graph program, which reduces parameter by parameter)
    on NCCL (on gloo they are not priced)."""
    return (context.plan.dp_flavour in FSDP2_FLAVOURS and not context.graph_program
            and context.cluster.backend != "gloo")


def _gather_copy_in(tasks, device: str, name: str, elements: float, deps: list[int]) -> int:
    """FSDP2's copy-in before a unit's all-gather (``foreach_all_gather`` in
    _fsdp_collectives.py: ``torch._foreach_copy_`` of each parameter's local shard into the
    all-gather input, cast to the parameter dtype, on the all-gather copy-in stream, which
    the all-gather stream then waits for): this rank's 1/dp of the ``elements`` read as held
    (fp32 in a bf16 program: ``mixed_precision.holds_fp32_weights``) and written as gathered."""
    context = tasks.context
    held = PARAM_BYTES["fp32"][0] if holds_fp32_weights(context.plan) else PARAM_BYTES[context.plan.precision][0]
    moved = elements / context.dp * (held + gathered_weight_bytes(context.plan))
    seconds = roofline_time(0.0, moved, context.device, PRECISIONS[context.plan.precision][0])
    return tasks.graph.add(f"copy-in {name.removeprefix('all-gather ')}", (device, GATHER_COPY_IN_STREAM),
                           seconds, deps=deps)


def _gradient_sync(tasks, device: str, name: str, buckets: list[tuple[float, int]], after: int) -> int:
    """Data-parallel reduction of the gradient buckets (bytes, count) one segment's
    backward filled, once that backward is done: each bucket is its own collective."""
    context = tasks.context
    sharded = context.plan.dp_flavour in SHARDED_GRADIENTS or runs_megatron_sync(context)
    kind = "reduce_scatter" if sharded else "all_reduce"
    if kind == "reduce_scatter" and context.cluster.backend == "gloo" and not context.graph_program:
        # FSDP2 (FSDP, ZeRO-2) on gloo, which has no reduce-scatter of one tensor, all-reduces
        # the whole gradient and keeps its shard (its profile shows gloo:all_reduce events).
        kind = "all_reduce"
    pieces = [(context.collective(kind, size, "dp"), count) for size, count in buckets]
    count = sum(count for _, count in buckets)
    label = f"{kind.replace('_', '-')} grads ({name}{f', {count} buckets' if count > 1 else ''})"
    fsdp2 = context.plan.dp_flavour in FSDP2_FLAVOURS and not context.graph_program
    stream = fsdp2_stream(context, REDUCE_STREAM) if fsdp2 else REDUCE_STREAM
    deps = [after]
    if kind == "reduce_scatter" and _copies_in(context):
        deps = [_reduce_scatter_copy_in(tasks, device, name, buckets, (device, stream), after)]
    if runs_megatron_sync(context):
        # Megatron's NaN check and 1/dp scaling of each bucket, on the compute stream, before
        # the collective is issued (cost_model.megatron_grad_sync.bucket_checks_time).
        checks = sum(bucket_checks_time(context, size, count) for size, count in buckets)
        deps = [tasks.graph.add(f"check and scale grads ({name}{f', {count} buckets' if count > 1 else ''})",
                                (device, "compute"), checks, deps=[after])]
    return tasks.graph.add_pieces(label, (device, stream), pieces, deps=deps, kind="comm")


def _reduce_scatter_copy_in(tasks, device: str, name: str, buckets: list[tuple[float, int]],
                            stream: tuple[str, str], after: int) -> int:
    """FSDP2's copy-in of a unit's gradients before its reduce-scatter (``foreach_reduce`` in
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: the reduce-scatter stream waits
    for the compute stream, then ``torch._chunk_cat`` writes every unsharded gradient, in the
    parameter dtype, into one reduce-scatter input in the reduce dtype, rank by rank): a
    memory-bound kernel on the reduce-scatter stream, reading each gradient element in the
    parameter dtype (``mixed_precision.gathered_weight_bytes``) and writing it in the reduce
    dtype (``StepContext.reduced_gradient_bytes``). FSDP2 on gloo is not priced with it."""
    context = tasks.context
    reduce_bytes = context.reduced_gradient_bytes()
    elements = sum(size * count for size, count in buckets) / reduce_bytes
    moved = elements * (gathered_weight_bytes(context.plan) + reduce_bytes)
    seconds = roofline_time(0.0, moved, context.device, PRECISIONS[context.plan.precision][0])
    return tasks.graph.add(f"copy-in grads ({name})", stream, seconds, deps=[after])


class _GradientReduction:
    """One backward pass's data-parallel gradient reduction, segment by segment."""

    def __init__(self, tasks, device: str) -> None:
        self.tasks, self.device = tasks, device
        megatron = runs_megatron_sync(tasks.context)
        self.buckets = GradientBuckets(bucket_cap_bytes(tasks.context, int(device.split()[-1])) if megatron else None)
        self.per_parameter = tasks.context.graph_program and not megatron

    def segment_done(self, segment: Segment, last: int, final: bool, deferred: list | None,
                     sync_after: dict[str, list[int]]) -> None:
        """Reduce what ``segment``'s backward (ending with task ``last``) filled."""
        context = self.tasks.context
        element_bytes = context.reduced_gradient_bytes()
        if self.per_parameter:
            # A graph program reduces each parameter's gradient in its own hook
            # (codegen.runtime.spmd): one collective per parameter, no buckets.
            ready = [(segment.params[name] * element_bytes, 1) for name in sorted(segment.dp_synced)
                     if segment.params[name] > 0]
        else:
            grads = sum(segment.params[name] for name in segment.dp_synced) * element_bytes
            ready = self.buckets.fill(grads, per_unit=_fsdp2(context), flush=final)
        if ready and deferred is not None:
            deferred.append(partial(_gradient_sync, self.tasks, self.device, segment.name, ready))
        elif ready:
            # The buckets a segment fills are all ready when its backward ends and run one
            # after another on the collective stream: one task of all of them.
            sync_after.setdefault(self.device, []).append(
                _gradient_sync(self.tasks, self.device, segment.name, ready, last))


class DataParallelStep(StepContributor):
    """The gathers, gradient reductions, sharding and traffic of ``Plan.dp_flavour`` over
    ``dp`` (module docstring)."""

    def reduces_every_micro_batch(self, context: StepContext) -> bool:
        """Whether gradients are reduced over ``dp`` after every micro-batch of an
        accumulating step (no pipeline): FSDP2 (FSDP, ZeRO-2) reduce-scatters each one into
        its sharded gradients, and graph programs (a label: searched or Megatron layouts)
        reduce in each parameter's gradient hook; DDP and Megatron's distributed optimizer
        sync once, after the last."""
        if context.plan.dp_flavour not in FLAVOURS or context.plan.pipeline is not None or context.dp == 1:
            return False
        if runs_megatron_sync(context):
            return False
        return context.plan.dp_flavour in FSDP2_FLAVOURS or bool(context.plan.label)

    def gathers_every_pass(self, context: StepContext) -> bool:
        """FSDP gathers each segment's weights before every pass."""
        return _fsdp(context)

    def forward_gather(self, tasks, device: str, segment: Segment, issue_after: list[int]) -> int | None:
        """FSDP2's gather of the segment's weights (FSDP and ZeRO-2, whose units are resharded
        after every backward), on the gather stream, issued after ``issue_after``
        (``step_tasks.prefetch_after``: once the segment two before it is done, so it
        overlaps the previous segment's forward)."""
        if runs_megatron_sync(tasks.context):
            return weight_gather(tasks, device, segment, issue_after)
        if not _fsdp2(tasks.context):
            return None
        return _fsdp_gather(tasks, device, segment, issue_after, f"all-gather {segment.name}")

    def backward_gather(self, tasks, device: str, segment: Segment, issue_after: list[int]) -> int | None:
        """FSDP gathers again for backward only what it freed after forward
        (``fsdp_regathered_elements``), prefetched as in forward (``forward_gather``)."""
        context = tasks.context
        if not _fsdp(context):
            return None
        regathered = fsdp_regathered_elements(context, segment)
        if regathered <= 0:
            return None
        return _fsdp_gather(tasks, device, segment, issue_after, f"all-gather {segment.name} (bwd)", regathered)

    def copy_out(self, tasks, device: str, segment: Segment, backward: bool, gathered: list[int]) -> int | None:
        """FSDP2's copy-out of a gathered unit (``foreach_all_gather_copy_out`` in
        ``wait_for_unshard``, on the compute stream before the unit runs): the all-gather
        output read and the unsharded parameters written, a memory-bound copy of the
        gathered bytes, once per gather (forward, and backward for what FSDP gathered
        again). A program wraps FSDP2 units unless it is a graph program naming none
        (``Plan.fsdp_units``), which gathers through DTensor and copies nothing more."""
        context = tasks.context
        if not _fsdp2(context) or (context.graph_program and not context.plan.fsdp_units) or not gathered:
            return None
        elements = fsdp_regathered_elements(context, segment) if backward else segment.shardable_elements()
        if backward and not _fsdp(context) or elements <= 0:
            return None
        copied = 2 * elements * gathered_weight_bytes(context.plan)
        seconds = roofline_time(0.0, copied, context.device, PRECISIONS[context.plan.precision][0])
        return tasks.graph.add(f"copy-out {segment.name}{' (bwd)' if backward else ''}", (device, "compute"),
                               seconds, deps=gathered)

    def gradient_reduction(self, tasks, device: str, sync: bool) -> _GradientReduction | None:
        """DDP's buckets, FSDP2's per-unit reduce-scatters or a graph program's per-parameter
        all-reduces over ``dp``, after a micro-batch whose gradients are reduced."""
        if tasks.context.plan.dp_flavour not in FLAVOURS or tasks.context.dp == 1 or not sync:
            return None
        return _GradientReduction(tasks, device)

    def after_optimizer(self, tasks, device: str, segments: list[Segment], step: int) -> None:
        """ZeRO-1's all-gathers of the updated slices, weight by weight (ZeRO-2 gathers its
        updated weights unit by unit in the next forward: ``forward_gather``); under Megatron's
        distributed optimizer, the fill of its fp32 gradient buffer."""
        context = tasks.context
        if context.dp == 1:
            return
        if runs_megatron_sync(context):
            # The next step's ``zero_grad_buffer`` fill of the whole fp32 gradient buffer
            # (cost_model.megatron_grad_sync.zero_buffer_time), after this step's update.
            elements = sum(sum(segment.params.values()) for segment in segments)
            tasks.graph.add("zero fp32 gradient buffer", (device, "compute"), zero_buffer_time(context, elements),
                            deps=[step], kind="optimizer")
        if context.plan.dp_flavour == "zero1" and not runs_megatron_sync(context):
            # ShardedStatesOptimizer.step gathers each sliced weight in its own blocking
            # all_gather_single once the inner step is done: one after another (fp32 slices
            # in a bf16 program: cost_model.mixed_precision).
            element_bytes = gathered_weight_bytes(context.plan)
            pieces = [(context.collective("all_gather", count * element_bytes, "dp"), 1)
                      for s in segments for count in s.zero1_gathered_elements(context.dp)]
            tasks.graph.add_pieces(f"all-gather updated slices ({len(pieces)} parameters)", (device, "collective"),
                                   pieces, deps=[step], kind="comm")

    def parameter_sharding(self, context: StepContext) -> ParameterSharding | None:
        """What the flavour shards over ``dp``: states (ZeRO-1), and gradients (ZeRO-2), and
        weights (FSDP)."""
        flavour, dp = context.plan.dp_flavour, context.dp
        if flavour not in FLAVOURS:
            return None
        sharded = dp > 1 and flavour in SHARDED_STATES
        # Megatron-Core's distributed optimizer cuts its flat, padded gradient buffer into dp
        # equal contiguous ranges whatever the tensor boundaries (``_build_model_gbuf_range``
        # in megatron/core/optimizer/distrib_optimizer.py, core_v0.8.0), so every weight's
        # states are divided by dp; the planner's ZeRO-1 cuts whole pieces of each tensor.
        pieces = sharded and flavour == "zero1" and not runs_megatron_sync(context)
        return ParameterSharding(
            weights=dp if flavour == "fsdp" else 1,
            gradients=dp if flavour in SHARDED_GRADIENTS else 1,
            states=dp if flavour in SHARDED_STATES else 1,
            dtensor_parameters=sharded and flavour != "zero1",
            steps_local_pieces=pieces,
        )

    def communication_buffer_bytes(self, context: StepContext, segments: list[Segment], elements: float,
                                   weight_bytes: float, gradient_bytes: float) -> float:
        """FSDP's two gathered units (running and prefetched), else DDP's bucket."""
        if context.plan.dp_flavour not in FLAVOURS or context.dp == 1:
            return 0.0
        if context.plan.dp_flavour == "fsdp":
            # The unit being used and the next one, prefetched, are gathered at once.
            return 2 * largest_fsdp_unit(context, segments) * weight_bytes
        if runs_megatron_sync(context):
            # Megatron-Core's buckets are views of its gradient and weight buffers, reduced and
            # gathered in place (``_ParamAndGradBuffer._new_bucket`` slices ``grad_data`` and
            # ``param_data``: megatron/core/distributed/param_and_grad_buffer.py, core_v0.8.0).
            return 0.0
        return min(defaults.DDP_BUCKET_BYTES, elements * gradient_bytes)

    def add_axis_bytes(self, context: StepContext, segment: Segment, totals: dict[str, float]) -> None:
        """The bytes the flavour's gathers and reductions of ``segment``'s weights send over ``dp``."""
        if context.plan.dp_flavour not in FLAVOURS or context.dp == 1 or not segment.dp_synced:
            return
        # fsdp: all-gather twice + reduce-scatter; zero1: all-reduce, then its all-gathers
        # of the updated slices (below); ddp: all-reduce; zero2: reduce-scatter + all-gather
        # (in forward). Gradient accumulation (no pipeline) repeats FSDP2's gathers (its units
        # are resharded after every backward) and reduce-scatters for every micro-batch.
        # Gradients move in their reduce dtype, weights in the dtype they are gathered in
        # (cost_model.mixed_precision).
        flavour = context.plan.dp_flavour
        elements = sum(segment.params[n] for n in segment.dp_synced)
        share = (context.dp - 1) / context.dp
        if runs_megatron_sync(context):  # one fp32 reduce-scatter and one gather of every weight
            grads = elements * context.reduced_gradient_bytes()
            gathered = segment.shardable_elements() * PARAM_BYTES[context.plan.precision][0]
            totals["dp"] = totals.get("dp", 0.0) + (grads + gathered) * share
            return
        gradient_bytes, weight_bytes = context.reduced_gradient_bytes(), gathered_weight_bytes(context.plan)
        gathers = context.micro_batches if context.plan.pipeline is None else 1  # FSDP2's, per micro-batch
        reductions = context.micro_batches if self.reduces_every_micro_batch(context) else 1
        reduced = {"fsdp": reductions, "zero2": reductions, "zero1": 2 * reductions, "ddp": 2 * reductions}[flavour]
        weights_gathered = {"fsdp": 2 * gathers, "zero2": gathers}.get(flavour, 0)
        sent = elements * (gradient_bytes * reduced + weight_bytes * weights_gathered)
        if flavour == "zero1":
            sent += sum(segment.zero1_gathered_elements(context.dp)) * weight_bytes
        if flavour == "fsdp":  # what is not gathered again for backward
            sent -= (segment.shardable_elements() - fsdp_regathered_elements(context, segment)) * weight_bytes * gathers
        totals["dp"] = totals.get("dp", 0.0) + sent * share
