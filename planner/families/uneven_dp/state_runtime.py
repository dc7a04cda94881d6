"""What a compiled program with optimizer-state shares by memory imports (codegen layer):
gradients reduced with an uneven split, each rank stepping its own part, parameters gathered
back with the same split (Cephalo's state placement; ``state_shares`` says why).

The weights stay whole on every rank (plain tensors, no DDP), so forward and backward run as
on one device over this rank's rows. ``StateShards`` views every trainable parameter as one
flat vector of ``N`` elements, cut into the plan's parts (``state_shares.state_parts``); rank
r owns elements ``offset_r .. offset_r + p_r``:

- ``reduce_gradients``: reduce-scatter-v. The flat gradient goes out with
  ``all_to_all_single`` (input split sizes: the parts), so rank r receives every rank's
  gradient of its own part and sums them, divided by ``dp`` (each rank's loss was scaled by
  ``b_r * dp / B``, ``Program.loss_weight``, so the result is one device's gradient). NCCL
  and gloo have no reduce-scatter of uneven parts; padding every part to the largest would
  send ``(n - 1) max p`` elements, this sends each its own.
- ``UnevenStatesOptimizer.step``: the inner optimizer (AdamW) steps rank r's fp32 piece of
  the flat parameters with that gradient part (its states are for ``p_r`` elements only),
  then all-gather-v: ``all_to_all_single`` again, this rank's piece to every rank (output
  split sizes: the parts), and the whole flat vector is copied back into the parameters.

Both exchanges go bucket by bucket (``state_shares.bucket_ranges``: a slice of every rank's
part in each, about ``EXCHANGE_BUCKET_ELEMENTS`` in all), so a rank copies one bucket of
gradients at a time and receives ``dp`` times its slice of it, never the whole flat vector.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from planner.errors import LaunchError
from planner.families.uneven_dp.state_shares import EXCHANGE_BUCKET_ELEMENTS, bucket_ranges, state_parts

__all__ = ["StateShards", "UnevenStatesOptimizer", "attach_state_shards"]


class StateShards:
    """The flat parameter vector of ``model`` over ``dp`` with uneven parts (module docstring).

    Args:
        model: the rank's whole model (its parameters equal on every rank: rank 0's are
            broadcast once here, as DDP does when it wraps a model).
        mesh: the program's mesh; the parts go over its ``"dp"`` axis.
        weights: the plan's ``state_shares``, one integer weight per ``dp`` rank.
        bucket: elements of the flat vector per exchange.
    """

    def __init__(self, model: torch.nn.Module, mesh: DeviceMesh, weights: Sequence[int],
                 bucket: int = EXCHANGE_BUCKET_ELEMENTS) -> None:
        self.group = mesh.get_group("dp")
        self.rank, self.ranks = mesh.get_local_rank("dp"), len(weights)
        unique: dict[int, torch.Tensor] = {}
        for param in model.parameters():
            if param.requires_grad:
                unique.setdefault(id(param), param)
        self.params = list(unique.values())
        # A tied weight under its first name, as one device's model names it (parity, reports).
        self.names = {id(param): name for name, param in model.named_parameters()}
        total = sum(param.numel() for param in self.params)
        self.parts = state_parts(total, tuple(weights))
        self.offset = sum(self.parts[:self.rank])
        self.exchanges = bucket_ranges(self.parts, bucket)
        self.starts = [0]
        for param in self.params:
            self.starts.append(self.starts[-1] + param.numel())
        self._reduced: torch.Tensor | None = None
        with torch.no_grad():
            for param in self.params:
                dist.broadcast(param.data, dist.get_global_rank(self.group, 0), group=self.group)

    @property
    def own(self) -> int:
        """Elements of the flat vector this rank holds states for."""
        return self.parts[self.rank]

    def flat(self, tensors: Sequence[torch.Tensor | None], start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Elements ``start .. stop`` of ``tensors`` (one per parameter, None: zeros) laid
        end to end as the flat vector (all of them by default)."""
        stop = self.starts[-1] if stop is None else stop
        pieces = [torch.zeros(0, dtype=self.params[0].dtype, device=self.params[0].device)]
        for index, (param, tensor) in enumerate(zip(self.params, tensors)):
            low, high = max(start, self.starts[index]), min(stop, self.starts[index + 1])
            if low >= high:
                continue
            if tensor is None:
                pieces.append(torch.zeros(high - low, dtype=param.dtype, device=param.device))
            else:
                pieces.append(tensor.reshape(-1)[low - self.starts[index]:high - self.starts[index]])
        return torch.cat(pieces)

    def reduce_gradients(self) -> torch.Tensor:
        """This rank's part of one device's gradient: the reduce-scatter-v of every rank's
        flat gradient (module docstring), bucket by bucket, computed once per step."""
        if self._reduced is None:
            grads = [param.grad for param in self.params]
            reduced = torch.zeros(self.own, dtype=torch.float32, device=self.params[0].device)
            for ranges in self.exchanges:
                sizes = [stop - start for start, stop in ranges]
                mine = sizes[self.rank]
                sent = torch.cat([self.flat(grads, start, stop).float() for start, stop in ranges])
                received = torch.empty(self.ranks * mine, dtype=torch.float32, device=reduced.device)
                dist.all_to_all_single(received, sent, output_split_sizes=[mine] * self.ranks,
                                       input_split_sizes=sizes, group=self.group)
                low = ranges[self.rank][0] - self.offset
                reduced[low:low + mine] += received.view(self.ranks, mine).sum(0)
            self._reduced = reduced / self.ranks
        return self._reduced

    def gather(self, piece: torch.Tensor, write) -> None:
        """Every rank's ``piece`` (all-gather-v), bucket by bucket: ``write(start, values)``
        receives elements ``start ..`` of the whole flat vector."""
        for ranges in self.exchanges:
            sizes = [stop - start for start, stop in ranges]
            mine = sizes[self.rank]
            low = ranges[self.rank][0] - self.offset
            received = torch.empty(sum(sizes), dtype=piece.dtype, device=piece.device)
            dist.all_to_all_single(received, piece[low:low + mine].repeat(self.ranks), output_split_sizes=sizes,
                                   input_split_sizes=[mine] * self.ranks, group=self.group)
            for (start, _), values in zip(ranges, received.split(sizes)):
                write(start, values)

    def write(self, start: int, values: torch.Tensor) -> None:
        """Copy ``values``, elements ``start ..`` of the flat vector, into the parameters."""
        stop = start + values.numel()
        with torch.no_grad():
            for index, param in enumerate(self.params):
                low, high = max(start, self.starts[index]), min(stop, self.starts[index + 1])
                if low < high:
                    param.view(-1)[low - self.starts[index]:high - self.starts[index]].copy_(
                        values[low - start:high - start])

    def forget_gradients(self) -> None:
        """Drop the reduced part (a new step reduces again)."""
        self._reduced = None

    def full_parameters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Every parameter by name with one device's gradient, for the parity check
        (``codegen.runtime.parity.full_parameters``): the reduced parts all-gathered.
        Collective."""
        grads = torch.empty(self.starts[-1], dtype=torch.float32, device=self.params[0].device)

        def keep(start: int, values: torch.Tensor) -> None:
            grads[start:start + values.numel()] = values

        self.gather(self.reduce_gradients(), keep)
        found, start = {}, 0
        for param in self.params:
            grad = grads[start:start + param.numel()].view(param.shape).to(param.dtype)
            found[self.names[id(param)]] = (param.detach(), grad if param.grad is not None else None)
            start += param.numel()
        return found


def attach_state_shards(model: torch.nn.Module, mesh: DeviceMesh, weights: Sequence[int],
                        bucket: int = EXCHANGE_BUCKET_ELEMENTS) -> torch.nn.Module:
    """``model`` with its ``StateShards`` (``bucket`` elements an exchange) as
    ``model.state_shards`` and their ``full_parameters`` hook (the parity check reads one
    device's gradients through it)."""
    shards = StateShards(model, mesh, weights, bucket)
    model.state_shards = shards
    model.full_parameters = shards.full_parameters
    return model


class UnevenStatesOptimizer:
    """``optimizer_class`` over this rank's part of the flat parameters (module docstring).

    Args:
        shards: the model's ``StateShards``.
        optimizer_class, kwargs: the inner optimizer (e.g. ``torch.optim.AdamW, lr=1e-3``);
            elementwise optimizers (SGD, Adam, AdamW) step a part as they step the whole.
    """

    def __init__(self, shards: StateShards, optimizer_class: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        self.shards = shards
        own = shards.flat([param.detach() for param in shards.params], shards.offset, shards.offset + shards.own)
        self.piece = own.float().clone()
        self.inner = optimizer_class([self.piece], **kwargs)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (learning-rate schedules set ``lr`` here)."""
        return self.inner.param_groups

    @property
    def state(self):
        """Refused: a checkpoint names each parameter's states (``codegen.runtime.checkpoint``),
        and this rank's part of the flat vector is no box of any parameter; without this the
        checkpoint would silently leave the states out."""
        raise LaunchError(
            "checkpoints of a plan with uneven.state_shares are not written yet (its optimizer states are parts "
            "of the flat parameter vector); run without --checkpoint-dir, or drop state_shares from the plan"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) every parameter's gradient and this step's reduced part."""
        for param in self.shards.params:
            if param.grad is not None:
                param.grad = None if set_to_none else param.grad.zero_()
        self.piece.grad = None
        self.shards.forget_gradients()

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("UnevenStatesOptimizer.step takes no closure")
        self.piece.grad = self.shards.reduce_gradients()
        self.inner.step()
        self.shards.gather(self.piece, self.shards.write)
        self.shards.forget_gradients()
