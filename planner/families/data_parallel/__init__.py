"""The data-parallel families: the whole model on every rank of ``dp``, the batch split over
it, from the most memory per device to the least (DDP, ZeRO-1, ZeRO-2, FSDP).

Parts: candidates ``search.data_parallel`` (the flavours on ``dp`` alone; beside other axes
``search.plan_variants.composed_flavours``), costs in the simulator's gradient and
weight-gathering tasks (``cost_model.step_tasks``, ``cost_model.step_memory``), emitter
``codegen.emit.render_data_parallel_program``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from planner.families import Family
from planner.program_shape import is_data_parallel

if TYPE_CHECKING:
    from planner.plans import Plan


def _uses(flavour: str) -> Callable[["Plan"], bool]:
    def uses(plan: "Plan") -> bool:
        return plan.dp_flavour == flavour and "dp" in plan.mesh.names and plan.mesh.axis_size("dp") > 1

    return uses


def _flavour(name: str, summary: str, order: int) -> Family:
    return Family(
        name, summary, _uses(name), data_parallel=True,
        candidates="search.data_parallel:data_parallel_candidates",
        emitter="codegen.emit:render_data_parallel_program", claims=is_data_parallel, emit_order=90,
        search_order=20 + order,
    )


FAMILIES = (
    _flavour("ddp", "data parallel, weights replicated, gradients all-reduced (DDP)", 0),
    _flavour("zero1", "data parallel, optimizer states sharded over dp (ZeRO-1)", 1),
    _flavour("zero2", "data parallel, gradients and optimizer states sharded (ZeRO-2)", 2),
    _flavour("fsdp", "data parallel, weights, gradients and states sharded (FSDP2)", 3),
)
