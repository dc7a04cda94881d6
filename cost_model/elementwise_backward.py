"""Bytes a memory-bound op's backward moves, relative to its forward, read from the gradient
formulas autograd runs (PyTorch's tools/autograd/derivatives.yaml) for the ops between a
transformer's GEMMs.

The roofline's default charges every op's backward twice its forward bytes
(``defaults.BACKWARD_TO_FORWARD``), the right count for a matmul's two gradient GEMMs but not
for these kernels, whose forward reads its inputs and writes its output (in + out):

* an activation that keeps its input or output for backward (gelu, silu, tanh, sigmoid, relu,
  exp: ``gelu_backward(grad, self)``, ``grad * result * (1 - result)``, ...) reads the
  gradient and the saved tensor and writes one gradient: 3 tensors against 2, 1.5x;
* a residual add passes its gradient through to both inputs (``AddBackward0``: ``grad``,
  ``maybe_multiply(grad, alpha)`` with alpha 1), and autograd sums the two gradients where
  the residual stream forks: one add of three tensors, as many bytes as the forward, 1x
  (every add and subtract is priced so; one whose inputs have no other reader, as in
  rotary embeddings, costs less: a pass-through or one negation);
* a multiply or divide of one tensor by a constant (the trace records no other tensor input)
  writes ``grad * c``: 2 tensors against 2, 1x;
* dropout's backward (``native_dropout_backward(grad, mask, scale)``) reads the gradient
  and the one-byte mask its forward wrote and writes the gradient: about the forward's bytes, 1x;
* a power of one tensor by a number (``pow.Tensor_Scalar``, and ``square``, which autograd
  differentiates as ``pow(self, 2)``) runs ``pow_backward``: ``grad * (exponent *
  self.pow(exponent - 1))`` (torch/csrc/autograd/FunctionsManual.cpp), three kernels: the
  inner power (for an exponent of 2, ``pow(self, 1)``, which ATen runs as a copy: Pow.cpp
  ``pow_Tensor_Scalar_out``), the multiply by the exponent, the multiply by the gradient:
  2 + 2 + 3 tensors against the forward's 2, 3.5x. Checked in ``benchmarks/components.py``
  (Liger-Kernel's eager ReLU² backward on H100).

Every other op keeps the default (a norm's backward reads the gradient and its input twice,
once for the input gradient and once more for the weight's, which is about twice its forward).
Applied on GPUs of a known generation (``gpu_kernels.generation_of``), where these kernels run;
checked in ``benchmarks/components.py`` (the loss rows' soft-cap).
"""

from __future__ import annotations

from planner.graph import OpNode

# op name prefixes (``OpNode.op`` without the overload) -> backward bytes over forward bytes
SAVED_TENSOR_ACTIVATIONS = ("aten.gelu", "aten.silu", "aten.tanh", "aten.sigmoid", "aten.relu", "aten.exp")
RESIDUAL_ADDS = ("aten.add", "aten.sub")
BY_A_CONSTANT = ("aten.mul", "aten.div")
DROPOUTS = ("aten.dropout", "aten.native_dropout")
POWERS = ("aten.pow", "aten.square")
ACTIVATION_RATIO = 1.5
PASS_THROUGH_RATIO = 1.0
POWER_RATIO = 3.5


def _base(op: str) -> str:
    """``aten.gelu.default`` -> ``aten.gelu``."""
    return op.rsplit(".", 1)[0] if op.count(".") >= 2 else op


def backward_bytes_ratio(node: OpNode) -> float | None:
    """Backward bytes over forward bytes of ``node``'s kernel (module docstring), or None for
    an op this module does not describe (the caller keeps its default)."""
    base = _base(node.op)
    if base in SAVED_TENSOR_ACTIVATIONS:
        return ACTIVATION_RATIO
    if base in RESIDUAL_ADDS or base in DROPOUTS:
        return PASS_THROUGH_RATIO
    if base in BY_A_CONSTANT and len(node.input_meta) == 1:
        return PASS_THROUGH_RATIO
    if base in POWERS and len(node.input_meta) == 1:
        return POWER_RATIO
    return None
