"""Tensor parallelism on a ``tp`` axis inside a node: every op's sharding searched (SOAP),
Megatron's column/row-parallel blocks and sequence parallelism among the candidates.

Parts: candidates ``search.mesh_search.searched_candidates`` (shared with ``summa``: one
op-by-op search over every mesh), the per-op rules of ``search/rules/``, costs in the
simulator's per-op resharding (``cost_model.resharding``), emitter
``codegen.spmd_emit.compile_graph_plan`` (the traced graph replayed on DTensors, which also
compiles searched plans on ``dp`` alone that replicate some activations).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.families import Family
from planner.program_shape import is_data_parallel

if TYPE_CHECKING:
    from planner.plans import Plan


def _size(plan: "Plan", axis: str) -> int:
    return plan.mesh.axis_size(axis) if axis in plan.mesh.names else 1


def _graph_program(plan: "Plan") -> bool:
    return plan.pipeline is None and not plan.expert_layouts and not is_data_parallel(plan)


FAMILIES = (
    Family(
        "tp", "tensor parallel inside a node (SOAP, Megatron, sequence par.)", lambda plan: _size(plan, "tp") > 1,
        axes=("tp",), candidates="search.mesh_search:searched_candidates", search_order=30,
        emitter="codegen.spmd_emit:compile_graph_plan", claims=_graph_program, emit_order=80,
    ),
)
