"""What a compiled uneven data-parallel program imports (codegen layer): this rank's rows of
the global batch, by the plan's shares, and its forward and backward over its own
micro-batches when the plan accumulates gradients."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from planner.families.uneven_dp.shares import micro_batch_sizes
from planner.model_loss import extract_loss


def share_rows(shares: Sequence[int], rank: int) -> tuple[int, int]:
    """``(start, stop)``: the rows of the global batch rank ``rank`` takes, consecutive, rank
    0 first."""
    start = sum(shares[:rank])
    return start, start + shares[rank]


def rows_of(args: tuple, kwargs: dict, start: int, stop: int, sharded: Sequence[str],
            names: Sequence[str]) -> tuple[tuple, dict]:
    """Rows ``start:stop`` of the inputs named in ``sharded`` (split on dim 0 over "dp"); the
    others passed whole. ``names``: the inputs' names in positional order."""

    def local(name: str, value):
        if name in sharded and isinstance(value, torch.Tensor):
            return value[start:stop]
        return value

    positional = iter(names)
    return (tuple(local(next(positional), value) for value in args),
            {key: local(key, value) for key, value in kwargs.items()})


def uneven_shard_batch(args: tuple, kwargs: dict, rank: int, shares: Sequence[int], sharded: Sequence[str],
                       names: Sequence[str]) -> tuple[tuple, dict]:
    """This rank's slice of one global batch: inputs named in ``sharded`` (split on dim 0
    over "dp") keep rows ``share_rows(shares, rank)``; the others are passed whole.
    ``names``: the inputs' names in positional order."""
    return rows_of(args, kwargs, *share_rows(shares, rank), sharded, names)


def uneven_forward_backward(module: torch.nn.Module, args: tuple, kwargs: dict, rank: int, shares: Sequence[int],
                            steps: int, sharded: Sequence[str], names: Sequence[str]) -> tuple[torch.Tensor, None]:
    """One step's forward and backward of this rank on its share of the GLOBAL batch, in
    ``steps`` micro-batches of its own rows (``shares.micro_batch_sizes``: every rank runs
    the same number, smaller ones on a rank of fewer samples).

    Micro-batch j of m_j samples has its loss (a mean over its samples) multiplied by
    ``m_j * dp / B`` before backward: the flavour's reduction averages over the ``dp`` ranks,
    so the reduced gradient is ``sum_{r,j} (m_j / B) grad_{r,j}``, one device's gradient of
    the whole batch. DDP reduces after the last micro-batch only (``no_sync``), FSDP2
    reduce-scatters every one (the ranks run the same count, so the collectives pair up).
    Returns this rank's loss over its share (``sum_j m_j loss_j / b_r``, so that
    ``Program.loss_weight`` weights it as a rank without accumulation) and no output."""
    start, _ = share_rows(shares, rank)
    batch, dp = sum(shares), len(shares)
    weighted = []
    sizes = micro_batch_sizes(shares[rank], steps)
    for index, size in enumerate(sizes):
        part_args, part_kwargs = rows_of(args, kwargs, start, start + size, sharded, names)
        start += size
        last = index == len(sizes) - 1
        quiet = module.no_sync() if hasattr(module, "no_sync") and not last else contextlib.nullcontext()
        with quiet:
            loss = extract_loss(module(*part_args, **part_kwargs))
            (loss * (size * dp / batch)).backward()
        weighted.append(loss.detach() * size)
    return torch.stack(weighted).sum() / shares[rank], None
