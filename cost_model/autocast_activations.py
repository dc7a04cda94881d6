"""What autocast makes of a bf16 program's activations: the dtype each op's output has at run
time, and the bytes its memory-bound kernels move beyond the bf16 they are priced at.

The simulator prices a memory-bound op's bytes at the plan's activation dtype (``compute.
op_times``: bf16 for a bf16 plan). A program of the planner's own runs its forward under
``torch.autocast(dtype=bfloat16)`` (``codegen.runtime.precision``), which does not make every
activation bf16 (the "CUDA Ops that can autocast to float32" list and the type-promotion rule
of the torch.amp documentation; aten/src/ATen/autocast_mode.cpp in pytorch/pytorch):

- ops on autocast's bf16 list (``mixed_precision.AUTOCAST_BF16_OPS``: linear, matmul,
  scaled_dot_product_attention, ...) cast every fp32 input to bf16 and return bf16; an input
  that is an activation (not a weight, whose cast autocast caches and
  ``mixed_precision.add_autocast_weight_casts`` prices) costs a cast kernel of its own each
  time an op reads it, and another for its gradient in backward;
- ops on the fp32 list (pow, rsqrt, exp, log, softmax, log_softmax, sum, layer_norm, the
  losses, ...) return fp32 whatever their input;
- every other op runs in the widest floating dtype among its dimensioned tensor inputs
  (type promotion: a bf16 tensor times an fp32 tensor is fp32), so an fp32 value spreads
  until a bf16-list op casts it back.

So a Llama RMSNorm (``x * rsqrt(x.pow(2).mean(-1) + eps) * w``) runs in fp32 from the pow on
and hands fp32 to the three projections that read it, each casting it; a rotary embedding
whose cos/sin tables are fp32 (made from ``arange`` at the default dtype) turns q and k fp32
until attention casts them back. Meta's and torchtitan's Llama code run the same ops in fp32
on purpose (``self._norm(x.float()).type_as(x)``, ``xq.float()`` before the rotary product).

Weights are bf16 inside FSDP2 units under the bf16 policy (``program_shape.
wraps_bf16_fsdp_units``), fp32 elsewhere (DDP, ZeRO-1, graph programs): there the embedding's
output, and with it the residual stream, is fp32. Other systems' 16-bit runs
(``Plan.half_precision_weights``, Megatron-Core's) keep their activations in 16 bits: nothing
here applies to them (``mixed_precision.holds_fp32_weights``).
"""

from __future__ import annotations

import math

from cost_model.compute import PRECISIONS, backward_bytes_ratio_on, efficiencies, roofline_time, runs_no_kernel
from cost_model.fused_chains import chain_kernels
from cost_model.memory_kernels import kernel_memory_efficiency
from cost_model.gpu_kernels import ATTENTION_OPS, MATMUL_OPS, generation_of
from cost_model.loss_parallel import CROSS_ENTROPY
from cost_model.mixed_precision import AUTOCAST_BF16_OPS, aten_name, holds_fp32_weights
from cost_model.op_share import work_split
from planner.graph import OpGraph, OpNode
from planner.program_shape import wraps_bf16_fsdp_units

# ATen ops autocast runs in fp32 on CUDA (autocast_mode.cpp: the ``fp32`` list, and the
# ``fp32_set_opt_dtype`` ops, which compute and return fp32 for a 16-bit input).
AUTOCAST_FP32_OPS = frozenset((
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm", "nuclear_norm",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss",
    "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "cross_entropy_loss",
    "prod", "softmax", "log_softmax", "_softmax", "_log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "sum",
))
# One cast kernel of an fp32 activation to bf16: 4 bytes read, 2 written per element (and the
# same for its gradient's cast back in backward).
ACTIVATION_CAST_BYTES = 4 + 2


def runtime_element_bytes(graph: OpGraph, weight_bytes: int, low_bytes: int = 2) -> dict[str, int]:
    """Bytes per element of each floating value of ``graph`` (node outputs, weights, inputs) as
    a program under 16-bit autocast holds it, weights being ``weight_bytes`` wide (module
    docstring). Values the trace made integral keep their size."""
    sizes: dict[str, int] = {}
    for node in graph.nodes:
        for name in _param_inputs(node):
            sizes[name] = weight_bytes
        output = node.output_meta[0] if node.output_meta else None
        if output is None or not output.dtype.is_floating_point:
            sizes[node.name] = output.dtype.itemsize if output is not None else 0
            continue
        floating = [(name, meta) for name, meta in zip(node.inputs, node.input_meta)
                    if meta.dtype.is_floating_point]
        traced_in = max((meta.dtype.itemsize for _, meta in floating), default=output.dtype.itemsize)
        name = aten_name(node.op)
        if name in AUTOCAST_BF16_OPS:
            sizes[node.name] = low_bytes
        elif name in AUTOCAST_FP32_OPS:
            sizes[node.name] = 4
        elif output.dtype.itemsize != traced_in:  # an explicit cast (.float(), .to(), type_as)
            sizes[node.name] = output.dtype.itemsize
        elif floating:  # promotion: dimensioned tensors decide, 0-dim ones only alone
            names = [n for n, meta in floating if len(meta.shape) > 0] or [n for n, _ in floating]
            sizes[node.name] = max(sizes.get(n, traced_in) for n in names)
        else:  # a factory (arange, ones): the default dtype the trace recorded
            sizes[node.name] = output.dtype.itemsize
    return sizes


def _param_inputs(node: OpNode) -> list[str]:
    """The input names of ``node`` that are its weights (the export's ``p_`` placeholders)."""
    return [name for name in node.inputs if name.startswith("p_")]


_CACHE: dict[int, tuple[OpGraph, int, dict[str, int]]] = {}


def _sizes_of(graph: OpGraph, weight_bytes: int) -> dict[str, int]:
    """``runtime_element_bytes`` once per graph and weight width (the simulator asks per op);
    a few graphs are held at most, since holding one keeps it alive."""
    key = id(graph) * 8 + weight_bytes
    held = _CACHE.get(key)
    if held is None or held[0] is not graph:
        if len(_CACHE) >= 4:
            _CACHE.clear()
        held = _CACHE[key] = (graph, weight_bytes, runtime_element_bytes(graph, weight_bytes))
    return held[2]


def _priced_bytes(node: OpNode, low_bytes: int) -> float:
    """The bytes ``compute.op_times`` prices ``node``'s kernel at: its traced bytes scaled to
    the plan's activation width."""
    traced = max((meta.dtype.itemsize for meta in node.output_meta if meta.dtype.is_floating_point), default=4)
    return node.bytes_moved * min(1.0, low_bytes / traced)


def _runtime_bytes(node: OpNode, sizes: dict[str, int]) -> float:
    """The bytes ``node``'s kernel moves with its inputs and output at their run-time widths."""
    moved = 0.0
    for name, meta in zip(node.inputs, node.input_meta):
        width = sizes.get(name, meta.dtype.itemsize) if meta.dtype.is_floating_point else meta.dtype.itemsize
        moved += math.prod(meta.shape) * width
    for meta in node.output_meta:
        width = sizes.get(node.name, meta.dtype.itemsize) if meta.dtype.is_floating_point else meta.dtype.itemsize
        moved += math.prod(meta.shape) * width
    return moved


def runtime_widths(context, node: OpNode) -> tuple[int, ...]:
    """The run-time bytes per element of ``node``'s inputs and output that
    ``autocast_activation_times`` prices it by, () where it prices nothing: two ops of the same
    shapes whose inputs differ in width (a projection of an fp32 norm's output, one of bf16
    attention's) cost differently, which a cache of node costs must tell apart."""
    plan = context.plan
    if not holds_fp32_weights(plan) or node.is_view or generation_of(context.device) is None:
        return ()
    low_bytes = PRECISIONS[plan.precision][1]
    sizes = _sizes_of(context.graph, low_bytes if wraps_bf16_fsdp_units(plan) else 4)
    return tuple(sizes.get(name, 0) for name in (*node.inputs, node.name))


def autocast_activation_times(context, node: OpNode, share: float, device) -> tuple[float, float]:
    """(forward, backward) seconds autocast's fp32 activations add to ``node`` doing ``share``
    of its traced work on ``device`` in a program of the planner's own: a memory-bound kernel
    moving more bytes than the bf16 it is priced at (its backward in proportion, by its
    gradient formula), and a bf16-list op's cast of each fp32 activation it reads, forward and
    backward (module docstring). (0, 0) for other systems' 16-bit runs and off CUDA GPUs."""
    plan = context.plan
    if (not holds_fp32_weights(plan) or node.is_view or runs_no_kernel(node)
            or generation_of(device) is None):
        return 0.0, 0.0  # the lists above are CUDA's; CPUs and calibrated devices keep their pricing
    if node.name in chain_kernels(context.graph, getattr(plan, "fused_chains", "")):
        # A fused norm or rotary kernel (Plan.fused_chains) reads and writes the 16-bit tensor;
        # its readers still pay autocast's casts of the fp32 value the trace hands them.
        return 0.0, 0.0
    low_bytes = PRECISIONS[plan.precision][1]
    weight_bytes = low_bytes if wraps_bf16_fsdp_units(plan) else 4
    sizes = _sizes_of(context.graph, weight_bytes)
    dtype = PRECISIONS[plan.precision][0]
    if aten_name(node.op) in AUTOCAST_BF16_OPS:
        parameters = set(_param_inputs(node))
        cast = sum(math.prod(meta.shape) for input_name, meta in zip(node.inputs, node.input_meta)
                   if input_name not in parameters and meta.dtype.is_floating_point
                   and sizes.get(input_name, low_bytes) > low_bytes)
        seconds = roofline_time(0.0, cast * share * ACTIVATION_CAST_BYTES, device, dtype) if cast else 0.0
        return seconds, seconds
    if node.op.startswith((*MATMUL_OPS, *ATTENTION_OPS)) or node.op == CROSS_ENTROPY:
        return 0.0, 0.0  # priced by their own models (cross entropy's already reads fp32 logits)
    extra = _runtime_bytes(node, sizes) - _priced_bytes(node, low_bytes)
    if extra <= 0:
        return 0.0, 0.0
    # The extra bytes are the same kernel's: they stream at its kind's efficiency.
    memory = kernel_memory_efficiency(node, device) or efficiencies(device, dtype)[1]
    forward = extra * share / (device.memory_bandwidth * memory)
    has_gradient = any(meta.dtype.is_floating_point for meta in node.output_meta)
    return forward, forward * backward_bytes_ratio_on(node, device) if has_gradient else 0.0


def add_autocast_activation_bytes(context, node, strategy, cost) -> None:
    """Charge ``cost`` (one micro-batch of ``node`` on the context's device) what autocast's
    fp32 activations add (``autocast_activation_times``)."""
    share = 1.0 / (work_split(context.mesh, strategy) * context.micro_batches)
    forward, backward = autocast_activation_times(context, node, share, context.device)
    cost.forward_s += forward
    cost.backward_s += backward
