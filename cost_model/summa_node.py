"""Prices the ops of a plan on a mesh with SUMMA axes (``row``, ``col``, ``dep``): the
simulator calls ``add_summa_costs`` (a step contributor, ``cost_model.contributor_registry``)
once per node with its ``StepContext``, after its generic (per-axis) pricing.

* A linear with a ``SummaLayout`` replaces its generic compute by the SUMMA algorithm's
  (``cost_model.summa.matmul_cost``): the local matmuls are its compute; what of its
  broadcasts, reductions, all-gathers and reduce-scatters the rounds do not hide is its
  communication on the critical path. Its input and output edges are priced generically
  (they are plain placement changes). A 3-D layout that keeps its gathered operands adds them to
  the bytes the node saves for the backward.
* A norm with a ``SummaLayout`` splits its hidden dim over the layout's ``hidden_axis``: it
  all-reduces two statistics per row there in forward, and two sums per row in backward.
* The gradients of parameters replicated over a non-``dp`` axis on which the rows are split
  (2.5-D's weights over depth, bias and norm chunks) are summed as on any mesh
  (``cost_model.replica_gradients``).
"""

from __future__ import annotations

import math

from torch.distributed.tensor import Shard

from cost_model.summa import Grid, MatmulShape, ThreeDAxes, matmul_cost
from planner.strategy import SummaLayout

SUMMA_AXES = ("row", "col", "dep")
LINEAR_OPS = ("aten.linear.default",)
NORM_OPS = ("aten.layer_norm.default", "aten.rms_norm.default")
# cost_model.summa's group names -> the mesh axis whose ranks form that group. Its "row"
# group is one block row (ranks that differ in their column), i.e. the mesh's ``col`` axis.
GROUP_AXIS = {"row": "col", "col": "row", "depth": "dep"}
# 3-D roles in cost_model.summa's group names: x gathered over b (mesh ``row``), W over
# ``dep``, y reduce-scattered over c (mesh ``col``); ``swapped`` exchanges row and col.
THREE_D_AXES = {False: ThreeDAxes(gather_input="col", gather_weight="depth", scatter_output="row"),
                True: ThreeDAxes(gather_input="row", gather_weight="depth", scatter_output="col")}


def has_summa_axes(mesh) -> bool:
    """Whether the mesh has any of the SUMMA axes (row, col, dep)."""
    return any(name in SUMMA_AXES for name in mesh.names)


def grid_ranks(mesh, layout: SummaLayout) -> list[int]:
    """Global ranks of the first SUMMA grid of ``mesh`` (other axes at 0) in
    ``cost_model.summa``'s order: grid coordinate (i = row, j = col, k = dep) is
    ``ranks[k q^2 + i q + j]``."""
    shape = mesh.shape
    strides = {name: math.prod(shape[index + 1:]) for index, name in enumerate(mesh.names)}
    q, d = layout.q, layout.d
    depth_stride = strides.get("dep", 0)
    return [k * depth_stride + i * strides["row"] + j * strides["col"]
            for k in range(d) for i in range(q) for j in range(q)]


def linear_shape(node, mesh, micro_batches: int) -> MatmulShape:
    """The per-grid matmul of a linear node: rows of one grid (the batch split over ``dp``
    and the micro-batches), K and N from its weight."""
    x = node.input_meta[0].shape
    n, k = node.input_meta[1].shape
    dp = mesh.axis_size("dp") if "dp" in mesh.names else 1
    batch = max(1, x[0] // (dp * micro_batches)) if len(x) > 2 else 1
    rows = math.prod(x[1:-1]) if len(x) > 2 else max(1, x[0] // (dp * micro_batches))
    return MatmulShape(batch, rows, k, n)


def summa_linear_cost(node, mesh, cluster, layout: SummaLayout, precision: str, micro_batches: int):
    """``cost_model.summa.MatmulCost`` of a linear node under ``layout`` on ``mesh``."""
    grid = Grid(layout.family, layout.q, layout.d)
    return matmul_cost(linear_shape(node, mesh, micro_batches), grid, cluster, grid_ranks(mesh, layout),
                       precision, THREE_D_AXES[layout.swapped], layout.keep_gathered)


def add_summa_costs(context, node, strategy, cost) -> None:
    """Adjust ``cost`` (one micro-batch of ``node`` on one device) for SUMMA meshes (see the
    module docstring). A no-op on meshes without SUMMA axes."""
    mesh = context.mesh
    if not has_summa_axes(mesh):
        return
    layout = strategy.layout
    if isinstance(layout, SummaLayout) and node.op in LINEAR_OPS:
        _linear(context, node, layout, cost)
    elif isinstance(layout, SummaLayout) and node.op in NORM_OPS:
        _norm_statistics(context, node, strategy, layout, cost)


def _linear(context, node, layout: SummaLayout, cost) -> None:
    matmul = summa_linear_cost(node, context.mesh, context.cluster, layout, context.plan.precision,
                               context.micro_batches)
    # 2.5-D's weight-gradient all-reduce over depth is the gradient sync of a weight
    # replicated on dep (``_gradient_sync``), charged once per step there.
    depth = [t for t in matmul.transfers if t.group == "depth" and t.kind == "all_reduce"]
    depth_s = sum(t.count * t.seconds for t in depth)
    cost.forward_s, cost.backward_s = matmul.forward_compute_s, matmul.backward_compute_s
    cost.saved_bytes += matmul.kept_bytes  # 3-D with kept gathers: held until the backward
    cost.buffer_bytes = matmul.buffer_bytes
    cost.forward_comm_s += max(0.0, matmul.forward_s - matmul.forward_compute_s)
    cost.backward_comm_s += max(0.0, matmul.backward_s - depth_s - matmul.backward_compute_s)
    for transfer in matmul.transfers:
        if transfer not in depth:
            axis = GROUP_AXIS[transfer.group]
            cost.axis_bytes[axis] = cost.axis_bytes.get(axis, 0.0) + transfer.bytes_per_device


def _norm_statistics(context, node, strategy, layout: SummaLayout, cost) -> None:
    axis = layout.hidden_axis
    meta, placements = node.input_meta[0], strategy.inputs[0]
    rows = meta.numel / meta.shape[-1] / context.micro_batches
    rows /= math.prod(size for (name, size), p in zip(context.mesh.axes, placements)
                      if name != axis and name != "pp" and isinstance(p, Shard))
    size_bytes = 2 * rows * 4  # mean and variance (backward: two row sums), fp32
    seconds = context.collective("all_reduce", size_bytes, axis)
    cost.forward_comm_s += seconds
    cost.backward_comm_s += seconds
    n = context.mesh.axis_size(axis)
    cost.axis_bytes[axis] = cost.axis_bytes.get(axis, 0.0) + 2 * 2 * (n - 1) / n * size_bytes
