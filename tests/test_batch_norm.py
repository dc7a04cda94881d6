"""Batch norm over the data-parallel group (codegen/runtime/batch_norm.py), in one process.

On a group of one rank the synchronised layer must compute exactly what the native layer
does: output, gradients of input, weight and bias, and running statistics, in training
(with and without momentum) and in evaluation, in float32 and in float64 (``launch.py
--check --fp64`` runs the layer in float64: no step of it may round to float32). Subclasses
whose forward does more than normalise (an activation after the norm, as timm's
BatchNormAct2d) keep all of it, and one that normalises by its own arithmetic is refused by
name. Several ranks are checked by the zoo's parity launch (tests/test_zoo.py: data-parallel
ResNets, and a program left unsynchronised that must fail) and by
tests/test_stable_programs.py (a subclass with an activation, at world 2).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from codegen.runtime.batch_norm import BatchNormNotSynchronised, synchronise_batch_norm
from planner.errors import PlannerError


@pytest.fixture(scope="module")
def one_rank():
    assert not dist.is_initialized(), "a process group is already up in this test process"
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


# (output, gradients, running statistics) as (rtol, atol), by dtype. float32: a few ulps of
# sums over up to 100 values. float64: the two computations differ by at most 5e-13 here
# (sums of up to 100 terms below 1e4, unit roundoff 1.1e-16), while one float32 rounding
# anywhere (the input, the Bessel factor 100/99) is off by 4e-8 or more: 1e-10 parts them.
TOLERANCES = {
    torch.float32: ((1e-5, 1e-5), (1e-4, 1e-4), (1e-5, 1e-6)),
    torch.float64: ((1e-10, 1e-10), (1e-10, 1e-10), (1e-10, 1e-10)),
}


@pytest.mark.parametrize("dtype", sorted(TOLERANCES, key=str), ids=str)
@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.BatchNorm2d(3), (4, 3, 5, 5)),
        (nn.BatchNorm1d(6, momentum=None), (8, 6)),
        (nn.BatchNorm1d(4, affine=False), (5, 4, 7)),
        (nn.BatchNorm3d(2, track_running_stats=False), (2, 2, 3, 3, 3)),
    ],
    ids=["2d", "1d cumulative average", "1d without affine", "3d without running stats"],
)
def test_one_rank_matches_the_native_layer(one_rank, layer, shape, dtype):
    torch.manual_seed(0)
    layer = copy.deepcopy(layer)  # the parametrised layer is shared by both dtypes
    native = nn.Sequential(layer).to(dtype)
    if layer.affine:
        nn.init.uniform_(layer.weight)
        nn.init.uniform_(layer.bias)
    synchronised = copy.deepcopy(native)
    assert synchronise_batch_norm(synchronised, one_rank) == 1
    (out_rtol, out_atol), (grad_rtol, grad_atol), (stat_rtol, stat_atol) = TOLERANCES[dtype]
    for step in range(2):  # twice: the running statistics move on
        x = (torch.randn(shape) * 3 + 1).to(dtype)
        native_x, synchronised_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, result = native(native_x), synchronised(synchronised_x)
        assert result.dtype == dtype
        torch.testing.assert_close(result, expected, rtol=out_rtol, atol=out_atol)
        (expected * torch.arange(expected.numel()).view_as(expected)).sum().backward()
        (result * torch.arange(result.numel()).view_as(result)).sum().backward()
        torch.testing.assert_close(synchronised_x.grad, native_x.grad, rtol=grad_rtol, atol=grad_atol)
        for (name, a), (_, b) in zip(synchronised.named_parameters(), native.named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=grad_rtol, atol=grad_atol, msg=name)
        for (name, a), (_, b) in zip(synchronised.named_buffers(), native.named_buffers()):
            torch.testing.assert_close(a, b, rtol=stat_rtol, atol=stat_atol, msg=name)
    native.eval(), synchronised.eval()
    x = torch.randn(shape).to(dtype)
    torch.testing.assert_close(synchronised(x), native(x))


class BatchNormAct2d(nn.BatchNorm2d):
    """A stand-in for timm's BatchNormAct2d: the norm through F.batch_norm, then an activation
    and a scale in the same forward (what a replaced forward would lose)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        x = torch.nn.functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, factor, self.eps
        )
        return torch.nn.functional.silu(x) * 1.5


class ShiftedBatchNorm(nn.BatchNorm1d):
    """A subclass that calls the native forward and adds a learned shift and an extra argument."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.shift = nn.Parameter(torch.linspace(-1, 1, channels))

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return super().forward(x) * scale + self.shift.view(1, -1, 1)


class LowLevelBatchNorm(nn.BatchNorm2d):
    """Normalises through torch.batch_norm (below F.batch_norm), then adds one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.batch_norm(x, self.weight, self.bias, self.running_mean, self.running_var, self.training,
                                0.1, self.eps, False) + 1.0


class HandMadeBatchNorm(nn.BatchNorm1d):
    """Normalises with its own arithmetic: nothing this module can take over the group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean, var = x.mean((0, 2), keepdim=True), x.var((0, 2), keepdim=True, unbiased=False)
        return (x - mean) / torch.sqrt(var + self.eps)


@pytest.mark.parametrize("layer, shape, kwargs", [
    (BatchNormAct2d(3), (4, 3, 5, 5), {}),
    (ShiftedBatchNorm(4), (6, 4, 3), {"scale": 0.5}),
    (LowLevelBatchNorm(2), (4, 2, 3, 3), {}),
], ids=["norm then activation", "super().forward plus a shift", "torch.batch_norm plus one"])
def test_subclasses_keep_what_their_forward_adds(one_rank, layer, shape, kwargs):
    """A batch-norm subclass whose forward does more than normalise keeps all of it: only the
    statistics are taken over the group (the layer's output equals the native layer's,
    activation included), in training and in evaluation."""
    torch.manual_seed(0)
    native = copy.deepcopy(layer)
    nn.init.uniform_(native.weight)
    synchronised = copy.deepcopy(native)
    assert synchronise_batch_norm(synchronised, one_rank) == 1
    for _ in range(2):
        x = torch.randn(shape) * 2 + 0.5
        native_x, synchronised_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, result = native(native_x, **kwargs), synchronised(synchronised_x, **kwargs)
        torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)
        expected.square().sum().backward()
        result.square().sum().backward()
        torch.testing.assert_close(synchronised_x.grad, native_x.grad, rtol=1e-4, atol=1e-4)
        for (name, a), (_, b) in zip(synchronised.named_parameters(), native.named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4, msg=name)
    for (name, a), (_, b) in zip(synchronised.named_buffers(), native.named_buffers()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    native.eval(), synchronised.eval()
    x = torch.randn(shape)
    torch.testing.assert_close(synchronised(x, **kwargs), native(x, **kwargs))


def test_a_layer_normalising_by_itself_is_refused_by_name(one_rank):
    """A batch-norm subclass that normalises without F.batch_norm cannot have its statistics
    taken over the group: its first training forward says so, naming the class, instead of
    each rank normalising its own slice (evaluation, which reads no statistics, still runs)."""
    layer = HandMadeBatchNorm(3)
    synchronise_batch_norm(layer, one_rank)
    with pytest.raises(BatchNormNotSynchronised, match=r"HandMadeBatchNorm is a batch-norm layer .* F?.*batch_norm") as info:
        layer(torch.randn(4, 3, 2))
    assert isinstance(info.value, PlannerError)  # launch.py prints it as one error line, exit 2
    assert "\n" not in str(info.value)
    layer.eval()
    assert layer(torch.randn(4, 3, 2)).shape == (4, 3, 2)
