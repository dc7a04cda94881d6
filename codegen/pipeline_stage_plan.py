"""A pipeline plan as its stages see it (``codegen.pipeline_emit``): the stage mesh (the plan's
mesh without ``pp``), the plan's strategies for the graph traced at one micro-batch, and the
flat program the dry run checks (all stages in one forward)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.tensor import Replicate

from codegen.micro_batch_source import first_micro_batch_only
from codegen.spmd_emit import GraphEmitter
from planner.graph import OpGraph
from planner.plans import Plan
from planner.strategy import Mesh

PP_AXIS = "pp"


class StagePlan:
    """``plan`` as one stage sees it: the mesh without ``pp``, placements without their ``pp``
    entry, no pipeline. Everything else is the plan's."""

    def __init__(self, plan: Plan, strategies=None):
        self._plan = plan
        index = plan.mesh.names.index(PP_AXIS)
        axes = tuple(axis for axis in plan.mesh.axes if axis[0] != PP_AXIS)
        self.padded = not axes
        self.mesh = Mesh(axes or (("dp", 1),))

        def drop(placements):
            if placements is None:
                return None
            kept = tuple(p for i, p in enumerate(placements) if i != index)
            return kept or (Replicate(),)

        self.strategies = tuple(
            dataclasses.replace(
                s,
                inputs=tuple(drop(p) for p in s.inputs),
                outputs=tuple(drop(p) for p in s.outputs),
                params={name: drop(p) for name, p in s.params.items()},
                produced=tuple(drop(p) for p in s.produced) if s.produced else None,
            )
            for s in (plan.strategies if strategies is None else strategies)
        )
        self.inputs = {name: drop(p) for name, p in plan.inputs.items()}
        self.pipeline = None
        self.recompute = "none"

    @property
    def world_size(self) -> int:
        return self.mesh.size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plan, name)


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
    import difflib

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


def flat_source(stage_plan: StagePlan, graph: OpGraph, facts, observed, forced, micro: int) -> str:
    """The graph program of one micro-batch on the stage mesh, all stages in one forward: what
    the dry run runs (its ``shard_batch`` keeps the first micro-batch of the example batch)."""
    source = GraphEmitter(stage_plan, graph, facts, observed, forced, "", local_replicated=False).render()
    return source + first_micro_batch_only(micro)
