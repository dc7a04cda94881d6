"""The data-parallel and expert-sliced modes of an MoE layer (Tutel's other two modes; the
expert-parallel one and the routing they share are in ``codegen.runtime.moe``).

Both route in the group's global order first (``route``: one all-gather of per-expert
counts), so the capacity, the drops and the balance loss are the single device's.

- ``DataParallelMoE``: every rank holds every expert and runs its own kept choices; no token
  moves. The expert weights are replicated like any data-parallel weight: their gradients
  are averaged over the group with the rest (DDP in a compiled program).
- ``ExpertSlicedMoE``: every expert's hidden width (ffn) is sliced over the group. Each rank
  sends its kept choices to every rank (an all-to-all that is an all-gather of uneven
  sizes), every rank runs its slice of every expert on the whole group's buffer, and the
  partial outputs go back to the tokens' ranks (the reverse all-to-all) where they are summed
  over the slices (a reduce-scatter). GELU acts on each hidden unit alone, so the slices'
  sum is the whole expert's output. Each slice sees every rank's tokens, so with
  ``rank_losses_averaged`` its gradient is divided by the group size in backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from codegen.runtime.materialize import set_derived_parameter
from codegen.runtime.moe import (
    DEFAULT_NAMES,
    RoutedMoE,
    Routing,
    all_to_all_rows,
    all_to_all_values,
    exchange_counts,
    scaled_gradient,
)

__all__ = ["DataParallelMoE", "ExpertSlicedMoE"]


class DataParallelMoE(RoutedMoE):
    """One MoE layer with every expert on every rank of ``group``; each rank runs its own
    tokens (arguments as ``ExpertParallelMoE``'s, without a placement)."""

    def __init__(self, router_weight, expert_in, expert_out, top_k: int, capacity_factor: float, group=None, *,
                 names: tuple[str, str, str] = DEFAULT_NAMES):
        super().__init__(router_weight, top_k, capacity_factor, group, names)
        set_derived_parameter(self, "w_in", expert_in)
        set_derived_parameter(self, "w_out", expert_out)

    def run_experts(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        k, width, experts = self.top_k, tokens.size(1), self.experts
        # A buffer of this rank's kept choices only: an expert's output for a token does not
        # depend on the other tokens in its buffer, so the single device's global slots are
        # not needed here, only who is kept. A kept choice's row: its place among this
        # rank's kept choices of the same expert.
        kept_one_hot = routing.one_hot * routing.kept.unsqueeze(-1)  # (k*n, E)
        local_slot = ((kept_one_hot.cumsum(dim=0) - 1) * kept_one_hot).sum(dim=-1)
        depth = int(kept_one_hot.sum(dim=0).max()) if kept_one_hot.numel() else 0
        kept = routing.kept.nonzero().squeeze(-1)
        row = routing.expert[kept] * depth + local_slot[kept]
        source = tokens.repeat(k, 1)[kept]
        buffer = tokens.new_zeros(experts * depth, width).index_copy(0, row, source)
        hidden = F.gelu(torch.bmm(buffer.view(experts, depth, width), self.w_in), approximate="tanh")
        output = torch.bmm(hidden, self.w_out).reshape(experts * depth, width)
        answered = output.index_select(0, row).to(tokens.dtype)
        return tokens.new_zeros(k * tokens.size(0), width).index_copy(0, kept, answered)

    def full_parameters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """See ``RoutedMoE.full_parameters``: every weight is whole on every rank."""
        router, in_name, out_name = self.names
        found = {router: self._router_entry()}
        for name, weight in ((in_name, self.w_in), (out_name, self.w_out)):
            found[name] = (weight.detach(), None if weight.grad is None else weight.grad.detach())
        return found


class ExpertSlicedMoE(RoutedMoE):
    """One MoE layer with every expert's hidden width sliced over ``group``: this rank keeps
    hidden units ``[start, end)`` of every expert (``torch.tensor_split`` of the width into
    group-size pieces, in rank order). Arguments as ``ExpertParallelMoE``'s, without a
    placement."""

    def __init__(self, router_weight, expert_in, expert_out, top_k: int, capacity_factor: float, group=None, *,
                 rank_losses_averaged: bool = False, names: tuple[str, str, str] = DEFAULT_NAMES):
        super().__init__(router_weight, top_k, capacity_factor, group, names)
        self.rank_losses_averaged = rank_losses_averaged
        self.ffn = expert_in.shape[2]
        pieces = torch.arange(self.ffn, device="cpu").tensor_split(self.world)
        self.bounds = [(int(p[0]) if len(p) else 0, int(p[-1]) + 1 if len(p) else 0) for p in pieces]
        start, end = self.bounds[self.rank]
        set_derived_parameter(self, "w_in", expert_in, dim=2, start=start, stop=end)  # (E, C, ffn/ranks)
        set_derived_parameter(self, "w_out", expert_out, dim=1, start=start, stop=end)  # (E, ffn/ranks, C)

    def rank_local_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's slices of the experts (see ``RoutedMoE.rank_local_parameters``)."""
        return [self.w_in, self.w_out]

    def run_experts(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        k, width, experts, capacity = self.top_k, tokens.size(1), self.experts, routing.capacity
        kept = routing.kept.nonzero().squeeze(-1)
        mine = int(kept.numel())
        # How many kept choices every rank has (each sends all of them to every rank).
        counts = torch.tensor([mine] * self.world, device=tokens.device)  # NCCL exchanges only GPU tensors
        send_sizes, receive_sizes = counts.tolist(), exchange_counts(counts, self.group).tolist()

        # Gather: every rank receives the whole group's kept choices, rank by rank, with
        # their rows in the single device's buffer (expert * capacity + slot).
        rows = tokens.repeat(k, 1)[kept].repeat(self.world, 1)  # backward sums the copies' gradients
        received = all_to_all_rows(rows, receive_sizes, send_sizes, self.group)
        address = (routing.expert[kept] * capacity + routing.slot[kept]).repeat(self.world)
        received_address = all_to_all_values(address, receive_sizes, send_sizes, self.group)

        # This rank's slice of every expert on the whole buffer: partial outputs.
        w_in, w_out = self.w_in, self.w_out
        if self.rank_losses_averaged:
            w_in, w_out = scaled_gradient(w_in, 1 / self.world), scaled_gradient(w_out, 1 / self.world)
        buffer = received.new_zeros(experts * capacity, width).index_copy(0, received_address, received)
        hidden = F.gelu(torch.bmm(buffer.view(experts, capacity, width), w_in), approximate="tanh")
        partial = torch.bmm(hidden, w_out).reshape(experts * capacity, width)

        # Reduce-scatter: each rank's rows back to it from every slice, summed in rank order.
        answered = partial.index_select(0, received_address)
        returned = all_to_all_rows(answered, send_sizes, receive_sizes, self.group)  # (ranks * mine, C)
        summed = returned.view(self.world, mine, width).sum(dim=0).to(tokens.dtype)
        return tokens.new_zeros(k * tokens.size(0), width).index_copy(0, kept, summed)

    def full_parameters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """See ``RoutedMoE.full_parameters``: the slices put back together."""
        router, in_name, out_name = self.names
        found = {router: self._router_entry()}
        for name, weight, dim in ((in_name, self.w_in, 2), (out_name, self.w_out, 1)):
            value = self._gather(weight.detach(), dim)
            grad = None if weight.grad is None else self._gather(weight.grad.detach(), dim)
            found[name] = (value, grad)
        return found

    def _gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        shape = list(local.shape)
        shape[dim] = self.ffn
        full = local.new_zeros(shape)
        start, end = self.bounds[self.rank]
        full.narrow(dim, start, end - start).copy_(local)
        dist.all_reduce(full, group=self.group)  # each hidden unit is on one rank only
        return full
