"""What simulators share: per-graph facts, and the node costs of plans simulated lately.

A search simulates thousands of nodes for every plan, and many plans in a row differ only in
what node costs do not read (recomputation, the dp flavour): ``Simulator`` takes their node
costs and segments from ``RECENTLY_COSTED`` rather than costing every node again, and the
facts that depend on the graph alone from ``graph_facts``. Both give exactly what computing
afresh gives; they only skip the work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cost_model.mixed_precision import holds_fp32_weights
from planner.graph import OpGraph, OpNode
from planner.program_shape import is_data_parallel, wraps_bf16_fsdp_units
from planner.strategy import ExpertLayout


@dataclass
class Costed:
    """What a ``Simulator`` derives from a plan's strategies before scheduling anything."""

    keep: tuple  # the strategies, graph, its facts and the cluster the key's identities belong to
    cache: dict[tuple, object]  # cost_model.node_costs.NodeCosts.cache
    first_use: dict[tuple, str]
    costs: dict[str, object]  # node name -> cost_model.node_costs.NodeCost
    segments: list  # cost_model.segments.Segment
    layouts: tuple = ()  # the last part of its costing_key: each MoE layer's layout as priced


@dataclass
class GraphFacts:
    """What simulators of one graph share whatever the plan: nodes by name, the readers of
    every tensor, whether autograd keeps each output (filled as asked), and each node's
    signature: equal for nodes whose op, shapes, FLOPs, bytes and parameter count are equal
    (their costs under equal placements are equal)."""

    graph: OpGraph
    node_list: tuple[OpNode, ...]  # the graph's nodes when these facts were taken
    nodes: dict[str, OpNode]
    consumers: dict[str, list[str]]
    kept: dict[str, bool]
    signature: dict[str, int]
    # MoE layers priced by layout (``cost_model.moe_layers``): one layer's pricing depends on
    # its layout, the cluster, the precision and the micro-batches only, and a search prices
    # the same layouts for many plans.
    moe_layers: dict[tuple, object] = field(default_factory=dict)
    # The same by the identity of the layout object, cluster and mesh asked with (each entry
    # keeps those objects alive, so an identity is not reused): a search asks for the same
    # layout objects in plan after plan, and hashing a layout of 256 experts by value is slow.
    moe_layers_by_identity: dict[tuple, tuple] = field(default_factory=dict)
    # The module-independent part of a layer's pricing, by the layer's shape and layout
    # without its module (``cost_model.moe_layers``): identical layers share it.
    moe_layer_prices: dict[tuple, tuple] = field(default_factory=dict)
    segment_members: object = None  # cost_model.segments.segment_members of the graph, once asked
    # Plan.fused_chains value -> cost_model.fused_chains.chain_kernels of the graph, once asked.
    fused_chains: dict[str, dict] = field(default_factory=dict)


_FACTS: dict[int, GraphFacts] = {}


def graph_facts(graph: OpGraph) -> GraphFacts:
    """The facts of ``graph``, taken once while its node list stays the same."""
    facts = _FACTS.get(id(graph))
    if facts is not None and facts.graph is graph and facts.node_list == tuple(graph.nodes):
        return facts
    consumers: dict[str, list[str]] = {}
    for node in graph.nodes:
        for name in node.inputs:
            consumers.setdefault(name, []).append(node.name)
    signatures: dict[tuple, int] = {}
    signature = {
        node.name: signatures.setdefault(
            (node.op, node.input_meta, node.output_meta, node.flops, node.bytes_moved, node.params and len(node.params)),
            len(signatures),
        )
        for node in graph.nodes
    }
    facts = GraphFacts(graph, tuple(graph.nodes), {node.name: node for node in graph.nodes}, consumers, {}, signature)
    _FACTS[id(graph)] = facts
    while len(_FACTS) > 4:  # the graph entry keeps its id from being reused while it stays
        del _FACTS[next(iter(_FACTS))]
    return facts


class RecentlyCosted:
    """The node costs and segments of the last few plans simulated, by ``costing_key``.
    A search simulates each layout again with every recomputation mode and dp flavour,
    which change neither (a few entries suffice: those variants are built in a row)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: dict[tuple, Costed] = {}
        # By ``same_but_layouts``: the latest entry of plans that differ only in their MoE
        # layers' layouts (an MoE search simulates many such plans in a row).
        self.by_dense: dict[tuple, Costed] = {}

    def get(self, key: tuple) -> Costed | None:
        return self.entries.get(key)

    def get_but_layouts(self, key: tuple) -> Costed | None:
        """The latest entry whose plan differs from ``key``'s at most in its MoE layouts."""
        return self.by_dense.get(same_but_layouts(key))

    def clear(self) -> None:
        """Forget every plan costed so far (both indexes): the next ``Simulator`` of any plan
        costs every node afresh. Clearing ``entries`` alone leaves ``by_dense``, which
        hands a plan simulated before its node costs all the same."""
        self.entries.clear()
        self.by_dense.clear()

    def put(self, key: tuple, costed: Costed) -> None:
        self.entries[key] = costed
        self.by_dense[same_but_layouts(key)] = costed
        while len(self.entries) > self.size:
            del self.entries[next(iter(self.entries))]
        while len(self.by_dense) > self.size:
            del self.by_dense[next(iter(self.by_dense))]


RECENTLY_COSTED = RecentlyCosted(size=8)


def same_but_layouts(key: tuple) -> tuple:
    """``key`` (a ``costing_key``) without its MoE layouts, but with the layers they lay out
    and their axes: plans equal under it have the same node costs outside the MoE layers
    (an op reading an MoE layer's output pays no resharding for it, ``cost_model.node_costs``),
    so one's costs are the other's once its MoE layers are re-costed."""
    return (*key[:-1], tuple((layout[0], layout[3]) for layout in key[-1]))


def costing_key(plan, graph: OpGraph, micro_batches: int) -> tuple:
    """What node costs and segments depend on: the graph, cluster, mesh, precision and
    micro-batch count, whether the program is plain data parallel, whether fused splits are
    local, whether the sequence-parallel collectives overlap GEMMs, each node's placements,
    parameters and stage, the MoE layers' layouts, and the plan sections that change op costs
    (``changes_op_costs``). Placements are compared by identity
    (a variant made with ``dataclasses.replace`` shares them; hashing thousands of placements
    by value costs more than costing the nodes); the entry keeps those objects alive, so an
    identity cannot be reused by another object. The strategies' part and each layout's
    part are made and hashed once per object (``HashedOnce``): a search of a 61-layer MoE
    model asks for the key of plans sharing one strategies tuple hundreds of times, and
    hashing its entry per op on every lookup took about a tenth of the search (cProfile)."""
    return (
        id(graph), id(graph_facts(graph)), id(plan.cluster), plan.mesh, plan.precision, micro_batches,
        is_data_parallel(plan),  # graph programs pay DTensor's per-op dispatch (planner.cluster)
        plan.fused_splits_local,  # splits of fused projections gather or not (cost_model.split_gather)
        plan.tp_comm_overlap,  # sequence-parallel collectives hidden behind GEMMs (cost_model.tp_comm_overlap)
        plan.moe_a2a_overlap,  # all-to-alls under another micro-batch's compute (cost_model.moe_overlap)
        # Another system's loss and training metrics (Plan.loss_implementation; cost_model.loss_kernels).
        getattr(plan, "loss_implementation", ""), getattr(plan, "metric_cross_entropies", 0),
        # The kernels the experts' GEMMs run on (Plan.expert_implementation; cost_model.grouped_gemm).
        getattr(plan, "expert_implementation", ""),
        # Norms and rotary embeddings as one fused kernel each (Plan.fused_chains; cost_model.fused_chains).
        getattr(plan, "fused_chains", ""),
        # fp32 weights cast by autocast, fp32 gradients of replicated weights (cost_model.mixed_precision).
        holds_fp32_weights(plan), wraps_bf16_fsdp_units(plan),
        _strategies_part(plan.strategies),
        # Family sections that change what each op costs (layer separation's per-group shares,
        # uneven data-parallel shares): ``changes_op_costs``.
        tuple(section for section in plan.sections.values() if getattr(section, "changes_op_costs", False)),
        # Folded MoE layers move tokens between the layouts unless sequence parallel (cost_model.moe_folding).
        getattr(plan, "sections", {}).get("moe-folding"),
        # MoE layers are priced by their layouts (their cost annotation aside). Last: what
        # ``same_but_layouts`` leaves out.
        tuple(_layout_part(layout) for layout in getattr(plan, "expert_layouts", ())),
    )


class HashedOnce:
    """A tuple that computes its hash once, equal to another ``HashedOnce`` of an equal
    tuple (compared only when the hashes agree). Indexing reads the tuple."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: tuple) -> None:
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HashedOnce):
            return NotImplemented
        return self.value is other.value or (self._hash == other._hash and self.value == other.value)

    def __getitem__(self, index):
        return self.value[index]


# id(object) -> (the object, its key part): each entry keeps its object alive, so the id is
# not reused while the entry stays. Bounded: the oldest entries leave first.
_PARTS: dict[int, tuple[object, HashedOnce]] = {}
_PARTS_SIZE = 4096


def _part_of(value: object, make) -> HashedOnce:
    if not isinstance(value, (tuple, ExpertLayout)):
        return HashedOnce(make(value))  # a mutable container may change under the same identity
    known = _PARTS.get(id(value))
    if known is not None and known[0] is value:
        return known[1]
    part = HashedOnce(make(value))
    _PARTS[id(value)] = (value, part)
    while len(_PARTS) > _PARTS_SIZE:
        del _PARTS[next(iter(_PARTS))]
    return part


def _strategies_part(strategies: tuple) -> HashedOnce:
    """Each node's placements (by identity), parameters and stage."""
    return _part_of(strategies, lambda all_: tuple(
        (s.node, id(s.inputs), id(s.outputs), id(s.params), id(s.produced), s.stage) for s in all_))


def _layout_part(layout) -> HashedOnce:
    """What prices one MoE layer: ``(module, mode, capacity factor, axis, all-to-all,
    placement, loads, sharded copies, tensor parallel)``."""
    return _part_of(layout, lambda l: (l.module, l.mode, l.capacity_factor, l.axis, l.all_to_all, l.placement,
                                      l.expert_loads, l.sharded_copies, l.tensor_parallel))
