"""Uneven tensor parallelism's part of a simulated step (cost-model layer): each split linear
priced rank by rank on the rank's own device at its share, with the uneven collectives the
program runs; every other op on the slowest device, since every rank runs it whole.

A linear layer of ``N`` input rows (all dims but the last), ``i`` input and ``o`` output
features, split with shares ``s_r`` over ``p`` ranks (``section.py``), costs one step:

=========  ======================================  ==========================================
kind       forward                                 backward
=========  ======================================  ==========================================
column     gather-v of the outputs' columns:       all-reduce of the inputs' gradient
           all-gather of ``p * max s * N`` elems    (partial sums, ``N * i`` elements)
row        all-reduce of the partial outputs       gather-v of the inputs' gradient
           (``N * o`` elements)                     columns (``p * max s * N`` elements)
batch      gather-v of the output rows             gather-v of the inputs' gradient rows
           (``p * max s * N/B * o`` elements)       (``p * max s * N/B * i``) and all-reduce of
                                                    the weight's gradient (``i * o + o``)
=========  ======================================  ==========================================

A gather-v is an all-gather of slices padded to the largest (``runtime.gather_uneven``), so
it is priced as ``collective_time("all_gather", p * max s * slice bytes)``. Every collective
blocks the rank (the program calls it inside the layer), so the layer's forward is the
slowest rank's forward plus its forward collective, and alike for backward:
``forward_s = max_r forward(s_r / D on device r)``, ``forward_comm_s`` the collective
(``NodeCost`` fields the simulator lays out on the compute stream).

``layer_terms`` gives the search the same costs as lines in the shares
(``ratios.KindTerms``), which ``ratios.best_layer_split`` minimises exactly.
"""

from __future__ import annotations

import math

from cost_model.collectives import collective_time
from cost_model.compute import PRECISIONS, op_times
from cost_model.parameter_bytes import PARAM_BYTES
from cost_model.step_contributor import StepContributor
from planner.cluster import Cluster
from planner.device_groups import rank_devices
from planner.families.uneven_tp.ratios import KindTerms
from planner.families.uneven_tp.section import JSON_KEY, LayerSplit
from planner.graph import OpNode


def _features(node: OpNode) -> tuple[int, int, int, int]:
    """``(rows N, input features i, output features o, batch B)`` of a linear op."""
    shape = node.input_meta[0].shape
    out_features, in_features = node.input_meta[1].shape
    return math.prod(shape) // in_features, in_features, out_features, shape[0]


def split_dimension(node: OpNode, kind: str) -> int:
    """The size of the dimension ``kind`` splits (``section.split_dimensions``)."""
    rows, in_features, out_features, batch = _features(node)
    return {"batch": batch, "column": out_features, "row": in_features}[kind]


def collective_seconds(node: OpNode, kind: str, largest: int, cluster: Cluster, precision: str) -> tuple[float, float]:
    """(forward, backward) collective seconds of ``node`` split ``kind`` over all of
    ``cluster``'s ranks, the largest share being ``largest`` (table in the module docstring)."""
    rows, in_features, out_features, batch = _features(node)
    ranks = range(cluster.world_size)
    p = cluster.world_size
    activation = PRECISIONS[precision][1]
    gradient = PARAM_BYTES[precision][1]

    def seconds(collective: str, elements: float, element_bytes: int) -> float:
        return collective_time(collective, elements * element_bytes, cluster, ranks)

    if kind == "column":
        return (seconds("all_gather", p * largest * rows, activation),
                seconds("all_reduce", rows * in_features, activation))
    if kind == "row":
        return (seconds("all_reduce", rows * out_features, activation),
                seconds("all_gather", p * largest * rows, activation))
    per_sample = rows // batch
    bias = out_features if len(node.params) > 1 else 0
    return (seconds("all_gather", p * largest * per_sample * out_features, activation),
            seconds("all_gather", p * largest * per_sample * in_features, activation)
            + seconds("all_reduce", in_features * out_features + bias, gradient))


def rank_seconds(node: OpNode, kind: str, shares, devices, precision: str) -> list[tuple[float, float]]:
    """(forward, backward) compute seconds of each rank: ``share / D`` of the op on its device."""
    dim = split_dimension(node, kind)
    return [op_times(node, share / dim, device, precision) for share, device in zip(shares, devices)]


def layer_seconds(node: OpNode, split: LayerSplit, cluster: Cluster, precision: str) -> tuple[float, float, float, float]:
    """``(forward_s, backward_s, forward_comm_s, backward_comm_s)`` of one step of ``node``
    split as ``split``: the slowest rank's compute and the collectives (module docstring)."""
    times = rank_seconds(node, split.kind, split.shares, rank_devices(cluster), precision)
    forward_comm, backward_comm = collective_seconds(node, split.kind, max(split.shares), cluster, precision)
    return max(t[0] for t in times), max(t[1] for t in times), forward_comm, backward_comm


def layer_terms(node: OpNode, kind: str, cluster: Cluster, precision: str, caps: tuple[int, ...]) -> KindTerms:
    """``node``'s cost split ``kind`` as lines in the shares (``ratios.KindTerms``): each rank's
    forward plus backward seconds through the even share and twice it (roofline times are
    piecewise linear in the work), the collectives through the even and the whole largest
    share. Per-unit seconds are kept positive, so no share grows for free."""
    devices = rank_devices(cluster)
    dim = split_dimension(node, kind)
    p = len(devices)
    even = max(1, dim // p)
    high = min(dim, 2 * even) if dim > even else even + 1
    fixed, unit = [], []
    for device in devices:
        low_s = sum(op_times(node, even / dim, device, precision))
        high_s = sum(op_times(node, high / dim, device, precision))
        # 1e-15 s per unit is no measured figure, a floor that keeps every share's cost rising.
        slope = max((high_s - low_s) / (high - even), 1e-15)
        fixed.append(max(0.0, low_s - even * slope))
        unit.append(slope)
    low_comm = sum(collective_seconds(node, kind, even, cluster, precision))
    whole_comm = sum(collective_seconds(node, kind, dim, cluster, precision))
    per_max = max((whole_comm - low_comm) / (dim - even), 0.0) if dim > even else 0.0
    return KindTerms(kind, dim, tuple(fixed), tuple(unit), caps, max(0.0, low_comm - even * per_max), per_max)


def whole_op_seconds(node: OpNode, cluster: Cluster, precision: str) -> tuple[float, float]:
    """(forward, backward) seconds of an op every rank runs whole: the slowest device's."""
    times = [op_times(node, 1.0, device, precision) for device in set(rank_devices(cluster))]
    return max(t[0] for t in times), max(t[1] for t in times)


class UnevenTensorStep(StepContributor):
    """The costs part of the ``uneven-tp`` family (``planner.families``): on a plan with an
    ``"uneven-tp"`` section every split linear is priced by ``layer_seconds`` and every other
    op whole on the slowest device, without DTensor's dispatch (the program runs plain
    tensors). Weights, gradients and states are counted whole on every rank (the simulator's
    memory is an upper bound for a column or row split; the section's report gives each
    rank's share)."""

    def node_cost(self, context, node, strategy, cost) -> None:
        if node.is_view:
            return
        plan = context.plan
        split = plan.sections[JSON_KEY].layer(node.module) if node.op == "aten.linear.default" else None
        if split is None:
            cost.forward_s, cost.backward_s = whole_op_seconds(node, plan.cluster, plan.precision)
            return
        cost.forward_s, cost.backward_s, cost.forward_comm_s, cost.backward_comm_s = layer_seconds(
            node, split, plan.cluster, plan.precision)
