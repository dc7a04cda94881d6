"""The PARAMETERS table of a deep model, written once per run of alike blocks.

A graph or pipeline program lists how each rank holds each parameter (``PARAMETERS``). An
80-layer model has some 700 of them, nearly all in blocks placed alike; like the block
functions (``codegen.block_fold``), the table writes such a run once, as a comprehension
over the blocks' indices::

    # layers.0 to layers.79 (80 blocks): each block's parameters placed alike
    **{
        'layers' + f".{index}." + name: placements
        for index in range(0, 80)
        for name, placements in (
            ('attention.wq.weight', TP_S0),  # (8192, 8192) -> (1024, 8192) per rank: S(0) on tp
            ...
        )
    },

Runs shorter than ``MIN_RUN`` blocks, and parameters outside blocks, keep one line each.
"""

from __future__ import annotations

from typing import Callable

from codegen.source_text import comment, with_comment
from planner.graph import OpGraph
from planner.strategy import Placements

MIN_RUN = 3  # blocks placed alike before the table writes them as one comprehension


def parameter_entries(
    placements: dict[str, Placements], graph: OpGraph, constant: Callable[[Placements], str], note: Callable[[str, Placements], str]
) -> list[str]:
    """The lines inside ``PARAMETERS = {...}``, in the order of ``placements`` (qualified name ->
    placements); ``constant`` names a placements constant, ``note`` gives a parameter's comment."""
    prefixes = {f"{group}.{index}.": (group, index) for group, index in graph.block_ids()}
    segments: list[tuple[tuple[str, int] | None, list[str]]] = []  # consecutive parameters of one block (or none)
    for name in placements:
        block = _block_of(name, prefixes)
        if segments and segments[-1][0] == block and block is not None:
            segments[-1][1].append(name)
        else:
            segments.append((block, [name]))
    lines: list[str] = []
    position = 0
    while position < len(segments):
        block, names = segments[position]
        run = 1
        if block is not None:
            signature = _signature(block, names, placements, constant)
            while position + run < len(segments):
                other, other_names = segments[position + run]
                if other != (block[0], block[1] + run) or _signature(other, other_names, placements, constant) != signature:
                    break
                run += 1
        if run >= MIN_RUN:
            lines += _comprehension(block, run, names, placements, constant, note)
        else:
            for _, plain in segments[position : position + run]:
                lines += [with_comment(f"    {name!r}: {constant(placements[name])},", note(name, placements[name])) for name in plain]
        position += run
    return lines


def _block_of(name: str, prefixes: dict[str, tuple[str, int]]) -> tuple[str, int] | None:
    """The block whose module holds parameter ``name`` (the longest matching prefix)."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        found = prefixes.get(".".join(parts[:cut]) + ".")
        if found is not None:
            return found
    return None


def _signature(block: tuple[str, int], names: list[str], placements: dict[str, Placements], constant) -> tuple:
    prefix = f"{block[0]}.{block[1]}."
    return tuple((name[len(prefix):], constant(placements[name])) for name in names)


def _comprehension(block, run: int, names: list[str], placements, constant, note) -> list[str]:
    group, first = block
    prefix = f"{group}.{first}."
    lines = [
        "    " + comment(f"{group}.{first} to {group}.{first + run - 1} ({run} blocks): each block's parameters placed alike"),
        "    **{",
        f"        {group!r} + f\".{{index}}.\" + name: placements",
        f"        for index in range({first}, {first + run})",
        "        for name, placements in (",
    ]
    for name in names:
        lines.append(with_comment(f"            ({name[len(prefix):]!r}, {constant(placements[name])}),", note(name, placements[name])))
    lines += ["        )", "    },"]
    return lines
