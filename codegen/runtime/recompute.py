"""Activation recomputation for module-level programs (DDP, ZeRO, FSDP2).

A plan with ``recompute="full"`` keeps, for each repeated block, only the block's inputs for
backward and runs the block's forward again when backward reaches it. Generated programs
call ``recompute_in_backward`` on every block before wrapping the model in DDP or FSDP2, so
the wrappers' hooks (FSDP2's all-gathers, DDP's bucket hooks) stay outside the recomputed
region and parameter names do not change. With ``recompute="selective"`` the modules are
the blocks' attention cores instead (``codegen.attention_core``).
"""

from __future__ import annotations

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def recompute_in_backward(module: nn.Module) -> nn.Module:
    """Make ``module``'s forward run under non-reentrant activation checkpointing: backward
    recomputes its intermediate activations instead of keeping them. Returns ``module``."""
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed_forward
    return module
