"""Memory-bound kernels priced by the kind of eager kernel ATen launches
(``cost_model.memory_kernels``), against figures worked out by hand.

A100-80GB preset: 2.039e12 B/s; 5 us per kernel. Contiguous pointwise 0.913 (1.8616e12 B/s),
broadcasting pointwise 0.539 (1.0990e12 B/s), fused norm 0.525 (1.0705e12 B/s), the rest at
the default 0.8 (1.6312e12 B/s).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cost_model import defaults
from cost_model.compute import op_times
from cost_model.memory_kernels import (
    BROADCAST_EFFICIENCY,
    FUSED_NORM_EFFICIENCY,
    STREAMING_EFFICIENCY,
    kernel_memory_efficiency,
    memory_kind,
)
from planner.cluster import Cluster
from planner.graph import OpNode, TensorMeta

A100 = Cluster.preset("dgx-a100-80g").device_of(0)
ACTIVATION = TensorMeta((4, 2048, 4096), torch.bfloat16)  # 2^25 elements, 2^26 bytes
ROW = TensorMeta((4, 2048, 1), torch.bfloat16)
WEIGHT = TensorMeta((4096,), torch.bfloat16)


def node(op: str, inputs: tuple[TensorMeta, ...], output: TensorMeta = ACTIVATION) -> OpNode:
    """An op reading ``inputs`` and writing ``output``, its traced bytes their sum."""
    return OpNode(name="x", op=op, inputs=tuple(f"i{n}" for n in range(len(inputs))), input_meta=inputs,
                  output_meta=(output,), bytes_moved=sum(meta.nbytes for meta in inputs) + output.nbytes)


def test_constants_are_the_cited_measurements_arithmetic():
    # ReLU² on H100: two kernels over 4096 x 16384 bf16 reading and writing 2 B each, 0.1855 ms
    # less two 5 us launches.
    assert STREAMING_EFFICIENCY == pytest.approx(2 * 4096 * 16384 * 4 / (3.35e12 * (0.1855e-3 - 10e-6)), abs=5e-4)
    # SwiGLU over chunk views on H100: silu 4 B and multiply 6 B per output element of
    # 8192 x 32768, 1.4953 ms less two launches.
    assert BROADCAST_EFFICIENCY == pytest.approx(8192 * 32768 * 10 / (3.35e12 * (1.4953e-3 - 10e-6)), abs=5e-4)
    # nn.LayerNorm on A100: 4096 x 16384 fp32 in and out plus weight and bias, 0.5067 ms less
    # one launch.
    moved = 4096 * 16384 * 8 + 2 * 16384 * 4
    assert FUSED_NORM_EFFICIENCY == pytest.approx(moved / (2.039e12 * (0.5067e-3 - 5e-6)), abs=5e-4)


def test_kinds_from_the_ops_shapes():
    assert memory_kind(node("aten.add.Tensor", (ACTIVATION, ACTIVATION))) == "streaming"  # residual add
    assert memory_kind(node("aten.silu.default", (ACTIVATION,))) == "streaming"
    assert memory_kind(node("aten.mul.Tensor", (ACTIVATION, ROW))) == "broadcast"  # x * rsqrt(mean)
    assert memory_kind(node("aten.mul.Tensor", (WEIGHT, ACTIVATION))) == "broadcast"  # weight * x
    assert memory_kind(node("aten.layer_norm.default", (ACTIVATION, WEIGHT, WEIGHT))) == "fused norm"
    assert memory_kind(node("aten.rms_norm.default", (ACTIVATION, WEIGHT))) == "fused norm"
    assert memory_kind(node("aten.mean.dim", (ACTIVATION,), ROW)) == "other"  # a reduction: the default
    assert memory_kind(node("aten._to_copy.default", (ACTIVATION,))) == "other"  # a cast: the default
    assert memory_kind(node("aten.cat.default", (ACTIVATION, ACTIVATION))) == "other"


def test_a_normalisations_kernels_priced_by_kind_by_hand():
    # One (4, 2048, 4096) bf16 activation = 2^26 B.
    # Residual add, contiguous: 3 x 2^26 B / 1.8616e12 = 108.14 us + 5 us.
    add_forward, _ = op_times(node("aten.add.Tensor", (ACTIVATION, ACTIVATION)), 1.0, A100, "bf16")
    assert add_forward == pytest.approx(3 * 2**26 / (2.039e12 * 0.913) + 5e-6)
    assert add_forward == pytest.approx(113.14e-6, rel=1e-3)
    # x * rsqrt(...), broadcasting: (2 x 2^26 + 2^14) B / 1.0990e12 = 122.14 us + 5 us; its
    # backward (the default, twice the bytes) at the same rate: 244.28 us + 5 us.
    forward, backward = op_times(node("aten.mul.Tensor", (ACTIVATION, ROW)), 1.0, A100, "bf16")
    moved = 2 * 2**26 + 2**14
    assert forward == pytest.approx(moved / (2.039e12 * 0.539) + 5e-6)
    assert forward == pytest.approx(127.14e-6, rel=1e-3)
    assert backward == pytest.approx(2 * moved / (2.039e12 * 0.539) + 5e-6)
    # The row mean, a reduction at the default: (2^26 + 2^14) B / 1.6312e12 = 41.15 us + 5 us.
    mean_forward, _ = op_times(node("aten.mean.dim", (ACTIVATION,), ROW), 1.0, A100, "bf16")
    assert mean_forward == pytest.approx((2**26 + 2**14) / (2.039e12 * defaults.MEMORY_EFFICIENCY) + 5e-6)
    # A fused LayerNorm: (2 x 2^26 + 2 x 2^13) B / 1.0705e12 = 125.39 us + 5 us.
    norm_forward, _ = op_times(node("aten.layer_norm.default", (ACTIVATION, WEIGHT, WEIGHT)), 1.0, A100, "bf16")
    assert norm_forward == pytest.approx((2 * 2**26 + 2 * 2**13) / (2.039e12 * 0.525) + 5e-6)
    assert norm_forward == pytest.approx(130.39e-6, rel=1e-3)


def test_calibrated_devices_and_cpus_keep_one_efficiency():
    # A measured profile's memory efficiency stands for every kind; a CPU has no ATen CUDA
    # kernels to tell apart.
    broadcast = node("aten.mul.Tensor", (ACTIVATION, ROW))
    calibrated = dataclasses.replace(A100, memory_efficiency=0.7)
    assert kernel_memory_efficiency(broadcast, calibrated) is None
    forward, _ = op_times(broadcast, 1.0, calibrated, "bf16")
    assert forward == pytest.approx(broadcast.bytes_moved / (2.039e12 * 0.7) + 5e-6)
    cpu = Cluster.preset("cpu").device_of(0)
    assert kernel_memory_efficiency(broadcast, cpu) is None
    assert kernel_memory_efficiency(broadcast, A100) == BROADCAST_EFFICIENCY
