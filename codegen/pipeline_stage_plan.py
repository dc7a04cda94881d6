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


def flat_source(stage_plan: StagePlan, graph: OpGraph, facts, observed, forced, micro: int) -> str:
    """The graph program of one micro-batch on the stage mesh, all stages in one forward: what
    the dry run runs (its ``shard_batch`` keeps the first micro-batch of the example batch)."""
    source = GraphEmitter(stage_plan, graph, facts, observed, forced, "", local_replicated=False).render()
    return source + first_micro_batch_only(micro)
