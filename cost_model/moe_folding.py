"""What one MoE layer of a folded plan costs: EP x ETP over the ``dp x tp`` ranks.

A folded plan (``planner.families.moe_folding``) runs attention and the dense layers tensor
parallel on ``tp`` and each MoE layer expert parallel over all ``R = dp x tp`` ranks of its
stage, as Megatron-Core's MoE parallel folding does (arXiv 2504.14960). In Megatron's rank
order (``megatron/core/parallel_state.py``: expert-tensor-parallel innermost, then expert
parallel, then expert data parallel) the ``R`` ranks, listed as the mesh orders them
(``folded``: dp-major, tp-minor), form:

- ETP groups of ``ETP`` consecutive ranks (``folded[0:ETP]``), each splitting every expert's
  hidden width (w1 by columns, w2 by rows);
- EP groups of ``EP`` ranks ``ETP`` apart (``folded[0], folded[ETP], ...``), over which the
  experts are placed (``layout.placement``) and the tokens exchanged by all-to-all;
- ``EDP = R / (EP x ETP)`` copies of each EP x ETP block, whose expert gradients are
  all-reduced (expert data parallelism); or, with ``ExpertLayout.sharded_copies``, each
  expert's weights, gradients and optimizer states sharded over its EDP group, gathered
  before each pass and reduce-scattered after each backward, as Megatron-FSDP runs experts
  (``cost_model.moe_layers.copy_shard_costs``, ``expert_data_parallel_groups``).

Per micro-batch of ``T`` tokens (one forward's, over the ``R`` ranks), one pass:

1. Attention layout -> expert layout. Without sequence parallelism the dense part holds each
   dp rank's ``T / dp`` tokens whole on every tp rank; each rank takes its ``T / R`` (a local
   slice, no communication). With sequence parallelism they are already split so.
2. Dispatch and combine: ``cost_model.moe.moe_layer_cost`` over the EP group, which holds
   ``EP x T / R`` tokens (capacity, drops, the busiest device, the all-to-all algorithm).
3. ETP: the rows a rank received are all-gathered over its ETP group (the group's ranks hold
   the same experts), each rank runs its ``1 / ETP`` slice of the experts on the group's
   ``ETP x`` rows, and the partial outputs are reduce-scattered back (Megatron's
   ``gather_from_sequence_parallel_region`` / ``reduce_scatter_to_sequence_parallel_region``
   in ``token_dispatcher.py``). The FLOPs are the same as whole experts on ``1 x`` the rows;
   the weights read are ``1 / ETP``, the activations ``ETP x`` the rows by ``1 / ETP`` the
   hidden width.
4. Expert layout -> attention layout. Without sequence parallelism the ``T / dp`` output
   rows are all-gathered over tp (backward: the input's gradient all-gathered likewise, the
   output's sliced); with it, nothing moves.

Backward runs the same collectives (an all-gather's backward is a reduce-scatter and back),
so each pass pays them once. ``folded_layer_cost`` returns all of it for the busiest device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cost_model import defaults
from cost_model.collectives import collective_time
from cost_model.compute import roofline_time
from cost_model.grouped_gemm import ExpertShape, expert_gemm_launches, expert_gemm_times
from cost_model.moe import MoECost, MoELayer, bmm_rows, element_bytes, moe_layer_cost
from planner.cluster import Cluster
from planner.expert_kernels import BATCHED_MATMUL, TE_GROUPED_GEMM
from planner.strategy import ExpertLayout

# (dtype key of DeviceSpec.peak_flops) of the activations by precision, as cost_model.moe prices them.
_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class FoldedGroups:
    """The first group of each kind among the folded ranks (module docstring), global ranks."""

    ep: tuple[int, ...]
    etp: tuple[int, ...]
    edp: tuple[int, ...]
    tp: tuple[int, ...]


def folded_groups(folded: Sequence[int], tp: int, ep: int, etp: int) -> FoldedGroups:
    """The EP, ETP, EDP and tp groups of rank ``folded[0]``, ``folded`` being the ``dp x tp``
    ranks in mesh order (tp innermost).

    Raises:
        ValueError: ``ep x etp`` does not divide the ranks, or ``tp`` does not.
    """
    ranks = len(folded)
    if ranks % (ep * etp) or ranks % tp:
        raise ValueError(f"EP={ep} x ETP={etp} and tp={tp} must divide the {ranks} folded ranks")
    return FoldedGroups(
        ep=tuple(folded[j * etp] for j in range(ep)),
        etp=tuple(folded[:etp]),
        edp=tuple(folded[k * ep * etp] for k in range(ranks // (ep * etp))),
        tp=tuple(folded[:tp]),
    )


@dataclass(frozen=True)
class FoldedLayerCost:
    """One folded MoE layer on the busiest device for one micro-batch: ``moe`` (compute and
    every collective of the pass in its fields; ``weight_bytes`` 1/ETP of the EP rank's
    experts; ``buffer_bytes`` the ETP-gathered receive buffer), and the parts that make it
    up, for tests and reports: ``dispatch_s`` (the EP all-to-alls of one pass),
    ``etp_s`` (the ETP all-gather + reduce-scatter of one pass), ``redistribution_s`` (the
    all-gather over tp between the two layouts, one pass), ``activation_bytes`` (what the
    experts keep for backward), and ``edp_sync_s`` (the all-reduce of the expert gradients
    over the EDP copies, per step)."""

    moe: MoECost
    dispatch_s: float
    etp_s: float
    redistribution_s: float
    activation_bytes: float
    edp_sync_s: float


def folded_layer_cost(layer: MoELayer, layout: ExpertLayout, cluster: Cluster, folded: Sequence[int], tp: int,
                      sequence_parallel: bool, precision: str, routing_groups: tuple[int, ...] = (),
                      implementation: str = TE_GROUPED_GEMM) -> FoldedLayerCost:
    """The cost of ``layer`` (``layer.tokens``: the micro-batch's tokens over all the folded
    ranks) run as ``layout`` (expert parallel, ``placement.devices`` = EP,
    ``tensor_parallel`` = ETP) over ``folded`` (module docstring), its expert GEMMs as
    ``implementation`` runs them (``planner.expert_kernels``)."""
    ep, etp = layout.placement.devices, layout.tensor_parallel
    groups = folded_groups(folded, tp, ep, etp)
    ranks = len(folded)
    element = element_bytes(precision)
    ep_layer = MoELayer(tokens=layer.tokens * ep // ranks, hidden=layer.hidden, ffn=layer.ffn, experts=layer.experts,
                        top_k=layer.top_k, matmuls=layer.matmuls)
    base = moe_layer_cost(
        ep_layer, "expert_parallel", cluster, list(groups.ep), token_share=layout.expert_loads or None,
        placement=layout.placement, capacity_factor=layout.capacity_factor or None, algorithm=layout.all_to_all,
        precision=precision, routing_groups=routing_groups, implementation=implementation,
    )
    dispatch = base.forward_comm_s  # dispatch + combine of one pass (forward and backward alike)

    # ETP: the EP rank's rows gathered over its ETP group, each rank a 1/ETP slice of its experts.
    rows = base.busiest_copies * etp
    gathered_bytes = rows * layer.hidden * element
    forward_compute, backward_compute = base.forward_compute_s, base.backward_compute_s
    etp_pass = sent_etp = 0.0
    device = cluster.device_of(groups.etp[0])
    local = layout.placement.most_experts_per_device
    priced = None
    kernels = ExpertShape(local, rows / local, layer.hidden, layer.ffn / etp, layer.matmuls)
    if implementation == BATCHED_MATMUL:
        # The compiled program routes over the whole folded group, so each held expert's buffer
        # is the capacity of all its tokens (not the EP group's share ``base`` saw), gathered
        # on the slot dim over ETP (codegen.runtime.moe_folding.SlicedExperts).
        kernels = ExpertShape(local, bmm_rows(layer, layout.capacity_factor or None) * etp, layer.hidden,
                              layer.ffn / etp, layer.matmuls)
        priced = expert_gemm_times(kernels, implementation, device, _DTYPE[precision], element)
    elif etp > 1:
        # Each rank's 1/ETP slice of its local experts as ``implementation`` runs it
        # (``cost_model.grouped_gemm``) where the shape model applies, else a roofline.
        priced = expert_gemm_times(kernels, implementation, device, _DTYPE[precision], element)
    if priced is not None:
        forward_compute, backward_compute = priced
        launches = expert_gemm_launches(kernels, implementation)
    elif etp > 1:
        launches = (0, 0)  # the roofline below: the experts priced as one kernel
    else:
        launches = base.gemm_launches
    if etp > 1:
        if priced is None:
            flops = rows * layer.flops_per_copy() / etp
            moved = base.weight_bytes / etp + rows * (layer.hidden + layer.ffn / etp) * element * layer.matmuls
            forward_compute = roofline_time(flops, moved, device, _DTYPE[precision]) if rows else 0.0
            backward_compute = (roofline_time(defaults.BACKWARD_TO_FORWARD * flops,
                                              defaults.BACKWARD_TO_FORWARD * moved, device, _DTYPE[precision])
                                if rows else 0.0)
        etp_pass = (collective_time("all_gather", gathered_bytes, cluster, list(groups.etp))
                    + collective_time("reduce_scatter", gathered_bytes, cluster, list(groups.etp)))
        # A ring all-gather and reduce-scatter each send (n - 1) / n of the whole; both, each pass.
        sent_etp = 4 * gathered_bytes * (etp - 1) / etp

    # Between the layouts: the dp rank's T / dp output rows all-gathered over tp (no SP).
    redistribution = sent_tp = 0.0
    if not sequence_parallel and tp > 1:
        dp_rows_bytes = layer.tokens * tp / ranks * layer.hidden * element
        redistribution = collective_time("all_gather", dp_rows_bytes, cluster, list(groups.tp))
        sent_tp = 2 * dp_rows_bytes * (tp - 1) / tp

    weight_bytes = base.weight_bytes / etp
    edp = ranks // (ep * etp)
    # Sharded over the EDP copies (``ExpertLayout.sharded_copies``) the gradients are
    # reduce-scattered there instead (``cost_model.moe_layers.copy_shard_costs``).
    whole_copies = edp > 1 and not layout.sharded_copies
    edp_sync = collective_time("all_reduce", weight_bytes, cluster, list(groups.edp)) if whole_copies else 0.0
    # Kept for backward: each matmul's input, ETP x the rows, the hidden ones 1/ETP as wide.
    activations = rows * element * (layer.hidden + 2 * (layer.matmuls - 1) * layer.ffn / etp)
    per_pass = dispatch + etp_pass + redistribution
    moe = MoECost(
        "expert_parallel", forward_compute, backward_compute, per_pass, per_pass, rows, base.dropped_fraction,
        base.max_over_mean, weight_bytes, base.buffer_bytes * etp, base.sent_bytes + sent_etp + sent_tp,
        kernels, launches,
    )
    return FoldedLayerCost(moe, dispatch, etp_pass, redistribution, activations, edp_sync)
