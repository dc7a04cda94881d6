"""Megatron-style tensor-parallel layers over a process group, as plain modules: what a
folded MoE program (``codegen.moe_folding_emit``) puts in place of the dense layers.

Shoeybi et al. 2019 (Megatron-LM), section 3: between blocks the activations are whole on
every rank of the tensor-parallel group. A column-parallel linear keeps a slice of the output
features (its input's gradient is all-reduced in backward: ``copy_to_group``), a row-parallel
linear a slice of the input features (its partial outputs are all-reduced in forward:
``reduce_from_group``); attention runs each rank's heads. The embedding is split over the
vocabulary (each rank looks up its rows, the others read zeros, summed over the group).

Every layer keeps its slices as parameters derived from the model's own
(``codegen.runtime.materialize.set_derived_parameter``) and gathers them whole again by their
names in the module it replaced (``full_parameters``, what ``launch.py --check`` compares).
Slices are ``torch.tensor_split`` pieces in group-rank order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from codegen.runtime.materialize import set_derived_parameter
from codegen.runtime.summa import replicated

__all__ = [
    "ColumnParallelLinear", "HeadParallelSelfAttention", "RowParallelLinear", "VocabParallelEmbedding",
    "copy_to_group", "gather_last_dim", "reduce_from_group",
]


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` in forward; its gradient all-reduced over ``group`` in backward (Megatron's f)."""
    return replicated(x, (group,))


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` all-reduced over ``group`` in forward; the gradient as it is in backward (g)."""
    return _ReduceFromGroup.apply(x, group)


def gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """The ranks' ``x`` concatenated on the last dim in rank order; backward keeps this
    rank's piece of the gradient (the gradient is the same on every rank)."""
    return _GatherLastDim.apply(x, group)


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.width = group, dist.get_rank(group), x.shape[-1]
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None


def _bounds(size: int, group) -> tuple[int, int]:
    """[start, stop) of this rank's piece of ``size`` (``torch.tensor_split`` order)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if size % world:
        raise ValueError(f"a tensor-parallel split of {size} over {world} ranks is uneven; plan a tp that divides {size}")
    piece = size // world
    return rank * piece, (rank + 1) * piece


def _gathered(local: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The ranks' pieces of a sliced tensor concatenated on ``dim`` (a collective)."""
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def _entry(param: torch.Tensor, dim: int | None, group, rows=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(value, gradient) of a parameter whole: gathered on ``dim`` (None: already whole); ``rows``
    reorders the gathered rows when the pieces were not consecutive rows."""
    gather = (lambda t: t) if dim is None else (lambda t: _gathered(t, dim, group))
    value = gather(param.detach())
    grad = None if param.grad is None else gather(param.grad.detach())
    if rows is not None:  # rows were taken out of order: put them back
        value, grad = rows(value), None if grad is None else rows(grad)
    return value, grad


class ColumnParallelLinear(nn.Module):
    """``linear`` with its output features split over ``group``; with ``gather_output`` the
    pieces are concatenated again (for a consumer that needs every feature, such as a loss)."""

    def __init__(self, linear: nn.Linear, group=None, gather_output: bool = False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        start, stop = _bounds(linear.out_features, group)
        set_derived_parameter(self, "weight", linear.weight, dim=0, start=start, stop=stop)
        self.bias = None
        if linear.bias is not None:
            set_derived_parameter(self, "bias", linear.bias, dim=0, start=start, stop=stop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_group(x, self.group), self.weight, self.bias)
        return gather_last_dim(y, self.group) if self.gather_output else y

    def full_parameters(self):
        """The replaced linear's ``weight`` and ``bias``, whole (a collective)."""
        found = {"weight": _entry(self.weight, 0, self.group)}
        if self.bias is not None:
            found["bias"] = _entry(self.bias, 0, self.group)
        return found


class RowParallelLinear(nn.Module):
    """``linear`` with its input features split over ``group``: its input is this rank's
    slice of the features (a column-parallel layer's output); the partial products are
    summed over the group, then the (whole, replicated) bias is added."""

    def __init__(self, linear: nn.Linear, group=None):
        super().__init__()
        self.group = group
        start, stop = _bounds(linear.in_features, group)
        set_derived_parameter(self, "weight", linear.weight, dim=1, start=start, stop=stop)
        self.bias = None
        if linear.bias is not None:  # whole on every rank: added once, after the sum
            set_derived_parameter(self, "bias", linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_group(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def full_parameters(self):
        """The replaced linear's ``weight`` (gathered) and ``bias`` (whole already)."""
        found = {"weight": _entry(self.weight, 1, self.group)}
        if self.bias is not None:
            found["bias"] = _entry(self.bias, None, self.group)
        return found


class VocabParallelEmbedding(nn.Module):
    """``embedding`` with its rows (the vocabulary) split over ``group``: each rank looks up
    the ids in its rows, zeros for the others, and the group sums the lookups."""

    def __init__(self, embedding: nn.Embedding, group=None):
        super().__init__()
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("a vocabulary-parallel embedding here has no padding_idx or max_norm; plan it replicated")
        self.group = group
        self.start, self.stop = _bounds(embedding.num_embeddings, group)
        set_derived_parameter(self, "weight", embedding.weight, dim=0, start=self.start, stop=self.stop)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        local = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return reduce_from_group(local.masked_fill(outside.unsqueeze(-1), 0.0), self.group)

    def full_parameters(self):
        """The replaced embedding's ``weight``, whole (a collective)."""
        return {"weight": _entry(self.weight, 0, self.group)}


class HeadParallelSelfAttention(nn.Module):
    """Causal self-attention with a fused q|k|v projection ``c_attn`` and an output
    projection ``c_proj`` (``examples/gpt.py``'s and ``examples/moe.py``'s
    ``CausalSelfAttention``), each rank running ``n_head / group size`` of the heads: its
    q, k and v rows of ``c_attn`` (column parallel) and its columns of ``c_proj`` (row
    parallel)."""

    def __init__(self, attention: nn.Module, group=None):
        super().__init__()
        self.group = group
        width = attention.c_proj.in_features
        world = dist.get_world_size(group)
        if attention.n_head % world:
            raise ValueError(f"{attention.n_head} heads do not split over {world} ranks; plan a tp that divides them")
        self.heads = attention.n_head // world
        start, stop = _bounds(width, group)
        self.rows = [part * width + row for part in range(3) for row in range(start, stop)]  # q, k, v rows
        set_derived_parameter(self, "qkv_weight", attention.c_attn.weight, rows=self.rows)
        self.qkv_bias = None
        if attention.c_attn.bias is not None:
            set_derived_parameter(self, "qkv_bias", attention.c_attn.bias, rows=self.rows)
        self.proj = RowParallelLinear(attention.c_proj, group)
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.size()
        local = self.width // dist.get_world_size(self.group)
        qkv = F.linear(copy_to_group(x, self.group), self.qkv_weight, self.qkv_bias)
        q, k, v = (t.view(batch, seq, self.heads, local // self.heads).transpose(1, 2) for t in qkv.split(local, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(batch, seq, local))

    def _qkv_whole(self, gathered: torch.Tensor) -> torch.Tensor:
        """The fused q|k|v rows as one device holds them, from the ranks' pieces in rank
        order (each piece: its q rows, then k, then v)."""
        world, local = dist.get_world_size(self.group), self.width // dist.get_world_size(self.group)
        pieces = gathered.reshape(world, 3, local, *gathered.shape[1:])
        return pieces.transpose(0, 1).reshape(3 * self.width, *gathered.shape[1:])

    def full_parameters(self):
        """``c_attn.weight``/``bias`` and ``c_proj.weight``/``bias`` of the replaced module, whole."""
        found = {"c_attn.weight": _entry(self.qkv_weight, 0, self.group, self._qkv_whole)}
        if self.qkv_bias is not None:
            found["c_attn.bias"] = _entry(self.qkv_bias, 0, self.group, self._qkv_whole)
        found.update({f"c_proj.{name}": entry for name, entry in self.proj.full_parameters().items()})
        return found
