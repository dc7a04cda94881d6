"""Costs of one Mixture-of-Experts layer under each way of running it.

A layer routes each of its ``tokens`` to ``top_k`` of ``experts`` feed-forward networks
(``matmuls`` matmuls of ``hidden x ffn`` each: 3 for SwiGLU, 2 for a GELU MLP). The modes
(Tutel's three, Megatron-Core's dispatchers):

- ``expert_parallel``: the experts split over the ``devices`` of a group (``ExpertPlacement``:
  which device holds which expert, hot experts possibly copied); each device starts with
  ``tokens / devices`` tokens, sends each routed copy to a device holding its expert
  (all-to-all, "dispatch"), runs its experts on what it received, and sends the results back
  (all-to-all, "combine"). Backward runs the same two all-to-alls in reverse. The step
  waits for the busiest device: expert compute is priced on the most loaded device's tokens,
  and the all-to-all on the most any device sends or receives. Dropless, the busiest
  device's load is its expected share plus the chance excess of one micro-batch's routing
  (``cost_model.expert_load``).
- ``data_parallel``: every device holds every expert and keeps its own tokens: no all-to-all,
  the load is even by construction, but every device holds all expert weights and their
  gradients are reduced over the group as every other data-parallel gradient is.
- ``expert_sliced``: every expert's FFN sliced ``devices`` ways on its hidden (ffn) dimension;
  every device sees every kept token copy (all-gather of the copies before, reduce-scatter
  of the outputs after, as the compiled program moves them) and computes its slice of every
  expert: perfectly balanced whatever the routing, at the price of moving every copy to every
  device.

With a capacity factor ``c`` each expert takes at most ``c x tokens x top_k / experts`` copies
(the rest are dropped: they skip the expert and keep their residual), and its buffer is
padded to that capacity, so compute and dispatch bytes follow the capacity, not the load.
Dropless (``capacity_factor=None``) computes exactly the routed copies and sizes buffers by
the busiest device.

Expert compute: on a GPU whose shape model applies (``cost_model.gpu_kernels``), the busiest
device's experts run as the ``implementation`` runs them (``planner.expert_kernels``,
``cost_model.grouped_gemm``): Transformer Engine's grouped GEMM (one cuBLAS GEMM per expert
and projection on four streams), one ``torch.bmm`` over buffers padded as the compiled
program pads them (``bmm_rows``), or a loop of one GEMM per expert, each GEMM's shape
priced; elsewhere (and for ``model_experts``) one roofline kernel for the device's copies at
the matmul efficiency.

All-to-all algorithms: ``flat`` (every device to every device at once), ``hierarchical``
(Tutel's two-level: gather inside the node, exchange across nodes, scatter inside the node:
fewer, larger inter-node messages) or ``deduplicated`` (DeepEP's: each token crosses the
network once per node it is bound for, and is forwarded over NVLink there), priced by
``cost_model.all_to_all.dispatch_traffic``; the last from the nodes a token reaches, which
group-limited routing (``routing_groups``) bounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cost_model import defaults
from cost_model.all_to_all import RoutingGroups, dispatch_traffic, node_fanout
from cost_model.collectives import collective_time, group_shape, peers_in_flight
from cost_model.compute import roofline_time
from cost_model.expert_load import busiest_load
from cost_model.grouped_gemm import ExpertShape, expert_gemm_launches, expert_gemm_times
from planner.cluster import Cluster
from planner.expert_kernels import BATCHED_MATMUL, TE_GROUPED_GEMM
from planner.strategy import ALL_TO_ALL_ALGORITHMS, EXPERT_MODES, ExpertPlacement

# (dtype key of DeviceSpec.peak_flops, bytes per element) of the activations and weights.
_PRECISION = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2), "fp16": ("float16", 2)}


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer's shape for one step (or micro-batch) on one group of devices."""

    tokens: int  # tokens entering the layer over the whole group
    hidden: int
    ffn: int  # each expert's hidden size
    experts: int
    top_k: int
    matmuls: int = 3  # matmuls per expert: 3 for SwiGLU, 2 for a GELU MLP

    @property
    def expert_parameters(self) -> int:
        """Parameter elements of one expert."""
        return self.matmuls * self.hidden * self.ffn

    def flops_per_copy(self) -> float:
        """Forward FLOPs of one routed token copy through its expert."""
        return 2.0 * self.expert_parameters


@dataclass(frozen=True)
class MoECost:
    """One layer's predicted cost on the busiest device (seconds, bytes): forward and
    backward compute, the all-to-all (or gather/scatter) time of forward and of backward,
    the copies the busiest device computes, the share of copies dropped by the capacity, the
    busiest device's load over the mean, its bytes of expert weights and dispatch buffers, the
    bytes it sends over the group in forward and backward together (``sent_bytes``), and the
    expert GEMMs' shape as the kernels run it (``kernels``: the device's experts, rows each,
    padded where the kernel pads, hidden widths; whether the shape model or the roofline priced
    them)."""

    mode: str
    forward_compute_s: float
    backward_compute_s: float
    forward_comm_s: float
    backward_comm_s: float
    busiest_copies: float
    dropped_fraction: float
    max_over_mean: float
    weight_bytes: float
    buffer_bytes: float
    sent_bytes: float = 0.0
    kernels: ExpertShape | None = None
    # (forward, backward) expert GEMMs the host launches one by one a pass where they are priced
    # as their kernels run (``cost_model.grouped_gemm.expert_gemm_launches``); (0, 0) on the
    # roofline path, where the experts are priced as one kernel.
    gemm_launches: tuple[int, int] = (0, 0)

    @property
    def communication_s(self) -> float:
        return self.forward_comm_s + self.backward_comm_s

    @property
    def total_s(self) -> float:
        """Forward + backward, communication not overlapped with compute (the dispatch must
        arrive before the experts run, and the combine waits for them)."""
        return self.forward_compute_s + self.backward_compute_s + self.forward_comm_s + self.backward_comm_s


def moe_layer_cost(
    layer: MoELayer,
    mode: str,
    cluster: Cluster,
    ranks: Sequence[int],
    token_share: Sequence[float] | None = None,
    placement: ExpertPlacement | None = None,
    capacity_factor: float | None = None,
    algorithm: str = "flat",
    precision: str = "bf16",
    routing_groups: tuple[int, ...] = (),
    implementation: str = TE_GROUPED_GEMM,
) -> MoECost:
    """The cost of ``layer`` run in ``mode`` on the devices ``ranks`` (see the module docstring).

    Args:
        token_share: each expert's share of the routed copies (uniform when None).
        placement: expert parallel only: which device holds which expert (round-robin when None).
        capacity_factor: copies an expert takes at most, as a multiple of the even share;
            None for dropless.
        algorithm: expert parallel only: ``flat``, ``hierarchical`` or ``deduplicated`` all-to-all.
        precision: the activations' and weights' precision.
        routing_groups: (groups, groups per token) of group-limited routing, or () (see
            ``cost_model.all_to_all``); only the deduplicated all-to-all depends on it.
        implementation: the kernels of the expert GEMMs (``planner.expert_kernels``; module docstring).
    """
    if mode not in EXPERT_MODES:
        raise ValueError(f"MoE mode must be one of {EXPERT_MODES}, got {mode!r}")
    if algorithm not in ALL_TO_ALL_ALGORITHMS:
        raise ValueError(f"all-to-all algorithm must be one of {ALL_TO_ALL_ALGORITHMS}, got {algorithm!r}")
    devices = len(ranks)
    share = list(token_share) if token_share is not None else [1.0 / layer.experts] * layer.experts
    if len(share) != layer.experts:
        raise ValueError(f"token_share has {len(share)} entries for {layer.experts} experts")
    dtype, element = _PRECISION[precision]
    device = cluster.device_of(ranks[0])
    copies = layer.tokens * layer.top_k
    expert_copies = [s * copies for s in share]
    if capacity_factor is not None:
        capacity = capacity_factor * copies / layer.experts
        kept = [min(c, capacity) for c in expert_copies]
        computed = [capacity] * layer.experts  # buffers padded to capacity
    else:
        kept = expert_copies
        computed = expert_copies
    dropped = 1.0 - sum(kept) / copies if copies and capacity_factor is not None else 0.0

    if mode == "data_parallel":
        # Each device routes its own tokens to its own copies of the experts.
        local = [c / devices for c in computed]
        busiest = sum(local)
        # One bmm pads every expert to this rank's fullest expert (codegen.runtime.moe_modes.DataParallelMoE).
        rows = max(kept) / devices if implementation == BATCHED_MATMUL else busiest / layer.experts
        return _cost(layer, mode, device, dtype, element, busiest, 0.0, 0.0, dropped, 1.0,
                     layer.experts * layer.expert_parameters * element, busiest * layer.hidden * element,
                     kernels=ExpertShape(layer.experts, rows, layer.hidden, layer.ffn, layer.matmuls),
                     implementation=implementation)
    if mode == "expert_sliced":
        # Every device computes 1/devices of every expert on every token copy.
        busiest = sum(computed) / devices
        # The group's kept token copies (codegen/runtime/moe_modes.py gathers each kept
        # choice's row, so a token routed to k experts travels k times).
        tokens_bytes = sum(kept) * layer.hidden * element
        gather = collective_time("all_gather", tokens_bytes, cluster, list(ranks))
        scatter = collective_time("reduce_scatter", tokens_bytes, cluster, list(ranks))
        # Backward: gradients of the outputs all-gathered, of the inputs reduce-scattered.
        # A ring all-gather and reduce-scatter each send (n - 1) / n of the copies, twice a pass.
        sent = 4 * tokens_bytes * (devices - 1) / devices
        # Every device runs its slice of every expert on all the copies (one bmm: every expert's
        # buffer padded to the capacity, codegen.runtime.moe_modes.ExpertSlicedMoE).
        rows = (bmm_rows(layer, capacity_factor) if implementation == BATCHED_MATMUL
                else sum(computed) / layer.experts)
        return _cost(layer, mode, device, dtype, element, busiest, gather + scatter, gather + scatter, dropped, 1.0,
                     layer.experts * layer.expert_parameters * element / devices,
                     sum(computed) * layer.hidden * element, sent,
                     kernels=ExpertShape(layer.experts, rows, layer.hidden, layer.ffn / devices, layer.matmuls),
                     implementation=implementation)

    placement = placement or ExpertPlacement.round_robin(layer.experts, devices)
    if placement.devices != devices or placement.experts != layer.experts:
        raise ValueError(
            f"the placement is for {placement.experts} experts on {placement.devices} devices, "
            f"the layer has {layer.experts} experts on {devices}"
        )
    loads = placement.device_loads(computed)
    mean = sum(loads) / devices
    # Dropless: the busiest device computes and receives what this micro-batch's routing
    # happens to send it, above its expected share by chance (cost_model.expert_load); with a
    # capacity it computes its padded buffers whatever the counts.
    busiest = busiest_load(loads, copies) if capacity_factor is None else max(loads)
    # Each device sends its tokens' routed copies (kept ones; padding is not sent) and receives
    # what its experts take; the busiest side of the exchange bounds it.
    sent = sum(kept) / devices * layer.hidden * element
    received = (busiest if capacity_factor is None else max(placement.device_loads(kept))) * layer.hidden * element
    exchange = max(sent, received)
    row = layer.hidden * element
    fanout = None
    if algorithm == "deduplicated" and devices > 1:
        groups = RoutingGroups(*routing_groups) if routing_groups else None
        fanout = node_fanout(placement, cluster, ranks, layer.top_k, groups)
    traffic = dispatch_traffic(algorithm, exchange / row, layer.tokens / devices, row, group_shape(cluster, list(ranks)),
                               fanout, in_flight=peers_in_flight(cluster))
    one = traffic.time_s
    weights = placement.most_experts_per_device * layer.expert_parameters * element
    # Four all-to-alls a pass (dispatch and combine, forward and backward); the share a device
    # keeps for itself does not travel. Deduplicated: what crosses the network plus what is
    # forwarded over NVLink.
    moved = 4 * (exchange * (devices - 1) / devices if algorithm != "deduplicated"
                 else traffic.network_bytes + traffic.nvlink_bytes)
    local = placement.most_experts_per_device
    # One bmm runs each held expert on a buffer of the whole capacity, whatever share of its
    # slots this copy takes (codegen.runtime.moe.ExpertParallelMoE); the other kernels run the rows received.
    rows = bmm_rows(layer, capacity_factor) if implementation == BATCHED_MATMUL else busiest / local
    return _cost(layer, mode, device, dtype, element, busiest, 2 * one, 2 * one, dropped,
                 busiest / mean if mean else 1.0, weights, busiest * layer.hidden * element, moved,
                 kernels=ExpertShape(local, rows, layer.hidden, layer.ffn, layer.matmuls),
                 implementation=implementation)


def bmm_rows(layer: MoELayer, capacity_factor: float | None) -> int:
    """Rows of each expert's buffer in the compiled program's batched matmul: the capacity
    (``codegen.runtime.moe.capacity_of``: the factor times an even share of the routed copies,
    rounded up), or, dropless (None), every token of the group, the only bound a token's
    choices of one expert have."""
    if capacity_factor is None:
        return layer.tokens
    return max(1, math.ceil(capacity_factor * layer.tokens * layer.top_k / layer.experts))


def expert_activation_bytes(layer: MoELayer, copies: float, element: int) -> float:
    """Bytes the experts keep for backward when a device computes ``copies`` token copies:
    each matmul's input (the tokens, then the FFN's hidden activations: one tensor before
    and one after the activation function for a GELU MLP, two more for SwiGLU's gate)."""
    return copies * element * (layer.hidden + 2 * (layer.matmuls - 1) * layer.ffn)


def element_bytes(precision: str) -> int:
    """Bytes per element of activations and weights at ``precision`` (fp32, bf16, fp16)."""
    return _PRECISION[precision][1]


def _cost(layer, mode, device, dtype, element, busiest, forward_comm, backward_comm, dropped, imbalance,
          weight_bytes, buffer_bytes, sent_bytes=0.0, kernels: ExpertShape | None = None,
          implementation: str = TE_GROUPED_GEMM) -> MoECost:
    # The device's experts (``kernels``: their count, rows each, widths) run as
    # ``implementation`` runs them (``cost_model.grouped_gemm``) on a GPU whose shape model
    # applies; other devices, and kernels it does not price, keep the roofline below.
    grouped = (expert_gemm_times(kernels, implementation, device, dtype, element)
               if kernels is not None and busiest else None)
    if grouped is not None:
        return MoECost(mode, *grouped, forward_comm, backward_comm, busiest, dropped, imbalance,
                       weight_bytes, buffer_bytes, sent_bytes, kernels, expert_gemm_launches(kernels, implementation))
    flops = busiest * layer.flops_per_copy()
    # The weights of every expert (or slice) the device holds read once (a grouped GEMM reads
    # each of its experts' matrices), activations in and out of each matmul.
    moved = weight_bytes + busiest * (layer.hidden + layer.ffn) * element * layer.matmuls
    forward = roofline_time(flops, moved, device, dtype) if busiest else 0.0
    backward = (
        roofline_time(defaults.BACKWARD_TO_FORWARD * flops, defaults.BACKWARD_TO_FORWARD * moved, device, dtype)
        if busiest else 0.0
    )
    return MoECost(mode, forward, backward, forward_comm, backward_comm, busiest, dropped, imbalance,
                   weight_bytes, buffer_bytes, sent_bytes, kernels)

