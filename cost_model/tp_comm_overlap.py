"""Transformer Engine's overlap of the sequence-parallel collectives with the GEMMs beside
them (Megatron-LM's ``--tp-comm-overlap``), for plans that set ``Plan.tp_comm_overlap``.

What runs (Transformer Engine 1.9-1.10, the releases Megatron-Core r0.8.0 calls
``initialize_ub(shape, tp_size, ...)`` in; Megatron-LM ``megatron/training/initialize.py``
``_initialize_tp_communicators`` passes ``ub_cfgs = {}`` unless ``--tp-comm-overlap-cfg``
names a file, so TE's defaults apply). ``transformer_engine/pytorch/module/base.py``
``initialize_ub`` gives each GEMM of a transformer layer a method (``methods``) and
``get_default_config`` its settings:

  * ``ring_exchange`` (``qkv_fprop``, ``fc1_fprop``, ``proj_dgrad``, ``fc2_dgrad``): an
    all-gather fused into the GEMM that reads it, ``num_splits = tp_size``, the transfers
    on the copy engines (``use_ce``), ``num_sm`` 1. ``split_overlap_ag`` in
    ``csrc/comm_gemm_overlap.h``: step ``i`` of ``tp`` multiplies the chunk a rank holds
    while it sends that chunk to the next rank and receives the next one; step ``i + 1``
    waits for the receive. With ``g = G / tp`` per GEMM chunk and ``p = C / (tp - 1)`` per
    transfer (the ring all-gather's ``tp - 1`` steps, ``C`` the whole all-gather), the GEMM
    ends at ``g + (tp - 1) max(g, p)``: exposed ``(tp - 1) max(0, p - g)``. The copy engines
    take no SMs, so the GEMM runs at its own speed.
  * ``pipeline`` (``proj_fprop``, ``fc2_fprop``): a reduce-scatter after the row-parallel
    GEMM, ``num_splits`` 4, ``num_sm`` 16. ``split_overlap_rs`` (``gemm_overlap`` False,
    as ``cpp_extensions/gemm.py`` passes it): GEMM chunk ``i``, then the reduce-scatter of
    its output on the communication stream, in order; the last chunk's reduce-scatter runs
    after the last GEMM chunk (exposed). With ``c`` one chunk's reduce-scatter (a quarter
    of the bytes) and ``g = G / 4``, each later GEMM chunk runs beside the previous chunk's
    reduce-scatter: ``max(c, g + (1 - share) c)``, where ``share`` is the fraction of the SMs
    the GEMM keeps while the communication kernel holds its 16 (``set_sm_margin`` False: the
    GEMM is launched on every SM but 16 are busy). Exposed: ``c + 3 max(c - g, (1 - share) c)``.
  * ``bulk`` (``qkv_dgrad``/``fc1_dgrad``: the all-gather of the layer-norm output that
    the weight gradient needs, beside the data-gradient GEMM; ``qkv_wgrad``/``fc1_wgrad``:
    the reduce-scatter of that data gradient, beside the weight-gradient GEMM): one
    collective on 16 SMs started with the GEMM (``bulk_overlap``), the layer waits for both:
    exposed ``max(C - G, (1 - share) C)``.

Megatron-Core saves a column-parallel layer's input as each rank's sequence slice and
gathers it again in backward (TE ``module/layernorm_linear.py``: with ``ub_bulk_dgrad`` the
backward copies ``ln_out`` into the userbuffer and all-gathers it; without TE, Megatron-LM's
``megatron/core/tensor_parallel/layers.py`` ``LinearWithGradAccumulationAndAsyncCommunication``
does the same with ``_all_gather_base(..., async_op=True)``): two all-gathers per layer that
the planner's own programs do not run (DTensor keeps the gathered input), priced here as the
bulk all-gathers above. Per layer and micro-batch that is Korthikanti et al.'s 4 all-gathers
and 4 reduce-scatters of ``s b h`` elements, plus these 2 re-gathers.

Not modelled: the LM head and the embedding (Megatron-Core's ``output_layer`` is a
``tensor_parallel.ColumnParallelLinear``, ``megatron/core/models/gpt/gpt_model.py``, and the
embedding vocabulary parallel: not TE modules, their collectives stay exposed as without the
setting); userbuffers' own kernels are priced as the NCCL curve of the same collective
(``cost_model.collectives``; TE documents no figure for them); a linear's backward is taken as
half data gradient, half weight gradient (equal FLOPs); what the copy engines' transfers take
from the GEMM's memory bandwidth. TE documents no figure for the slowdown of a GEMM beside a
userbuffers kernel; taking it as the share of SMs the kernel holds is this module's model.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Shard

from planner.cluster import DeviceSpec

# transformer_engine/pytorch/module/base.py, initialize_ub.get_default_config (v1.9):
# "num_splits": 4 if method == "pipeline", "num_sm": 16 unless method == "ring_exchange".
TE_PIPELINE_SPLITS = 4
TE_COMM_SMS = 16
# Streaming multiprocessors per GPU: NVIDIA H100 Tensor Core GPU Architecture whitepaper
# (2022), "H100 SXM5: 132 SMs"; NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020),
# "108 SMs"; V100 whitepaper (2017), "80 SMs".
STREAMING_MULTIPROCESSORS = {"H100": 132, "A100": 108, "V100": 80}
_MATMULS_WITH_WEIGHT = ("aten.linear.", "aten.addmm.", "aten.mm.", "aten.matmul.")


def ring_exchange_exposed(gemm_s: float, gather_s: float, ranks: int) -> float:
    """Seconds a ring-exchange all-gather fused into a GEMM adds to it (module docstring):
    ``(ranks - 1) max(0, gather_s / (ranks - 1) - gemm_s / ranks)``."""
    if ranks < 2:
        return 0.0
    return (ranks - 1) * max(0.0, gather_s / (ranks - 1) - gemm_s / ranks)


def pipelined_exposed(gemm_s: float, chunk_s: float, splits: int, gemm_share: float) -> float:
    """Seconds a reduce-scatter pipelined after a GEMM in ``splits`` chunks (``chunk_s``
    each) adds to it: ``chunk_s + (splits - 1) max(chunk_s - g, (1 - gemm_share) chunk_s)``."""
    chunk_gemm = gemm_s / splits
    return chunk_s + (splits - 1) * max(chunk_s - chunk_gemm, (1.0 - gemm_share) * chunk_s)


def bulk_exposed(gemm_s: float, collective_s: float, gemm_share: float) -> float:
    """Seconds a collective started beside a GEMM adds to it:
    ``max(collective_s - gemm_s, (1 - gemm_share) collective_s)``."""
    return max(collective_s - gemm_s, (1.0 - gemm_share) * collective_s)


def gemm_share(device: DeviceSpec) -> float:
    """Fraction of the SMs a GEMM keeps while a userbuffers kernel holds ``TE_COMM_SMS``;
    1 for a device whose SM count is not known (nothing taken)."""
    sms = next((count for family, count in STREAMING_MULTIPROCESSORS.items() if family in device.name), None)
    return (sms - TE_COMM_SMS) / sms if sms else 1.0


@dataclass(frozen=True)
class EdgeOverlap:
    """How the collectives of one sequence-parallel edge overlap GEMMs.

    ``forward_method`` (``"ring_exchange"`` or ``"pipeline"``) hides the forward collective
    behind ``forward_gemm_s``; ``backward_method`` (``"bulk"`` or ``"ring_exchange"``) the
    gradient's behind ``backward_gemm_s``; ``regather_gemm_s`` > 0 when the edge's input is
    gathered again in backward beside that data-gradient GEMM (a column-parallel input)."""

    forward_method: str
    forward_gemm_s: float
    backward_method: str
    backward_gemm_s: float
    regather_gemm_s: float = 0.0

    def exposed(self, kind: str, backward: bool, size_bytes: float, whole_s: float, context, axis: str) -> float:
        """Seconds of the ``kind`` collective (``whole_s`` if run alone) left on the critical path."""
        method, gemm = (self.backward_method, self.backward_gemm_s) if backward else (self.forward_method, self.forward_gemm_s)
        share = gemm_share(context.device)
        if method == "ring_exchange":
            return ring_exchange_exposed(gemm, whole_s, context.mesh.axis_size(axis))
        if method == "pipeline":
            chunk = context.collective(kind, size_bytes / TE_PIPELINE_SPLITS, axis)
            return pipelined_exposed(gemm, chunk, TE_PIPELINE_SPLITS, share)
        return bulk_exposed(gemm, whole_s, share)


def _is_tp_split_matmul(node, strategy, tp_index: int) -> bool:
    """A matmul whose weight is split on the tensor-parallel axis (column or row parallel)."""
    if node is None or strategy is None or not node.op.startswith(_MATMULS_WITH_WEIGHT):
        return False
    return any(isinstance(p[tp_index], Shard) for p in strategy.params.values())


def edge_overlap(context, node, strategy, producer, producer_strategy, kind: str,
                 node_times: tuple[float, float], producer_times: tuple[float, float]) -> EdgeOverlap | None:
    """The overlap of a ``kind`` forward collective on ``tp`` from ``producer`` to ``node``
    inside a block, or None where Transformer Engine runs it alone:

    * an all-gather read by a column-parallel matmul (``qkv``/``fc1``): ring exchange with
      its forward GEMM; the gradient's reduce-scatter beside its weight-gradient GEMM and the
      input's re-gather beside its data-gradient GEMM (bulk);
    * a reduce-scatter of a row-parallel matmul's partial sums (``proj``/``fc2``):
      pipelined after that GEMM; the gradient's all-gather by ring exchange with its
      data-gradient GEMM.

    ``node_times`` and ``producer_times`` are the two ops' (forward, backward) seconds."""
    if node.block is None or "tp" not in context.mesh.names:
        return None
    tp_index = context.mesh.names.index("tp")
    if kind == "all_gather" and _is_tp_split_matmul(node, strategy, tp_index):
        forward, backward = node_times
        return EdgeOverlap("ring_exchange", forward, "bulk", backward / 2, regather_gemm_s=backward / 2)
    if kind == "reduce_scatter" and producer is not None and producer.block == node.block \
            and _is_tp_split_matmul(producer, producer_strategy, tp_index):
        forward, backward = producer_times
        return EdgeOverlap("pipeline", forward, "ring_exchange", backward / 2)
    return None


def regather_exposed(overlap: EdgeOverlap, gather_s: float, context) -> float:
    """Seconds the backward re-gather of a column-parallel input (``gather_s`` alone) adds
    beside the data-gradient GEMM (bulk)."""
    return bulk_exposed(overlap.regather_gemm_s, gather_s, gemm_share(context.device))
