"""Recomputation that keeps what crossed the network (``recompute="full_keep_a2a"``).

A block checkpointed with ``recompute_in_backward_counting_once(module, keep_exchanges=True)``
(``codegen.runtime.moe``) runs its forward again in backward, as full recomputation does,
but each collective of its MoE layers (the dispatch and combine all-to-alls, the counts
exchanged before them, the routing's all-gather, the balance loss's all-reduce) does not
communicate again: forward keeps each one's output on the block's ``ExchangeTape`` and the
recomputation takes them back in the same order. What the block keeps per micro-batch is
then its input plus those outputs, as ``cost_model.recompute`` prices it; the dense part and
the experts' compute are recomputed.

Why this is exact: the recomputed forward runs the same code on the same inputs, so it
reaches the same collectives in the same order and, had they run, they would have returned
the same values. An autograd function around a collective (``all_to_all_rows``) still
runs in the recomputation and saves what it saved in forward, so the checkpoint sees the
same saved tensors; its backward (the reverse exchange) is the original graph's, unchanged.

A collective site calls ``kept_exchange(lambda: ...)`` around the call that communicates;
outside a block recomputed this way it just runs the call. ``keeping_exchanges`` is the
``context_fn`` of ``torch.utils.checkpoint`` that does this for one checkpointed call
(module programs pass it through ``recompute_in_backward_counting_once``, pipeline programs
write it into their ``checkpoint(...)`` calls). Every recomputation also says so
(``is_recomputing``): MoE layers count their routing in forward only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

__all__ = ["ExchangeTape", "is_recomputing", "kept_exchange", "keeping_exchanges", "recomputation"]

Value = TypeVar("Value")

# The tape of the block whose forward (recording) or recomputation (replaying) runs now.
_active: tuple[ExchangeTape, bool] | None = None
# How many checkpointed blocks backward is recomputing right now.
_recomputing = 0


def is_recomputing() -> bool:
    """Whether backward is re-running a checkpointed block whose checkpoint says so
    (``recomputation``): routing statistics are counted in forward only."""
    return _recomputing > 0


@contextlib.contextmanager
def recomputation() -> Iterator[None]:
    """The context a checkpoint's recomputation runs in (``is_recomputing`` is true there)."""
    global _recomputing
    _recomputing += 1
    try:
        yield
    finally:
        _recomputing -= 1


def keeping_exchanges() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
    a new tape for this call, recording in forward, replaying in the recomputation (which
    also runs under ``recomputation``)."""
    tape = ExchangeTape()
    return tape.recording(), _replaying(tape)


@contextlib.contextmanager
def _replaying(tape: ExchangeTape) -> Iterator[None]:
    with recomputation(), tape.replaying():
        yield


class ExchangeTape:
    """The outputs of one block's collectives for one forward, in the order it ran them."""

    def __init__(self) -> None:
        self.kept: list = []
        self.position = 0

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Forward: every ``kept_exchange`` runs its collective and keeps the output here."""
        with _activated(self, replaying=False):
            yield

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Backward's recomputation: every ``kept_exchange`` hands back the next kept output."""
        self.position = 0
        with _activated(self, replaying=True):
            yield

    def next_kept(self):
        """The output of the next collective forward ran (the recomputation's next site)."""
        if self.position >= len(self.kept):
            raise RuntimeError(
                "a recomputed block reached more collectives than its forward ran; its forward must not "
                "depend on anything but its inputs (recompute with 'full' instead)"
            )
        value = self.kept[self.position]
        self.position += 1
        return value


@contextlib.contextmanager
def _activated(tape: ExchangeTape, replaying: bool) -> Iterator[None]:
    global _active
    before, _active = _active, (tape, replaying)
    try:
        yield
    finally:
        _active = before


def kept_exchange(communicate: Callable[[], Value]) -> Value:
    """``communicate()``, a collective's call; inside a block recomputed with its exchanges
    kept, forward keeps what it returns and the recomputation gets that back without
    communicating. Tensors come back as new tensors on the kept storage (``detach``), so an
    autograd function that returns one gives it a gradient function of its own and leaves
    the forward graph's alone."""
    if _active is None:
        return communicate()
    tape, replaying = _active
    if replaying:
        return _fresh(tape.next_kept())
    value = communicate()
    tape.kept.append(value)
    return value


def _fresh(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh(item) for item in value)
    return value
