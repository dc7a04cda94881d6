"""What each data-parallel flavour does, in the words of the report and the pipeline axes line."""

from __future__ import annotations

FLAVOUR_TEXT = {
    "ddp": "DDP: weights replicated, gradients all-reduced (bucketed, overlapped with backward)",
    "zero1": "ZeRO-1: optimizer states sharded over dp",
    "zero2": "ZeRO-2: optimizer states and gradients sharded over dp",
    "fsdp": "FSDP (ZeRO-3): weights, gradients and optimizer states sharded over dp; "
    "weights all-gathered per unit, gradients reduce-scattered",
}
