"""Attention whose traced mask is causal runs as the causal kernel in graph programs.

Traced on meta, a Hugging Face decoder hands ``scaled_dot_product_attention`` an explicit
(B, 1, S, S) mask, which the trace proves causal (``planner.attention_masks``); replayed as
is, the program would run the masked kernel (no FlashAttention on CUDA, twice the work). The
program calls the op with ``attn_mask=None, is_causal=True`` instead: the same result (the
mask allows exactly ``j <= i``), priced as such by the cost model.

Only where the plan keeps the query sequence whole on every mesh axis: ``is_causal`` aligns the
diagonal with each rank's first local row, so a query split on the sequence (which reads its
rows of the explicit mask) keeps the mask. Data-parallel programs (DDP, ZeRO, FSDP) run the
user's model itself, where transformers chooses its kernel; this concerns graph programs only.
"""

from __future__ import annotations

from torch.distributed.tensor import Shard

from planner.attention_masks import CAUSAL_ARGUMENT, MASK_ARGUMENT, MASK_KEYWORDS, is_causal_kind
from planner.graph import OpNode
from planner.strategy import NodeStrategy

__all__ = ["runs_causal_kernel", "causal_arguments", "CAUSAL_KERNEL_COMMENT"]

CAUSAL_KERNEL_COMMENT = (
    "# the traced mask is causal (planner.attention_masks): the causal kernel, no explicit mask"
)


def runs_causal_kernel(op: str, opnode: OpNode | None, strategy: NodeStrategy | None) -> bool:
    """Whether attention op ``op`` (its graph node and the plan's strategy for it) is written
    as the causal kernel: its mask is proven causal and no mesh axis splits the query's
    sequence (dim 2 of (B, H, S, D))."""
    name = op.rsplit(".", 1)[0]
    if opnode is None or name not in MASK_ARGUMENT or not is_causal_kind(opnode.attention_mask_kind):
        return False
    if strategy is not None and strategy.inputs:
        query = strategy.inputs[0]
        if any(isinstance(p, Shard) and p.dim in (2, -2) for p in query):
            return False
    return True


def causal_arguments(op: str, args: list, kwargs: dict) -> tuple[list, dict]:
    """The attention op's arguments with the mask dropped and ``is_causal`` set."""
    name = op.rsplit(".", 1)[0]
    args, kwargs = list(args), dict(kwargs)
    mask_index, causal_index = MASK_ARGUMENT[name], CAUSAL_ARGUMENT[name]
    if len(args) > mask_index:
        args[mask_index] = None
    for keyword in MASK_KEYWORDS:
        kwargs.pop(keyword, None)
    if len(args) > causal_index:
        args[causal_index] = True
    else:
        kwargs["is_causal"] = True
    return args, kwargs
