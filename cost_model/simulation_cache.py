"""What simulators share: per-graph facts, and the node costs of plans simulated lately.

A search simulates thousands of nodes for every plan, and many plans in a row differ only in
what node costs do not read (recomputation, the dp flavour): ``Simulator`` takes their node
costs and segments from ``RECENTLY_COSTED`` rather than costing every node again, and the
facts that depend on the graph alone from ``graph_facts``. Both give exactly what computing
afresh gives; they only skip the work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.graph import OpGraph, OpNode
from planner.program_shape import is_data_parallel


@dataclass
class Costed:
    """What a ``Simulator`` derives from a plan's strategies before scheduling anything."""

    keep: tuple  # the strategies, graph, its facts and the cluster the key's identities belong to
    cache: dict[tuple, object]  # cost_model.node_costs.NodeCosts.cache
    first_use: dict[tuple, str]
    costs: dict[str, object]  # node name -> cost_model.node_costs.NodeCost
    segments: list  # cost_model.segments.Segment


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

    def get(self, key: tuple) -> Costed | None:
        return self.entries.get(key)

    def put(self, key: tuple, costed: Costed) -> None:
        self.entries[key] = costed
        while len(self.entries) > self.size:
            del self.entries[next(iter(self.entries))]


RECENTLY_COSTED = RecentlyCosted(size=8)


def costing_key(plan, graph: OpGraph, micro_batches: int) -> tuple:
    """What node costs and segments depend on: the graph, cluster, mesh, precision and
    micro-batch count, whether the program is plain data parallel, whether fused splits are
    local, whether the sequence-parallel collectives overlap GEMMs, each node's placements,
    parameters and stage, and the MoE layers' layouts. Placements are compared by identity
    (a variant made with ``dataclasses.replace`` shares them; hashing thousands of placements
    by value costs more than costing the nodes); the entry keeps those objects alive, so an
    identity cannot be reused by another object."""
    return (
        id(graph), id(graph_facts(graph)), id(plan.cluster), plan.mesh, plan.precision, micro_batches,
        is_data_parallel(plan),  # graph programs pay DTensor's per-op dispatch (planner.cluster)
        plan.fused_splits_local,  # splits of fused projections gather or not (cost_model.split_gather)
        plan.tp_comm_overlap,  # sequence-parallel collectives hidden behind GEMMs (cost_model.tp_comm_overlap)
        plan.moe_a2a_overlap,  # all-to-alls under another micro-batch's compute (cost_model.moe_overlap)
        tuple((s.node, id(s.inputs), id(s.outputs), id(s.params), id(s.produced), s.stage) for s in plan.strategies),
        # MoE layers are priced by their layouts (their cost annotation aside).
        tuple(
            (layout.module, layout.mode, layout.capacity_factor, layout.axis, layout.all_to_all, layout.placement,
             layout.expert_loads, layout.sharded_copies)
            for layout in getattr(plan, "expert_layouts", ())
        ),
    )
