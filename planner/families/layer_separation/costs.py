"""Layer separation's part of a simulated step (cost-model layer).

The simulator runs one device's timeline, with the batch split over all ``W`` ranks of
``dp``. A layer-separation plan (``T`` trunk ranks, ``H`` head ranks) runs, per step:

1. the trunk's forward on a trunk rank, on ``B/T`` samples: each trunk op costs ``W/T``
   times its ``B/W`` cost;
2. the send of the activations at the cut to the head rank: a head rank receives ``B/H``
   samples' activations from its ``T/H`` trunk ranks over its one link, priced as one
   ``send_recv`` of ``B/H x bytes per sample`` (``collective_time``) in forward, and the
   same bytes of their gradients back in backward (on the compute stream: the program's
   sends and receives block);
3. the head's forward and backward on ``B/H`` samples on a head rank, which the trunk rank
   waits for: each head op costs ``W/H`` times its ``B/W`` cost;
4. the trunk's backward (scaled as in 1), its gradients all-reduced in DDP's buckets over
   the ``T`` trunk ranks (ranks ``0..T-1``), overlapped with the rest of its backward;
   the head's gradients all-reduced over the ``H`` head ranks (``T..W-1``; none when
   ``H = 1``) on another stream: they run on the head ranks, beside the trunk's backward.

So the step is one device's timeline with the two groups' work in sequence where they wait
for each other. Memory is the ddp plan's (every weight, gradient and state on the simulated
device, an upper bound: a trunk rank holds the trunk's, a head rank the head's), its saved
activations scaled as the compute is. Ops of the trunk and the head that look alike to the
simulator's cost cache (the same op, shapes and placements) share one cost: in a CNN the
trunk's are 4-D and the head's 2-D, so they do not meet.
"""

from __future__ import annotations

from cost_model.collectives import collective_time
from cost_model.data_parallel_step import DataParallelStep, GradientBuckets
from cost_model.step_contributor import REDUCE_STREAM, ParameterSharding, StepContributor
from planner.families.layer_separation.trunk import Trunk, find_trunk, in_module

HEAD_REDUCE_STREAM = "head_reduce"  # the head ranks' all-reduces, beside the trunk's


def activation_send_seconds(cluster, trunk_ranks: int, head_ranks: int, batch: int, bytes_per_sample: float) -> float:
    """Seconds to move one head rank's ``batch / head_ranks`` samples of activations (or
    their gradients) between it and its trunk ranks: one ``send_recv`` over the head rank's
    link (trunk rank 0 to head rank ``trunk_ranks``)."""
    return collective_time("send_recv", batch / head_ranks * bytes_per_sample, cluster, [0, trunk_ranks])


class _SeparatedReduction:
    """One backward pass's reductions: the trunk's buckets over the trunk ranks, the head's
    over the head ranks (module docstring, 4)."""

    def __init__(self, tasks, device: str, trunk_path: str, trunk_ranks: int, head_ranks: int) -> None:
        self.tasks, self.device, self.path = tasks, device, trunk_path
        self.groups = {"trunk": list(range(trunk_ranks)), "head": list(range(trunk_ranks, trunk_ranks + head_ranks))}
        self.buckets = {"trunk": GradientBuckets(), "head": GradientBuckets()}

    def segment_done(self, segment, last: int, final: bool, deferred, sync_after: dict[str, list[int]]) -> None:
        if deferred is not None:
            raise ValueError("layer separation reduces gradients as backward fills DDP's buckets; none are deferred")
        context = self.tasks.context
        element = context.reduced_gradient_bytes()
        for part, ranks in self.groups.items():
            names = [n for n in segment.dp_synced if (n.startswith(self.path + ".")) == (part == "trunk")]
            ready = self.buckets[part].fill(sum(segment.params[n] for n in names) * element, per_unit=False, flush=final)
            if not ready or len(ranks) < 2:
                continue
            pieces = [(collective_time("all_reduce", size, context.cluster, ranks), count) for size, count in ready]
            stream = REDUCE_STREAM if part == "trunk" else HEAD_REDUCE_STREAM
            sync_after.setdefault(self.device, []).append(self.tasks.graph.add_pieces(
                f"all-reduce {part} grads ({segment.name})", (self.device, stream), pieces, deps=[last], kind="comm"))


class LayerSeparationStep(StepContributor):
    """The costs part of the ``layer-separation`` family (``planner.families``): on a plan
    with a ``"layer-separation"`` section it takes the data-parallel contributor's place
    and prices the module docstring's step."""

    takes_over = (DataParallelStep,)

    def __init__(self) -> None:
        self.inner = DataParallelStep()
        self._last: tuple[object, Trunk | None] | None = None

    def _trunk(self, graph) -> Trunk | None:
        # The trunk of the graph being costed, found once per graph and not kept beyond the
        # next one (holding every graph would hold their memory).
        if self._last is None or self._last[0] is not graph:
            self._last = (graph, find_trunk(graph))
        return self._last[1]

    def node_cost(self, context, node, strategy, cost) -> None:
        """Scale ``node``'s cost from ``B/W`` samples to its group's share, and add the
        activation sends to the trunk's last op."""
        section = context.plan.sections["layer-separation"]
        trunk = self._trunk(context.graph)
        if trunk is None:
            raise ValueError(f"layer separation needs a convolutional trunk; this model has none at {section.trunk!r}")
        world, heads = context.plan.world_size, section.head_ranks
        trunks = world - heads
        inside = in_module(node.module, section.trunk)
        scale = world / trunks if inside else world / heads
        cost.forward_s *= scale
        cost.backward_s *= scale
        cost.saved_bytes *= scale
        if node.name == trunk.last:
            send = activation_send_seconds(context.cluster, trunks, heads, context.plan.batch_size,
                                           trunk.cut_bytes_per_sample)
            cost.forward_comm_s += send
            cost.backward_comm_s += send
            # A trunk rank sends its B/T samples' activations (and receives their gradients).
            sent = context.plan.batch_size / trunks * trunk.cut_bytes_per_sample
            cost.axis_bytes["dp"] = cost.axis_bytes.get("dp", 0.0) + sent

    def gradient_reduction(self, tasks, device: str, sync: bool) -> _SeparatedReduction | None:
        if not sync:
            return None
        section = tasks.context.plan.sections["layer-separation"]
        return _SeparatedReduction(tasks, device, section.trunk, section.trunk_ranks(tasks.context.plan),
                                   section.head_ranks)

    def parameter_sharding(self, context) -> ParameterSharding | None:
        return self.inner.parameter_sharding(context)

    def communication_buffer_bytes(self, context, segments, elements, weight_bytes, gradient_bytes) -> float:
        return self.inner.communication_buffer_bytes(context, segments, elements, weight_bytes, gradient_bytes)

    def add_axis_bytes(self, context, segment, totals: dict[str, float]) -> None:
        """A trunk rank's ring all-reduce of the trunk's gradients over the trunk ranks
        (``2 (T - 1) / T`` of them); the activations it sends are counted with the trunk's
        last op (``node_cost``)."""
        section = context.plan.sections["layer-separation"]
        trunks = section.trunk_ranks(context.plan)
        names = [n for n in segment.dp_synced if n.startswith(section.trunk + ".")]
        grads = sum(segment.params[n] for n in names) * context.reduced_gradient_bytes()
        totals["dp"] = totals.get("dp", 0.0) + grads * 2 * (trunks - 1) / trunks
