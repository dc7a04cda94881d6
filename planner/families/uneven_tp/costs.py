"""Uneven tensor parallelism's part of a simulated step (cost-model layer): each split linear
priced rank by rank on the rank's own device at its share, with the uneven collectives the
program runs; every other op on the slowest device, since every rank runs it whole.

A linear layer of ``N`` input rows (all dims but the last), ``i`` input and ``o`` output
features, split with shares ``s_r`` over ``p`` ranks (``section.py``), costs one step:

=========  ======================================  ==========================================
kind       forward                                 backward
=========  ======================================  ==========================================
column     gather-v of the outputs' columns        all-reduce of the inputs' gradient
           (``p * max s * N`` elements sent)        (partial sums, ``N * i`` elements)
row        all-reduce of the partial outputs       gather-v of the inputs' gradient
           (``N * o`` elements)                     columns (``p * max s * N`` elements)
batch      gather-v of the output rows             gather-v of the inputs' gradient rows
           (``p * max s * N/B * o`` elements)       (``p * max s * N/B * i``) and all-reduce of
                                                    the weight's gradient (``i * o + o``)
=========  ======================================  ==========================================

A gather-v (``runtime.gather_slices``) sends each rank's slice, unpadded, to every other rank
in one ``all_to_all_single`` with uneven split sizes, priced as the bytes it moves
(``gather_v_seconds``): rank r sends ``(p - 1) s_r`` slices and receives ``D - s_r``; the
busiest rank, the largest share's, sends ``(p - 1) max s`` (at least anyone's ``D - s_r``), so
it is ``collective_time("all_to_all", p * max s * slice bytes)`` (pairwise: each rank sends
``S/p`` to each peer). A ``fused`` column keeps its output split and a fused row takes its
input split (``regions.py``): no gather-v for them, and the elementwise ops between run on
each rank's share (``fused_terms``, ``between_seconds``). Every collective
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
from cost_model.mixed_precision import reduced_gradient_bytes
from cost_model.parameter_bytes import PARAM_BYTES
from cost_model.simulator import Simulator
from cost_model.step_contributor import StepContributor
from cost_model.step_memory import stage_memory
from planner.cluster import Cluster
from planner.device_groups import rank_devices
from planner.families.uneven_tp.ratios import KindTerms
from planner.families.uneven_tp.section import JSON_KEY, LayerSplit, complete_fused_groups
from planner.graph import OpNode
from planner.strategy import MemoryBreakdown


def _features(node: OpNode) -> tuple[int, int, int, int]:
    """``(rows N, input features i, output features o, batch B)`` of a linear op."""
    shape = node.input_meta[0].shape
    out_features, in_features = node.input_meta[1].shape
    return math.prod(shape) // in_features, in_features, out_features, shape[0]


def split_dimension(node: OpNode, kind: str) -> int:
    """The size of the dimension ``kind`` splits (``regions.split_dimensions``)."""
    rows, in_features, out_features, batch = _features(node)
    return {"batch": batch, "column": out_features, "row": in_features}[kind]


def gather_v_seconds(shares_largest: int, slice_bytes: float, cluster: Cluster) -> float:
    """Seconds of a gather-v over all of ``cluster``'s ranks whose largest share is
    ``shares_largest`` slices of ``slice_bytes`` (module docstring): the all-to-all in which
    every rank sends as much as the largest share's rank does."""
    p = cluster.world_size
    return collective_time("all_to_all", p * shares_largest * slice_bytes, cluster, range(p))


def collective_seconds(node: OpNode, kind: str, largest: int, cluster: Cluster, precision: str,
                       fused: bool = False, gradient_bytes: int | None = None) -> tuple[float, float]:
    """(forward, backward) collective seconds of ``node`` split ``kind`` over all of
    ``cluster``'s ranks, the largest share being ``largest`` (table in the module docstring);
    ``fused``: a column without its forward gather-v, a row without its backward one.
    ``gradient_bytes``: bytes per element of a batch split's weight-gradient all-reduce
    (``cost_model.mixed_precision.reduced_gradient_bytes`` of the plan: 4 in a bf16 program,
    whose weights and gradients stay fp32 under autocast); None: the precision's own."""
    rows, in_features, out_features, batch = _features(node)
    ranks = range(cluster.world_size)
    activation = PRECISIONS[precision][1]
    gradient = PARAM_BYTES[precision][1] if gradient_bytes is None else gradient_bytes

    def reduce(elements: float, element_bytes: int) -> float:
        return collective_time("all_reduce", elements * element_bytes, cluster, ranks)

    if kind == "column":
        return (0.0 if fused else gather_v_seconds(largest, rows * activation, cluster),
                reduce(rows * in_features, activation))
    if kind == "row":
        return (reduce(rows * out_features, activation),
                0.0 if fused else gather_v_seconds(largest, rows * activation, cluster))
    per_sample = rows // batch
    bias = out_features if len(node.params) > 1 else 0
    return (gather_v_seconds(largest, per_sample * out_features * activation, cluster),
            gather_v_seconds(largest, per_sample * in_features * activation, cluster)
            + reduce(in_features * out_features + bias, gradient))


def rank_seconds(node: OpNode, kind: str, shares, devices, precision: str) -> list[tuple[float, float]]:
    """(forward, backward) compute seconds of each rank: ``share / D`` of the op on its device."""
    dim = split_dimension(node, kind)
    return [op_times(node, share / dim, device, precision) for share, device in zip(shares, devices)]


def layer_seconds(node: OpNode, split: LayerSplit, cluster: Cluster, precision: str,
                  gradient_bytes: int | None = None) -> tuple[float, float, float, float]:
    """``(forward_s, backward_s, forward_comm_s, backward_comm_s)`` of one step of ``node``
    split as ``split``: the slowest rank's compute and the collectives (module docstring;
    ``gradient_bytes``: as ``collective_seconds``)."""
    times = rank_seconds(node, split.kind, split.shares, rank_devices(cluster), precision)
    forward_comm, backward_comm = collective_seconds(node, split.kind, max(split.shares), cluster, precision,
                                                     split.fused, gradient_bytes)
    return max(t[0] for t in times), max(t[1] for t in times), forward_comm, backward_comm


def _rank_lines(seconds_at, devices, dim: int) -> tuple[tuple[float, ...], tuple[float, ...], int, int]:
    """Per rank, the line ``fixed + unit * share`` through ``seconds_at(device, share)`` at the
    even share and twice it (roofline times are piecewise linear in the work); also those
    two shares. Per-unit seconds are kept positive, so no share grows for free."""
    p = len(devices)
    even = max(1, dim // p)
    high = min(dim, 2 * even) if dim > even else even + 1
    fixed, unit = [], []
    for device in devices:
        low_s, high_s = seconds_at(device, even), seconds_at(device, high)
        # 1e-15 s per unit is no measured figure, a floor that keeps every share's cost rising.
        slope = max((high_s - low_s) / (high - even), 1e-15)
        fixed.append(max(0.0, low_s - even * slope))
        unit.append(slope)
    return tuple(fixed), tuple(unit), even, high


def layer_terms(node: OpNode, kind: str, cluster: Cluster, precision: str, caps: tuple[int, ...],
                gradient_bytes: int | None = None) -> KindTerms:
    """``node``'s cost split ``kind`` as lines in the shares (``ratios.KindTerms``): each rank's
    forward plus backward seconds (``_rank_lines``), the collectives through the even and the
    whole largest share (``gradient_bytes``: as ``collective_seconds``)."""
    devices = rank_devices(cluster)
    dim = split_dimension(node, kind)
    fixed, unit, even, _ = _rank_lines(lambda device, share: sum(op_times(node, share / dim, device, precision)),
                                       devices, dim)
    low_comm = sum(collective_seconds(node, kind, even, cluster, precision, gradient_bytes=gradient_bytes))
    whole_comm = sum(collective_seconds(node, kind, dim, cluster, precision, gradient_bytes=gradient_bytes))
    per_max = max((whole_comm - low_comm) / (dim - even), 0.0) if dim > even else 0.0
    return KindTerms(kind, dim, fixed, unit, caps, max(0.0, low_comm - even * per_max), per_max)


def fused_terms(columns, row: OpNode, between, cluster: Cluster, precision: str, caps: tuple[int, ...]) -> KindTerms:
    """A fused group's cost as lines in its one set of shares (``regions.FusableGroup``): the
    ``columns``' and the ``row``'s compute at each share plus the elementwise ``between`` ops
    on that share of their features; the columns' backward all-reduces and the row's forward
    one, which do not depend on the shares."""
    devices = rank_devices(cluster)
    dim = split_dimension(row, "row")

    def seconds_at(device, share: int) -> float:
        return sum(sum(op_times(node, share / dim, device, precision)) for node in (*columns, row, *between))

    fixed, unit, _, _ = _rank_lines(seconds_at, devices, dim)
    comm = sum(sum(collective_seconds(node, "column", 1, cluster, precision, fused=True)) for node in columns)
    comm += sum(collective_seconds(row, "row", 1, cluster, precision, fused=True))
    return KindTerms("fused", dim, fixed, unit, caps, comm, 0.0)


def whole_op_seconds(node: OpNode, cluster: Cluster, precision: str) -> tuple[float, float]:
    """(forward, backward) seconds of an op every rank runs whole: the slowest device's."""
    times = [op_times(node, 1.0, device, precision) for device in set(rank_devices(cluster))]
    return max(t[0] for t in times), max(t[1] for t in times)


def between_seconds(node: OpNode, shares, dim: int, cluster: Cluster, precision: str) -> tuple[float, float]:
    """(forward, backward) seconds of an elementwise op between fused layers: each rank runs
    ``share / dim`` of it on its device; the slowest rank's."""
    times = [op_times(node, share / dim, device, precision) for share, device in zip(shares, rank_devices(cluster))]
    return max(t[0] for t in times), max(t[1] for t in times)


_SPLIT_OPS: dict[int, tuple] = {}


def split_ops(graph, section) -> dict[str, tuple[tuple[int, ...], int]]:
    """The elementwise ops between ``section``'s fused layers, by node name: (the group's
    shares, its feature dimension). Memoised for the last few (graph, section) pairs."""
    key = id(graph)
    found = _SPLIT_OPS.get(key)
    if found is not None and found[0] is graph and found[1] == section:
        return found[2]
    rows = {layer.module: layer for layer in section.layers if layer.fused and layer.kind == "row"}
    ops = {}
    for group in complete_fused_groups(graph, section.layers):  # not a group whose row is another's column
        ops.update({name: (rows[group.row].shares, group.dim) for name in group.between})
    if len(_SPLIT_OPS) > 8:
        _SPLIT_OPS.clear()
    _SPLIT_OPS[key] = (graph, section, ops)
    return ops


class UnevenTensorStep(StepContributor):
    """The costs part of the ``uneven-tp`` family (``planner.families``): on a plan with an
    ``"uneven-tp"`` section every split linear is priced by ``layer_seconds`` and every other
    op whole on the slowest device, without DTensor's dispatch (the program runs plain
    tensors). Each rank's memory holds its share of each column or row split's weights,
    gradients and optimizer states, and of the activations split between fused layers
    (``rank_memories``); the plan reports the rank nearest its own device's capacity."""

    def node_cost(self, context, node, strategy, cost) -> None:
        if node.is_view:
            return
        plan = context.plan
        section = plan.sections[JSON_KEY]
        split = section.layer(node.module) if node.op == "aten.linear.default" else None
        if split is None:
            between = split_ops(context.graph, section).get(node.name)
            if between is not None:
                cost.forward_s, cost.backward_s = between_seconds(node, *between, plan.cluster, plan.precision)
                return
            cost.forward_s, cost.backward_s = whole_op_seconds(node, plan.cluster, plan.precision)
            return
        cost.forward_s, cost.backward_s, cost.forward_comm_s, cost.backward_comm_s = layer_seconds(
            node, split, plan.cluster, plan.precision, reduced_gradient_bytes(plan))

    def rank_memory(self, context, costs, memory) -> tuple[MemoryBreakdown, ...]:
        """Each rank's memory (``rank_memories``)."""
        return rank_memories(context, costs, memory)


def plan_rank_memories(plan, graph) -> tuple[MemoryBreakdown, ...]:
    """Each rank's memory of ``plan`` (a plan with an ``"uneven-tp"`` section), as its
    simulation prices it: the step's memory with every weight and activation whole, less
    what each rank does not hold (``rank_memories``). The simulation keeps only the rank
    nearest its own capacity; the report shows them all."""
    simulator = Simulator(plan, graph)
    whole = stage_memory(simulator.context, simulator.contributors, 0, simulator.segments())
    return rank_memories(simulator.context, simulator.costs, whole)


def rank_memories(context, costs, memory: MemoryBreakdown) -> tuple[MemoryBreakdown, ...]:
    """Per rank, ``memory`` (the simulator's breakdown, every weight whole and every
    activation whole-size) less what the compiled program (``runtime.UnevenLinear``) does not
    hold on that rank:

    - weights, gradients and optimizer states: a ``column`` split keeps the rank's ``s_r``
      of the ``o`` output rows of the weight and bias, a ``row`` split its ``s_r`` of the
      ``i`` input columns of the weight (the bias whole), a ``batch`` split everything;
    - activations: a fused column's output and the elementwise ops' between it and the
      fused row are the rank's ``s_r / D`` slice; a row or batch split that is not fused
      saves its slice of the input (``scatter_uneven``'s copy) for backward, and the whole
      input stays held only where another reader keeps it: where the layer is the only
      reader of the input (through views), the slice replaces it, else it is added.
    """
    plan, graph = context.plan, context.graph
    section = plan.sections[JSON_KEY]
    weight_b, grad_b, state_b = PARAM_BYTES[plan.precision]
    ranks = len(section.layers[0].shares)
    dropped = [0.0] * ranks  # parameter elements rank r does not hold
    freed = [0.0] * ranks  # activation bytes rank r does not hold (negative: holds more)
    nodes = {node.module: node for node in graph.nodes if node.op == "aten.linear.default"}
    for split in section.layers:
        node = nodes[split.module]
        dim = split_dimension(node, split.kind)
        for index, param in enumerate(node.params):
            numel = math.prod(graph.parameters[param].shape)
            if split.kind == "column" or (split.kind == "row" and index == 0):
                for rank, share in enumerate(split.shares):
                    dropped[rank] += numel * (1 - share / dim)
        if split.fused and split.kind == "column":
            _add_saved_slice(freed, costs[node.name].saved_bytes, split.shares, dim)
        elif split.kind in ("row", "batch") and not split.fused:
            _add_input_slice(freed, context, costs, node, split.shares, dim)
    for name, (shares, dim) in split_ops(graph, section).items():
        _add_saved_slice(freed, costs[name].saved_bytes, shares, dim)
    return tuple(MemoryBreakdown(
        weights=int(memory.weights - dropped[rank] * weight_b),
        gradients=int(memory.gradients - dropped[rank] * grad_b),
        optimizer_states=int(memory.optimizer_states - dropped[rank] * state_b),
        activations=int(max(0.0, memory.activations - freed[rank])),
        communication_buffers=memory.communication_buffers,
    ) for rank in range(ranks))


def _add_saved_slice(freed: list[float], saved_bytes: float, shares, dim: int) -> None:
    """A tensor of ``saved_bytes`` held whole in the simulation, of which rank r holds ``s_r / dim``."""
    for rank, share in enumerate(shares):
        freed[rank] += saved_bytes * (1 - share / dim)


def _add_input_slice(freed: list[float], context, costs, node: OpNode, shares, dim: int) -> None:
    """A row or batch split's saved input slice (``rank_memories``)."""
    reader, source = node.name, node.inputs[0]
    producer = context.nodes.get(source)
    # Back through views read by nothing else (a reshape before the layer) to the op whose
    # output the simulator counted: the layer its only reader, the program keeps only the slice.
    while producer is not None and context.consumers.get(source, []) == [reader] and producer.is_view:
        reader, source = source, producer.inputs[0]
        producer = context.nodes.get(source)
    if producer is not None and context.consumers.get(source, []) == [reader] and source in costs:
        _add_saved_slice(freed, costs[source].saved_bytes, shares, dim)
        return
    whole = node.input_meta[0].nbytes * context.activation_scale / context.micro_batches
    for rank, share in enumerate(shares):
        freed[rank] -= whole * share / dim
