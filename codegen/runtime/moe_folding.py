"""An MoE layer of a folded plan: the tensor-parallel dense part around it, its experts
split over every rank of ``dp x tp`` (Megatron-Core's MoE parallel folding, arXiv 2504.14960).

Around the layer, the ``tp`` ranks of one dp rank hold the same tokens (the dense layers are
tensor parallel: ``codegen.runtime.tensor_parallel_layers``). ``FoldedMoE`` moves them into the
expert layout and back:

1. Each tp rank takes its ``1 / tp`` of the dp rank's tokens (consecutive rows of the
   flattened batch x sequence: a local slice, no communication; backward all-gathers the
   slices' gradients, each rank then holding the whole gradient as the dense part expects).
2. The layer runs ``codegen.runtime.moe.ExpertParallelMoE`` over the folded group (every rank
   of ``dp x tp``, in mesh order): routing in the group's global order (which, rank by rank,
   is the whole batch's token order), the all-to-alls, the experts.
3. The outputs are all-gathered over ``tp`` (backward keeps this rank's slice of the
   gradient, which is the same on every tp rank).

Gradients. The step's loss is the mean of the dp ranks' losses, which every tp rank of a dp
rank computes alike; so the mean over all ``dp x tp`` ranks is that loss too. But each token
now reaches the experts and the router from one tp rank only:

- an expert's gradient sums every token's once, the whole batch's ``dp`` losses: divided by
  ``dp`` (``ExpertParallelMoE`` divides by the group, ``dp x tp``; ``FoldedExpertParallelMoE``
  multiplies back by ``tp``);
- the router's gradient on a rank holds its slice's tokens only: summed over ``tp`` (a hook,
  before the data-parallel wrapper averages it over ``dp``);
- the balance loss is one number every rank computes from the group's sums; its gradient
  reaches every rank's routing through the group's all-reduce, from all ``dp x tp`` ranks'
  losses, ``tp`` times per dp loss: divided by ``tp`` on the way in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from codegen.runtime.moe import ExpertParallelMoE, scaled_gradient

__all__ = ["FoldedExpertParallelMoE", "FoldedMoE", "TokensOverTensorParallel"]


class FoldedExpertParallelMoE(ExpertParallelMoE):
    """``ExpertParallelMoE`` over the folded ``dp x tp`` group whose ranks' losses repeat
    ``tensor_parallel`` times (module docstring): expert gradients divided by dp, not dp x tp."""

    def __init__(self, *args, tensor_parallel: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.tensor_parallel = tensor_parallel

    def expert_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """See ``ExpertParallelMoE.expert_gradient``; times tp (module docstring)."""
        return super().expert_gradient(grad) * self.tensor_parallel


class TokensOverTensorParallel:
    """Runs an MoE layer over the folded group on this tp rank's ``1 / tp`` of the tokens
    (steps 1 and 3 of the module docstring): ``(layer, x)`` -> (output gathered over tp, the
    layer's balance loss)."""

    def __init__(self, tp_group):
        self.group = tp_group
        self.tp, self.rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)

    def __call__(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, width = x.shape
        rows = batch * seq
        if rows % self.tp:
            raise ValueError(f"{rows} tokens per dp rank do not split over tp={self.tp}; plan a batch x sequence "
                             f"divisible by tp")
        piece = rows // self.tp
        mine = _SliceRows.apply(x.reshape(rows, width), self.group, self.rank, piece)
        output, balance = layer(mine.view(1, piece, width))
        whole = _GatherRows.apply(output.reshape(piece, width), self.group, self.rank)
        return whole.view(batch, seq, width), balance


class FoldedMoE(nn.Module):
    """``layer`` (a ``FoldedExpertParallelMoE`` over the folded group) run on this tp rank's
    slice of the tokens, its output gathered over ``tp_group`` (module docstring).
    ``forward(x)`` returns (output, balance loss) as ``examples/moe.py``'s ``MoE`` does."""

    def __init__(self, layer: FoldedExpertParallelMoE, tp_group):
        super().__init__()
        self.layer, self.tp_group = layer, tp_group
        self.tokens = TokensOverTensorParallel(tp_group)
        # The router's gradient from this rank's slice of the tokens, summed over tp.
        layer.router.register_hook(self._sum_over_tp)

    def _sum_over_tp(self, grad: torch.Tensor) -> torch.Tensor:
        summed = grad.clone()
        dist.all_reduce(summed, group=self.tp_group)
        return summed

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output, balance = self.tokens(self.layer, x)
        return output, scaled_gradient(balance, 1.0 / self.tokens.tp)

    def full_parameters(self):
        """The replaced layer's router and experts, whole (``ExpertParallelMoE``'s)."""
        return self.layer.full_parameters()


class _SliceRows(torch.autograd.Function):
    """This rank's ``piece`` rows; backward all-gathers the pieces' gradients."""

    @staticmethod
    def forward(ctx, rows, group, rank, piece):
        ctx.group = group
        return rows.narrow(0, rank * piece, piece).clone()

    @staticmethod
    def backward(ctx, grad):
        pieces = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(pieces, grad.contiguous(), group=ctx.group)
        return torch.cat(pieces), None, None, None


class _GatherRows(torch.autograd.Function):
    """Every rank's rows, in rank order; backward keeps this rank's rows of the gradient."""

    @staticmethod
    def forward(ctx, rows, group, rank):
        ctx.rank, ctx.piece = rank, rows.shape[0]
        pieces = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, rows.contiguous(), group=group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(0, ctx.rank * ctx.piece, ctx.piece).contiguous(), None, None
