"""Adasum's part of a simulated step (cost-model layer): DDP's buckets, each combined by
Adasum in place of its ring all-reduce.

What the compiled hook (``planner.families.adasum.runtime.adasum_hook``) does to one bucket
of ``S`` bytes over ``c = dp / local`` node copies, and what it is priced as:

1. ``local > 1``: an all-reduce of the bucket over the node's ``local`` ranks (averaged);
2. log2(c) swaps: at distance 1, 2, 4, ... node copies each rank sends its whole bucket to
   its partner and receives the partner's (one ``send_recv`` of ``S`` bytes each way; the
   ``local`` ranks of a node swap at once, sharing the node's network, so the exchange is
   priced with ``local`` concurrent pairs);
3. after each swap, per tensor, three dot products (g1.g2, |g1|^2, |g2|^2: ``4 S`` bytes
   read) and the combination (``first * a``: ``S`` read, ``S`` written; ``+= b * second``:
   ``2 S`` read, ``S`` written): memory-bound work of ``9 S`` bytes and ``9`` flops per
   element at the device's roofline (``cost_model.compute.roofline_time``).

The hook runs in the thread that runs backward and waits for each swap before combining
(a blocking ``recv``), so its time is priced on the compute stream: backward of the next
bucket's layers waits for it. It is not a speed-up and never overlaps like DDP's
all-reduces; that is its price for a combination that converges better at large batches.

Horovod's own implementation halves the vector at each level (recursive halving, then an
all-gather), sending less; the program here swaps whole buckets, so that is what is priced.
"""

from __future__ import annotations

import math

from cost_model.collectives import collective_time
from cost_model.compute import PRECISIONS, roofline_time
from cost_model.data_parallel_step import DataParallelStep, GradientBuckets
from cost_model.parameter_bytes import PARAM_BYTES
from cost_model.step_contributor import ParameterSharding, StepContributor

# Flops per gradient element and level: 3 dot products (a multiply and an add each: 6) and the
# combination a*g1 + b*g2 (a multiply, then a multiply-add: 3); bytes, in buffers of the
# bucket's size: the dots read g1 and g2 twice (4), the combination reads 3 and writes 2 (5)
# (runtime.adasum_pair, op by op).
COMBINE_FLOPS_PER_ELEMENT = 9
COMBINE_BUFFER_PASSES = 9


def adasum_bucket_seconds(cluster, device, dp_ranks: list[int], local: int, size_bytes: float, precision: str,
                          gradient_bytes: int | None = None) -> float:
    """Seconds of the hook on one bucket of ``size_bytes`` over ``dp_ranks`` of ``cluster``
    (groups of ``local`` consecutive ranks share a node; ``device`` combines): the node all-reduce, then log2(copies) swaps
    and combinations (module docstring). ``gradient_bytes``: bytes of one gradient element
    (``StepContext.reduced_gradient_bytes``: fp32 in a bf16 program), by default the precision's."""
    copies = len(dp_ranks) // local
    seconds = collective_time("all_reduce", size_bytes, cluster, dp_ranks[:local]) if local > 1 else 0.0
    dtype = PRECISIONS[precision][0]
    elements = size_bytes / (gradient_bytes or PARAM_BYTES[precision][1])
    combine = roofline_time(COMBINE_FLOPS_PER_ELEMENT * elements, COMBINE_BUFFER_PASSES * size_bytes, device, dtype)
    distance = 1
    while distance < copies:
        pair = [dp_ranks[0], dp_ranks[distance * local]]
        seconds += collective_time("send_recv", size_bytes, cluster, pair, local) + combine
        distance *= 2
    return seconds


class _AdasumReduction:
    """One backward pass's Adasum: DDP's buckets as they fill, each hooked (module docstring)."""

    def __init__(self, tasks, device: str, local: int) -> None:
        self.tasks, self.device, self.local = tasks, device, local
        self.buckets = GradientBuckets()

    def segment_done(self, segment, last: int, final: bool, deferred, sync_after: dict[str, list[int]]) -> None:
        if deferred is not None:
            raise ValueError("Adasum combines each DDP bucket as backward fills it; a plan that defers it is not Adasum")
        context = self.tasks.context
        grads = sum(segment.params[name] for name in segment.dp_synced) * context.reduced_gradient_bytes()
        ready = self.buckets.fill(grads, per_unit=False, flush=final)
        if not ready:
            return
        ranks = list(range(context.dp))
        pieces = [(adasum_bucket_seconds(context.cluster, context.device, ranks, self.local, size, context.plan.precision,
                                         context.reduced_gradient_bytes()), count)
                  for size, count in ready]
        count = sum(count for _, count in ready)
        sync_after.setdefault(self.device, []).append(self.tasks.graph.add_pieces(
            f"adasum grads ({segment.name}{f', {count} buckets' if count > 1 else ''})", (self.device, "compute"),
            pieces, deps=[last], kind="comm",
        ))


class AdasumStep(StepContributor):
    """The costs part of the ``adasum`` family (``planner.families``): on a plan with an
    ``"adasum"`` section it takes the data-parallel contributor's place (``takes_over``):
    DDP's weights and memory, its buckets combined by Adasum (module docstring)."""

    takes_over = (DataParallelStep,)

    def __init__(self) -> None:
        self.inner = DataParallelStep()

    def gradient_reduction(self, tasks, device: str, sync: bool) -> _AdasumReduction | None:
        if tasks.context.dp == 1 or not sync:
            return None
        return _AdasumReduction(tasks, device, tasks.context.plan.sections["adasum"].local)

    def parameter_sharding(self, context) -> ParameterSharding | None:
        return self.inner.parameter_sharding(context)

    def communication_buffer_bytes(self, context, segments, elements, weight_bytes, gradient_bytes) -> float:
        """DDP's bucket, and the partner's copy of it that each swap receives."""
        return 2 * self.inner.communication_buffer_bytes(context, segments, elements, weight_bytes, gradient_bytes)

    def add_axis_bytes(self, context, segment, totals: dict[str, float]) -> None:
        """Bytes each rank sends over ``dp``: its whole gradient once per swap, after the
        node's ring all-reduce (``2 (local - 1) / local`` of it)."""
        if context.dp == 1 or not segment.dp_synced:
            return
        local = context.plan.sections["adasum"].local
        swaps = int(math.log2(context.dp // local))
        grads = sum(segment.params[n] for n in segment.dp_synced) * context.reduced_gradient_bytes()
        totals["dp"] = totals.get("dp", 0.0) + grads * (swaps + 2 * (local - 1) / local)
