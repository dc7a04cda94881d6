"""Repeated blocks: which node of its run's first block stands for each node of the other blocks.

Blocks of one run have the same ops on the same shapes (``planner.trace`` marks them only
then), so node k of every block can share the candidates, costs and decision of node k of
the run's first block: the search enumerates, prices and solves one block per run, whatever
the depth (DeepSeek-V3: one dense layer and one MoE layer).
"""

from __future__ import annotations

from planner.graph import OpGraph
from planner.strategy import NodeStrategy


def block_representatives(graph: OpGraph) -> dict[str, str]:
    """Every node -> the node that decides for it (itself, or its twin in the first block of
    its run, for the runs of the first stack of repeated blocks)."""
    representative = {node.name: node.name for node in graph.nodes}
    group = next(iter(graph.blocks), None)
    if group is None:
        return representative
    members: dict[int, list[str]] = {}
    for node in graph.nodes:
        if node.block is not None and node.block[0] == group:
            members.setdefault(node.block[1], []).append(node.name)
    for run in graph.block_runs:
        if run.group != group:
            continue
        first = members[run.start]
        for index in run.indices:
            for position, name in enumerate(members[index]):
                representative[name] = first[position]
    return representative


def clone_strategy(strategy: NodeStrategy, graph: OpGraph, name: str) -> NodeStrategy:
    """``strategy`` of a block-0 node, made for its twin ``name`` (own module and parameters)."""
    source, target = graph.node(strategy.node), graph.node(name)
    renamed = dict(zip(source.params, target.params))
    return strategy.replaced(
        node=name,
        module=target.module,
        params={renamed.get(param, param): placements for param, placements in strategy.params.items()},
    )
