"""What a compiled uneven tensor-parallel program imports (codegen layer): a linear layer split
over the ranks with uneven shares, and the uneven collectives it needs.

DTensor shards a dimension evenly (``Shard(d)`` gives every rank ``ceil(D / p)``), so uneven
shares use explicit collectives on plain tensors. Every rank holds the same activations
outside the split layers (the program runs every other op whole on every rank), so:

- ``gather_uneven``: each rank's slice of a dimension gathered whole on every rank without
  padding (``gather_slices``: an all-gather-v as one ``all_to_all_single`` with uneven
  split sizes, which gloo and NCCL both run; ``all_gather_into_tensor`` needs equal sizes,
  and gloo's ``all_gather`` too). Its backward keeps this rank's slice of the (replicated)
  gradient.
- ``scatter_uneven``: this rank's slice of a replicated tensor; backward gathers the slices'
  gradients (a gather-v), so the input's gradient is whole on every rank.
- ``copy_to_group`` / ``reduce_from_group`` (``codegen.runtime.tensor_parallel_layers``):
  Megatron's ``f`` (identity forward, gradient all-reduced) and ``g`` (all-reduce forward).

``UnevenLinear`` replaces an ``nn.Linear``: ``batch`` (its rows of the input, the weight
whole, the weight's gradient summed), ``column`` (its output features) or ``row`` (its input
features, partial outputs summed). ``fused`` (``planner.families.uneven_tp.regions``): a
column returns its slice of the output as it is, and a row takes its slice of the input as
it comes, so the elementwise ops between them run on the slice. Its weights are derived
from the model's (``codegen.runtime.materialize.set_derived_parameter``), so a rank built
on meta holds only its slice, and ``full_parameters`` gathers them whole for ``launch.py
--check``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from codegen.runtime.materialize import set_derived_parameter
from codegen.runtime.tensor_parallel_layers import copy_to_group, reduce_from_group
from planner.errors import LaunchError


def _slice_of(shares: Sequence[int], rank: int) -> tuple[int, int]:
    start = sum(shares[:rank])
    return start, shares[rank]


def gather_slices(local: torch.Tensor, dim: int, shares: Sequence[int], group) -> torch.Tensor:
    """The whole tensor from each rank's slice ``local`` of ``dim`` (rank r holding
    ``shares[r]``): the slices, moved to dim 0, sent to every rank by one
    ``all_to_all_single`` whose split sizes are the shares (no padding), then moved back."""
    dim = dim % local.dim()
    rows = local.movedim(dim, 0).contiguous()
    ranks = len(shares)
    whole = rows.new_empty((sum(shares), *rows.shape[1:]))
    dist.all_to_all_single(whole, rows.repeat(ranks, *([1] * (rows.dim() - 1))), output_split_sizes=list(shares),
                           input_split_sizes=[rows.shape[0]] * ranks, group=group)
    return whole.movedim(0, dim).contiguous()


class _GatherUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, dim, shares, rank, group):
        ctx.dim, ctx.start, ctx.length = dim, *_slice_of(shares, rank)
        return gather_slices(local, dim, shares, group)

    @staticmethod
    def backward(ctx, grad):
        # Every rank holds the same gradient of the whole tensor: this rank's slice of it.
        return grad.narrow(ctx.dim % grad.dim(), ctx.start, ctx.length).contiguous(), None, None, None, None


class _ScatterUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, whole, dim, shares, rank, group):
        ctx.dim, ctx.shares, ctx.group = dim, shares, group
        start, length = _slice_of(shares, rank)
        return whole.narrow(dim % whole.dim(), start, length).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return gather_slices(grad.contiguous(), ctx.dim, ctx.shares, ctx.group), None, None, None, None


def gather_uneven(local, dim: int, shares: Sequence[int], rank: int, group) -> torch.Tensor:
    """The whole of ``dim`` from every rank's slice (backward: this rank's slice)."""
    return _GatherUneven.apply(local, dim, tuple(shares), rank, group)


def scatter_uneven(whole, dim: int, shares: Sequence[int], rank: int, group) -> torch.Tensor:
    """This rank's slice of ``dim`` of a replicated tensor (backward: the slices gathered)."""
    return _ScatterUneven.apply(whole, dim, tuple(shares), rank, group)


class UnevenLinear(nn.Module):
    """An ``nn.Linear`` split ``kind`` (``batch``, ``column`` or ``row``) over ``group``, this
    rank (``rank``) taking ``shares[rank]`` of the split dimension (module docstring).

    Raises:
        LaunchError: the shares do not add up to the dimension ``kind`` splits; one line.
    """

    def __init__(self, linear: nn.Linear, path: str, kind: str, shares: Sequence[int], rank: int, group,
                 fused: bool = False) -> None:
        super().__init__()
        self.kind, self.shares, self.rank, self.group, self.fused = kind, tuple(shares), rank, group, fused
        self.path = path
        out_features, in_features = linear.weight.shape
        wanted = {"column": out_features, "row": in_features}.get(kind)
        if wanted is not None and sum(self.shares) != wanted:
            raise LaunchError(f"the plan splits {path!r} ({kind}) into shares summing to {sum(self.shares)}, but the "
                              f"model's layer has {wanted}; re-plan for this model")
        start, length = _slice_of(self.shares, rank)
        if kind == "column":
            # Rows of dim 0 (not a range of it): how checkpoints save a part of a parameter
            # (codegen.runtime.derived_checkpoint).
            rows = range(start, start + length)
            set_derived_parameter(self, "weight", linear.weight, rows=rows)
            if linear.bias is not None:
                set_derived_parameter(self, "bias", linear.bias, rows=rows)
            else:
                self.register_parameter("bias", None)
        elif kind == "row":
            set_derived_parameter(self, "weight", linear.weight, dim=1, start=start, stop=start + length)
        else:
            self.weight = linear.weight
        if kind != "column":
            # Whole on every rank: under row every rank adds it to the summed output, under
            # batch its gradient is summed like the weight's.
            self.register_parameter("bias", linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "column":
            local = F.linear(copy_to_group(x, self.group), self.weight, self.bias)
            return local if self.fused else gather_uneven(local, -1, self.shares, self.rank, self.group)
        if self.kind == "row":
            if self.fused and x.shape[-1] != self.shares[self.rank]:
                raise LaunchError(f"the plan fuses {self.path!r} with the split layers before it, but its input has "
                                  f"{x.shape[-1]} features, not this rank's {self.shares[self.rank]}; re-plan")
            part = x if self.fused else scatter_uneven(x, -1, self.shares, self.rank, self.group)
            local = F.linear(part, self.weight)
            summed = reduce_from_group(local, self.group)
            return summed if self.bias is None else summed + self.bias
        if x.shape[0] != sum(self.shares):
            raise LaunchError(f"the plan splits a layer's {sum(self.shares)} input rows by batch, but it got "
                              f"{x.shape[0]}; run the plan's batch size")
        rows = scatter_uneven(x, 0, self.shares, self.rank, self.group)
        bias = None if self.bias is None else copy_to_group(self.bias, self.group)
        local = F.linear(rows, copy_to_group(self.weight, self.group), bias)
        return gather_uneven(local, 0, self.shares, self.rank, self.group)

    def full_parameters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """The weight and bias whole, with their gradients (``codegen.runtime.parity``).
        Collective: every rank calls it."""
        found = {}
        for name, param in (("weight", self.weight), ("bias", self.bias)):
            if param is None:
                continue
            dim = {"column": 0, "row": 1 if name == "weight" else None}.get(self.kind)
            if dim is None:
                found[name] = (param.detach(), None if param.grad is None else param.grad)
                continue
            value = gather_slices(param.detach(), dim, self.shares, self.group)
            grad = None
            if param.grad is not None:
                grad = gather_slices(param.grad, dim, self.shares, self.group)
            found[name] = (value, grad)
        return found


def split_linears(model: nn.Module, layers: Sequence[tuple], rank: int, group) -> nn.Module:
    """``model`` with each ``(module path, kind, shares)`` or ``(module path, kind, shares,
    fused)`` of ``layers`` replaced by an ``UnevenLinear``; returns ``model``.

    Raises:
        LaunchError: a path that is not an ``nn.Linear`` of the model; one line.
    """
    for path, kind, shares, *fused in layers:
        try:
            linear = model.get_submodule(path)
        except AttributeError:
            linear = None
        if not isinstance(linear, nn.Linear):
            raise LaunchError(f"the plan splits {path!r}, which is not an nn.Linear of this model; re-plan")
        parent_path, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attribute, UnevenLinear(linear, path, kind, shares, rank, group, bool(fused and fused[0])))
    return model
