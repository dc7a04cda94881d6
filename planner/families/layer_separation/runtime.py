"""What a compiled layer-separation program calls at run time (Stanza's layer separation).

The world's first ``trunk_ranks`` ranks run the model's convolutional trunk (one module,
the one the model's first input enters) data parallel, each on its 1/T of the batch; the
last ``head_ranks`` ranks run everything after it (the fully connected head and the loss),
each on 1/H of the batch. Head rank ``h`` serves the T/H trunk ranks ``h*T/H ...``, whose
samples are its own, in order. In forward each trunk rank sends its activations to its head
rank; in backward the head rank sends each trunk rank the gradient of its activations back.
The trunk's gradients are averaged over the trunk ranks only (DDP on their group), the
head's over the head ranks only (DDP on theirs, the trunk's weights ignored).

Scales, so that one step equals one device's: a head rank's loss is the mean over its B/H
samples, so DDP's average over the H head ranks gives the global mean's head gradients, and
the activation gradients it sends are H/B per sample; a trunk rank multiplies them by T/H
(T/B per sample: its own mean's), and DDP's average over T gives the global mean's.

Codegen layer: imports torch only.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

HEADER = 8  # int64s of a shape message: the rank count of dims, then the dims


def head_rank_of(trunk: int, trunk_ranks: int, head_ranks: int) -> int:
    """The global rank of the head rank that serves trunk rank ``trunk``."""
    return trunk_ranks + trunk // (trunk_ranks // head_ranks)


def trunk_ranks_of(head: int, trunk_ranks: int, head_ranks: int) -> list[int]:
    """The trunk ranks head rank ``head`` (a global rank) serves, in batch order."""
    per_head = trunk_ranks // head_ranks
    first = (head - trunk_ranks) * per_head
    return list(range(first, first + per_head))


def _send_shape(shape: Sequence[int], peer: int, device: torch.device) -> None:
    message = torch.zeros(HEADER, dtype=torch.int64, device=device)
    message[0] = len(shape)
    message[1:1 + len(shape)] = torch.tensor(list(shape), dtype=torch.int64)
    dist.send(message, peer)


def _received_shape(peer: int, device: torch.device) -> list[int]:
    message = torch.empty(HEADER, dtype=torch.int64, device=device)
    dist.recv(message, peer)
    return message[1:1 + int(message[0])].tolist()


class SendActivations(torch.autograd.Function):
    """Forward: send ``activations`` to ``head`` and return a 0-dim zero that depends on
    them. Backward: receive their gradient from ``head``, times ``scale`` (module docstring)."""

    @staticmethod
    def forward(ctx, activations: torch.Tensor, head: int, scale: float) -> torch.Tensor:
        ctx.head, ctx.scale, ctx.shape, ctx.dtype = head, scale, activations.shape, activations.dtype
        ctx.device = activations.device
        _send_shape(activations.shape, head, activations.device)
        dist.send(activations.detach().contiguous(), head)
        return activations.new_zeros(())

    @staticmethod
    def backward(ctx, _unused: torch.Tensor):
        gradient = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        dist.recv(gradient, ctx.head)
        return gradient * ctx.scale, None, None


class ReceiveActivations(torch.autograd.Function):
    """Forward: the activations of ``trunks`` (global ranks), concatenated on the batch dim.
    Backward: each trunk rank's rows of the gradient sent back to it."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, trunks: list[int]) -> torch.Tensor:
        parts = []
        for trunk in trunks:
            part = torch.empty(_received_shape(trunk, anchor.device), dtype=anchor.dtype, device=anchor.device)
            dist.recv(part, trunk)
            parts.append(part)
        ctx.trunks, ctx.rows = trunks, [part.shape[0] for part in parts]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, gradient: torch.Tensor):
        for trunk, rows in zip(ctx.trunks, gradient.contiguous().split(ctx.rows)):
            dist.send(rows.contiguous(), trunk)
        return torch.zeros((), device=gradient.device), None


class TrunkSlot(torch.nn.Module):
    """What stands in the model at the trunk's path: on a trunk rank the trunk itself under
    DDP over the trunk ranks; on a head rank the activations its trunk ranks sent, whatever
    the input (the head runs the model's own forward past the trunk)."""

    def __init__(self, trunk: torch.nn.Module, role: "Role") -> None:
        super().__init__()
        self.trunk, self.role = trunk, role
        self.wrapped = (DistributedDataParallel(trunk, process_group=role.trunk_group, gradient_as_bucket_view=True)
                        if role.is_trunk else None)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        if self.role.is_trunk:
            return self.wrapped(*args, **kwargs)
        weight = next(self.trunk.parameters())
        anchor = torch.zeros((), dtype=weight.dtype, device=weight.device, requires_grad=True)
        return ReceiveActivations.apply(anchor, self.role.served_trunks)

    def full_parameters(self) -> dict:
        """The trunk's parameters and gradients as trunk rank 0 holds them, on every rank
        (``codegen.runtime.parity.full_parameters``'s hook; collective)."""
        return _broadcast_parameters(self.trunk.named_parameters(), 0)


class Role:
    """This rank's part: trunk or head, its process groups and its peers."""

    def __init__(self, rank: int, trunk_ranks: int, head_ranks: int) -> None:
        self.rank, self.trunk_ranks, self.head_ranks = rank, trunk_ranks, head_ranks
        self.is_trunk = rank < trunk_ranks
        # Every rank makes both groups, in the same order (torch's rule for new_group).
        self.trunk_group = dist.new_group(list(range(trunk_ranks)))
        self.head_group = dist.new_group(list(range(trunk_ranks, trunk_ranks + head_ranks)))
        self.head = head_rank_of(rank, trunk_ranks, head_ranks) if self.is_trunk else rank
        self.served_trunks = [] if self.is_trunk else trunk_ranks_of(rank, trunk_ranks, head_ranks)


class LayerSeparated(torch.nn.Module):
    """This rank's module (module docstring). ``forward`` takes this rank's part of the
    batch (``layer_separated_batch``) and returns the global loss on every rank; backward
    from it runs this rank's part of the step."""

    def __init__(self, model: torch.nn.Module, trunk_path: str, trunk_ranks: int, head_ranks: int) -> None:
        super().__init__()
        self.role = role = Role(dist.get_rank(), trunk_ranks, head_ranks)
        parent_path, _, name = trunk_path.rpartition(".")
        parent = model.get_submodule(parent_path)
        self.slot = TrunkSlot(getattr(parent, name), role)
        setattr(parent, name, self.slot)
        head_names = [n for n, _ in model.named_parameters() if not n.startswith(trunk_path + ".")]
        # The full-parameter hook of the head's weights (the model's root): codegen.runtime.parity.
        object.__setattr__(model, "full_parameters",
                           lambda: _broadcast_parameters(((n, model.get_parameter(n)) for n in head_names), trunk_ranks))
        if role.is_trunk:
            self.model = model
            return
        trunk_names = tuple(n for n, _ in model.named_parameters() if n.startswith(trunk_path + "."))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, trunk_names)
        # Gradients as views of DDP's buckets: no second copy of the head's (VGG-16: 0.5 GB).
        self.model = DistributedDataParallel(model, process_group=role.head_group, gradient_as_bucket_view=True)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        role = self.role
        if role.is_trunk:
            token = SendActivations.apply(self.slot(*args[:1]), role.head, role.trunk_ranks / role.head_ranks)
            total = torch.zeros((), device=token.device)
            dist.all_reduce(total)
            return token + total / role.head_ranks
        loss = self.model(*args, **kwargs)
        total = loss.detach().clone()
        dist.all_reduce(total)
        return loss + (total / role.head_ranks - loss).detach()


def _broadcast_parameters(named, source: int) -> dict:
    """(value, gradient or None) of each named parameter as rank ``source`` holds it: on
    ``source`` its own tensors (detached, not copied: the check reads them, and VGG-16's head
    is 0.5 GB), elsewhere received copies."""
    found = {}
    is_source = dist.get_rank() == source
    for name, parameter in named:
        value = parameter.detach() if is_source else torch.empty_like(parameter)
        dist.broadcast(value, source)
        flag = torch.tensor([0 if parameter.grad is None else 1], device=value.device)
        dist.broadcast(flag, source)
        grad = None
        if flag.item():
            grad = parameter.grad.detach() if is_source else torch.empty_like(value)
            dist.broadcast(grad, source)
        found[name] = (value, grad)
    return found


def layer_separated_batch(args: tuple, kwargs: dict, batch: int, trunk_ranks: int, head_ranks: int) -> tuple[tuple, dict]:
    """This rank's part of one global batch of ``batch`` samples: a trunk rank's 1/T of
    every tensor whose dim 0 is the batch, a head rank's 1/H (the samples of the trunk ranks
    it serves); other values whole."""
    rank = dist.get_rank()
    index, parts = (rank, trunk_ranks) if rank < trunk_ranks else (rank - trunk_ranks, head_ranks)

    def local(value):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
            return value.chunk(parts, dim=0)[index]
        return value

    return tuple(local(value) for value in args), {key: local(value) for key, value in kwargs.items()}
