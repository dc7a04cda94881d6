"""A starting solution for CP-SAT on a SUMMA mesh: every op in the block layout where it has
one, each op reading what its producers make where it can.

Walks the graph in order and gives each node the candidate whose tensor inputs match the
most of its producers' chosen outputs (no resharding), SUMMA layouts first among equals
(so a 3-D MLP alternates ``swapped`` by itself: only the alternate one reads its input as
it comes), then the earliest candidate. Greedy and deterministic; the search improves it.
"""

from __future__ import annotations

from planner.graph import OpGraph


def summa_hint(graph: OpGraph, candidates: dict[str, list]) -> dict[str, int]:
    """Node name -> candidate index (``search.cost_tables.Candidate`` lists by node)."""
    chosen: dict[str, int] = {}
    for node in graph.nodes:
        options = candidates.get(node.name)
        if not options:
            continue

        def score(index: int) -> tuple:
            strategy = options[index].strategy
            matches = 0
            for position, source in enumerate(node.inputs):
                if source in chosen and position < len(strategy.inputs):
                    made = candidates[source][chosen[source]].strategy.outputs
                    matches += bool(made) and made[0] == strategy.inputs[position]
            return (matches, strategy.layout is not None, -index)

        chosen[node.name] = max(range(len(options)), key=score)
    return chosen
