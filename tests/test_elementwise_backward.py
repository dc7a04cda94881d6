"""Memory-bound ops' backward bytes from their gradient formulas (``cost_model.elementwise_backward``),
priced on a GPU against figures worked out by hand; CPUs keep the default of twice the forward.

H100 SXM5 preset: 3.35e12 B/s x 0.8 = 2.68e12 B/s for kernels of no measured kind (dropout),
3.35e12 x 0.913 = 3.0586e12 B/s for contiguous pointwise ones (``memory_kernels``), 5 us per kernel.
"""

from __future__ import annotations

import pytest
import torch

from cost_model import defaults
from cost_model.compute import op_times
from cost_model.elementwise_backward import backward_bytes_ratio
from planner.cluster import Cluster
from planner.graph import OpNode, TensorMeta

H100_DEVICE = Cluster.preset("dgx-h100").device_of(0)
STREAM = 3.35e12 * defaults.MEMORY_EFFICIENCY
CONTIGUOUS = 3.35e12 * 0.913  # memory_kernels.STREAMING_EFFICIENCY
OVERHEAD = defaults.KERNEL_OVERHEAD_S
ACTIVATION = TensorMeta((8, 2048, 4096), torch.bfloat16)  # 2^26 elements, 2^27 bytes


def elementwise(op: str, inputs: int) -> OpNode:
    """A bf16 op over ``inputs`` full-size tensors, reading them and writing one."""
    return OpNode(name="x", op=op, inputs=tuple(f"i{n}" for n in range(inputs)), input_meta=(ACTIVATION,) * inputs,
                  output_meta=(ACTIVATION,), bytes_moved=(inputs + 1) * ACTIVATION.nbytes)


def test_ratios_from_the_gradient_formulas():
    assert backward_bytes_ratio(elementwise("aten.gelu.default", 1)) == 1.5  # grad + saved input in, grad out
    assert backward_bytes_ratio(elementwise("aten.add.Tensor", 2)) == 1.0  # passed through, summed at the fork
    assert backward_bytes_ratio(elementwise("aten.mul.Tensor", 1)) == 1.0  # by a constant: grad * c
    assert backward_bytes_ratio(elementwise("aten.mul.Tensor", 2)) is None  # two tensors: the default
    assert backward_bytes_ratio(elementwise("aten.native_layer_norm.default", 1)) is None
    # pow_backward: pow(self, exponent - 1), times the exponent, times grad: 2 + 2 + 3 tensors
    # against the forward's 2; square is differentiated as pow(self, 2).
    assert backward_bytes_ratio(elementwise("aten.pow.Tensor_Scalar", 1)) == 3.5
    assert backward_bytes_ratio(elementwise("aten.square.default", 1)) == 3.5
    assert backward_bytes_ratio(elementwise("aten.pow.Tensor_Tensor", 2)) is None  # a tensor exponent


def test_gelu_backward_on_h100_by_hand():
    # A contiguous pointwise kernel, at 3.0586e12 B/s. Forward: read 2^27 B, write 2^27 B =
    # 2^28 B / 3.0586e12 = 87.77 us + 5 us. Backward: 1.5 x 2^28 B (gradient and saved input
    # read, gradient written) = 131.65 us + 5 us.
    forward, backward = op_times(elementwise("aten.gelu.default", 1), 1.0, H100_DEVICE, "bf16")
    assert forward == pytest.approx(2**28 / CONTIGUOUS + OVERHEAD)
    assert backward == pytest.approx(1.5 * 2**28 / CONTIGUOUS + OVERHEAD)
    assert backward == pytest.approx(136.65e-6, rel=1e-3)


def test_residual_add_backward_is_one_add():
    # Forward reads two and writes one (3 x 2^27 B); its backward is the fork's one add: the same.
    forward, backward = op_times(elementwise("aten.add.Tensor", 2), 1.0, H100_DEVICE, "bf16")
    assert backward == pytest.approx(forward)


def test_cpu_keeps_twice_the_forward():
    cpu = Cluster.preset("cpu").device_of(0)
    forward, backward = op_times(elementwise("aten.gelu.default", 1), 1.0, cpu, "bf16")
    overhead = defaults.KERNEL_OVERHEAD_S
    assert backward - overhead == pytest.approx(defaults.BACKWARD_TO_FORWARD * (forward - overhead))


def _dropout(p: float) -> OpNode:
    """``aten.dropout(x, p, train=True)`` as the tracer records it (``examples/gpt.py``'s
    ``nn.Dropout``: attrs ``(None, p, True)``)."""
    return OpNode(name="x", op="aten.dropout.default", inputs=("i0",), input_meta=(ACTIVATION,),
                  output_meta=(ACTIVATION,), bytes_moved=2 * ACTIVATION.nbytes, attrs=(None, p, True))


def test_dropout_with_p_zero_runs_no_kernel():
    # ATen's dropout returns its input when p == 0 (no native_dropout kernel, no backward
    # node): nothing in either pass. With p = 0.1 it is the fused kernel: read 2^27 B,
    # write 2^27 B (the one-byte mask is the traced bytes' business) = 2^28 B / 2.68e12 + 5 us,
    # and a backward of the same bytes.
    assert op_times(_dropout(0.0), 1.0, H100_DEVICE, "bf16") == (0.0, 0.0)
    forward, backward = op_times(_dropout(0.1), 1.0, H100_DEVICE, "bf16")
    assert forward == pytest.approx(2**28 / STREAM + OVERHEAD)
    assert backward == pytest.approx(forward)
