"""One MoE layer's forward of one micro-batch run beside its backward of another, the
all-to-alls of each hidden under the other's compute: Megatron-Core's EP overlap
(``--overlap-moe-expert-parallel-comm``, the "combined 1F1B" schedule) and the overlapped
forward-and-backward chunk of DeepSeek-V3's DualPipe (DeepSeek-V3 technical report,
arXiv 2412.19437, section 3.2.1, figure 4).

A layer's forward is four parts in a chain: attention (compute), dispatch (all-to-all),
experts (compute), combine (all-to-all); its backward the reverse chain: combine, experts,
dispatch, attention. The two micro-batches share no data, so their parts run on two streams
(compute, communication), each stream in the order the host issues them. Megatron-Core
issues (``TransformerLayerSchedulePlan.run`` in
``megatron/core/models/common/model_chunk_schedule_plan.py``, NVIDIA/Megatron-LM at
d7bf5aaaa8, 2025-08-26, the commit that brought the overlap to the interleaved pipeline):

    backward combine, forward attention, backward experts' data gradients, forward
    dispatch, backward experts' weight gradients, backward dispatch, forward experts,
    forward combine, backward attention

Each part waits for the part issued before it on its own stream and, through the one CUDA
event its micro-batch's parts share (``stream_acquire_context`` in
megatron/core/pipeline_parallel/utils.py), for the part before it in its own chain; the
experts' weight gradients (``--delay-wgrad-compute``, which the model zoo's ``A2A_OVERLAP=1``
sets with the overlap: sbatch_benchmarking.sh) are issued by ``backward_dw`` outside that
event, so the backward dispatch waits only for the data gradients and runs under the weight
gradients and the forward experts. Data and weight gradients of a matmul are two GEMMs of
the same FLOPs (2MNK each), so each is half the experts' backward.

What the overlap costs: the exchange's kernels run on SMs the GEMMs beside them lose. DeepEP's
normal kernels take ``DEEPEP_NORMAL_KERNEL_SMS`` of the device's SMs, so compute running beside
them progresses at (SMs - 20) / SMs (on an H100, 112 of 132); NCCL's all-to-all takes its
channels' SMs and memory traffic, ``cost_model.nccl.OVERLAP_COMPUTE_SLOWDOWN`` (a compute
kernel 18.9% slower while a collective runs). ``overlapped_timeline`` replays the issue order
on two streams with that slowdown; ``exposed_communication`` is what the pair takes beyond
its compute run alone: the all-to-alls the compute does not hide and the compute slowed
under those it does. Without the overlap nothing computes beside an exchange (the experts
wait for the dispatch, the next layer for the combine), so the exchange's SMs cost nothing
there.

Which passes pair (``overlapped_pairs``): without a pipeline every micro-batch's forward but
the first beside the previous one's backward; in the interleaved pipeline only the steady
state's, after one warm-up chunk forward more than the plain interleaved schedule runs (the
warm-up and cool-down chunk passes run alone).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.fused_chains import chain_kernels, chain_op_times
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

    def part(self, name: str) -> float:
        """Seconds of ``name``: a field, or half the experts for ``expert_dgrad`` and
        ``expert_wgrad`` (a matmul's data and weight gradients: two GEMMs of equal FLOPs)."""
        if name in ("expert_dgrad", "expert_wgrad"):
            return self.experts / 2
        return getattr(self, name)


# DeepEP's normal (high-throughput) kernels run on 20 SMs: ``Buffer.num_sms = 20``
# (deepseek-ai/DeepEP deep_ep/buffer.py at 04b06f7a: V1's ``Buffer``, the one Megatron-Core's
# fused_a2a.py drives; the README of its later V2 notes "for V3-like legacy training, SM
# usage reduced from 24 to 4 - 6", so V1 took 20-24).
# Megatron-Core sets it from ``--moe-deepep-num-sms``, default 20 (``moe_deepep_num_sms`` in
# megatron/core/transformer/transformer_config.py at d7bf5aaaa8, passed to
# ``Buffer.set_num_sms`` by fused_a2a.py's ``set_deepep_num_sms``); the model zoo's Qwen3
# configuration does not set it (model_configs/benchmarking/Qwen3-235B-A22B.yaml at 8017e1120).
# DeepSeek-V3's own kernels took as many: 20 of an H800's 132 SMs in 10 communication channels
# (DeepSeek-V3 technical report, arXiv 2412.19437, section 3.2.2).
DEEPEP_NORMAL_KERNEL_SMS = 20

# (direction, part, stream, chained) in the order Megatron-Core issues them (module
# docstring); ``chained``: the part waits for, and is waited on by, its micro-batch's chain.
_ISSUE_ORDER = (
    ("backward", "combine", "comm", True),
    ("forward", "attention", "compute", True),
    ("backward", "expert_dgrad", "compute", True),
    ("forward", "dispatch", "comm", True),
    ("backward", "expert_wgrad", "compute", False),
    ("backward", "dispatch", "comm", True),
    ("forward", "experts", "compute", True),
    ("forward", "combine", "comm", True),
    ("backward", "attention", "compute", True),
)


def exchange_compute_slowdown(all_to_all: str, sms: int | None, nccl_slowdown: float) -> float:
    """Fraction by which compute slows while an MoE exchange runs beside it: DeepEP's
    (``all_to_all`` "deduplicated") takes ``DEEPEP_NORMAL_KERNEL_SMS`` of the device's ``sms``
    (the rest run the compute: 20 of 132 on an H100 leave 112, 132 / 112 - 1 = 0.179 slower);
    NCCL's all-to-all the measured ``nccl_slowdown`` of any collective. No SMs (a CPU), none."""
    if all_to_all == "deduplicated":
        if not sms or sms <= DEEPEP_NORMAL_KERNEL_SMS:
            return 0.0
        return DEEPEP_NORMAL_KERNEL_SMS / (sms - DEEPEP_NORMAL_KERNEL_SMS)
    return nccl_slowdown


def overlapped_timeline(forward: LayerPasses, backward: LayerPasses,
                        slowdown: float = 0.0) -> list[tuple[str, str, float, float]]:
    """``(direction, part, start, end)`` of each part of ``forward`` (one micro-batch) and
    ``backward`` (another) run as Megatron-Core's combined 1F1B runs one layer, in issue
    order; compute beside a running all-to-all progresses at ``1 / (1 + slowdown)`` of its
    speed (``exchange_compute_slowdown``)."""
    parts = [(direction, part, stream, chained, (forward if direction == "forward" else backward).part(part))
             for direction, part, stream, chained in _ISSUE_ORDER]
    queues = {stream: [i for i, p in enumerate(parts) if p[2] == stream] for stream in ("compute", "comm")}
    # The chained part each part waits for: the last chained one of its direction issued before it.
    waits_for: list[int | None] = []
    last_chained: dict[str, int] = {}
    for index, (direction, _, _, chained, _) in enumerate(parts):
        waits_for.append(last_chained.get(direction))
        if chained:
            last_chained[direction] = index
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    left = {i: p[4] for i, p in enumerate(parts)}
    running: dict[str, int] = {}
    now = 0.0
    while len(end) < len(parts):
        for stream, queue in queues.items():
            if stream not in running and queue and (waits_for[queue[0]] is None or waits_for[queue[0]] in end):
                running[stream] = queue.pop(0)
                start[running[stream]] = now
        rate = {"compute": 1.0 / (1.0 + slowdown) if "comm" in running else 1.0, "comm": 1.0}
        step = min(left[index] / rate[stream] for stream, index in running.items())
        now += step
        for stream, index in list(running.items()):
            left[index] -= step * rate[stream]
            if left[index] <= 1e-12 * max(1.0, parts[index][4]):
                end[index] = now
                del running[stream]
    return [(parts[i][0], parts[i][1], start[i], end[i]) for i in range(len(parts))]


def overlapped_layer_time(forward: LayerPasses, backward: LayerPasses, slowdown: float = 0.0) -> float:
    """Seconds from the first part of the pair to the last (``overlapped_timeline``)."""
    return max(end for _, _, _, end in overlapped_timeline(forward, backward, slowdown))


def exposed_communication(forward: LayerPasses, backward: LayerPasses, slowdown: float = 0.0) -> float:
    """Seconds the pair takes beyond both directions' compute run alone: the all-to-alls the
    compute does not hide, and the compute's own slowdown under those it does."""
    return max(0.0, overlapped_layer_time(forward, backward, slowdown) - forward.compute - backward.compute)


def overlapped_pairs(micro_batches: int, stages: int = 1, chunks: int = 1, rank: int = 0) -> tuple[int, int]:
    """(passes, pairs): the chunk forwards a pipeline rank runs in a step (``micro_batches`` x
    ``chunks``), and how many of them run beside another's backward.

    Without a pipeline: all but the first forward, beside the previous micro-batch's backward
    (``combined_1f1b_schedule_for_no_pipelining``, megatron/core/pipeline_parallel/combined_1f1b.py
    at d7bf5aaaa8: the first forward and the last backward run alone). With one (Megatron-Core
    runs the overlap on the interleaved schedule only, ``TransformerConfig.__post_init__``):
    the steady state's, after ``(stages - rank - 1) x 2 + (chunks - 1) x stages`` warm-up chunk
    forwards plus the one more the overlap adds (``get_pp_rank_microbatches`` in
    megatron/core/pipeline_parallel/schedules.py at d7bf5aaaa8: "we schedule one extra
    micro-batch forward step before the 1f1b stages"; the micro-batch group per virtual stage is
    ``stages`` by default, model_parallel_config.py), whose backwards run alone in the cool-down."""
    passes = micro_batches * chunks
    if stages <= 1:
        return passes, max(0, passes - 1)
    warmup = min(passes, (stages - rank - 1) * 2 + (chunks - 1) * stages + 1)
    return passes, passes - warmup


def exposed_share(forward: LayerPasses, backward: LayerPasses, passes: int, pairs: int,
                  slowdown: float = 0.0) -> float:
    """The share of a layer's all-to-all time per step left exposed when the EP overlap runs:
    of ``passes`` forward (and as many backward) passes, ``pairs`` run overlapped and expose
    ``exposed_communication``, the others all of theirs. 1.0 when there is nothing to overlap."""
    total = forward.communication + backward.communication
    if total <= 0.0 or pairs < 1:
        return 1.0
    exposed = pairs * exposed_communication(forward, backward, slowdown) + (passes - pairs) * total
    return exposed / (passes * total)


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
    fused = chain_kernels(context.graph, getattr(context.plan, "fused_chains", ""))  # as the node costs price them
    for node in context.graph.nodes:
        if node.name in layer.nodes or not (node.module == parent or node.module.startswith(parent + ".")):
            continue
        f, b = chain_op_times(node, fused, 1.0 / split, context.device, context.plan.precision)
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
