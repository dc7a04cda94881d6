"""Expert parallelism for an MoE layer: tokens travel to the devices holding their experts.

The layer is ``examples/moe.py``'s ``MoE`` (router, top-k with weights summing to 1, a
capacity per expert filled in GShard's priority order, GELU experts, combine, Switch's
balance loss), run with its experts split over a process group and each rank holding a
slice of the tokens. It computes what one device computes on all the tokens, exactly:

1. Route (every rank, its own tokens): softmax of the router's logits, top-k.
2. Slots. A choice's slot in its expert's buffer counts the choices of that expert before
   it in the global order: every token's first choice (tokens in global order, rank by
   rank), then every second choice, ... Each rank needs only the per-expert counts of the
   other ranks' choices (one all-gather of a (ranks, k, experts) table), so the drops are
   the single device's drops.
3. Dispatch. Each kept choice goes to a device holding its expert (``ExpertPlacement``: a
   hot expert may have copies; its slots are split among them by their shares, in slot
   order) with one ``all_to_all_single`` (uneven splits, with autograd), its slot alongside.
4. Experts. Each device fills a buffer (its experts x capacity x width, zeros elsewhere: the
   single device's padding) and runs its experts as one batched matmul.
5. Combine. The outputs go back with a second all-to-all and are summed with the gates.
6. Balance loss: the routed share and mean probability of each expert are summed over the
   group (all-reduce with autograd) before their product, as on one device.

Gradients: an expert's weights get the gradient of the tokens it processed; a copied expert's
copies are summed over their holders (``sum_copied_expert_gradients``). The router and every
replicated weight outside the experts are data parallel: their gradients are summed (or
averaged, with the loss) over the group as any data-parallel gradient.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["ExpertParallelMoE", "sum_copied_expert_gradients"]


class ExpertParallelMoE(torch.nn.Module):
    """One MoE layer with its experts split over ``group`` by ``placement``.

    Args:
        router_weight: (experts, width), the router's weight (replicated on every rank).
        expert_in, expert_out: (experts, width, ffn) and (experts, ffn, width): ALL experts'
            weights; this rank keeps the experts the placement gives it.
        placement: ``replicas[e]`` lists (group rank, share) for expert e, shares summing to 1.
        top_k, capacity_factor: as in ``examples/moe.py`` (capacity factor 0: dropless).
        tokens_in_group: tokens of the layer over the whole group (the capacity is the single
            device's, computed from all of them).
    """

    def __init__(self, router_weight, expert_in, expert_out, placement, top_k: int, capacity_factor: float,
                 tokens_in_group: int, group=None):
        super().__init__()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.experts, self.top_k = router_weight.shape[0], top_k
        self.replicas = [tuple((int(d), float(s)) for d, s in copies) for copies in placement]
        if len(self.replicas) != self.experts:
            raise ValueError(f"the placement covers {len(self.replicas)} experts, the router {self.experts}")
        if capacity_factor == 0:
            self.capacity = tokens_in_group
        else:
            self.capacity = max(1, math.ceil(capacity_factor * tokens_in_group * top_k / self.experts))
        self.local_experts = [e for e, copies in enumerate(self.replicas) if any(d == self.rank for d, _ in copies)]
        self.router = torch.nn.Parameter(router_weight.detach().clone())
        self.w_in = torch.nn.Parameter(expert_in.detach()[self.local_experts].clone())
        self.w_out = torch.nn.Parameter(expert_out.detach()[self.local_experts].clone())
        self._slot_ranges = [self._ranges(copies) for copies in self.replicas]

    def _ranges(self, copies):
        """(device, first slot, end slot) of each copy: slots split by the shares, in order."""
        ranges, start = [], 0
        for position, (device, share) in enumerate(copies):
            end = self.capacity if position == len(copies) - 1 else start + round(share * self.capacity)
            ranges.append((device, start, end))
            start = end
        return ranges

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, width = x.shape
        tokens = x.reshape(batch * seq, width)
        count, k, experts = tokens.size(0), self.top_k, self.experts
        probs = F.softmax(F.linear(tokens, self.router).float(), dim=-1)  # (n, E)
        gate, chosen = probs.topk(k, dim=-1)
        gate = (gate / gate.sum(dim=-1, keepdim=True)).to(x.dtype)

        # 2. Slots in the global priority order (choice-major, tokens rank by rank).
        choice_expert = chosen.t().reshape(-1)  # (k*n,) choice-major
        one_hot = F.one_hot(choice_expert, experts)  # (k*n, E)
        per_choice = one_hot.view(k, count, experts).sum(dim=1)  # (k, E) this rank's counts
        table = [torch.zeros_like(per_choice) for _ in range(self.world)]
        dist.all_gather(table, per_choice, group=self.group)
        table = torch.stack(table)  # (ranks, k, E)
        # Before choice j of this rank: all ranks' choices j' < j, and lower ranks' choice j.
        earlier = table.sum(dim=0).cumsum(dim=0) - table.sum(dim=0) + table[: self.rank].sum(dim=0)  # (k, E)
        local_rank_in_expert = (one_hot.view(k, count, experts).cumsum(dim=1) - 1)  # (k, n, E)
        slot_all = (local_rank_in_expert + earlier[:, None, :]) * one_hot.view(k, count, experts)
        slot = slot_all.sum(dim=-1).reshape(-1)  # (k*n,)
        kept = slot < self.capacity
        # What this rank routed in its last forward: copies per expert and how many were dropped
        # (for routing statistics and the report's load figures).
        self.last_expert_counts = one_hot.sum(dim=0).detach()
        self.last_dropped = int((~kept).sum())

        # 3. Dispatch: each kept choice to the copy of its expert that holds its slot.
        destination = torch.full_like(slot, -1)
        for expert, ranges in enumerate(self._slot_ranges):
            mine = kept & (choice_expert == expert)
            for device, first, end in ranges:
                destination[mine & (slot >= first) & (slot < end)] = device
        order = torch.argsort(torch.where(kept, destination, self.world), stable=True)
        sending = order[: int(kept.sum())]
        send_counts = torch.bincount(destination[sending], minlength=self.world)
        receive_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(receive_counts, send_counts, group=self.group)
        send_sizes, receive_sizes = send_counts.tolist(), receive_counts.tolist()
        source_rows = tokens.repeat(k, 1)[sending]  # (sent, C)
        received = _all_to_all(source_rows, receive_sizes, send_sizes, self.group)
        # Where each received row goes: its expert (local index) and slot, sent alongside.
        local_index = {expert: i for i, expert in enumerate(self.local_experts)}
        addresses = torch.stack([choice_expert[sending], slot[sending]], dim=1)
        received_addresses = addresses.new_empty(sum(receive_sizes), 2)
        dist.all_to_all_single(received_addresses, addresses, receive_sizes, send_sizes, group=self.group)
        to_local = torch.tensor([local_index.get(e, -1) for e in range(experts)], dtype=torch.long)
        row = to_local[received_addresses[:, 0]] * self.capacity + received_addresses[:, 1]

        # 4. This rank's experts on their buffers (zeros where no token landed).
        held = len(self.local_experts)
        buffer = received.new_zeros(held * self.capacity, width).index_copy(0, row, received)
        hidden = F.gelu(torch.bmm(buffer.view(held, self.capacity, width), self.w_in), approximate="tanh")
        output = torch.bmm(hidden, self.w_out).reshape(held * self.capacity, width)

        # 5. Results back to their tokens' ranks, then weighted by the gates.
        answered = output.index_select(0, row)
        returned = _all_to_all(answered, send_sizes, receive_sizes, self.group)
        picked = tokens.new_zeros(k * count, width).index_copy(0, sending, returned)
        combined = (picked * gate.t().reshape(-1, 1)).view(k, count, width).sum(dim=0)

        # 6. Switch's balance loss over the whole group's tokens.
        totals = _SumOverGroup.apply(torch.cat([one_hot.float().sum(dim=0), probs.sum(dim=0)]), self.group)
        all_tokens = count * self.world
        share, mean_prob = totals[:experts] / (k * all_tokens), totals[experts:] / all_tokens
        balance = experts * (share * mean_prob).sum()
        return combined.view(batch, seq, width), balance


def _all_to_all(rows: torch.Tensor, receive_sizes: list[int], send_sizes: list[int], group) -> torch.Tensor:
    """Rows to the ranks (uneven counts), with autograd: backward sends the gradients back."""
    return _AllToAll.apply(rows, receive_sizes, send_sizes, group)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, receive_sizes: list[int], send_sizes: list[int], group) -> torch.Tensor:
        ctx.receive_sizes, ctx.send_sizes, ctx.group = receive_sizes, send_sizes, group
        received = rows.new_empty(sum(receive_sizes), *rows.shape[1:])
        dist.all_to_all_single(received, rows.contiguous(), receive_sizes, send_sizes, group=group)
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.send_sizes), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send_sizes, ctx.receive_sizes, group=ctx.group)
        return back, None, None, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradients: every rank's input
    reaches every rank's output."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        summed = tensor.clone()
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = grad.clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed, None


def sum_copied_expert_gradients(layer: ExpertParallelMoE) -> None:
    """Sum the gradients of every copied expert over the ranks holding a copy (after
    backward, before the optimizer step): each copy saw only its share of the tokens."""
    copied = [e for e, copies in enumerate(layer.replicas) if len(copies) > 1]
    if not copied:
        return
    for weight in (layer.w_in, layer.w_out):
        full = weight.new_zeros(len(copied), *weight.shape[1:])
        for position, expert in enumerate(copied):
            if expert in layer.local_experts:
                full[position] = weight.grad[layer.local_experts.index(expert)]
        dist.all_reduce(full, group=layer.group)
        for position, expert in enumerate(copied):
            if expert in layer.local_experts:
                weight.grad[layer.local_experts.index(expert)] = full[position]
