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

A HuggingFace MoE block (Mixtral, Qwen3-MoE, ...: its own router, stacked SwiGLU experts,
dropless, no balance loss in the block) folds the same way without being replaced: its
experts become ``FoldedStackedExperts`` (``ExpertParallelExperts`` over the folded group,
gradients divided by dp), and ``fold_block_tokens`` hooks the block so that it runs on this
tp rank's ``1 / tp`` of the tokens and its output is all-gathered over tp; the gradients of
its other parameters (router, shared experts) are summed over tp. Routing is per token, so
which rank routes a token does not change it. The block keeps its module path and parameter
names (checkpoints and ``--check`` see the model's own names).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from codegen.runtime.expert_dispatch import ExpertParallelExperts
from codegen.runtime.materialize import set_derived_parameter
from codegen.runtime.moe import ExpertParallelMoE, gelu_experts, scaled_gradient
from codegen.runtime.summa import all_reduce_gradient

__all__ = [
    "FoldedExpertParallelMoE", "FoldedMoE", "FoldedStackedExperts", "SlicedExperts", "TokensOverTensorParallel",
    "expert_tensor_groups", "fold_block_tokens", "sum_gradients_over",
]


class FoldedExpertParallelMoE(ExpertParallelMoE):
    """``ExpertParallelMoE`` over the folded ``dp x tp`` group whose ranks' losses repeat
    ``tensor_parallel`` times (module docstring): expert gradients divided by dp, not dp x tp.

    With ``etp_group`` (expert tensor parallelism, ETP = its size): the placement gives each
    expert to the ETP consecutive ranks of that group, each taking a share of its slots, and
    each of them holds ``1 / ETP`` of the expert's hidden width (``SlicedExperts``): the
    group's buffers are all-gathered, each rank runs its slice on all of them, and the partial
    outputs are reduce-scattered back (Megatron-Core's expert tensor parallelism)."""

    def __init__(self, router_weight, expert_in, expert_out, placement, top_k: int, capacity_factor: float,
                 group=None, *, tensor_parallel: int, etp_group=None, **kwargs):
        sliced = etp_group is not None and dist.get_world_size(etp_group) > 1
        super().__init__(router_weight, expert_in, expert_out, placement, top_k, capacity_factor, group,
                         sharded_copies=sliced, **kwargs)
        self.tensor_parallel = tensor_parallel
        self.etp_group = etp_group if sliced else None
        if sliced:  # the experts' own module, each its slice of the width
            self.sharded_experts = SlicedExperts(expert_in, expert_out, self.local_experts, self._weights, etp_group)

    def expert_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """See ``ExpertParallelMoE.expert_gradient``; times tp (module docstring). A slice's
        gradient is complete on its rank (it saw every row of its ETP group)."""
        return super().expert_gradient(grad) * self.tensor_parallel

    def full_parameters(self):
        """See ``ExpertParallelMoE.full_parameters``; with ETP the slices put together."""
        if self.etp_group is None:
            return super().full_parameters()
        router, in_name, out_name = self.names
        found = {router: self._router_entry()}
        experts = self.sharded_experts
        for name, weight, dim in ((in_name, experts.w_in, 2), (out_name, experts.w_out, 1)):
            value = self._whole_slices(weight.detach(), dim)
            grad = None if weight.grad is None else self._whole_slices(weight.grad.detach(), dim)
            found[name] = (value, grad)
        return found

    def _whole_slices(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """Every expert whole from the ranks' slices (each (expert, slice) on one rank: summed)."""
        shape = [self.experts, *local.shape[1:]]
        shape[dim] = local.shape[dim] * self.sharded_experts.slices
        full = local.new_zeros(shape)
        start = self.sharded_experts.start
        for position, expert in enumerate(self.local_experts):
            full[expert].narrow(dim - 1, start, local.shape[dim]).copy_(local[position])
        dist.all_reduce(full, group=self.group)
        return full


class SlicedExperts(nn.Module):
    """This rank's experts with ``1 / ETP`` of their hidden width each (w1's columns and w2's
    rows ``[start, start + ffn / ETP)``, ETP the size of ``etp_group``, in its rank order).
    ``forward(buffer)``: the group's buffers all-gathered on the slot dim, this slice run on
    all of them, the partial outputs summed back to their rank (reduce-scatter)."""

    def __init__(self, expert_in, expert_out, local_experts: list[int], as_used, etp_group) -> None:
        super().__init__()
        self.group, self.slices, rank = etp_group, dist.get_world_size(etp_group), dist.get_rank(etp_group)
        ffn = expert_in.shape[2]
        if ffn % self.slices:
            raise ValueError(f"expert width {ffn} does not split over ETP={self.slices}; plan an ETP that divides it")
        piece = ffn // self.slices
        self.start = rank * piece
        set_derived_parameter(self, "w_in", expert_in, rows=local_experts, dim=2, start=self.start, stop=self.start + piece)
        set_derived_parameter(self, "w_out", expert_out, rows=local_experts, dim=1, start=self.start,
                              stop=self.start + piece)
        self.as_used = as_used  # a bound method of the layer: a plain attribute, not a submodule

    def forward(self, buffer: torch.Tensor) -> torch.Tensor:
        gathered = _GatherSlots.apply(buffer, self.group)
        partial = gelu_experts(gathered, *self.as_used(self.w_in, self.w_out))
        return _ReduceScatterSlots.apply(partial, self.group)


def expert_tensor_groups(size: int):
    """This rank's group of ``size`` consecutive ranks of the world (ETP innermost), made with
    every other such group (a collective: every rank calls it alike, once)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return mine


class _GatherSlots(torch.autograd.Function):
    """(experts, slots, C) of every rank concatenated on the slots; backward sums each rank's
    slots' gradients over the group (every slice contributed one)."""

    @staticmethod
    def forward(ctx, buffer, group):
        ctx.group, ctx.rank, ctx.slots = group, dist.get_rank(group), buffer.shape[1]
        pieces = [torch.empty_like(buffer) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, buffer.contiguous(), group=group)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad):
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed.narrow(1, ctx.rank * ctx.slots, ctx.slots).contiguous(), None


class _ReduceScatterSlots(torch.autograd.Function):
    """Partial outputs summed over the group, each rank keeping its own slots; backward
    gathers the slots' gradients (every slice needs every row's)."""

    @staticmethod
    def forward(ctx, partial, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.group = group
        summed = partial.contiguous().clone()
        dist.all_reduce(summed, group=group)
        slots = partial.shape[1] // world
        return summed.narrow(1, rank * slots, slots).contiguous()

    @staticmethod
    def backward(ctx, grad):
        pieces = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(pieces, grad.contiguous(), group=ctx.group)
        return torch.cat(pieces, dim=1), None


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
        return all_reduce_gradient(grad.clone(), (self.tp_group,))

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


class FoldedStackedExperts(ExpertParallelExperts):
    """A HuggingFace block's stacked experts over the folded ``dp x tp`` group whose ranks'
    losses repeat ``tensor_parallel`` times (module docstring): expert gradients divided by
    dp, not dp x tp."""

    def __init__(self, experts: nn.Module, placement, top_k: int, group=None, *, tensor_parallel: int) -> None:
        super().__init__(experts, placement, top_k, group)
        self.tensor_parallel = tensor_parallel

    def expert_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """See ``ExpertParallelExperts.expert_gradient``; times tp (module docstring)."""
        return super().expert_gradient(grad) * self.tensor_parallel


def fold_block_tokens(block: nn.Module, tp_group, experts: nn.Module) -> None:
    """Make the HuggingFace MoE ``block`` run on this tp rank's ``1 / tp`` of its input's
    tokens (consecutive rows of batch x sequence) and all-gather its output over ``tp_group``;
    sum the gradients of its parameters outside ``experts`` over ``tp_group`` (each rank saw
    only its slice's tokens). ``block.forward(hidden)`` takes and returns (batch, seq, width)."""
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    shapes = []  # the input's shape, from the pre-hook to the hook of the same call

    def take_slice(module, args):
        hidden, *rest = args
        batch, seq, width = hidden.shape
        rows = batch * seq
        if rows % tp:
            raise ValueError(f"{rows} tokens per dp rank do not split over tp={tp}; plan a batch x sequence "
                             f"divisible by tp")
        shapes.append(hidden.shape)
        piece = rows // tp
        mine = _SliceRows.apply(hidden.reshape(rows, width), tp_group, rank, piece)
        return (mine.view(1, piece, width), *rest)

    def gather_output(module, args, output):
        shape = shapes.pop()
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"a folded HuggingFace MoE block returns one tensor; {type(module).__name__} returned "
                            f"{type(output).__name__}")
        whole = _GatherRows.apply(output.reshape(-1, shape[-1]), tp_group, rank)
        return whole.view(shape)

    block.register_forward_pre_hook(take_slice)
    block.register_forward_hook(gather_output)
    sum_gradients_over(block, tp_group, skip=experts)


def sum_gradients_over(module: nn.Module, group, skip: nn.Module | None = None) -> None:
    """Sum the gradients of ``module``'s parameters (those of ``skip`` left out) over
    ``group`` in backward, before a data-parallel wrapper averages them: each rank's copy saw
    a disjoint part of the work (its tokens, or its attention heads for a per-head norm)."""
    own = set() if skip is None else {id(weight) for weight in skip.parameters()}
    for weight in module.parameters():
        if id(weight) not in own and weight.requires_grad:
            weight.register_hook(lambda grad: all_reduce_gradient(grad.clone(), (group,)))
