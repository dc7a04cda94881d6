"""2-D SUMMA, 2.5-D and 3-D tensor-parallel matmuls, and the block-layout ops of a GPT MLP.

Activations are 2-D, ``[T, H]`` (tokens flattened), and live in a *block layout*: every rank
holds one block of rows and one block of columns. The algorithms (and what they cost) are in
``cost_model/summa.py``; this module runs them as ``torch.autograd.Function``s over the
process groups of a DeviceMesh.

The grid. Rank (i, j, k) of a ``q x q x d`` grid (``SummaGroups``) communicates on:
  row    ranks (i, *, k)   (same block row: it varies j)
  col    ranks (*, j, k)   (same block column: it varies i)
  depth  ranks (i, j, *)   (absent in 2-D, where d = 1)
Group member l of ``row`` is rank (i, l, k), of ``col`` rank (l, j, k), of ``depth`` (i, j, l).

2-D / 2.5-D block layout (``split_rows_2d``): an activation [T, H] is cut into d q row chunks
and q column chunks; rank (i, j, k) holds row chunk ``k q + i`` (depth slices first) and column
chunk j: [T/(d q), H/q]. A weight [K, N] is cut q x q; rank (i, j, k) holds block (i, j)
[K/q, N/q], the same on every depth slice. A bias or norm weight [N] is cut into q chunks;
rank (i, j, k) holds chunk j.

3-D block layout (``ThreeD``): with a = i, b = j, c = k and a matmul's roles (which group
gathers its input, which its weight, which scatters its output), the input X [T, K] at rank
(a, b, c) is row chunk ``a q + b`` of T/q^2 rows and column chunk c; the weight [K, N] block
(c, b) split over a on its rows: [K/q^2, N/q]; the output Y [T, N] is row chunk ``a q + c``
and column chunk b. The next matmul swaps b and c (``ThreeD.swapped``), so a two-matmul MLP
returns to its input's layout and the residual add is local.

Replicated parameters. A weight block replicated over depth (2.5-D), and every bias or norm
chunk (replicated over the ranks that hold other rows), gets a gradient from its own rows
only; ``all_reduce_gradient`` sums it over the replicas inside backward, so after
``loss.backward()`` every rank holds the single device's gradient of its shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "BlockMLP",
    "SummaGroups",
    "ThreeD",
    "all_reduce_gradient",
    "layer_norm_block",
    "linear_2d",
    "linear_3d",
    "matmul_3d",
    "replicated",
    "split_input_3d",
    "split_output_3d",
    "split_rows_2d",
    "split_vector_2d",
    "split_vector_3d",
    "split_weight_2d",
    "split_weight_3d",
    "sum_over_group",
    "summa_matmul",
    "vector_replicas",
]


@dataclass(frozen=True)
class SummaGroups:
    """This rank's place in a ``q x q x d`` grid and the grid's process groups (module docstring)."""

    q: int
    d: int
    i: int
    j: int
    k: int
    row: ProcessGroup
    col: ProcessGroup
    depth: ProcessGroup | None

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, row_dim: str, col_dim: str, depth_dim: str | None = None) -> SummaGroups:
        """The grid on ``mesh``: ``row_dim`` indexes the block row i, ``col_dim`` the block column j,
        ``depth_dim`` (optional) the depth slice k. The row group is the mesh's ``col_dim`` group
        (its members differ in j), the column group its ``row_dim`` group."""
        names = mesh.mesh_dim_names or ()
        for dim in (row_dim, col_dim, depth_dim):
            if dim is not None and dim not in names:
                raise ValueError(f"mesh has no dimension {dim!r}; its dimensions are {list(names)}")
        q = mesh.size(mesh.mesh_dim_names.index(row_dim))
        if mesh.size(mesh.mesh_dim_names.index(col_dim)) != q:
            raise ValueError(f"a SUMMA grid is square: mesh dims {row_dim!r} and {col_dim!r} differ in size")
        d = 1 if depth_dim is None else mesh.size(mesh.mesh_dim_names.index(depth_dim))
        return cls(q, d, mesh.get_local_rank(row_dim), mesh.get_local_rank(col_dim),
                   0 if depth_dim is None else mesh.get_local_rank(depth_dim),
                   row=mesh.get_group(col_dim), col=mesh.get_group(row_dim),
                   depth=None if depth_dim is None else mesh.get_group(depth_dim))

    def coordinate(self, group: str) -> int:
        """This rank's index inside ``group`` ("row" varies j, "col" varies i, "depth" varies k)."""
        return {"row": self.j, "col": self.i, "depth": self.k}[group]

    def group(self, name: str) -> ProcessGroup | None:
        """The process group called ``name``."""
        return {"row": self.row, "col": self.col, "depth": self.depth}[name]


# ---- collectives with autograd ----

def all_reduce_gradient(grad: torch.Tensor, groups: tuple[ProcessGroup | None, ...]) -> torch.Tensor:
    """Sum ``grad`` over each of ``groups`` in turn (None: a group of one): the gradient of a
    parameter whose copies on those ranks saw different rows."""
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=group)
    return grad


class _Replicated(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the replicas (Megatron's "f")."""

    @staticmethod
    def forward(ctx, tensor, groups):
        ctx.groups = groups
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_gradient(grad.clone(), ctx.groups), None


def replicated(tensor: torch.Tensor, groups: tuple[ProcessGroup | None, ...]) -> torch.Tensor:
    """``tensor`` as is; its gradient summed over ``groups`` (a parameter replicated on them)."""
    return _Replicated.apply(tensor, groups)


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the group's ranks, on every rank. Backward: each rank used its copy
    of the sum with its own block, so the gradient of one rank's term is the sum of all ranks'
    gradients of the sum: an all-reduce again."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_group(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-reduce (sum) with autograd, e.g. for statistics over a hidden dimension split on ``group``."""
    return _SumOverGroup.apply(tensor, group)


# ---- 2-D SUMMA and 2.5-D ----

def _post_broadcast(block: torch.Tensor, shape: torch.Size, owner: int, mine: int, group: ProcessGroup):
    """Start broadcasting ``block`` from group member ``owner``; returns (buffer, work)."""
    buffer = block.contiguous() if mine == owner else torch.empty(shape, dtype=block.dtype, device=block.device)
    return buffer, dist.broadcast(buffer, group=group, group_src=owner, async_op=True)


class _Summa(torch.autograd.Function):
    """Y = X W on a q x q grid (per depth slice; the weight blocks are the same on every slice).

    Shapes at rank (i, j, k): x [t, K/q] with t = T/(d q), w [K/q, N/q], y [t, N/q].
    """

    @staticmethod
    def forward(ctx, x, w, grid: SummaGroups):
        ctx.save_for_backward(x, w)
        ctx.grid = grid
        q, i, j = grid.q, grid.i, grid.j
        y = x.new_zeros(x.shape[0], w.shape[1])

        def start(round_):  # round l: X_il along row i (from column l), W_lj along column j (from row l)
            x_l, x_work = _post_broadcast(x, x.shape, round_, j, grid.row)
            w_l, w_work = _post_broadcast(w, w.shape, round_, i, grid.col)
            return x_l, w_l, (x_work, w_work)

        pending = start(0)
        for round_ in range(q):
            x_l, w_l, works = pending
            for work in works:
                work.wait()
            if round_ + 1 < q:  # the next round's blocks travel while this round multiplies
                pending = start(round_ + 1)
            y += x_l @ w_l  # [t, K/q] x [K/q, N/q]
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        grid = ctx.grid
        q, i, j = grid.q, grid.i, grid.j
        dy = dy.contiguous()
        # dX_il = sum_j dY_ij W_lj^T: W_lj along column j, partial [t, K/q] reduced along row i onto (i, l).
        dx = _reduce_rounds(q, lambda l: _post_broadcast(w, w.shape, l, i, grid.col),
                            lambda w_l: dy @ w_l.T, grid.row, j)
        # dW_lj = sum_i X_il^T dY_ij: X_il along row i, partial [K/q, N/q] reduced along column j onto (l, j).
        dw = _reduce_rounds(q, lambda l: _post_broadcast(x, x.shape, l, j, grid.row),
                            lambda x_l: x_l.T @ dy, grid.col, i)
        # The depth slices share W but saw different rows: sum their weight gradients.
        return dx, all_reduce_gradient(dw, (grid.depth,)), None


def _reduce_rounds(q, start, partial_of, reduce_group, mine):
    """q rounds of: receive a block (``start(l)`` posts its broadcast; the next one is posted
    before this round's matmul), multiply (``partial_of``), reduce the partial onto member l
    (asynchronously: it drains during the next round). Returns the block reduced onto this rank."""
    pending = start(0)
    reductions, result = [], None
    for round_ in range(q):
        block, work = pending
        work.wait()
        if round_ + 1 < q:
            pending = start(round_ + 1)
        partial = partial_of(block).contiguous()
        # (work, buffer): the buffer must outlive its asynchronous reduction.
        reductions.append((dist.reduce(partial, group=reduce_group, group_dst=round_, async_op=True), partial))
        if round_ == mine:
            result = partial  # the reduction lands here
    for work, _ in reductions:
        work.wait()
    return result


def summa_matmul(x: torch.Tensor, w: torch.Tensor, grid: SummaGroups) -> torch.Tensor:
    """2-D (d = 1) or 2.5-D SUMMA product of blocks: x [T/(d q), K/q], w [K/q, N/q] -> [T/(d q), N/q]."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"summa_matmul takes blocks [t, K/q] and [K/q, N/q], got {list(x.shape)} and {list(w.shape)}")
    return _Summa.apply(x, w, grid)


# ---- 3-D ----

@dataclass(frozen=True)
class ThreeD:
    """A 3-D matmul's roles: the group over which its input is split (b), its weight (a), and
    over which its output is reduce-scattered (c). Group names as in ``SummaGroups``."""

    gather_input: str = "row"
    gather_weight: str = "col"
    scatter_output: str = "depth"

    def swapped(self) -> ThreeD:
        """The next matmul's roles: it reads Y[a, b] split over c as its X."""
        return ThreeD(self.scatter_output, self.gather_weight, self.gather_input)


def _all_gather_rows(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    out = tensor.new_empty(tensor.shape[0] * size, *tensor.shape[1:])
    dist.all_gather_single(out, tensor.contiguous(), group=group)
    return out


def _start_reduce_scatter_rows(tensor: torch.Tensor, group: ProcessGroup):
    """Start the reduce-scatter of ``tensor``'s rows over ``group``: (this rank's rows, the
    pending work; wait on it before reading them)."""
    size = dist.get_world_size(group)
    out = tensor.new_empty(tensor.shape[0] // size, *tensor.shape[1:])
    return out, dist.reduce_scatter_single(out, tensor.contiguous(), group=group, async_op=True)


def _reduce_scatter_rows(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    out, pending = _start_reduce_scatter_rows(tensor, group)
    pending.wait()
    return out


class _Matmul3D(torch.autograd.Function):
    """Y = X W on a q x q x q grid. At rank (a, b, c): x [T/q^2, K/q], w [K/q^2, N/q]; gathered
    X[a, c] [T/q, K/q] and W[c, b] [K/q, N/q]; partial Y[a, b] [T/q, N/q]; y [T/q^2, N/q].
    Saves the shards (memory 1/q^3; the backward gathers them again) or, ``keep_gathered``,
    the gathered blocks (1/q^2; the backward gathers dY only)."""

    @staticmethod
    def forward(ctx, x, w, grid: SummaGroups, roles: ThreeD, keep_gathered: bool):
        ctx.grid, ctx.roles, ctx.keep_gathered = grid, roles, keep_gathered
        x_full = _all_gather_rows(x, grid.group(roles.gather_input))
        w_full = _all_gather_rows(w, grid.group(roles.gather_weight))
        ctx.save_for_backward(*((x_full, w_full) if keep_gathered else (x, w)))
        return _reduce_scatter_rows(x_full @ w_full, grid.group(roles.scatter_output))

    @staticmethod
    def backward(ctx, dy):
        grid, roles = ctx.grid, ctx.roles
        dy_full = _all_gather_rows(dy, grid.group(roles.scatter_output))  # dY[a, b] [T/q, N/q]
        if ctx.keep_gathered:
            x_full, w_full = ctx.saved_tensors
        else:
            x, w = ctx.saved_tensors
            x_full = _all_gather_rows(x, grid.group(roles.gather_input))
            w_full = _all_gather_rows(w, grid.group(roles.gather_weight))
        # dX's reduce-scatter (sum over b) runs while dW's partial product is computed.
        dx, pending = _start_reduce_scatter_rows(dy_full @ w_full.T, grid.group(roles.gather_input))
        dw = _reduce_scatter_rows(x_full.T @ dy_full, grid.group(roles.gather_weight))  # sum over a
        pending.wait()
        return dx, dw, None, None, None


def matmul_3d(x: torch.Tensor, w: torch.Tensor, grid: SummaGroups, roles: ThreeD = ThreeD(),
              keep_gathered: bool = False) -> torch.Tensor:
    """3-D product of shards: x [T/q^2, K/q], w [K/q^2, N/q] -> [T/q^2, N/q] (module docstring).
    ``keep_gathered`` trades memory for two all-gathers in the backward (``_Matmul3D``)."""
    if grid.d != grid.q:
        raise ValueError(f"a 3-D matmul needs a q x q x q grid, got q={grid.q}, d={grid.d}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0] * grid.q:
        raise ValueError(f"matmul_3d takes shards [T/q^2, K/q] and [K/q^2, N/q], got {list(x.shape)} and {list(w.shape)}")
    return _Matmul3D.apply(x, w, grid, roles, keep_gathered)


# ---- splitting full tensors into this rank's blocks (tests, boundaries, loading weights) ----

def _chunk(tensor: torch.Tensor, parts: int, index: int, dim: int) -> torch.Tensor:
    if tensor.shape[dim] % parts:
        raise ValueError(f"dimension {dim} of size {tensor.shape[dim]} does not split into {parts} equal blocks")
    return tensor.chunk(parts, dim)[index]


def split_rows_2d(x: torch.Tensor, grid: SummaGroups) -> torch.Tensor:
    """This rank's block of an activation [T, H]: rows chunk k q + i of d q, columns chunk j of q."""
    return _chunk(_chunk(x, grid.d * grid.q, grid.k * grid.q + grid.i, 0), grid.q, grid.j, 1)


def split_weight_2d(w: torch.Tensor, grid: SummaGroups) -> torch.Tensor:
    """Block (i, j) of a weight [K, N]."""
    return _chunk(_chunk(w, grid.q, grid.i, 0), grid.q, grid.j, 1)


def split_vector_2d(v: torch.Tensor, grid: SummaGroups) -> torch.Tensor:
    """Chunk j of a bias or norm weight [N]."""
    return _chunk(v, grid.q, grid.j, 0)


def split_input_3d(x: torch.Tensor, grid: SummaGroups, roles: ThreeD = ThreeD()) -> torch.Tensor:
    """This rank's shard of a 3-D matmul's input [T, K]: rows chunk a q + b of q^2, columns chunk c."""
    a, b, c = (grid.coordinate(roles.gather_weight), grid.coordinate(roles.gather_input),
               grid.coordinate(roles.scatter_output))
    return _chunk(_chunk(x, grid.q * grid.q, a * grid.q + b, 0), grid.q, c, 1)


def split_output_3d(y: torch.Tensor, grid: SummaGroups, roles: ThreeD = ThreeD()) -> torch.Tensor:
    """This rank's shard of a 3-D matmul's output [T, N]: rows chunk a q + c, columns chunk b."""
    return split_input_3d(y, grid, roles.swapped())


def split_weight_3d(w: torch.Tensor, grid: SummaGroups, roles: ThreeD = ThreeD()) -> torch.Tensor:
    """Piece a (of q, on the rows) of block (c, b) of a weight [K, N]: [K/q^2, N/q]."""
    a, b, c = (grid.coordinate(roles.gather_weight), grid.coordinate(roles.gather_input),
               grid.coordinate(roles.scatter_output))
    block = _chunk(_chunk(w, grid.q, c, 0), grid.q, b, 1)
    return _chunk(block, grid.q, a, 0)


def split_vector_3d(v: torch.Tensor, grid: SummaGroups, hidden_group: str) -> torch.Tensor:
    """Chunk of a bias or norm weight [N] for the layout whose columns are split over ``hidden_group``."""
    return _chunk(v, grid.q, grid.coordinate(hidden_group), 0)


# ---- the other ops of a block, in the block layout ----

def vector_replicas(grid: SummaGroups, hidden_group: str) -> tuple[ProcessGroup | None, ...]:
    """The groups holding copies of a bias or norm chunk whose columns are split over
    ``hidden_group``: the other two (the ranks with the same columns but other rows)."""
    return tuple(grid.group(name) for name in ("row", "col", "depth") if name != hidden_group)


def layer_norm_block(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, hidden_size: int,
                     grid: SummaGroups, hidden_group: str, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the full hidden size of an activation whose columns are split over
    ``hidden_group``: each row's sum, then its squared deviations, are summed over that group
    (all-reduces of one number per local row). ``weight`` and ``bias`` are this rank's chunks."""
    group = grid.group(hidden_group)
    mean = sum_over_group(x.sum(-1, keepdim=True), group) / hidden_size
    centred = x - mean
    variance = sum_over_group((centred * centred).sum(-1, keepdim=True), group) / hidden_size
    replicas = vector_replicas(grid, hidden_group)
    return centred * torch.rsqrt(variance + eps) * replicated(weight, replicas) + replicated(bias, replicas)


def linear_2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: SummaGroups) -> torch.Tensor:
    """``x @ W + b`` by 2-D / 2.5-D SUMMA: x [T/(d q), K/q], weight block [K/q, N/q], bias chunk [N/q]."""
    out = summa_matmul(x, weight, grid)
    return out if bias is None else out + replicated(bias, vector_replicas(grid, "row"))


def linear_3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: SummaGroups,
              roles: ThreeD = ThreeD()) -> torch.Tensor:
    """``x @ W + b`` by 3-D: x [T/q^2, K/q], weight shard [K/q^2, N/q], bias chunk [N/q] (the output's
    columns are split over ``roles.gather_input``)."""
    out = matmul_3d(x, weight, grid, roles)
    return out if bias is None else out + replicated(bias, vector_replicas(grid, roles.gather_input))


# ---- a GPT MLP block ----

class BlockMLP(torch.nn.Module):
    """``x + fc2(gelu(fc1(layer_norm(x))))`` with every tensor in a block layout.

    ``family`` is "2d" (2-D or 2.5-D SUMMA, by the grid's depth) or "3d". Built from the full
    parameters (LayerNorm weight/bias [H], fc1 [H, F] as ``x @ w``, its bias [F], fc2 [F, H], its
    bias [H]); keeps this rank's shards as Parameters. Input and output are the block of the
    activation [T, H] given by ``split_rows_2d`` (2-D/2.5-D) or ``split_input_3d`` (3-D).
    """

    def __init__(self, family: str, grid: SummaGroups, norm_weight, norm_bias, fc1_weight, fc1_bias,
                 fc2_weight, fc2_bias, eps: float = 1e-5) -> None:
        super().__init__()
        if family not in ("2d", "3d"):
            raise ValueError(f"BlockMLP family must be '2d' or '3d', got {family!r}")
        self.family, self.grid, self.eps = family, grid, eps
        self.hidden = norm_weight.shape[0]
        if family == "2d":
            # Every activation's columns are split over the row group (j), its rows over col
            # (i) and depth (k).
            self.norm_group = "row"
            fc1_hidden = fc2_hidden = "row"
            fc1_w, fc2_w = split_weight_2d(fc1_weight, grid), split_weight_2d(fc2_weight, grid)
        else:
            self.fc1_roles = ThreeD()
            self.fc2_roles = self.fc1_roles.swapped()
            # The input's columns are split over fc1's scatter group (c); fc1's output columns
            # over its input group (b); fc2's output returns to the input's layout.
            self.norm_group = self.fc1_roles.scatter_output
            fc1_hidden, fc2_hidden = self.fc1_roles.gather_input, self.fc2_roles.gather_input
            fc1_w = split_weight_3d(fc1_weight, grid, self.fc1_roles)
            fc2_w = split_weight_3d(fc2_weight, grid, self.fc2_roles)

        def shard(tensor: torch.Tensor) -> torch.nn.Parameter:
            return torch.nn.Parameter(tensor.detach().clone())

        def chunk(vector: torch.Tensor, hidden_group: str) -> torch.nn.Parameter:
            return shard(_chunk(vector, grid.q, grid.coordinate(hidden_group), 0))
        self.norm_weight = chunk(norm_weight, self.norm_group)
        self.norm_bias = chunk(norm_bias, self.norm_group)
        self.fc1_weight, self.fc2_weight = shard(fc1_w), shard(fc2_w)
        self.fc1_bias, self.fc2_bias = chunk(fc1_bias, fc1_hidden), chunk(fc2_bias, fc2_hidden)

    def linear(self, x: torch.Tensor, which: str) -> torch.Tensor:
        weight, bias = getattr(self, f"{which}_weight"), getattr(self, f"{which}_bias")
        if self.family == "2d":
            return linear_2d(x, weight, bias, self.grid)
        return linear_3d(x, weight, bias, self.grid, getattr(self, f"{which}_roles"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = layer_norm_block(x, self.norm_weight, self.norm_bias, self.hidden, self.grid, self.norm_group,
                                  self.eps)
        hidden = F.gelu(self.linear(normed, "fc1"))  # elementwise: local
        return x + self.linear(hidden, "fc2")  # same layout as x: the residual add is local
