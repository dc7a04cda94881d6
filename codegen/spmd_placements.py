"""The placements a graph program works with: what each value of ``forward`` holds, and the
small rules codegen applies to the plan's placements (parameters and inputs are whole
values, dropout cannot draw on partial sums, ...)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard

from planner.strategy import NodeStrategy, Placements


@dataclass
class Value:
    """A value of the generated forward: its Python name and what it holds.

    ``kind`` is ``"dt"`` (a DTensor), ``"plain"`` (a tensor computed locally, the same on
    every rank), ``"seq_dt"``/``"seq_plain"`` (a list of them, from a multi-output op) or
    ``"other"``. ``placements`` are the planned ones of a DTensor (per element for a list).
    """

    expr: str
    kind: str
    placements: Any = None
    param: str | None = None  # qualified name, for parameters
    exact: bool = False  # placements known for certain (inputs, parameters), not only planned
    elements: list["Value"] | None = None  # the values of a tuple built here (an inlined subgraph's results)


def dropout_without_partials(strategy: NodeStrategy, read_as: Placements | None, comments: list[str]) -> NodeStrategy:
    """Dropout of partial sums, in plan files written before the rules stopped offering it
    (``search.rules.pointwise``: each rank would draw its own mask); DTensor cannot draw
    random numbers for partial values either. On
    those axes the sums are resharded first into the layout the dropout's consumer reads
    (a reduce-scatter under sequence parallelism), or summed whole (an all-reduce)."""
    wanted = strategy.inputs[0]
    if not any(isinstance(p, Partial) for p in wanted):
        return strategy
    target = tuple(
        (r if read_as is not None and not isinstance(r, Partial) else Replicate()) if isinstance(p, Partial) else p
        for p, r in zip(wanted, read_as or wanted)
    )
    comments.append("# dropout draws its mask on summed values: DTensor cannot draw one for partial sums")
    return dataclasses.replace(
        strategy,
        inputs=(target, *strategy.inputs[1:]),
        outputs=(target, *strategy.outputs[1:]),
        produced=None,
    )


def splits_rows(strategy: NodeStrategy | None) -> bool:
    """Whether an embedding's table (its first input) is split on rows (the vocabulary)."""
    if strategy is None or not strategy.inputs:
        return False
    return any(getattr(p, "dim", None) == 0 and not isinstance(p, (Partial, Replicate)) for p in strategy.inputs[0])


def planned_input(strategy: NodeStrategy | None, opnode, name: str) -> Placements | None:
    if strategy is None or opnode is None or name not in opnode.inputs:
        return None
    index = opnode.inputs.index(name)
    return tuple(strategy.inputs[index]) if index < len(strategy.inputs) else None


def all_replicate(placements: Placements | None) -> bool:
    return placements is not None and all(isinstance(p, Replicate) for p in placements)


def whole(placements: Placements) -> Placements:
    """Parameters and inputs are whole values, never partial sums: ``P`` is held as ``R``."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def same(a, b) -> bool:
    from codegen.runtime.spmd import same_placements

    return same_placements(a, b)


# Data-parallel flavours that keep weights (and so their gradients and optimizer states)
# split over ``dp`` between uses, composed with the other axes of a graph program.
SHARDED_OVER_DP = ("zero2", "fsdp")


def held_over_dp(placements: Placements, shape, axes, sizes, dp_flavour: str) -> Placements:
    """How a graph program holds a parameter between uses under ``dp_flavour``.

    DDP keeps it as its readers want it (whole over ``dp``). ZeRO-2 and FSDP split it over
    ``dp`` too, on the first dimension no other axis splits that is at least ``dp`` long
    (so DTensor never nests two splits of one dimension, whose gathers need strided layouts):
    each rank then holds, steps and keeps optimizer states for 1/dp of it, every reader
    gathers it over ``dp`` first (an all-gather), and that gather's backward reduce-scatters
    the gradient's partial sums over ``dp``. A parameter with no such dimension (a bias
    already split by ``tp``) stays whole over ``dp``."""
    if dp_flavour not in SHARDED_OVER_DP or "dp" not in axes:
        return placements
    dp_index = axes.index("dp")
    if sizes[dp_index] == 1 or not isinstance(placements[dp_index], Replicate):
        return placements
    taken = {p.dim for p in placements if hasattr(p, "dim") and not isinstance(p, (Replicate, Partial))}
    for dim, length in enumerate(shape):
        local = length // max(1, _ranks_splitting(placements, sizes, dim))
        if dim not in taken and local >= sizes[dp_index]:
            return tuple(Shard(dim) if i == dp_index else p for i, p in enumerate(placements))
    return placements


def _ranks_splitting(placements: Placements, sizes, dim: int) -> int:
    ranks = 1
    for placement, size in zip(placements, sizes):
        if getattr(placement, "dim", None) == dim and not isinstance(placement, (Replicate, Partial)):
            ranks *= size
    return ranks
