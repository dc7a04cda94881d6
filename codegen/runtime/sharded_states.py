"""ZeRO-1 of every program: optimizer states split over ``dp``.

A program holds its weights whole on ``dp`` (plain tensors under DDP in the data-parallel
program; DTensors beside tensor or pipeline parallelism), and their gradients end whole
there too (all-reduced by DDP's buckets or the parameters' hooks). ``ShardedStatesOptimizer``
then steps each rank's 1/dp of every weight only, so AdamW's two moments take 1/dp of the
memory (Megatron-LM's distributed optimizer), and all-gathers the updated pieces over
``dp`` so every rank holds the whole new weight again: one ``all_gather_single`` per sliced
weight, of the weight's local tensor, issued one after another once the inner step is done.

Each piece is a view of the rank's own local tensor, so the inner optimizer updates the
weight in place. Which dimension is cut is ``planner.sharded_states_layout.sliced_dim``: a
weight with no dimension that ``dp`` divides is stepped whole on every rank (its gradient
is the same everywhere, so every rank computes the same update).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from planner.sharded_states_layout import sliced_dim

__all__ = ["ShardedStatesOptimizer"]


class _Piece:
    """One weight's local tensor and the part of it this rank steps (all of it when ``whole``)."""

    def __init__(self, param: torch.Tensor, rank: int, ranks: int, whole: bool = False) -> None:
        self.param = param
        self.local = _local(param).detach()  # shares the weight's storage
        self.dim = None if whole else sliced_dim(self.local.shape, ranks)
        self.start = 0  # where the piece starts on ``dim`` (checkpoints name its box)
        if self.dim is None:
            self.piece = self.local
        else:
            length = self.local.shape[self.dim] // ranks
            self.start = rank * length
            self.piece = self.local.narrow(self.dim, self.start, length)

    def take_gradient(self, rank: int, ranks: int) -> None:
        grad = self.param.grad
        if grad is None:
            self.piece.grad = None
            return
        grad = _local(grad)
        if self.dim is not None:
            length = grad.shape[self.dim] // ranks
            grad = grad.narrow(self.dim, rank * length, length)
        self.piece.grad = grad

    def gather(self, group, ranks: int) -> None:
        """Every rank's updated piece, written into the whole local tensor."""
        if self.dim is None:
            return
        mine = self.piece.movedim(self.dim, 0).contiguous()
        gathered = torch.empty((ranks * mine.shape[0], *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
        dist.all_gather_single(gathered, mine, group=group)  # rank r's piece at rows r * length...
        self.local.copy_(gathered.movedim(0, self.dim))


class ShardedStatesOptimizer:
    """``optimizer_class`` over this rank's 1/dp of each parameter (see the module docstring).

    Args:
        params: the module's parameters (DTensors whole on ``axis``, or plain tensors).
        mesh: the program's device mesh.
        axis: the mesh axis the states are split over (``"dp"``).
        optimizer_class, kwargs: the inner optimizer (e.g. ``torch.optim.AdamW, lr=1e-3``).
        rank_local: parameters among ``params`` that differ from rank to rank (an MoE
            layer's own experts): each rank steps them whole, with their own gradients, and
            nothing is gathered.
    """

    def __init__(
        self, params: Iterable[torch.Tensor], mesh: DeviceMesh, axis: str, optimizer_class: type[torch.optim.Optimizer],
        rank_local: Iterable[torch.Tensor] = (), **kwargs: Any
    ) -> None:
        self.group = mesh.get_group(axis)
        self.rank, self.ranks = mesh.get_local_rank(axis), mesh.size(mesh.mesh_dim_names.index(axis))
        unique: dict[int, torch.Tensor] = {}
        for param in params:
            if param.requires_grad:
                unique.setdefault(id(param), param)
        own = {id(param) for param in rank_local}
        self.pieces = [_Piece(param, self.rank, self.ranks, id(param) in own) for param in unique.values()]
        self.inner = optimizer_class([piece.piece for piece in self.pieces], **kwargs)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (learning-rate schedules set ``lr`` here)."""
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for piece in self.pieces:
            if set_to_none:
                piece.param.grad = None
            elif piece.param.grad is not None:
                piece.param.grad.zero_()
            piece.piece.grad = None

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("ShardedStatesOptimizer.step takes no closure")
        for piece in self.pieces:
            piece.take_gradient(self.rank, self.ranks)
        self.inner.step()
        for piece in self.pieces:
            piece.gather(self.group, self.ranks)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
