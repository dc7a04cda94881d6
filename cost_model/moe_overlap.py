"""One MoE layer's forward of one micro-batch run beside its backward of another, the
all-to-alls of each hidden under the other's compute: Megatron-Core's EP overlap
(``--overlap-moe-expert-parallel-comm``, the "combined 1F1B" schedule) and the overlapped
forward-and-backward chunk of DeepSeek-V3's DualPipe (DeepSeek-V3 technical report,
arXiv 2412.19437, section 3.2.1, figure 4).

A layer's forward is four parts in a chain: attention (compute), dispatch (all-to-all),
experts (compute), combine (all-to-all); its backward the reverse chain: combine, experts,
dispatch, attention. The two micro-batches share no data, so their parts run on two streams
(compute, communication), each stream in the order the host issues them. Megatron-Core
issues (``schedule_layer_1f1b`` in ``megatron/core/models/gpt/fine_grained_callables.py``
and its A2A-overlap schedule plan):

    backward combine, forward attention, forward dispatch, backward experts,
    backward dispatch, forward experts, forward combine, backward attention

so the backward's combine runs under the forward's attention, the forward's dispatch under
the backward's experts, the backward's dispatch under the forward's experts, and the
forward's combine under the backward's attention. ``overlapped_layer_time`` replays that
order on two streams and returns when both are done; ``exposed_communication`` is what of
the four all-to-alls the compute does not hide.

Each part waits for the part before it in its own micro-batch's chain and for the part
issued before it on its own stream. The streams do not slow each other here: the contention
of communication kernels with compute is ``cost_model.nccl``'s overlap slowdown, applied by
the simulator to the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.compute import op_times
from planner.expert_layouts import expert_axis_size


@dataclass(frozen=True)
class LayerPasses:
    """Seconds of one MoE layer's parts in one direction (forward or backward) for one
    micro-batch: ``attention`` is the compute before the experts in forward (after them in
    backward): attention, norms, router and the shared expert."""

    attention: float
    dispatch: float
    experts: float
    combine: float

    @property
    def compute(self) -> float:
        return self.attention + self.experts

    @property
    def communication(self) -> float:
        return self.dispatch + self.combine


# (direction, part, stream) in the order Megatron-Core issues them (module docstring).
_ISSUE_ORDER = (
    ("backward", "combine", "comm"),
    ("forward", "attention", "compute"),
    ("forward", "dispatch", "comm"),
    ("backward", "experts", "compute"),
    ("backward", "dispatch", "comm"),
    ("forward", "experts", "compute"),
    ("forward", "combine", "comm"),
    ("backward", "attention", "compute"),
)


def overlapped_timeline(forward: LayerPasses, backward: LayerPasses) -> list[tuple[str, str, float, float]]:
    """``(direction, part, start, end)`` of each part of ``forward`` (one micro-batch) and
    ``backward`` (another) run as Megatron-Core's combined 1F1B runs one layer, in issue order."""
    stream_free = {"compute": 0.0, "comm": 0.0}
    chain_done = {"forward": 0.0, "backward": 0.0}
    timeline = []
    for direction, part, stream in _ISSUE_ORDER:
        duration = getattr(forward if direction == "forward" else backward, part)
        start = max(stream_free[stream], chain_done[direction])
        end = start + duration
        stream_free[stream] = chain_done[direction] = end
        timeline.append((direction, part, start, end))
    return timeline


def overlapped_layer_time(forward: LayerPasses, backward: LayerPasses) -> float:
    """Seconds from the first part of the pair to the last (``overlapped_timeline``)."""
    return max(end for _, _, _, end in overlapped_timeline(forward, backward))


def exposed_communication(forward: LayerPasses, backward: LayerPasses) -> float:
    """Seconds of the pair's all-to-alls the compute does not hide: the overlapped time less
    both directions' compute (never more than the all-to-alls themselves)."""
    return max(0.0, overlapped_layer_time(forward, backward) - forward.compute - backward.compute)


def overlapped_pairs(micro_batches: int) -> int:
    """Forward/backward pairs a device runs overlapped in a step of ``micro_batches``: the
    forward of micro-batch i + 1 beside the backward of micro-batch i, so all but one
    micro-batch's forward and all but one's backward (Megatron-Core's
    ``combined_1f1b_schedule_for_no_pipelining``: the first forward and the last backward
    run alone). One micro-batch, none."""
    return max(0, micro_batches - 1)


def exposed_share(forward: LayerPasses, backward: LayerPasses, micro_batches: int) -> float:
    """The share of a layer's all-to-all time per step left exposed when the EP overlap runs:
    the overlapped pairs expose ``exposed_communication``, the unpaired forward and backward
    all of theirs. 1.0 when there is nothing to overlap."""
    total = forward.communication + backward.communication
    if total <= 0.0 or micro_batches < 2:
        return 1.0
    pairs = overlapped_pairs(micro_batches)
    exposed = pairs * exposed_communication(forward, backward) + (micro_batches - pairs) * total
    return exposed / (micro_batches * total)


def block_compute_s(context, layer) -> tuple[float, float]:
    """(forward, backward) seconds of the compute beside an MoE layer in its block, for one
    micro-batch on one device: every op of the module enclosing the layer (``blocks.3`` for
    ``blocks.3.moe``) that is not the layer's own, its traced work split over the layer's
    ranks and the micro-batches as the routing ops' is (``cost_model.node_costs``). This
    is what hides the other micro-batch's all-to-alls (the "attention" part of
    ``LayerPasses``). A layer at the model's top level has none."""
    parent = layer.block.module.rpartition(".")[0]
    if not parent:
        return 0.0, 0.0
    # The layer's ranks: one axis, or dp x tp for a folded layer (the dense ops split over both).
    split = expert_axis_size(context.mesh, layer.layout.axis) * context.micro_batches
    forward = backward = 0.0
    for node in context.graph.nodes:
        if node.name in layer.nodes or not (node.module == parent or node.module.startswith(parent + ".")):
            continue
        f, b = op_times(node, 1.0 / split, context.device, context.plan.precision)
        forward, backward = forward + f, backward + b
    return forward, backward


def layer_passes(layer, beside: tuple[float, float]) -> tuple[LayerPasses, LayerPasses]:
    """The forward and backward ``LayerPasses`` of a priced MoE layer (``cost_model.
    moe_layers.LaidOutLayer``) with ``beside`` (``block_compute_s``) as its attention part.
    Its dispatch and combine move the same copies, so each is half the direction's
    all-to-all time."""
    cost = layer.cost
    forward = LayerPasses(beside[0], cost.forward_comm_s / 2, cost.forward_compute_s, cost.forward_comm_s / 2)
    backward = LayerPasses(beside[1], cost.backward_comm_s / 2, cost.backward_compute_s, cost.backward_comm_s / 2)
    return forward, backward
