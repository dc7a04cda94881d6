"""The parallelism families a plan is made of, by name: what ``planner families`` lists and
``--family`` chooses among.

A plan belongs to every family whose parallelism it uses: ``megatron (pp=2 x dp=2 x tp=2;
...; zero1)`` is ``pipeline``, ``tp`` and ``zero1``. A plan on one device uses none.
Recomputation and gradient accumulation are not families: they change what a step keeps in
memory, not how the work is split, and every family may use them.

Vocabulary layer: reads a ``Plan``, imports nothing below the planner's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from planner.plans import Plan


def _data_parallel(flavour: str) -> Callable[["Plan"], bool]:
    def uses(plan: "Plan") -> bool:
        return plan.dp_flavour == flavour and _size(plan, "dp") > 1

    return uses


def _size(plan: "Plan", axis: str) -> int:
    return plan.mesh.axis_size(axis) if axis in plan.mesh.names else 1


@dataclass(frozen=True)
class Family:
    """One parallelism family: its name, one line about it, the mesh axes only it uses
    (a mesh with one of them larger than 1 needs the family), and whether a plan uses it."""

    name: str
    summary: str
    axes: tuple[str, ...]
    uses: Callable[["Plan"], bool]


FAMILIES: tuple[Family, ...] = (
    Family("ddp", "data parallel, weights replicated, gradients all-reduced (DDP)", (), _data_parallel("ddp")),
    Family("zero1", "data parallel, optimizer states sharded over dp (ZeRO-1)", (),
           _data_parallel("zero1")),
    Family("zero2", "data parallel, gradients and optimizer states sharded (ZeRO-2)", (), _data_parallel("zero2")),
    Family("fsdp", "data parallel, weights, gradients and states sharded (FSDP2)", (),
           _data_parallel("fsdp")),
    Family("tp", "tensor parallel on tp inside a node (SOAP, Megatron, sequence par.)", ("tp",), lambda plan: _size(plan, "tp") > 1),
    Family("summa", "2-D/2.5-D/3-D tensor-parallel matmuls, row x col x dep (SUMMA)", ("row", "col", "dep"),
           lambda plan: any(_size(plan, axis) > 1 for axis in ("row", "col", "dep"))),
    Family("pipeline", "pipeline stages on a pp axis (1F1B, interleaved schedules)", ("pp",),
           lambda plan: plan.pipeline is not None),
    Family("moe", "MoE layers by expert layout (expert/data parallel, sliced)", (), lambda plan: bool(plan.expert_layouts)),
)
FAMILY_NAMES: tuple[str, ...] = tuple(family.name for family in FAMILIES)
DATA_PARALLEL_FAMILIES = ("ddp", "zero1", "zero2", "fsdp")


def families_of(plan: "Plan") -> frozenset[str]:
    """The names of the families ``plan`` uses."""
    return frozenset(family.name for family in FAMILIES if family.uses(plan))


def family_of_axis(axis: str) -> str | None:
    """The family a mesh axis larger than 1 needs (``tp`` -> ``tp``, ``pp`` -> ``pipeline``),
    or None for ``dp``, which any data-parallel family uses."""
    return next((family.name for family in FAMILIES if axis in family.axes), None)


def family_table() -> list[tuple[str, str]]:
    """(name, one line) for every family, as ``planner families`` prints them."""
    return [(family.name, family.summary) for family in FAMILIES]
