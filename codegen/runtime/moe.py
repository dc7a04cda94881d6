"""Mixture-of-Experts layers over a process group: each rank routes its own tokens, and the
layer computes what one device computes on all the group's tokens, exactly.

The layer is ``examples/moe.py``'s ``MoE`` (router, top-k with weights summing to 1, a
capacity per expert filled in GShard's priority order, GELU experts, combine, Switch's
balance loss). Every mode shares the routing (``route``) and the balance loss; they differ
in where the experts run (``codegen.runtime.moe_modes`` has the data-parallel and
expert-sliced modes, this file the expert-parallel one):

1. Route (every rank, its own tokens): softmax of the router's logits, top-k.
2. Slots. A choice's slot in its expert's buffer counts the choices of that expert before
   it in the global order: every token's first choice (tokens in global order, rank by
   rank), then every second choice, ... Each rank needs only the per-expert counts of the
   other ranks' choices (one all-gather of a (ranks, k, experts) table), so the capacity
   (from the group's token count) and the drops are the single device's.

   The group's tokens are those of one forward: the global batch, or under gradient
   accumulation (and in a pipeline) the micro-batch every rank is running, so each
   micro-batch is routed on its own, with its own capacity, drops and balance loss, as MoE
   trainers route them (the single-device reference of ``launch.py --check`` cuts the same
   micro-batches). ``route`` is that per-forward routing, and ``capacity_of`` the
   capacity it gives a (micro-)batch: what a schedule of micro-batches calls once per
   micro-batch, with the group the batch is split over.
3. Dispatch (expert parallel). Each kept choice goes to a device holding its expert
   (``ExpertPlacement``: a hot expert may have copies; its slots are split among them by
   their shares, in slot order) with one all-to-all (uneven splits, with autograd; flat,
   ``FlatExchange``, or two-level, ``codegen.runtime.moe_exchange``), its slot alongside.
4. Experts. Each device fills a buffer (its experts x capacity x width, zeros elsewhere: the
   single device's padding) and runs its experts as one batched matmul.
5. Combine. The outputs go back with a second all-to-all and are summed with the gates.
6. Balance loss: the routed share and mean probability of each expert are summed over the
   group (all-reduce with autograd) before their product, as on one device.

Gradients: an expert's weights get the gradient of the tokens it processed, from every
rank. In data-parallel training each rank's loss is the mean over its own tokens and the
step's loss is the mean of the ranks' losses, so with ``rank_losses_averaged`` the expert
gradients are divided by the group size in backward, and a copied expert's copies are
summed over their holders there too (without it: ``sum_copied_expert_gradients`` after
backward, for a caller whose losses already sum to the step's). The router and every
replicated weight outside the experts are data parallel: their gradients are averaged over
the group as any data-parallel gradient (DDP does it in a compiled program).

Each layer also counts its routed choices per expert (before drops) and how often two
experts are chosen for one token, forward after forward (``routed_counts``,
``coselected``): ``launch.py --record-routing`` writes them as routing statistics. A block
checkpointed by ``recompute_in_backward_counting_once`` routes again in backward without
counting again; with ``keep_exchanges`` its collectives hand back what they returned in
forward instead of communicating again (``codegen.runtime.kept_exchanges``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from codegen.runtime.kept_exchanges import is_recomputing, kept_exchange, keeping_exchanges, recomputation
from codegen.runtime.materialize import set_derived_parameter

__all__ = [
    "ExpertParallelMoE", "FlatExchange", "count_choices", "RoutedMoE", "Routing", "all_to_all_rows", "all_to_all_values",
    "exchange_counts", "gather_experts",
    "is_recomputing", "route", "rank_local_parameters", "recompute_in_backward_counting_once", "scaled_gradient", "sum_copied_expert_gradients",
    "sum_copies", "whole", "with_expert_gradient", "GeluExperts",
]

# The parameter names of examples/moe.py's MoE, relative to the layer: what full_parameters
# reports unless the compiled program names them (codegen.moe_emit passes the block's own).
DEFAULT_NAMES = ("router.weight", "experts.w_in", "experts.w_out")


@dataclass
class Routing:
    """One forward's routing of this rank's tokens, placed in the group's global order.
    Choices are choice-major: every token's first choice, then every second choice, ..."""

    probs: torch.Tensor  # (n, experts) router probabilities, fp32
    gate: torch.Tensor  # (n, k) each choice's weight, the k summing to 1
    expert: torch.Tensor  # (k*n,) each choice's expert
    one_hot: torch.Tensor  # (k*n, experts)
    slot: torch.Tensor  # (k*n,) the choice's slot in its expert's buffer, in the global order
    kept: torch.Tensor  # (k*n,) bool: slot < capacity (the rest are dropped)
    capacity: int  # slots per expert, from the group's token count (the single device's)
    group_tokens: int  # tokens of the layer over the whole group


def capacity_of(tokens: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """Slots per expert: the factor times an even share of the routed choices, or every
    token when dropless (factor 0); ``examples/moe.py``'s ``MoE.capacity``."""
    if capacity_factor == 0:
        return tokens
    return max(1, math.ceil(capacity_factor * tokens * top_k / experts))


def route(tokens: torch.Tensor, router: torch.Tensor, top_k: int, capacity_factor: float, group=None) -> Routing:
    """Route this rank's ``tokens`` (n, width) and place each choice in the group's global
    priority order (steps 1 and 2 of the module docstring)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    count, experts = tokens.size(0), router.size(0)
    probs = F.softmax(F.linear(tokens, router).float(), dim=-1)  # (n, E)
    gate, chosen = probs.topk(top_k, dim=-1)
    gate = (gate / gate.sum(dim=-1, keepdim=True)).to(tokens.dtype)
    expert = chosen.t().reshape(-1)  # (k*n,) choice-major
    one_hot = F.one_hot(expert, experts)  # (k*n, E)
    by_choice = one_hot.view(top_k, count, experts)
    per_choice = by_choice.sum(dim=1)  # (k, E) this rank's counts
    table = kept_exchange(lambda: _gathered(per_choice, world, group))  # (ranks, k, E)
    group_tokens = int(table[:, 0].sum())  # each token has exactly one first choice
    capacity = capacity_of(group_tokens, top_k, experts, capacity_factor)
    # Before choice j of this rank: all ranks' choices j' < j, and lower ranks' choice j.
    totals = table.sum(dim=0)
    earlier = totals.cumsum(dim=0) - totals + table[:rank].sum(dim=0)  # (k, E)
    slot = ((by_choice.cumsum(dim=1) - 1 + earlier[:, None, :]) * by_choice).sum(dim=-1).reshape(-1)  # (k*n,)
    return Routing(probs, gate, expert, one_hot, slot, slot < capacity, capacity, group_tokens)


def _gathered(tensor: torch.Tensor, world: int, group) -> torch.Tensor:
    """Every rank's ``tensor``, stacked in rank order (one all-gather)."""
    table = [torch.zeros_like(tensor) for _ in range(world)]
    dist.all_gather(table, tensor, group=group)
    return torch.stack(table)


class RoutedMoE(torch.nn.Module):
    """What every mode shares: the router (replicated), routing in the global order, the
    combine and the balance loss; a mode implements ``run_experts`` (each kept choice's
    expert output) and ``full_parameters``.

    ``forward(x)`` returns the layer's output for this rank's tokens and the balance loss
    of the whole group's tokens, as ``examples/moe.py``'s ``MoE`` does on one device.
    """

    def __init__(self, router_weight: torch.Tensor, top_k: int, capacity_factor: float, group=None,
                 names: tuple[str, str, str] = DEFAULT_NAMES):
        super().__init__()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.experts, self.top_k, self.capacity_factor = router_weight.shape[0], top_k, capacity_factor
        self.names = tuple(names)
        set_derived_parameter(self, "router", router_weight)
        # Routing statistics, summed over forwards: this rank's choices per expert before
        # drops, and how often each pair of experts was chosen for one token. Plain tensors,
        # not buffers: DDP would overwrite buffers with rank 0's.
        self.routed_counts = torch.zeros(self.experts, dtype=torch.float64, device="cpu")
        self.coselected = torch.zeros(self.experts, self.experts, dtype=torch.float64, device="cpu")
        self.last_dropped = 0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, width = x.shape
        tokens = x.reshape(batch * seq, width)
        count, k, experts = tokens.size(0), self.top_k, self.experts
        routing = route(tokens, self.router, k, self.capacity_factor, self.group)
        self._record(routing, count)

        picked = self.run_experts(tokens, routing)  # (k*n, C): each choice's output, zeros if dropped
        combined = (picked * routing.gate.t().reshape(-1, 1)).view(k, count, width).sum(dim=0)

        # Switch's balance loss over the whole group's tokens.
        sums = _SumOverGroup.apply(torch.cat([routing.one_hot.float().sum(dim=0), routing.probs.sum(dim=0)]), self.group)
        share, mean_prob = sums[:experts] / (k * routing.group_tokens), sums[experts:] / routing.group_tokens
        balance = experts * (share * mean_prob).sum()
        return combined.view(batch, seq, width), balance

    def run_experts(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Each choice's expert output (k*n, width), choice-major; zeros for dropped ones."""
        raise NotImplementedError

    def full_parameters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Every parameter of the layer as one device holds it, by its name in the module
        this layer replaced (``names``): (value, gradient or None). Collective: every rank
        of the group calls it (``codegen.runtime.parity`` does, for ``launch.py --check``)."""
        raise NotImplementedError

    def rank_local_parameters(self) -> list[torch.nn.Parameter]:
        """The layer's parameters that differ from rank to rank (its own experts or slices):
        no data-parallel wrapper or optimizer may average, shard or broadcast them."""
        return []

    def _record(self, routing: Routing, count: int) -> None:
        if is_recomputing():  # backward re-running a checkpointed block: counted in its forward already
            return
        with torch.no_grad():
            count_choices(self, routing.one_hot.view(self.top_k, count, self.experts).sum(dim=0).double())
            self.last_dropped = int((~routing.kept).sum())

    def _router_entry(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        grad = None if self.router.grad is None else self.router.grad.detach()
        return self.router.detach(), grad


def count_choices(layer, per_token: torch.Tensor) -> None:
    """Add one forward's routing to ``layer.routed_counts`` (choices per expert) and
    ``layer.coselected`` (pairs of experts chosen for one token) from ``per_token``, an
    (n, E) table of each token's choices. The statistics live on the tokens' device (created
    on the CPU, moved at the first forward): adding a GPU table into CPU tensors would fail,
    and copying it to the host would stall every forward."""
    if layer.routed_counts.device != per_token.device:
        layer.routed_counts = layer.routed_counts.to(per_token.device)
        layer.coselected = layer.coselected.to(per_token.device)
    layer.routed_counts += per_token.sum(dim=0)
    pairs = per_token.t() @ per_token
    layer.coselected += pairs - torch.diag(torch.diagonal(pairs))


def rank_local_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of every MoE layer in ``module`` that differ from rank to rank."""
    return [
        param for layer in module.modules() if callable(getattr(layer, "rank_local_parameters", None))
        for param in layer.rank_local_parameters()
    ]


def recompute_in_backward_counting_once(module: torch.nn.Module, keep_exchanges: bool = False) -> torch.nn.Module:
    """Make ``module``'s forward run under non-reentrant activation checkpointing (backward
    recomputes its activations, as ``codegen.runtime.recompute.recompute_in_backward`` does),
    with the MoE layers inside it counting their routing only in forward, not again when
    backward recomputes them. Returns ``module``. Every rank recomputes at the same point of
    backward, so the layers' collectives match up. With ``keep_exchanges``
    (``recompute="full_keep_a2a"``) the MoE layers' collectives do not run again: each
    forward keeps their outputs and its recomputation takes them back
    (``codegen.runtime.kept_exchanges``)."""
    forward = module.forward

    def counting_once():
        return contextlib.nullcontext(), recomputation()

    contexts = keeping_exchanges if keep_exchanges else counting_once  # one tape per forward call

    @functools.wraps(forward)
    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    module.forward = checkpointed_forward
    return module


class ExpertParallelMoE(RoutedMoE):
    """One MoE layer with its experts split over ``group`` by ``placement``.

    Args:
        router_weight: (experts, width), the router's weight (replicated on every rank).
        expert_in, expert_out: (experts, width, ffn) and (experts, ffn, width): ALL experts'
            weights; this rank keeps the experts the placement gives it.
        placement: ``replicas[e]`` lists (group rank, share) for expert e, shares summing to 1.
        top_k, capacity_factor: as in ``examples/moe.py`` (capacity factor 0: dropless).
        group: the process group the experts are split over (default: the world).
        rank_losses_averaged: the step's loss is the mean of the ranks' losses (data-parallel
            training): divide the expert gradients by the group size and sum the copies of
            a copied expert in backward (see the module docstring).
        names: the router's and the two expert weights' names in the replaced module.
        exchange: how rows move between the ranks of ``group`` (``FlatExchange``, the
            default, or ``codegen.runtime.moe_exchange.TwoLevelExchange``).
        sharded_copies: this rank's experts live in a child module ``sharded_experts``
            (``GeluExperts``) that the program shards over the ranks holding the same experts
            (``codegen.runtime.expert_copies``); its reduce-scatter sums the copies'
            gradients, so backward only divides them by the group size.
    """

    def __init__(self, router_weight, expert_in, expert_out, placement, top_k: int, capacity_factor: float,
                 group=None, *, rank_losses_averaged: bool = False, names: tuple[str, str, str] = DEFAULT_NAMES,
                 exchange=None, sharded_copies: bool = False):
        super().__init__(router_weight, top_k, capacity_factor, group, names)
        self.exchange = exchange if exchange is not None else FlatExchange(group)
        self.replicas = [tuple((int(d), float(s)) for d, s in copies) for copies in placement]
        if len(self.replicas) != self.experts:
            raise ValueError(f"the placement covers {len(self.replicas)} experts, the router {self.experts}")
        self.rank_losses_averaged = rank_losses_averaged
        self.local_experts = [e for e, copies in enumerate(self.replicas) if any(d == self.rank for d, _ in copies)]
        self.sharded_copies = sharded_copies
        if sharded_copies:
            # A module of their own, which FSDP2 can shard and gather around its forward.
            self.sharded_experts = GeluExperts(expert_in, expert_out, self.local_experts, self._weights)
        else:
            set_derived_parameter(self, "w_in", expert_in, rows=self.local_experts)
            set_derived_parameter(self, "w_out", expert_out, rows=self.local_experts)

    def _expert_weights(self) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
        """This rank's two expert weights, wherever they live."""
        owner = self.sharded_experts if self.sharded_copies else self
        return owner.w_in, owner.w_out

    def rank_local_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's experts (see ``RoutedMoE.rank_local_parameters``)."""
        return list(self._expert_weights())

    def _slot_ranges(self, copies, capacity: int):
        """(device, first slot, end slot) of each copy: slots split by the shares, in order."""
        ranges, start = [], 0
        for position, (device, share) in enumerate(copies):
            end = capacity if position == len(copies) - 1 else start + round(share * capacity)
            ranges.append((device, start, end))
            start = end
        return ranges

    def run_experts(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        k, width, capacity = self.top_k, tokens.size(1), routing.capacity
        choice_expert, slot, kept = routing.expert, routing.slot, routing.kept

        # 3. Dispatch: each kept choice to the copy of its expert that holds its slot.
        destination = torch.full_like(slot, -1)
        for expert, copies in enumerate(self.replicas):
            mine = kept & (choice_expert == expert)
            for device, first, end in self._slot_ranges(copies, capacity):
                destination[mine & (slot >= first) & (slot < end)] = device
        order = torch.argsort(torch.where(kept, destination, self.world), stable=True)
        sending = order[: int(kept.sum())]
        send_sizes = torch.bincount(destination[sending], minlength=self.world).tolist()
        source_rows = tokens.repeat(k, 1)[sending]  # (sent, C)
        if torch.is_autocast_enabled(tokens.device.type):
            # Rows travel in the compute dtype, as the cost model prices them (2 bytes in bf16):
            # the residual stream autocast leaves fp32 would double the exchange. The experts'
            # matmuls cast their input to it anyway, so forward and gradients are unchanged.
            source_rows = source_rows.to(torch.get_autocast_dtype(tokens.device.type))
        received, receive_sizes = self.exchange(source_rows, send_sizes)
        # Where each received row goes: its expert (local index) and slot, sent alongside.
        local_index = {expert: i for i, expert in enumerate(self.local_experts)}
        received_addresses, _ = self.exchange(torch.stack([choice_expert[sending], slot[sending]], dim=1), send_sizes)
        to_local = torch.tensor([local_index.get(e, -1) for e in range(self.experts)], dtype=torch.long,
                                device=received_addresses.device)
        row = to_local[received_addresses[:, 0]] * capacity + received_addresses[:, 1]

        # 4. This rank's experts on their buffers (zeros where no token landed).
        held = len(self.local_experts)
        buffer = received.new_zeros(held * capacity, width).index_copy(0, row, received)
        if self.sharded_copies:
            output = self.sharded_experts(buffer.view(held, capacity, width))
        else:
            output = gelu_experts(buffer.view(held, capacity, width), *self._weights(*self._expert_weights()))
        output = output.reshape(held * capacity, width)

        # 5. Results back to their tokens' ranks (the combine weights them with the gates).
        answered = output.index_select(0, row)
        returned, _ = self.exchange(answered, receive_sizes)  # arrives in the order it was sent
        return tokens.new_zeros(k * tokens.size(0), width).index_copy(0, sending, returned.to(tokens.dtype))

    def _weights(self, w_in: torch.Tensor, w_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The expert weights as the experts use them: with ``rank_losses_averaged``, their
        gradients become ``expert_gradient`` of what backward computes."""
        if not self.rank_losses_averaged:
            return w_in, w_out
        return with_expert_gradient(w_in, self), with_expert_gradient(w_out, self)

    def expert_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of one of this rank's expert weights as the step's loss needs it
        (``rank_losses_averaged``): divided by the group size, copies summed over holders
        (by the sharded copies' reduce-scatter when ``sharded_copies``)."""
        if self.sharded_copies:
            return grad / self.world
        return self._sum_copies(grad / self.world)

    def _sum_copies(self, grad: torch.Tensor) -> torch.Tensor:
        return sum_copies(grad, self.replicas, self.local_experts, self.group)

    def full_parameters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """See ``RoutedMoE.full_parameters``. A copied expert is reported as the mean of its
        copies: equal copies give the expert itself, copies that drifted apart do not."""
        router, in_name, out_name = self.names
        found = {router: self._router_entry()}
        for name, weight in zip((in_name, out_name), self._expert_weights()):
            value = self._gather(whole(weight.detach()))
            grad = None if weight.grad is None else self._gather(whole(weight.grad.detach()))
            found[name] = (value, grad)
        return found

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        return gather_experts(local, self.replicas, self.local_experts, self.group)


def gelu_experts(buffer: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """GELU experts as one batched matmul: ``buffer`` (experts, slots, width) through
    ``w_in`` (experts, width, ffn) and ``w_out`` (experts, ffn, width)."""
    return torch.bmm(F.gelu(torch.bmm(buffer, w_in), approximate="tanh"), w_out)


class GeluExperts(torch.nn.Module):
    """This rank's experts of an ``ExpertParallelMoE`` with sharded copies, as a module of
    their own (``w_in``, ``w_out``: the rows ``local_experts`` of the model's stacked
    weights) whose forward runs them, so that FSDP2 gathers them around it. ``as_used`` turns
    the weights into what the experts multiply with (the layer's gradient scaling)."""

    def __init__(self, expert_in, expert_out, local_experts: list[int], as_used) -> None:
        super().__init__()
        set_derived_parameter(self, "w_in", expert_in, rows=local_experts)
        set_derived_parameter(self, "w_out", expert_out, rows=local_experts)
        self.as_used = as_used  # a bound method of the layer: a plain attribute, not a submodule

    def forward(self, buffer: torch.Tensor) -> torch.Tensor:
        return gelu_experts(buffer, *self.as_used(self.w_in, self.w_out))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole on this rank: a DTensor (an expert weight or gradient sharded over
    its copies) gathered over its mesh, a plain tensor as it is. A collective for a DTensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def sum_copies(grad: torch.Tensor, replicas, local_experts: list[int], group) -> torch.Tensor:
    """``grad`` (this rank's experts' gradients, ``local_experts`` order) with each copied
    expert's gradient summed over the ranks holding a copy (``replicas[e]``: (rank, share)
    of each copy): each copy saw only its share of the tokens. A collective of ``group``."""
    copied = [e for e, copies in enumerate(replicas) if len(copies) > 1]
    if not copied:
        return grad
    full = grad.new_zeros(len(copied), *grad.shape[1:])
    for position, expert in enumerate(copied):
        if expert in local_experts:
            full[position] = grad[local_experts.index(expert)]
    dist.all_reduce(full, group=group)
    grad = grad.clone()
    for position, expert in enumerate(copied):
        if expert in local_experts:
            grad[local_experts.index(expert)] = full[position]
    return grad


def gather_experts(local: torch.Tensor, replicas, local_experts: list[int], group) -> torch.Tensor:
    """Every expert's tensor whole (experts first, as one device stacks them) from this
    rank's ``local`` ones: a copied expert as the mean of its copies (equal copies give the
    expert itself). A collective of ``group``."""
    full = local.new_zeros(len(replicas), *local.shape[1:])
    for position, expert in enumerate(local_experts):
        full[expert] = local[position] / len(replicas[expert])
    dist.all_reduce(full, group=group)
    return full


def with_expert_gradient(weight: torch.Tensor, layer) -> torch.Tensor:
    """``weight`` itself in forward; in backward its gradient becomes
    ``layer.expert_gradient(grad)`` (scaled for averaged rank losses, copies summed)."""
    return _ExpertGradient.apply(weight, layer)


class FlatExchange:
    """How an expert-parallel layer moves rows: one all-to-all over ``group``. Called with
    ``rows`` ordered by destination rank (``send_sizes[d]`` for rank ``d``), it returns the
    rows received, ordered by source rank, and how many came from each (with autograd)."""

    def __init__(self, group=None):
        self.group = group

    def __call__(self, rows: torch.Tensor, send_sizes: list[int]) -> tuple[torch.Tensor, list[int]]:
        # The counts travel on the rows' device: NCCL exchanges only GPU tensors.
        receive_sizes = exchange_counts(torch.tensor(send_sizes, device=rows.device), self.group).tolist()
        return all_to_all_rows(rows, receive_sizes, send_sizes, self.group), receive_sizes


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Row ``d`` of ``counts`` (a number, or a row of numbers) to rank ``d`` of ``group``;
    returns what each rank sent this one, by source."""
    def exchange() -> torch.Tensor:
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=group)
        return received

    return kept_exchange(exchange)


def all_to_all_rows(rows: torch.Tensor, receive_sizes: list[int], send_sizes: list[int], group) -> torch.Tensor:
    """Rows to the ranks (uneven counts), with autograd: backward sends the gradients back."""
    return _AllToAll.apply(rows, receive_sizes, send_sizes, group)


def all_to_all_values(rows: torch.Tensor, receive_sizes: list[int], send_sizes: list[int], group) -> torch.Tensor:
    """Rows to the ranks (uneven counts) without autograd: the expert and slot numbers sent
    alongside the token rows."""
    return kept_exchange(lambda: _exchanged(rows, receive_sizes, send_sizes, group))


def _exchanged(rows: torch.Tensor, receive_sizes: list[int], send_sizes: list[int], group) -> torch.Tensor:
    received = rows.new_empty(sum(receive_sizes), *rows.shape[1:])
    dist.all_to_all_single(received, rows.contiguous(), receive_sizes, send_sizes, group=group)
    return received


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, receive_sizes: list[int], send_sizes: list[int], group) -> torch.Tensor:
        ctx.receive_sizes, ctx.send_sizes, ctx.group = receive_sizes, send_sizes, group
        return kept_exchange(lambda: _exchanged(rows, receive_sizes, send_sizes, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.send_sizes), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send_sizes, ctx.receive_sizes, group=ctx.group)
        return back, None, None, None


def _summed(tensor: torch.Tensor, group) -> torch.Tensor:
    summed = tensor.clone()
    dist.all_reduce(summed, group=group)
    return summed


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradients: every rank's input
    reaches every rank's output."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return kept_exchange(lambda: _summed(tensor, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = grad.clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed, None


class _ExpertGradient(torch.autograd.Function):
    """Identity in forward; in backward, the layer's ``expert_gradient`` of the weight's
    gradient (scaled for averaged rank losses, copies summed). Every rank reaches it at the
    same point of backward, so its collective matches up across the group."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, layer) -> torch.Tensor:
        ctx.layer = layer
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.layer.expert_gradient(grad), None


def scaled_gradient(weight: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight`` itself in forward; its gradient times ``scale`` in backward."""
    return _ScaledGradient.apply(weight, scale)


class _ScaledGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def sum_copied_expert_gradients(layer: ExpertParallelMoE) -> None:
    """Sum the gradients of every copied expert over the ranks holding a copy (after
    backward, before the optimizer step), for a layer without ``rank_losses_averaged``:
    each copy saw only its share of the tokens."""
    for weight in layer._expert_weights():
        weight.grad = layer._sum_copies(weight.grad)
