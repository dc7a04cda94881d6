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

gpt-oss's experts (``planner.moe_blocks``) store their weights transposed (in, out), add a
bias after each projection and gate with a clamped SwiGLU whose gate and up columns
interleave; this module runs them so (``_swiglu``), holding the rank's rows of the biases too.

Gradients: an expert's weights get the gradient of every rank's tokens it processed: the sum
over ranks of each rank's loss. A data-parallel program averages the other gradients over
the ranks, so in backward the experts' are divided by the group size and a copied expert's
are summed over its copies (``codegen.runtime.moe.with_expert_gradient``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from codegen.runtime.materialize import set_derived_parameter
from codegen.runtime.moe import (
    all_to_all_rows,
    all_to_all_values,
    count_choices,
    exchange_counts,
    gather_experts,
    is_recomputing,
    sum_copies,
    whole,
    with_expert_gradient,
)

__all__ = ["ExpertParallelExperts"]


class ExpertParallelExperts(torch.nn.Module):
    """Drop-in for a HuggingFace stacked-experts module with its experts split over
    ``group`` by ``placement`` (see the module docstring).

    Args:
        experts: the model's experts module (``gate_up_proj``, ``down_proj``, ``act_fn``);
            this rank keeps the experts the placement gives it.
        placement: ``placement[e]`` lists (group rank, share) for expert e, shares summing to 1.
        top_k: experts per token (for routing statistics).
        rank_losses_averaged: each rank's loss is a mean over its own tokens and the
            program averages the other gradients over the group (a data-parallel program):
            expert gradients are divided by the group size in backward.
        sharded_copies: the program shards this module over the ranks holding the same
            experts (``codegen.runtime.expert_copies``), whose reduce-scatter sums the copies'
            gradients: backward only divides by the group size.
    """

    # ``launch.py --record-routing`` names this module's counts by the MoE block holding it.
    records_routing_of_parent = True

    def __init__(self, experts: torch.nn.Module, placement, top_k: int, group=None, *,
                 rank_losses_averaged: bool = True, sharded_copies: bool = False) -> None:
        super().__init__()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.replicas = [tuple((int(d), float(s)) for d, s in copies) for copies in placement]
        self.experts = experts.gate_up_proj.shape[0]
        if len(self.replicas) != self.experts:
            raise ValueError(f"the placement covers {len(self.replicas)} experts, the model's layer {self.experts}")
        self.top_k, self.rank_losses_averaged, self.sharded_copies = top_k, rank_losses_averaged, sharded_copies
        self.local_experts = [e for e, copies in enumerate(self.replicas) if any(d == self.rank for d, _ in copies)]
        # gpt-oss: weights (in, out) with a bias each, gate and up interleaved, a clamped SwiGLU.
        self.transposed = bool(getattr(experts, "is_transposed", False))
        biased = bool(getattr(experts, "has_bias", False))
        self.weight_names = ("gate_up_proj", "down_proj") + (("gate_up_proj_bias", "down_proj_bias") if biased else ())
        for name in self.weight_names:
            set_derived_parameter(self, name, getattr(experts, name), rows=self.local_experts)
        self.interleaved = not getattr(experts, "is_concatenated", True)
        self.act_fn = getattr(experts, "act_fn", None)
        self.alpha, self.limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
        # Routing statistics, summed over forwards (plain tensors: DDP would overwrite buffers).
        self.routed_counts = torch.zeros(self.experts, dtype=torch.float64, device="cpu")  # moved by count_choices
        self.coselected = torch.zeros(self.experts, self.experts, dtype=torch.float64, device="cpu")

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        count = hidden.size(0)
        chosen = top_k_index.reshape(-1)  # (n*k,) token-major: choice i is token i // k
        token = torch.arange(count, device=hidden.device).repeat_interleave(top_k_index.size(1))
        self._record(top_k_index)

        # 1. Each choice's destination: a holder of its expert, copies by their shares.
        destination = self._destinations(chosen)
        order = torch.argsort(destination, stable=True)
        send_counts = torch.bincount(destination, minlength=self.world)
        send_sizes, receive_sizes = send_counts.tolist(), exchange_counts(send_counts, self.group).tolist()
        rows = hidden[token[order]]
        if torch.is_autocast_enabled(hidden.device.type):
            # Rows travel in the compute dtype, as the cost model prices them (2 bytes in bf16),
            # not as the fp32 residual stream autocast leaves: the experts' matmuls cast their
            # input to it anyway, so forward and gradients are unchanged.
            rows = rows.to(torch.get_autocast_dtype(hidden.device.type))
        received = all_to_all_rows(rows, receive_sizes, send_sizes, self.group)
        received_experts = all_to_all_values(chosen[order].contiguous(), receive_sizes, send_sizes, self.group)

        # 2. This rank's experts on the rows they received (SwiGLU, as the model's experts).
        weights = self._weights()
        # The outputs go back in the rows' dtype, but with biases (gpt-oss) in the dtype the
        # bias addition gives (fp32 under autocast, as on one device): rounding them to bf16
        # would change the step. That combine sends more than the plan prices (the simulator
        # prices bf16 rows either way).
        dtype = torch.promote_types(received.dtype, weights[-1].dtype) if len(weights) > 2 else received.dtype
        output = received.new_zeros(received.shape, dtype=dtype)
        for position, expert in enumerate(self.local_experts):
            rows = (received_experts == expert).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            result = self._expert(received[rows], [weight[position] for weight in weights])
            output = output.index_copy(0, rows, result.to(output.dtype))

        # Every rank's backward must reach its expert weights, also when no token came here: the
        # copies' gradient sum is a collective every rank joins. And it must reach the rows it
        # received, also when there were none: otherwise the dispatch's backward all-to-all (which
        # returns the gradients of the rows this rank sent) is never run here while every other
        # rank of the group waits in it, a hang (tiny DeepSeek-V3, 1 sample per micro-batch).
        output = output + 0 * sum(weight.flatten()[:1].sum() for weight in weights)
        if received.size(0) == 0:
            output = output + 0 * received.sum()

        # 3. Back to the tokens' ranks, weighted by the router there, summed per token.
        returned = all_to_all_rows(output, send_sizes, receive_sizes, self.group)
        scale = top_k_weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(hidden).index_add(0, token[order], (returned * scale).to(hidden.dtype))

    def _weights(self) -> list[torch.Tensor]:
        """This rank's expert weights in ``weight_names`` order, scaled in backward."""
        weights = [getattr(self, name) for name in self.weight_names]
        if not self.rank_losses_averaged:
            return weights
        return [with_expert_gradient(weight, self) for weight in weights]

    def _expert(self, rows: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        """One expert on ``rows``: (gate_up, down) or (gate_up, down, gate_up bias, down bias)."""
        gate_up, down, *biases = weights
        projected = rows @ gate_up if self.transposed else torch.nn.functional.linear(rows, gate_up)
        if biases:
            projected = projected + biases[0]
        hidden = self._swiglu(projected)
        result = hidden @ down if self.transposed else torch.nn.functional.linear(hidden, down)
        return result + biases[1] if biases else result

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The experts' gating: ``act_fn(gate) * up`` over the two halves, or gpt-oss's over
        interleaved columns, clamped at ``limit``: ``(up + 1) * gate * sigmoid(alpha * gate)``
        (transformers' ``GptOssExperts._apply_gate``)."""
        if not self.interleaved:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate) * up
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def expert_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of this rank's expert weights as the step's mean loss needs it:
        divided by the group size, copies summed over their holders (by the sharded copies'
        reduce-scatter when ``sharded_copies``)."""
        if self.sharded_copies:
            return grad / self.world
        return sum_copies(grad / self.world, self.replicas, self.local_experts, self.group)

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

    def rank_local_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's own experts: no data-parallel wrapper or optimizer may average,
        shard or broadcast them."""
        return [getattr(self, name) for name in self.weight_names]

    def _record(self, top_k_index: torch.Tensor) -> None:
        if is_recomputing():  # backward re-running a checkpointed block: counted in its forward
            return
        with torch.no_grad():
            per_token = torch.zeros(top_k_index.size(0), self.experts, dtype=torch.float64, device=top_k_index.device)
            count_choices(self, per_token.scatter_(1, top_k_index.long(), 1.0))

    def full_parameters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Every expert's weights (and gradients) as one device stacks them, by the names of
        the module this one replaced (``codegen.runtime.parity``). Collective over ``group``."""
        found = {}
        for name in self.weight_names:
            weight = getattr(self, name)
            value = gather_experts(whole(weight.detach()), self.replicas, self.local_experts, self.group)
            grad = None if weight.grad is None else gather_experts(whole(weight.grad.detach()), self.replicas,
                                                                   self.local_experts, self.group)
            found[name] = (value, grad)
        return found
