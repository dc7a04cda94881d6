"""Expert parallelism for HuggingFace MoE blocks: their stacked experts split over ranks.

HuggingFace's MoE decoders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 in
transformers 5) share one structure: the block's router (``gate``) picks ``top_k`` experts
per token with their weights, and ``experts(hidden, top_k_index, top_k_weights)`` runs
SwiGLU experts stored as stacked weights (``gate_up_proj`` (E, 2F, C), ``down_proj``
(E, C, F)) and sums each token's chosen outputs with the weights. Routing is dropless and
per token, so the router, shared experts and everything else can stay as the model wrote
them; only ``experts`` is swapped for ``ExpertParallelExperts``, which computes the same
sum with the experts split over a process group:

1. Each rank sends every choice of its tokens (the token's row and the expert's number) to
   a rank holding that expert (``ExpertPlacement``: a hot expert may have copies; a rank's
   choices of a copied expert are split among the copies by their shares), with one
   ``all_to_all_single`` of uneven sizes (``all_to_all_rows``, with autograd).
2. Each rank runs its experts on what it received.
3. The outputs go back with the reverse all-to-all, are weighted by the router's weights on
   the rank that owns the token (so the router's gradient stays there) and summed per token.

Gradients: an expert's weights get the gradient of every rank's tokens it processed: the sum
over ranks of each rank's loss. A data-parallel program averages the other gradients over
the ranks, so ``scale_expert_gradients`` divides the experts' by the group size and sums a
copied expert's gradients over its copies, once per step after backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ExpertParallelExperts", "all_to_all_rows", "scale_expert_gradients"]


def all_to_all_rows(rows: torch.Tensor, receive_sizes: list[int], send_sizes: list[int], group=None) -> torch.Tensor:
    """Send ``rows`` to the ranks of ``group`` (``send_sizes[r]`` consecutive rows to rank r;
    ``receive_sizes[r]`` come from rank r), with autograd: backward sends the gradients back
    the same way reversed."""
    return _AllToAllRows.apply(rows, receive_sizes, send_sizes, group)


class _AllToAllRows(torch.autograd.Function):
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


class ExpertParallelExperts(torch.nn.Module):
    """Drop-in for a HuggingFace stacked-experts module with its experts split over
    ``group`` by ``placement`` (see the module docstring).

    Args:
        experts: the model's experts module (``gate_up_proj``, ``down_proj``, ``act_fn``);
            this rank keeps the experts the placement gives it.
        placement: ``placement[e]`` lists (group rank, share) for expert e, shares summing to 1.
    """

    def __init__(self, experts: torch.nn.Module, placement, group=None) -> None:
        super().__init__()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.replicas = [tuple((int(d), float(s)) for d, s in copies) for copies in placement]
        self.experts = experts.gate_up_proj.shape[0]
        if len(self.replicas) != self.experts:
            raise ValueError(f"the placement covers {len(self.replicas)} experts, the model's layer {self.experts}")
        self.local_experts = [e for e, copies in enumerate(self.replicas) if any(d == self.rank for d, _ in copies)]
        self.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach()[self.local_experts].clone())
        self.down_proj = torch.nn.Parameter(experts.down_proj.detach()[self.local_experts].clone())
        self.act_fn = experts.act_fn
        self.last_expert_counts = torch.zeros(self.experts, dtype=torch.long)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        count, width = hidden.shape
        chosen = top_k_index.reshape(-1)  # (n*k,) token-major: choice i is token i // k
        token = torch.arange(count, device=hidden.device).repeat_interleave(top_k_index.size(1))
        self.last_expert_counts = torch.bincount(chosen, minlength=self.experts).detach()

        # 1. Each choice's destination: a holder of its expert, copies by their shares.
        destination = self._destinations(chosen)
        order = torch.argsort(destination, stable=True)
        send_counts = torch.bincount(destination, minlength=self.world)
        receive_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(receive_counts, send_counts, group=self.group)
        send_sizes, receive_sizes = send_counts.tolist(), receive_counts.tolist()
        received = all_to_all_rows(hidden[token[order]], receive_sizes, send_sizes, self.group)
        received_experts = chosen.new_empty(sum(receive_sizes))
        dist.all_to_all_single(received_experts, chosen[order].contiguous(), receive_sizes, send_sizes, group=self.group)

        # 2. This rank's experts on the rows they received (SwiGLU, as the model's experts).
        output = torch.zeros_like(received)
        for position, expert in enumerate(self.local_experts):
            rows = (received_experts == expert).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            gate, up = torch.nn.functional.linear(received[rows], self.gate_up_proj[position]).chunk(2, dim=-1)
            result = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[position])
            output = output.index_copy(0, rows, result.to(output.dtype))

        # 3. Back to the tokens' ranks, weighted by the router there, summed per token.
        returned = all_to_all_rows(output, send_sizes, receive_sizes, self.group)
        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(hidden).index_add(0, token[order], (returned * weights).to(hidden.dtype))

    def _destinations(self, chosen: torch.Tensor) -> torch.Tensor:
        """The rank each choice goes to: an expert's only holder, or for a copied expert its
        copies in turn by share (this rank's choices of it split in order: any split
        computes the same outputs, the shares balance the load)."""
        destination = torch.empty_like(chosen)
        for expert, copies in enumerate(self.replicas):
            mine = (chosen == expert).nonzero().squeeze(-1)
            cumulative, bounds = 0.0, [0]
            for _, share in copies[:-1]:
                cumulative += share
                bounds.append(round(cumulative * mine.numel()))
            bounds.append(mine.numel())
            for (device, _), start, end in zip(copies, bounds, bounds[1:]):
                destination[mine[start:end]] = device
        return destination

    def full_weights(self, grads: bool) -> dict[str, torch.Tensor]:
        """Every expert's weights (and, with ``grads``, their gradients; zero where backward
        gave none) gathered from their first holders, in the model's stacked layout: what
        one device holds. Every rank of the group must call it."""
        gathered = {}
        for name in ("gate_up_proj", "down_proj"):
            local = getattr(self, name)
            parts = [("weight", local.detach())]
            if grads:
                parts.append(("grad", local.grad if local.grad is not None else torch.zeros_like(local)))
            for kind, values in parts:
                full = values.new_zeros(self.experts, *values.shape[1:])
                for position, expert in enumerate(self.local_experts):
                    if self.replicas[expert][0][0] == self.rank:
                        full[expert] = values[position]
                dist.all_reduce(full, group=self.group)
                gathered[f"{name}.{kind}"] = full
        return gathered


def scale_expert_gradients(layer: ExpertParallelExperts) -> None:
    """After backward, before the optimizer step: divide the experts' gradients by the group
    size (each is a sum over every rank's loss; the step's loss is their mean) and sum a
    copied expert's gradients over its copies (each copy saw only its share of the tokens)."""
    copied = [e for e, copies in enumerate(layer.replicas) if len(copies) > 1]
    for weight in (layer.gate_up_proj, layer.down_proj):
        if weight.grad is None:  # no token reached this rank's experts: a zero gradient
            weight.grad = torch.zeros_like(weight)
        weight.grad.div_(layer.world)
        if not copied:
            continue
        summed = weight.grad.new_zeros(len(copied), *weight.shape[1:])
        for position, expert in enumerate(copied):
            if expert in layer.local_experts:
                summed[position] = weight.grad[layer.local_experts.index(expert)]
        dist.all_reduce(summed, group=layer.group)
        for position, expert in enumerate(copied):
            if expert in layer.local_experts:
                weight.grad[layer.local_experts.index(expert)] = summed[position]
