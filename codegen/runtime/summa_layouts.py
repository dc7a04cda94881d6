"""SUMMA matmuls and block-layout norms on the DTensors of a plan's block layouts.

A generated program (``model_spmd.py``) holds its parameters and activations as DTensors with
the plan's placements (``planner.strategy.SummaLayout``). On a SUMMA node it hands their local
shards (``to_local()``) to the algorithms of ``codegen.runtime.summa`` and wraps the result
back with ``DTensor.from_local`` in the output's placements. The mesh axes are named ``row``
(q), ``col`` (q) and, for 2.5-D and 3-D, ``dep`` (d); ``dp`` may sit outside them.

Block layouts, as DTensor lays nested shards out (the mesh's outer axis takes the outer chunk):

- 2-D / 2.5-D (mesh ``dep x row x col``): x is ``S(0)`` on ``dep`` and ``row`` and
  ``S(-1)`` on ``col``, so rank (dep e, row r, col c) holds rows chunk ``e q + r`` and
  columns chunk c: the layout ``summa.summa_matmul`` works on, with i = r and j = c. W (N, K)
  is ``S(1)`` on ``row`` and ``S(0)`` on ``col``, so its local transpose is block (r, c) of
  W^T. y keeps x's placements.
- 3-D (mesh ``row x col x dep``), roles b = ``row``, c = ``col`` (``swapped`` exchanges
  them): x is ``S(0)`` on b and ``dep`` (rows chunk ``b q + e``), ``S(-1)`` on c; W is
  ``S(1)`` on c and ``dep`` (K chunk ``c q + e``: the all-gather over ``dep`` gives K block
  c) and ``S(0)`` on b. The op all-gathers x over b (the rows ``b' q + e`` for every b'),
  multiplies by W's K block c, and reduce-scatters over c: rank c keeps rows chunk ``c q +
  e``, which is y's layout, ``S(0)`` on c and ``dep`` and ``S(-1)`` on b.

Gradients of replicated shards. A parameter shard replicated over a mesh axis on which the
activation's rows are split (W over ``dep`` and ``dp``; a bias or norm chunk over every axis
but the hidden one) saw only its own rows: its local gradient is handed back as ``Partial``
on those axes, and the program's gradient hook (``codegen.runtime.spmd``) all-reduces it
into the parameter's placements, once.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from codegen.runtime.summa import SummaGroups, ThreeD, matmul_3d, sum_over_group, summa_matmul

__all__ = ["block_layer_norm", "in_layout", "input_placements", "summa_linear", "weight_placements"]

SUMMA_AXES = ("row", "col", "dep")


def _index(mesh, axis: str) -> int:
    names = mesh.mesh_dim_names or ()
    if axis not in names:
        raise ValueError(f"a SUMMA layout needs mesh axis {axis!r}; this mesh has {list(names)}")
    return names.index(axis)


def _is_shard(placement: Placement, dim: int, rank: int) -> bool:
    """A plain (not strided) split of ``dim``: the contiguous chunks the algorithms assume."""
    return type(placement) is Shard and placement.dim % rank == dim % rank


def input_placements(axes: Sequence[str], rank: int, family: str, swapped: bool = False) -> dict[str, Placement]:
    """The placements of a SUMMA linear's input x (of ``rank`` dims, rows on dim 0) on the
    SUMMA axes among ``axes``: {axis: placement}."""
    rows, hidden = Shard(0), Shard(rank - 1)
    if family in ("2d", "2.5d"):
        wanted = {"row": rows, "col": hidden}
        if family == "2.5d":
            wanted["dep"] = rows
    else:
        row_role, col_role = ("col", "row") if swapped else ("row", "col")
        wanted = {row_role: rows, "dep": rows, col_role: hidden}
    return {axis: placement for axis, placement in wanted.items() if axis in axes}


def in_layout(tensor: DTensor, wanted: dict[str, Placement]) -> DTensor:
    """``tensor`` with the ``wanted`` placements on those axes (others kept): as is when it
    already has them, else redistributed. The plan reads a SUMMA op's operands in the block
    layout and the program redistributes them there, but DTensor's own rule for the op
    before may lay its result out otherwise (e.g. a view merging split heads gathers them):
    then the operand moves here, as ``_to`` would move it."""
    mesh = tensor.device_mesh
    target = list(tensor.placements)
    for axis, placement in wanted.items():
        target[_index(mesh, axis)] = placement
    if all(_same(held, want, tensor.dim()) for held, want in zip(tensor.placements, target)):
        return tensor
    return tensor.redistribute(mesh, target)


def _vector_in_layout(vector: DTensor, hidden_axis: str) -> DTensor:
    """A bias or norm weight as the block layout holds it: ``S(0)`` on ``hidden_axis``,
    whole on every other axis."""
    names = vector.device_mesh.mesh_dim_names or ()
    return in_layout(vector, {axis: Shard(0) if axis == hidden_axis else Replicate() for axis in names})


def _same(held: Placement, wanted: Placement, rank: int) -> bool:
    if isinstance(wanted, Shard):
        return _is_shard(held, wanted.dim, rank)
    return type(held) is type(wanted) and held == wanted


def weight_placements(axes: Sequence[str], family: str, swapped: bool = False) -> dict[str, Placement]:
    """The placements of a SUMMA linear's weight (N, K) on the SUMMA axes among ``axes``."""
    if family in ("2d", "2.5d"):
        wanted = {"row": Shard(1), "col": Shard(0)}
        if family == "2.5d":
            wanted["dep"] = Replicate()
    else:
        row_role, col_role = ("col", "row") if swapped else ("row", "col")
        wanted = {col_role: Shard(1), "dep": Shard(1), row_role: Shard(0)}
    return {axis: placement for axis, placement in wanted.items() if axis in axes}


def _local_with_partial_gradient(param: DTensor, rows_split_on: Sequence[bool]) -> torch.Tensor:
    """``param``'s local shard; its gradient comes back ``Partial`` on the axes where the
    shard is replicated but the activation's rows are split (each rank saw other rows)."""
    grad_placements = [
        Partial() if isinstance(p, Replicate) and split else p for p, split in zip(param.placements, rows_split_on)
    ]
    return param.to_local(grad_placements=grad_placements)


def _rows_split(x: DTensor) -> list[bool]:
    """Per mesh axis: whether x's rows (a dim other than the hidden one) are split on it."""
    return [isinstance(p, Shard) and p.dim % x.dim() != x.dim() - 1 for p in x.placements]


def summa_linear(x: DTensor, weight: DTensor, bias: DTensor | None, family: str, swapped: bool = False,
                 keep_gathered: bool = False) -> DTensor:
    """``x @ weight.T + bias`` by 2-D SUMMA, 2.5-D or 3-D on the block layouts of the module
    docstring: x (..., K) with its rows on dim 0, weight (N, K), bias (N). Returns y (..., N),
    in x's placements (2-D, 2.5-D) or with ``row`` and ``col`` exchanged (3-D). A 3-D matmul
    with ``keep_gathered`` keeps its gathered x and W for the backward (``matmul_3d``)."""
    if family not in ("2d", "2.5d", "3d"):
        raise ValueError(f"SUMMA family must be 2d, 2.5d or 3d, got {family!r}")
    if keep_gathered and family != "3d":
        raise ValueError(f"only 3-D matmuls keep their gathered operands, not {family}")
    names = x.device_mesh.mesh_dim_names or ()
    x = in_layout(x, input_placements(names, x.dim(), family, swapped))
    weight = in_layout(weight, weight_placements(names, family, swapped))
    mesh = x.device_mesh
    row, col = _index(mesh, "row"), _index(mesh, "col")
    rows_split = _rows_split(x)
    x_local = x.to_local()
    lead = x_local.shape[:-1]
    x_rows = x_local.reshape(-1, x_local.shape[-1])  # [t, K/q]: rows in order (dim 0 outermost)
    w_t = _local_with_partial_gradient(weight, rows_split).t()  # [K/q, N/q] (3-D: [K/q^2, N/q])
    if family == "3d":
        grid = SummaGroups.from_mesh(mesh, "row", "col", "dep")
        # SummaGroups names groups by what they connect: its "col" group is the mesh's row
        # axis, its "row" group the mesh's col axis.
        roles = ThreeD(gather_input="row", gather_weight="depth", scatter_output="col") if swapped else \
            ThreeD(gather_input="col", gather_weight="depth", scatter_output="row")
        y_rows = matmul_3d(x_rows, w_t, grid, roles, keep_gathered)
        out = list(x.placements)
        out[row], out[col] = x.placements[col], x.placements[row]
    else:
        # The depth slices share W: its gradient's depth sum is the Partial above, so the
        # grid has no depth group (summa_matmul would sum it a second time).
        grid = SummaGroups(mesh.size(row), 1, mesh.get_local_rank("row"), mesh.get_local_rank("col"), 0,
                           row=mesh.get_group("col"), col=mesh.get_group("row"), depth=None)
        y_rows = summa_matmul(x_rows, w_t, grid)
        out = list(x.placements)
    if bias is not None:
        # y's columns are split over 'col' (2-D, 2.5-D) or over the 3-D op's b role.
        hidden_out = "col" if family != "3d" or swapped else "row"
        bias = _vector_in_layout(bias, hidden_out)
        out_rows_split = [isinstance(p, Shard) and p.dim % x.dim() != x.dim() - 1 for p in out]
        y_rows = y_rows + _local_with_partial_gradient(bias, out_rows_split)
    y_local = y_rows.reshape(*lead, y_rows.shape[-1])
    shape = (*x.shape[:-1], weight.shape[0])
    return DTensor.from_local(y_local, mesh, out, run_check=False, shape=torch.Size(shape), stride=_strides(shape))


def block_layer_norm(x: DTensor, normalized_shape: Sequence[int], weight: DTensor | None, bias: DTensor | None,
                     eps: float, hidden_axis: str) -> DTensor:
    """LayerNorm over x's last dim, split over mesh axis ``hidden_axis``: each row's sum, then
    its squared deviations, are all-reduced over that axis (one number per local row);
    ``weight`` and ``bias`` are ``S(0)`` on it. y keeps x's placements."""
    if len(normalized_shape) != 1:
        raise ValueError(f"a block-layout norm normalises the last dim only, got normalized_shape={list(normalized_shape)}")
    x = in_layout(x, {hidden_axis: Shard(x.dim() - 1)})
    mesh = x.device_mesh
    group = mesh.get_group(hidden_axis)
    hidden = normalized_shape[0]
    x_local = x.to_local()
    mean = sum_over_group(x_local.sum(-1, keepdim=True), group) / hidden
    centred = x_local - mean
    variance = sum_over_group((centred * centred).sum(-1, keepdim=True), group) / hidden
    y = centred * torch.rsqrt(variance + eps)
    rows_split = _rows_split(x)
    if weight is not None:
        y = y * _local_with_partial_gradient(_vector_in_layout(weight, hidden_axis), rows_split)
    if bias is not None:
        y = y + _local_with_partial_gradient(_vector_in_layout(bias, hidden_axis), rows_split)
    return DTensor.from_local(y, mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= size
    return tuple(reversed(strides))
