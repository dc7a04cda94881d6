"""What a compiled uneven data-parallel program imports (codegen layer): this rank's rows of
the global batch, by the plan's shares."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def share_rows(shares: Sequence[int], rank: int) -> tuple[int, int]:
    """``(start, stop)``: the rows of the global batch rank ``rank`` takes, consecutive, rank
    0 first."""
    start = sum(shares[:rank])
    return start, start + shares[rank]


def uneven_shard_batch(args: tuple, kwargs: dict, rank: int, shares: Sequence[int], sharded: Sequence[str],
                       names: Sequence[str]) -> tuple[tuple, dict]:
    """This rank's slice of one global batch: inputs named in ``sharded`` (split on dim 0
    over "dp") keep rows ``share_rows(shares, rank)``; the others are passed whole.
    ``names``: the inputs' names in positional order."""
    start, stop = share_rows(shares, rank)

    def local(name: str, value):
        if name in sharded and isinstance(value, torch.Tensor):
            return value[start:stop]
        return value

    positional = iter(names)
    return (tuple(local(next(positional), value) for value in args),
            {key: local(key, value) for key, value in kwargs.items()})
