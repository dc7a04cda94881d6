"""Kernels autograd runs in backward that no traced op's forward shows: the gradient of a
tensor split into views, and the gradient of a linear layer's bias.

* A ``split`` (``chunk``, ``split_with_sizes``, ``tensor_split``, ``unbind``) is a view in
  forward: no kernel. Its backward is not: ``split_backward`` and ``split_with_sizes_backward``
  (torch/csrc/autograd/FunctionsManual.cpp, as in PyTorch 2.1) materialize the missing
  gradients and ``at::cat`` them into the input's gradient (``unbind_backward``: ``at::stack``),
  a copy that reads every output gradient and writes the input's: twice the input's bytes.
  A fused q|k|v projection split for attention pays it in every block (the attention kernel
  returns dq, dk and dv as three tensors).
* A linear layer with a bias adds the bias to every row; the bias's gradient sums the output
  gradient over the rows. ``at::linear`` runs ``addmm`` (on the flattened rows for a
  contiguous 3-D input: ``_flatten_nd_linear`` in aten/src/ATen/native/Linear.cpp), whose
  derivative for ``self`` passes the gradient on unreduced (tools/autograd/derivatives.yaml:
  ``self: maybe_multiply(grad, beta.conj())``), and the autograd engine reduces it to the
  bias's shape (torch/csrc/autograd/engine.cpp ``validate_outputs``:
  ``metadata.reduce_grad(grad)``, an ``at::sum_to``): one reduction kernel that reads the
  whole output gradient, beside the two gradient GEMMs. (Transformer Engine's linear computes
  it in its weight-gradient GEMM's epilogue instead; Megatron-LM's own linear layers run
  ``grad_output.sum(dim=0)``, the same reduction.)

Both are memory-bound kernels priced at the default memory efficiency, on GPUs of a known
generation (``gpu_kernels.generation_of``) as the other shape-aware kernel prices are.
"""

from __future__ import annotations

from cost_model import defaults
from planner.cluster import DeviceSpec
from planner.graph import OpNode

# Views whose backward concatenates (or stacks) the outputs' gradients into the input's.
SPLITTING_VIEWS = ("aten.split", "aten.split_with_sizes", "aten.chunk", "aten.tensor_split", "aten.unbind")


def memory_bound_time(num_bytes: float, device: DeviceSpec) -> float:
    """Seconds of one memory-bound kernel moving ``num_bytes`` at the default efficiency."""
    return num_bytes / (device.memory_bandwidth * defaults.MEMORY_EFFICIENCY) + defaults.KERNEL_OVERHEAD_S


def split_backward_bytes(node: OpNode, work_fraction: float, element_bytes: int) -> float:
    """Bytes the backward of a splitting view moves (``work_fraction`` of its traced work, in
    ``element_bytes`` per element): its outputs' gradients read and the input's written, so
    twice the input; 0 for any other view, or one of integers (no gradient)."""
    if not node.op.startswith(SPLITTING_VIEWS) or not node.input_meta:
        return 0.0
    source = node.input_meta[0]
    if not source.dtype.is_floating_point:
        return 0.0
    moved = min(element_bytes, source.dtype.itemsize)
    return 2.0 * source.numel * moved * work_fraction


def view_backward_time(node: OpNode, work_fraction: float, device: DeviceSpec, element_bytes: int) -> float:
    """Backward seconds of a view op: the concatenation of a split's gradients, else none."""
    num_bytes = split_backward_bytes(node, work_fraction, element_bytes)
    return memory_bound_time(num_bytes, device) if num_bytes else 0.0


def bias_gradient_time(rows: float, outputs: float, element_bytes: int, device: DeviceSpec) -> float:
    """Seconds of the reduction that sums a linear layer's output gradient (``rows`` x
    ``outputs``) into its bias's gradient: the gradient read, ``outputs`` values written."""
    return memory_bound_time(element_bytes * (rows * outputs + outputs), device)


def bias_length(node: OpNode) -> int | None:
    """The length of the 1-D bias a linear or addmm op adds to every row (its gradient is a
    reduction over the rows), or None when it has none."""
    shapes = [meta.shape for meta in node.input_meta]
    op = node.op.rsplit(".", 1)[0]
    if op == "aten.linear" and len(shapes) >= 3 and len(shapes[2]) == 1:
        return shapes[2][0]
    if op == "aten.addmm" and len(shapes) >= 3 and len(shapes[0]) == 1:
        return shapes[0][0]
    return None
