"""Compressed gradient reduction in a simulated step (cost-model layer): PowerSGD, top-k and
fp32 gradients all-reduced in 16 bits (``half_reduce_work``).

A compressed plan is a ``ddp`` plan whose DDP buckets are reduced by a communication hook
(``planner.families.gradient_compression.section``). ``CompressedDataParallelStep`` takes the
data-parallel contributor's place on such a plan, keeps everything it does (parameters held
whole, DDP's 1 MiB then 25 MiB buckets filled in backward order: ``GradientBuckets``) and
prices each segment's buckets as the hook runs them instead of one all-reduce each:

PowerSGD (torch ``powerSGD_hook``, read at torch 2.13): every gradient of 2 or more
dimensions is viewed as M (n x m) with n its first dimension; it is compressed when
``(n + m) r * min_compression_rate < n m`` (``_should_compress``, ``min_compression_rate``
2 by default), else all-reduced whole with the vectors. Per bucket, in order:

1. encode, in the hook (compute stream): with error feedback M += E (read M and E, write
   M) and a copy of the bucket kept (read, write); P = M Q: ``2 n m r`` FLOPs, M read once;
2. all-reduce of the uncompressed tensors, then of every P (``n r`` elements each);
3. orthogonalise P (Gram-Schmidt or QR: ``2 n r^2`` FLOPs), Q = M^T P (``2 n m r``, M read
   once), in the future's callback;
4. all-reduce of every Q (``m r`` elements each);
5. decode M = P Q^T (``2 n m r``, M written once) and, with error feedback, E = copy - M
   (read two, write one).

Steps 3 and 5 run in the hook's future callbacks, whose kernels interleave with the rest of
backward: they are put on a stream of their own (``COMPRESSION_STREAM``), so they delay
backward only through what waits for them (optimistic: their SM time is not taken from
backward's kernels). Step 1 runs in the hook call, on the compute stream. On gloo the
compiled program waits for each bucket's PowerSGD chain in the hook
(``runtime.powersgd_one_bucket_at_a_time``: nested waits in gloo's workers deadlock), so
there every step of it is on the compute stream: nothing overlaps.

Top-k (``planner.families.gradient_compression.runtime.top_k_hook``): per bucket of
``n`` elements, ``k = ceil(f n)``:

1. encode (compute stream): with error feedback add E (read 2, write 1); ``torch.topk`` of
   |bucket|: a radix select reads the bucket once per 8-bit digit of the 32-bit key, 4 passes
   (PyTorch's multi-block top-k, aten/src/ATen/native/cuda/TensorTopK.cu, ``RADIX_BITS = 8``);
   with error feedback E = bucket with the k sent entries zeroed (read, write);
2. all-gather of every rank's k values and k int32 indices: ``dp k (g + 4)`` bytes gathered;
3. decode (compression stream): zero the bucket (write) and scatter-add the ``dp k``
   entries received (read values and indices, write entries).

Memory: the error-feedback buffers (one per compressed gradient, the bucket's dtype),
PowerSGD's P and Q (kept between steps with warm start) and the bucket copy (one 25 MiB
bucket at a time), besides DDP's own bucket.

The gradients are priced in the dtype the step reduces (``StepContext.reduced_gradient_bytes``)
so compressed and uncompressed plans of one precision compare on the same footing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_model.compute import roofline_time
from cost_model.data_parallel_step import DataParallelStep, GradientBuckets
from cost_model.segments import Segment
from cost_model.step_context import StepContext
from cost_model.step_contributor import REDUCE_STREAM, StepContributor
from planner.families.gradient_compression.section import HALF_REDUCE, POWERSGD, TOP_K, compression_of

COMPRESSION_STREAM = "compression"
MIN_COMPRESSION_RATE = 2  # PowerSGDState's default min_compression_rate (torch powerSGD_hook.py)
TOPK_RADIX_PASSES = 4  # 32-bit keys / 8-bit digits (TensorTopK.cu, RADIX_BITS = 8)
INDEX_BYTES = 4  # int32 indices: top_k_hook casts topk's int64 indices (buckets < 2**31 elements)


@dataclass(frozen=True)
class CompressionWork:
    """What one segment's compressed reduction costs before it is timed.

    Attributes:
        elements: gradient elements of the segment that DDP reduces.
        first_bytes, second_bytes: bytes of the first and second collective (PowerSGD: the
            uncompressed tensors and every P, then every Q; top-k: the all-gathered
            values and indices, then nothing), for the whole segment.
        collective: ``"all_reduce"`` or ``"all_gather"``.
        encode_flops, encode_bytes: work in the hook (compute stream).
        middle_flops, middle_bytes: PowerSGD's orthogonalisation and Q (compression stream).
        decode_flops, decode_bytes: decode and error update (compression stream).
        kept_bytes: error-feedback buffers and factors kept between steps.
    """

    elements: float
    first_bytes: float
    second_bytes: float
    collective: str
    encode_flops: float
    encode_bytes: float
    middle_flops: float
    middle_bytes: float
    decode_flops: float
    decode_bytes: float
    kept_bytes: float


def powersgd_work(segment: Segment, rank: int, error_feedback: bool, warm_start: bool, element_bytes: int) -> CompressionWork:
    """PowerSGD's work on ``segment``'s reduced gradients (module docstring, steps 1-5),
    with gradients of ``element_bytes`` bytes per element."""
    g = element_bytes
    total = uncompressed = ps = qs = 0.0
    flops_pm = flops_orth = compressed = 0.0
    for name in sorted(segment.dp_synced):
        elements = segment.params[name]
        total += elements
        shape = segment.shapes.get(name, ())
        if len(shape) < 2 or shape[0] == 0:
            uncompressed += elements
            continue
        n = shape[0]
        m = elements / n
        r = min(n, m, rank)
        if (n + m) * r * MIN_COMPRESSION_RATE >= n * m:
            uncompressed += elements
            continue
        ps, qs, compressed = ps + n * r, qs + m * r, compressed + elements
        flops_pm += 2 * n * m * r
        flops_orth += 2 * n * r * r
    feedback = 1 if error_feedback else 0
    return CompressionWork(
        elements=total,
        first_bytes=(uncompressed + ps) * g,
        second_bytes=qs * g,
        collective="all_reduce",
        encode_flops=flops_pm,
        encode_bytes=compressed * g * (1 + 5 * feedback) + (ps + qs) * g,
        middle_flops=flops_orth + flops_pm,
        middle_bytes=compressed * g + (ps + qs) * g,
        decode_flops=flops_pm,
        decode_bytes=compressed * g * (1 + 3 * feedback) + (ps + qs) * g,
        kept_bytes=compressed * g * feedback + ((ps + qs) * g if warm_start else 0.0),
    )


def top_k_work(segment: Segment, fraction: float, error_feedback: bool, element_bytes: int, dp: int) -> CompressionWork:
    """Top-k's work on ``segment``'s reduced gradients over ``dp`` ranks (module docstring)."""
    g = element_bytes
    n = sum(segment.params[name] for name in segment.dp_synced)
    k = math.ceil(fraction * n) if n else 0
    feedback = 1 if error_feedback else 0
    entry = g + INDEX_BYTES
    return CompressionWork(
        elements=n,
        first_bytes=dp * k * entry,
        second_bytes=0.0,
        collective="all_gather",
        encode_flops=0.0,
        encode_bytes=n * g * (TOPK_RADIX_PASSES + 5 * feedback) + k * entry,
        middle_flops=0.0,
        middle_bytes=0.0,
        decode_flops=0.0,
        decode_bytes=n * g + dp * k * (entry + g),
        kept_bytes=n * g * feedback,
    )


def half_reduce_work(segment: Segment, element_bytes: int) -> CompressionWork:
    """``fp16_compress_hook``/``bf16_compress_hook`` on ``segment``'s ``element_bytes``-byte
    gradients: cast to 16 bits (read g, write 2 bytes an element), all-reduce the 16-bit
    bucket, cast the average back (read 2, write g) in the future's callback."""
    n = sum(segment.params[name] for name in segment.dp_synced)
    return CompressionWork(
        elements=n, first_bytes=n * 2, second_bytes=0.0, collective="all_reduce",
        encode_flops=0.0, encode_bytes=n * (element_bytes + 2), middle_flops=0.0, middle_bytes=0.0,
        decode_flops=0.0, decode_bytes=n * (2 + element_bytes), kept_bytes=0.0,
    )


def compression_work(context: StepContext, segment: Segment) -> CompressionWork:
    """The work of the plan's compression (its section) on ``segment``."""
    section = compression_of(context.plan)
    g = context.reduced_gradient_bytes()
    if POWERSGD in context.plan.sections:
        return powersgd_work(segment, section.rank, section.error_feedback, section.warm_start, g)
    if TOP_K in context.plan.sections:
        return top_k_work(segment, section.fraction, section.error_feedback, g, context.dp)
    if HALF_REDUCE in context.plan.sections:
        return half_reduce_work(segment, g)
    raise ValueError(f"plan {context.plan.name} has no gradient-compression section")


def _kernel_seconds(context: StepContext, flops: float, moved: float) -> float:
    """Seconds of the hook's kernels doing ``flops`` and moving ``moved`` bytes, in the
    gradients' dtype."""
    if flops <= 0 and moved <= 0:
        return 0.0
    dtype = "float32" if context.reduced_gradient_bytes() == 4 else "bfloat16"
    return roofline_time(flops, moved, context.device, dtype)


class _CompressedReduction:
    """One backward pass's compressed reduction, segment by segment (module docstring)."""

    def __init__(self, tasks, device: str) -> None:
        self.tasks, self.device = tasks, device
        self.buckets = GradientBuckets()
        self.comm_stream = REDUCE_STREAM

    def segment_done(self, segment: Segment, last: int, final: bool, deferred, sync_after: dict[str, list[int]]) -> None:
        if deferred is not None:
            raise ValueError("a compressed plan reduces each bucket as backward fills it; a plan that defers it is not one")
        context, graph, device = self.tasks.context, self.tasks.graph, self.device
        work = compression_work(context, segment)
        ready = self.buckets.fill(work.elements * context.reduced_gradient_bytes(), per_unit=False, flush=final)
        if not ready or work.elements <= 0:
            return
        whole = work.elements * context.reduced_gradient_bytes()
        # PowerSGD on gloo blocks the thread that runs backward (module docstring).
        blocking = context.cluster.backend == "gloo" and POWERSGD in context.plan.sections
        self.comm_stream = "compute" if blocking else REDUCE_STREAM
        callbacks = "compute" if blocking else COMPRESSION_STREAM
        label = f"{segment.name}, {sum(count for _, count in ready)} bucket(s)"
        encode = graph.add(f"compress grads ({label})", (device, "compute"),
                           _kernel_seconds(context, work.encode_flops, work.encode_bytes), deps=[last])
        end = self._collective(work.collective, work.first_bytes / whole, ready, f"{label}", encode)
        if work.second_bytes > 0:
            middle = graph.add(f"orthogonalise P, Q = M^T P ({label})", (device, callbacks),
                               _kernel_seconds(context, work.middle_flops, work.middle_bytes), deps=[end])
            end = self._collective("all_reduce", work.second_bytes / whole, ready, f"Q, {label}", middle)
        decode = graph.add(f"decompress grads ({label})", (device, callbacks),
                           _kernel_seconds(context, work.decode_flops, work.decode_bytes), deps=[end])
        sync_after.setdefault(device, []).append(decode)

    def _collective(self, kind: str, ratio: float, ready, label: str, after: int) -> int:
        """One collective per DDP bucket, each carrying ``ratio`` of its bucket's bytes."""
        context = self.tasks.context
        pieces = [(context.collective(kind, size * ratio, "dp"), count) for size, count in ready]
        return self.tasks.graph.add_pieces(f"{kind.replace('_', '-')} compressed grads ({label})",
                                           (self.device, self.comm_stream), pieces, deps=[after], kind="comm")


class CompressedDataParallelStep(StepContributor):
    """The costs part of the ``powersgd`` and ``top-k`` families (``planner.families``): on
    a plan with either section it takes the data-parallel contributor's place and keeps its
    sharding (none: DDP), but prices the gradient reduction as the hook runs it and adds the
    hook's buffers and traffic (module docstring)."""

    takes_over = (DataParallelStep,)

    def __init__(self) -> None:
        self.inner = DataParallelStep()

    def gradient_reduction(self, tasks, device: str, sync: bool):
        if tasks.context.dp == 1 or not sync:
            return None
        return _CompressedReduction(tasks, device)

    def parameter_sharding(self, context):
        return self.inner.parameter_sharding(context)

    def communication_buffer_bytes(self, context, segments, elements, weight_bytes, gradient_bytes) -> float:
        """DDP's bucket, a copy of one bucket (PowerSGD's ``input_tensor_cp``, top-k's
        selection), and every segment's kept buffers (error feedback, P and Q)."""
        bucket = self.inner.communication_buffer_bytes(context, segments, elements, weight_bytes, gradient_bytes)
        return 2 * bucket + sum(compression_work(context, segment).kept_bytes for segment in segments)

    def add_axis_bytes(self, context, segment, totals: dict[str, float]) -> None:
        """Bytes each rank sends over ``dp``: a ring all-reduce sends ``2 (dp - 1) / dp`` of
        its size, an all-gather ``(dp - 1) / dp`` of what it gathers."""
        if context.dp == 1 or not segment.dp_synced:
            return
        work = compression_work(context, segment)
        dp = context.dp
        factor = 2 * (dp - 1) / dp if work.collective == "all_reduce" else (dp - 1) / dp
        sent = (work.first_bytes + work.second_bytes) * factor
        totals["dp"] = totals.get("dp", 0.0) + sent
