"""Exact reductions of the intra-op model before CP-SAT sees it.

The CP-SAT model of ``search.ilp`` has one variable per (edge, producer placement, consumer
placement): tens of thousands on a transformer block. Many nodes are views, casts and
elementwise ops that touch nothing but the op before and the op after; their choice is
then a function of their two neighbours' choices, and they can be taken out of the model
without changing its optimum (the series and leaf reductions of graph-based MAP inference,
and what Alpa does when it merges "follow" ops into their producer, here done exactly):

    leaf      v reads u and nothing reads v:
              t'[u,c] = t[u,c] + min_k (t[v,k] + r[e](out[u,c], in[v,k]))
    source    v reads nothing and w reads v:
              t'[w,c] = t[w,c] + min_k (t[v,k] + r[e](out[v,k], in[w,c]))
    series    v reads u only and only w reads v: the two edges become one, u -> w, with
              r'(p, q) = min_k (t[v,k] + r[u->v](p, in[v,k]) + r[v->w](out[v,k], q))
    isolated  v touches no edge: min_k t[v,k] is a constant

A node is taken out only when the memory constraint cannot tell its candidates apart (they
all hold the same bytes) and no gradient-reduction variable z involves it (neither as the
reader that triggers one nor as the producer whose gradient is reduced), so the reduced
model has the same optimum as the whole one. Edges whose every placement pair is free carry
no information and are dropped. After the solve, ``expand`` gives each removed node the
candidate that achieves the minimum for its neighbours' choices (last removed first).

All costs are integer nanoseconds weighted by repeated-block counts, exactly the
coefficients CP-SAT would have had, so the reduced objective equals the original one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Edge:
    """Resharding between two modelled nodes: ``src[c]`` is the placement producer
    candidate c outputs, ``dst[k]`` the placement consumer candidate k reads (any hashable
    key: ``search.ilp`` numbers the placements, which hash slowly), and
    ``cost[src, dst]`` the weighted nanoseconds of that pair (every pair present)."""

    producer: str
    consumer: str
    name: str
    src: list
    dst: list
    cost: dict[tuple, int]

    def pair_cost(self, producer_choice: int, consumer_choice: int) -> int:
        return self.cost[self.src[producer_choice], self.dst[consumer_choice]]

    def groups(self) -> tuple[dict, dict]:
        """Placements that cost the same against every placement on the other side share one
        index: producer outputs with equal cost rows, consumer inputs with equal cost
        columns. The cost is constant on each (row group, column group), so pairing the
        groups instead of the placements is the same model with fewer y variables."""
        sources, targets = list(dict.fromkeys(self.src)), list(dict.fromkeys(self.dst))
        rows = {p: tuple(self.cost[p, q] for q in targets) for p in sources}
        columns = {q: tuple(self.cost[p, q] for p in sources) for q in targets}
        row_index: dict[tuple, int] = {}
        column_index: dict[tuple, int] = {}
        src_group = {p: row_index.setdefault(rows[p], len(row_index)) for p in sources}
        dst_group = {q: column_index.setdefault(columns[q], len(column_index)) for q in targets}
        return src_group, dst_group

    def size(self) -> int:
        """The y variables this edge needs (row groups x column groups)."""
        src_group, dst_group = self.groups()
        return len(set(src_group.values())) * len(set(dst_group.values()))


@dataclass
class _Removal:
    """How to choose a removed node's candidate once its neighbours are chosen."""

    node: str
    costs: list[int]
    incoming: Edge | None  # the edge from its producer (at the time of removal)
    outgoing: Edge | None  # the edge to its consumer


@dataclass
class IlpData:
    """The intra-op model as numbers: weighted node costs and memory per candidate, edges
    with their pair costs, and what the reductions took out.

    Attributes:
        costs: node -> weighted nanoseconds of each candidate (compute + communication).
        memory_kb: node -> weighted kilobytes of each candidate.
        edges: the resharding edges left in the model.
        pinned: nodes that take part in gradient-reduction constraints (never removed).
        offset_ns: objective of the removed nodes that no remaining variable accounts for.
        offset_kb: memory of the removed nodes (the same whatever they chose).
    """

    costs: dict[str, list[int]]
    memory_kb: dict[str, list[int]]
    edges: list[Edge]
    pinned: set[str]
    offset_ns: int = 0
    offset_kb: int = 0
    removed: list[_Removal] = field(default_factory=list)

    @property
    def nodes(self) -> list[str]:
        return list(self.costs)


def reduce_model(data: IlpData) -> IlpData:
    """Apply the leaf, source, series and isolated reductions until none applies (in place;
    returns ``data``). Deterministic: nodes are visited in their order in ``data.costs``,
    then the neighbours of each removed node again. A series reduction is refused when the
    merged edge would need more y variables than the two edges and the node it replaces
    (a node with one candidate between two nodes with many)."""
    edges = {id(edge): edge for edge in data.edges if any(edge.cost.values())}
    incoming: dict[str, list[Edge]] = {name: [] for name in data.costs}
    outgoing: dict[str, list[Edge]] = {name: [] for name in data.costs}
    for edge in edges.values():
        outgoing[edge.producer].append(edge)
        incoming[edge.consumer].append(edge)
    queue = deque(data.costs)
    while queue:
        name = queue.popleft()
        ins, outs = incoming.get(name), outgoing.get(name)
        if name not in data.costs or name in data.pinned or len(ins) > 1 or len(outs) > 1:
            continue
        if len(set(data.memory_kb[name])) > 1:
            continue  # the memory constraint tells its candidates apart
        before = ins[0] if ins else None
        after = outs[0] if outs else None
        merged = _series(data.costs[name], before, after) if before and after else None
        if merged is not None and merged.producer != merged.consumer and merged.size() > before.size() + after.size() + len(data.costs[name]):
            continue
        _remove(data, name, before, after, merged)
        for old in (before, after):
            if old is not None:
                edges.pop(id(old))
                outgoing[old.producer] = [e for e in outgoing[old.producer] if e is not old]
                incoming[old.consumer] = [e for e in incoming[old.consumer] if e is not old]
        if merged is not None and merged.producer != merged.consumer and any(merged.cost.values()):
            edges[id(merged)] = merged
            outgoing[merged.producer].append(merged)
            incoming[merged.consumer].append(merged)
        del incoming[name], outgoing[name]
        queue.extend(old.producer if old is before else old.consumer for old in (before, after) if old is not None)
    data.edges = list(edges.values())
    return data


def _series(costs: list[int], incoming: Edge, outgoing: Edge) -> Edge:
    """The edge u -> w that stands for u -> v -> w with v at its cheapest for each pair."""
    through: dict[tuple, int] = {}
    for k, node in enumerate(costs):  # each distinct (reads, writes) pair once, at its cheapest
        key = (incoming.dst[k], outgoing.src[k])
        through[key] = min(through.get(key, node), node)
    cost = {
        (p, q): min(node + incoming.cost[p, reads] + outgoing.cost[writes, q] for (reads, writes), node in through.items())
        for p in dict.fromkeys(incoming.src)
        for q in dict.fromkeys(outgoing.dst)
    }
    return Edge(incoming.producer, outgoing.consumer, f"{incoming.name}~{outgoing.name}", incoming.src, outgoing.dst, cost)


def _remove(data: IlpData, name: str, incoming: Edge | None, outgoing: Edge | None, merged: Edge | None) -> None:
    """Take ``name`` out: fold its cost into a neighbour, the objective's constant, or (in
    series) ``merged``, which the caller puts in the model."""
    costs = data.costs.pop(name)
    data.offset_kb += data.memory_kb.pop(name)[0]
    data.removed.append(_Removal(name, costs, incoming, outgoing))
    choices = range(len(costs))
    if incoming is None and outgoing is None:
        data.offset_ns += min(costs)
    elif outgoing is None:  # a leaf: fold into its producer's candidates
        best = {p: min(costs[k] + incoming.cost[p, incoming.dst[k]] for k in choices) for p in set(incoming.src)}
        producer = data.costs[incoming.producer]
        for c in range(len(producer)):
            producer[c] += best[incoming.src[c]]
    elif incoming is None:  # a source: fold into its consumer's candidates
        best = {q: min(costs[k] + outgoing.cost[outgoing.src[k], q] for k in choices) for q in set(outgoing.dst)}
        consumer = data.costs[outgoing.consumer]
        for c in range(len(consumer)):
            consumer[c] += best[outgoing.dst[c]]
    elif merged.producer == merged.consumer:  # u -> v -> u: a cost of u's own choice
        producer = data.costs[merged.producer]
        for c in range(len(producer)):
            producer[c] += merged.cost[merged.src[c], merged.dst[c]]


def expand(data: IlpData, choice: dict[str, int]) -> dict[str, int]:
    """``choice`` (the remaining nodes) plus a cheapest candidate for every removed node,
    given its neighbours' choices (last removed first, so they are known)."""
    choice = dict(choice)
    for removal in reversed(data.removed):
        def total(k: int, removal=removal) -> int:
            value = removal.costs[k]
            if removal.incoming is not None:
                value += removal.incoming.pair_cost(choice[removal.incoming.producer], k)
            if removal.outgoing is not None:
                value += removal.outgoing.pair_cost(k, choice[removal.outgoing.consumer])
            return value

        choice[removal.node] = min(range(len(removal.costs)), key=total)
    return choice
