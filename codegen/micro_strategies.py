"""A plan's strategies for its model traced at another batch size (one micro-batch).

Pipeline programs and graph programs that accumulate gradients run the graph traced at one
micro-batch; the plan's strategies name the ops of the graph traced at the global batch.

Below both emitters that need it (``codegen.spmd_emit``, ``codegen.pipeline_emit``), so
neither imports the other for it.
"""

from __future__ import annotations

import dataclasses
import difflib

from planner.graph import OpGraph
from planner.plans import Plan


def micro_strategies(plan: Plan, graph: OpGraph, micro: int) -> tuple:
    """The plan's strategies for the graph traced at one micro-batch. Usually it has the same
    ops in the same order, under other names (an op's name digests its arguments, sizes
    included: ``planner.node_names``), and each op takes the strategy of the op at its place.
    Traced at a micro-batch of one sample, export may drop ops that do nothing there (an
    ``expand`` or ``contiguous`` over the batch): then the two op sequences are aligned, and
    each op of the micro-batch graph takes the strategy of the op it matches."""
    if [n.name for n in graph.nodes] == [s.node for s in plan.strategies]:
        return plan.strategies
    planned = list(plan.strategies)
    if [s.op for s in planned] == [n.op for n in graph.nodes]:
        return tuple(dataclasses.replace(s, node=n.name) for s, n in zip(planned, graph.nodes))
    matcher = difflib.SequenceMatcher(a=[s.op for s in planned], b=[n.op for n in graph.nodes], autojunk=False)
    strategies: list = [None] * len(graph.nodes)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for i, j in zip(range(i1, i2), range(j1, j2)):
                strategies[j] = dataclasses.replace(planned[i], node=graph.nodes[j].name)
        elif tag != "delete":
            op = graph.nodes[j1].op
            raise NotImplementedError(
                f"traced at one micro-batch ({micro} samples) the model has ops the plan has not (e.g. {op} "
                f"'{graph.nodes[j1].name}'); plan with larger micro-batches"
            )
    return tuple(strategies)
