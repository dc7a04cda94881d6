"""Backward kernels no traced forward shows (``cost_model.gradient_copies``): the concatenation
of a split's gradients and the reduction of a linear layer's bias gradient, priced by hand on
an A100 (2.039 TB/s at the default memory efficiency 0.8 = 1.6312 TB/s, 5 us per kernel)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cost_model import defaults
from cost_model.compute import op_times
from planner.cluster import Cluster
from planner.graph import OpNode, TensorMeta

A100 = Cluster.preset("dgx-a100-80g").device_of(0)
ROOFLINE = dataclasses.replace(A100, name="roofline-device")  # no known generation
BF16 = torch.bfloat16
STREAM = 2.039e12 * defaults.MEMORY_EFFICIENCY


def _linear(bias: bool) -> OpNode:
    # MPT-7B's fused q|k|v projection on one micro-batch of 6 x 2048 tokens.
    x, w, b = TensorMeta((6, 2048, 4096), BF16), TensorMeta((12288, 4096), BF16), TensorMeta((12288,), BF16)
    metas = (x, w, b) if bias else (x, w)
    return OpNode("qkv", "aten.linear.default", tuple("xwb"[:len(metas)]), metas, (TensorMeta((6, 2048, 12288), BF16),),
                  flops=2 * 12288 * 4096 * 12288)


def test_bias_gradient_is_a_reduction_over_the_rows():
    # The output gradient, 12,288 rows x 12,288 bf16 values, read once and 12,288 values
    # written: 2 x (12288 x 12288 + 12288) = 302,014,464 bytes / 1.6312e12 B/s = 0.18515 ms
    # + 5 us, on top of the two gradient GEMMs the bias-free layer has.
    with_bias = op_times(_linear(True), 1.0, A100, "bf16")
    without = op_times(_linear(False), 1.0, A100, "bf16")
    assert with_bias[0] == without[0]
    expected = 2 * (12288 * 12288 + 12288) / STREAM + defaults.KERNEL_OVERHEAD_S
    assert with_bias[1] - without[1] == pytest.approx(expected)
    assert expected == pytest.approx(190.15e-6, rel=1e-3)
    # Half the rows (two ranks or micro-batches share the op) read half the gradient.
    half = op_times(_linear(True), 0.5, A100, "bf16")[1] - op_times(_linear(False), 0.5, A100, "bf16")[1]
    assert half == pytest.approx(2 * (6144 * 12288 + 12288) / STREAM + defaults.KERNEL_OVERHEAD_S)


def test_split_backward_concatenates_the_gradients():
    # q, k, v = qkv.split(4096, dim=2) on (6, 2048, 12288) bf16: forward a view; backward
    # cats the three gradients: 151M elements read and written, 2 x 2 x 150,994,944 bytes =
    # 603,979,776 / 1.6312e12 = 0.37027 ms + 5 us.
    qkv = TensorMeta((6, 2048, 12288), BF16)
    part = TensorMeta((6, 2048, 4096), BF16)
    split = OpNode("split", "aten.split.Tensor", ("qkv",), (qkv,), (part, part, part), attrs=(None, 4096, 2))
    forward, backward = op_times(split, 1.0, A100, "bf16")
    assert forward == 0.0
    assert backward == pytest.approx(4 * 6 * 2048 * 12288 / STREAM + defaults.KERNEL_OVERHEAD_S)
    assert backward == pytest.approx(375.27e-6, rel=1e-3)
    # Other views stay free; so does a split of integers (no gradient) and any view on a
    # device of no known GPU generation (the roofline's views).
    view = OpNode("view", "aten.view.default", ("qkv",), (qkv,), (TensorMeta((12288, 12288), BF16),))
    assert op_times(view, 1.0, A100, "bf16") == (0.0, 0.0)
    ids = TensorMeta((6, 2048, 3), torch.int64)
    int_split = OpNode("isplit", "aten.split.Tensor", ("ids",), (ids,), (TensorMeta((6, 2048, 1), torch.int64),) * 3)
    assert op_times(int_split, 1.0, A100, "bf16") == (0.0, 0.0)
    assert op_times(split, 1.0, ROOFLINE, "bf16") == (0.0, 0.0)
