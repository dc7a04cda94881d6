"""Batch norm over the data-parallel group (codegen/runtime/batch_norm.py), in one process.

On a group of one rank the synchronised layer must compute exactly what the native layer
does: output, gradients of input, weight and bias, and running statistics, in training
(with and without momentum) and in evaluation. Several ranks are checked by the zoo's
parity launch (tests/test_zoo.py: data-parallel ResNets, and a program left unsynchronised
that must fail).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from codegen.runtime.batch_norm import synchronise_batch_norm


@pytest.fixture(scope="module")
def one_rank():
    assert not dist.is_initialized(), "a process group is already up in this test process"
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


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
def test_one_rank_matches_the_native_layer(one_rank, layer, shape):
    torch.manual_seed(0)
    native = nn.Sequential(layer)
    if layer.affine:
        nn.init.uniform_(layer.weight)
        nn.init.uniform_(layer.bias)
    synchronised = copy.deepcopy(native)
    assert synchronise_batch_norm(synchronised, one_rank) == 1
    for step in range(2):  # twice: the running statistics move on
        x = torch.randn(shape) * 3 + 1
        native_x, synchronised_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, result = native(native_x), synchronised(synchronised_x)
        torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)
        (expected * torch.arange(expected.numel()).view_as(expected)).sum().backward()
        (result * torch.arange(result.numel()).view_as(result)).sum().backward()
        torch.testing.assert_close(synchronised_x.grad, native_x.grad, rtol=1e-4, atol=1e-4)
        for (name, a), (_, b) in zip(synchronised.named_parameters(), native.named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4, msg=name)
        for (name, a), (_, b) in zip(synchronised.named_buffers(), native.named_buffers()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    native.eval(), synchronised.eval()
    x = torch.randn(shape)
    torch.testing.assert_close(synchronised(x), native(x))
