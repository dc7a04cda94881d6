"""The optimizers a compiled program's step may use, by the name a plan or flag gives them.

One table for every part of the runtime that builds or names the step's optimizer: the
training loop, the parity check, the comm audit, and the compile-time check of a plan.
"""

from __future__ import annotations

import torch

OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The optimizer class of the step: ``adamw`` (the plan's default) or ``sgd``."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer '{name}' (adamw or sgd)")
    return OPTIMIZERS[name]


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    """The single-device optimizer of the step over ``params``: ``adamw`` or ``sgd``."""
    return optimizer_class(name)(params, lr=lr)
