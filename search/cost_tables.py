"""Per-candidate costs that the CP-SAT model and the exhaustive check both read.

For every node, each candidate strategy (one placement per mesh axis for every input and
output) gets a cost split into compute and communication seconds and a memory footprint;
every graph edge gets a resharding cost for each (producer output, consumer input)
placement pair. All numbers come from ``cost_model`` (the simulator's own functions), so
the search's objective and the simulation agree up to the simulator's overlap and
scheduling:

    node cost   = forward + backward time of its share of work
                + gradient reduction of its parameters over the axes they are replicated
                  on while the batch or work is split there (data-parallel sync)
    edge cost   = forward collective + backward dual of the placement change (per axis)
    input-gradient all-reduce (Megatron's f): a replicated activation read by an op whose
                  weights are split on an axis has a partial gradient there; it is summed
                  once per tensor and axis, however many readers trigger it (q, k and v
                  share one), and only when the tensor is replicated on that axis (a
                  gathered one is reduce-scattered by the gather's backward)
    node memory = its parameters' bytes after sharding x (weights + gradients + optimizer
                  states per element) + the activations it saves for backward
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch.distributed.tensor import Replicate, Shard

from cost_model.simulator import NodeCost, Simulator
from cost_model.parameter_bytes import PARAM_BYTES
from planner.graph import OpGraph, OpNode
from planner.strategy import NodeStrategy, Placements
from search.blocks import clone_strategy


@dataclass
class Candidate:
    """One way to run a node: its strategy and what it costs."""

    strategy: NodeStrategy
    compute_s: float
    communication_s: float
    memory_bytes: float
    # (input position, axis index) whose gradient is partial because of this choice
    gradient_reductions: tuple[tuple[int, int], ...] = ()

    @property
    def inputs(self) -> tuple[Placements, ...]:
        return self.strategy.inputs

    @property
    def output(self) -> Placements | None:
        return self.strategy.outputs[0] if self.strategy.outputs else None


class _TwinCandidate(Candidate):
    """A repeated block's candidate: its representative's costs, and the representative's
    strategy renamed for this node only when first read. The meshes that the lower bound
    skips read no strategy, and a solved mesh reads one per node, so most never are renamed
    (renaming all of them took about a tenth of DeepSeek-V3's planning time)."""

    def __init__(self, source: Candidate, graph: OpGraph, name: str):  # noqa: D107 - the class says it
        self.compute_s, self.communication_s = source.compute_s, source.communication_s
        self.memory_bytes, self.gradient_reductions = source.memory_bytes, source.gradient_reductions
        self._source, self._graph, self._name, self._strategy = source, graph, name, None

    @property
    def strategy(self) -> NodeStrategy:  # type: ignore[override]
        if self._strategy is None:
            self._strategy = clone_strategy(self._source.strategy, self._graph, self._name)
        return self._strategy


@dataclass
class CostTables:
    """Candidates of every node and the resharding cost of every edge."""

    graph: OpGraph
    candidates: dict[str, list[Candidate]]
    # (producer, consumer, input position) -> tensor metadata of the edge
    edges: list[tuple[str, str, int]] = field(default_factory=list)
    _edge_cost: dict[tuple, float] = field(default_factory=dict)
    simulator: Simulator | None = None

    def edge_cost(self, producer: str, consumer: str, position: int, src: Placements, dst: Placements) -> float:
        """Seconds to turn the producer's output ``src`` into what the consumer reads ``dst``."""
        if src == dst:
            return 0.0
        meta = self.graph.node(consumer).input_meta[position]
        key = (meta, src, dst)
        if key not in self._edge_cost:
            cost = NodeCost()
            self.simulator.node_costs.charge_edge(cost, meta, src, dst)
            self._edge_cost[key] = (cost.forward_comm_s + cost.backward_comm_s) * self.simulator.context.micro_batches
        return self._edge_cost[key]

    def reduction_cost(self, producer: str, axis_index: int) -> float:
        """Seconds of the backward all-reduce of ``producer``'s output gradient on one axis."""
        key = ("reduce", producer, axis_index)
        if key not in self._edge_cost:
            context = self.simulator.context
            axis, size = context.mesh.axes[axis_index]
            meta = self.graph.node(producer).output_meta[0]
            full = meta.nbytes * context.activation_scale / context.micro_batches
            self._edge_cost[key] = context.collective("all_reduce", full, axis) * context.micro_batches
        return self._edge_cost[key]

    def objective(self, choice: dict[str, int]) -> float:
        """The search's linear objective for one candidate index per node (exhaustive checks)."""
        total = 0.0
        reduced: set[tuple[str, int]] = set()
        for name, index in choice.items():
            candidate = self.candidates[name][index]
            total += candidate.compute_s + candidate.communication_s
        for producer, consumer, position in self.edges:
            src = self.candidates[producer][choice[producer]].output
            candidate = self.candidates[consumer][choice[consumer]]
            if src is None:
                continue
            total += self.edge_cost(producer, consumer, position, src, candidate.inputs[position])
            for where, axis_index in candidate.gradient_reductions:
                if where == position and isinstance(src[axis_index], Replicate):
                    reduced.add((producer, axis_index))
        return total + sum(self.reduction_cost(producer, axis) for producer, axis in reduced)

    def memory(self, choice: dict[str, int]) -> float:
        return sum(self.candidates[name][index].memory_bytes for name, index in choice.items())


def build_cost_tables(
    plan, graph: OpGraph, strategies_of: dict[str, list[NodeStrategy]], representative: dict[str, str] | None = None
) -> CostTables:
    """Cost every candidate of every node of ``graph`` under ``plan``'s mesh and cluster.

    Args:
        plan: a plan on the target mesh (its own strategies only seed the simulator).
        strategies_of: node name -> candidate strategies (first: the all-replicate one); only
            representatives need entries.
        representative: node -> the block-0 twin whose candidates it shares
            (``search.blocks.block_representatives``); twins get clones, costed once.
    """
    representative = representative or {node.name: node.name for node in graph.nodes}
    simulator = Simulator(plan, graph)
    tables = CostTables(graph=graph, candidates={}, simulator=simulator)
    names = {node.name for node in graph.nodes}
    for node in graph.nodes:
        twin = representative[node.name]
        if twin == node.name:
            tables.candidates[node.name] = [candidate_cost(simulator, node, s) for s in strategies_of[node.name]]
        else:
            tables.candidates[node.name] = [_TwinCandidate(c, graph, node.name) for c in tables.candidates[twin]]
        for position, source in enumerate(node.inputs):
            if source in names:
                tables.edges.append((source, node.name, position))
    return tables


def candidate_cost(simulator: Simulator, node: OpNode, strategy: NodeStrategy) -> Candidate:
    """What running ``node`` by ``strategy`` costs on its own (compute, its collectives and
    data-parallel gradient sync, memory), with ``simulator``'s plan and mesh."""
    context = simulator.context
    context.strategies[node.name] = strategy
    simulator.node_costs.first_use = {}  # input-gradient all-reduces are counted by the search per tensor
    cost = simulator.node_costs.compute(node, strategy, edges=[])
    mesh = context.mesh
    weight_b, grad_b, state_b = PARAM_BYTES[context.plan.precision]
    memory = cost.saved_bytes * context.micro_batches
    sync = 0.0
    for name, placements in strategy.params.items():
        meta = context.graph.parameters.get(name)
        if meta is None:
            continue
        shards = math.prod(size for (_, size), p in zip(mesh.axes, placements) if isinstance(p, Shard))
        elements = meta.numel / shards
        memory += elements * (weight_b + grad_b + state_b)
        # Data-parallel replicas sum their gradients over dp; other axes whose ranks saw other
        # rows are in the node's cost already (cost.axis_sync_s, cost_model.replica_gradients).
        if "dp" in mesh.names and mesh.axis_size("dp") > 1 and isinstance(placements[mesh.names.index("dp")], Replicate):
            sync += context.collective("all_reduce", elements * grad_b, "dp")
    reductions = []
    params = set(node.param_inputs)
    for index, (axis, size) in enumerate(mesh.axes):
        if axis in ("pp", "dp") or size == 1 or not any(isinstance(p[index], Shard) for p in strategy.params.values()):
            continue
        for position, name in enumerate(node.inputs):
            wanted = strategy.inputs[position]
            if name not in params and node.input_meta[position].dtype.is_floating_point and isinstance(wanted[index], Replicate):
                reductions.append((position, index))
    return Candidate(
        strategy=strategy,
        compute_s=(cost.forward_s + cost.backward_s) * context.micro_batches,
        communication_s=(cost.forward_comm_s + cost.backward_comm_s) * context.micro_batches + sync + cost.axis_sync_s,
        memory_bytes=memory,
        gradient_reductions=tuple(reductions),
    )
