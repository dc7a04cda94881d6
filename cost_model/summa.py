"""Costs of one matmul under 1-D (Megatron), 2-D SUMMA, 2.5-D and 3-D tensor parallelism.

The matmul is ``Y = X @ W`` with ``X: [batch, m, K]``, ``W: [K, N]``, ``Y: [batch, m, N]``;
``T = batch * m`` rows ("tokens") take part. Sizes below are in elements; ``e`` is the bytes
of one element (the precision's). Every layout's algorithm, derived here from the block
decomposition of the product (the published tables differ in normalisation, so the tests
re-derive each figure by hand):

1-D, ``p`` devices (Megatron-LM, Shoeybi et al. 2019)
  column: ``W[:, n-slice]`` per device ([K, N/p]); ``X`` replicated; ``Y`` column slices. Forward
          needs no communication; backward all-reduces ``dX`` ([T, K], partial on every rank),
          overlapped with the weight-gradient matmul (computed after dX).
  row:    ``W[k-slice, :]`` per device ([K/p, N]); ``X`` column slices; ``Y`` partial sums,
          all-reduced in forward ([T, N]); backward needs none.

2-D SUMMA on a ``q x q`` grid (van de Geijn & Watts 1997; Optimus, Xu et al. 2021). Rank
(i, j) holds the blocks ``X_ij`` [T/q, K/q], ``W_ij`` [K/q, N/q] and produces ``Y_ij``
[T/q, N/q], so every tensor, activations included, is 1/q^2 per device.
  forward   Y_ij = sum_l X_il W_lj: q rounds; in round l, X_il is broadcast along row i (from
            column l) and W_lj along column j (from row l), then each rank adds X_il W_lj.
  backward  dX_il = sum_j dY_ij W_lj^T: q rounds; W_lj broadcast along column j, each rank
            computes dY_ij W_lj^T and the row reduces it onto (i, l).
            dW_lj = sum_i X_il^T dY_ij: q rounds; X_il broadcast along row i, each rank
            computes X_il^T dY_ij and the column reduces it onto (l, j).
  The next round's broadcast runs while this round's local matmul computes (and the previous
  round's reduction too, in backward); see ``pipelined_rounds``.

2.5-D on a ``q x q x d`` grid (SUMMA2.5 / Tesseract, Wang et al. 2021). The rows T split over
the depth d first: depth slice k runs 2-D SUMMA on its T/d rows with the same weight blocks,
which every depth slice holds (W_ij replicated over depth). Activation blocks are
[T/(d q), K/q]: 1/(d q^2); weight blocks stay 1/q^2. Backward adds one all-reduce over depth
of each weight-gradient block (the depth slices saw different rows).

3-D on a ``q x q x q`` grid (Agarwal et al. 1995; Bian et al. 2021). Rank (a, b, c) computes
the one block product X[a, c] W[c, b] ([T/q, K/q] x [K/q, N/q]), a partial sum of Y[a, b]
over c. To keep every stored tensor at 1/q^3, X[a, c] is kept split over b ([T/q^2, K/q] each)
and W[c, b] split over a ([K/q^2, N/q] each):
  forward   all-gather X[a, c] over b; all-gather W[c, b] over a; multiply; reduce-scatter the
            partial Y[a, b] over c (rows), leaving [T/q^2, N/q] per rank.
  backward  all-gather dY[a, b] over c; all-gather X and W again (they were not kept);
            dX[a, c] = sum_b dY[a, b] W[c, b]^T, reduce-scattered over b while
            dW[c, b] = sum_a X[a, c]^T dY[a, b] is computed; then dW reduce-scattered over a.
  kept gathers (``keep_gathered``): the forward keeps its gathered X[a, c] and W[c, b] for
            the backward, which then gathers dY only: two all-gathers fewer per matmul, for
            saved blocks of 2-D's size (1/q^2, not 1/q^3) until the backward has used them,
            as FSDP's ``reshard_after_forward=False`` trades memory for communication.
  Y comes out as "Y[a, b] split over c": the next matmul takes it as its X with the roles of
  b and c swapped (``ThreeDAxes``), so a chain of matmuls never re-lays out its activations.

Grid ranks. ``ranks`` lists the group's global ranks in the grid's order, depth slowest and
column fastest: grid coordinate (i, j, k) is ``ranks[k q^2 + i q + j]``. The groups:
  row    ranks (i, *, k): same block row, q of them, stride 1 (X broadcasts in 2-D / 2.5-D)
  col    ranks (*, j, k): same block column, q of them, stride q (W broadcasts)
  depth  ranks (i, j, *): d of them, stride q^2 (2.5-D's weight-gradient all-reduce)
For 3-D, (a, b, c) = (i, j, k). Permute ``ranks`` to place a group inside a node.

Times come from ``cost_model.collectives.collective_time`` on the group's ranks (intra- versus
inter-node links, sharing of a node's network by the groups of one axis that have members on
it and communicate at the same moment) and ``cost_model.compute.roofline_time``. A reduction to
one rank ("reduce") has no entry there; it is priced as a broadcast, its mirror image (a
pipelined tree carrying the same bytes the other way).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from cost_model.collectives import collective_time
from cost_model.compute import PRECISIONS, check_precision, roofline_time
from planner.cluster import Cluster

FAMILIES = ("1d_column", "1d_row", "2d", "2.5d", "3d")
GROUPS = ("tp", "row", "col", "depth")


@dataclass(frozen=True)
class MatmulShape:
    """``[batch, m, k] @ [k, n]``: the rows of all ``batch`` inputs share one weight."""

    batch: int
    m: int
    k: int
    n: int

    def __post_init__(self) -> None:
        for name in ("batch", "m", "k", "n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MatmulShape.{name} must be a positive integer, got {value!r}")

    @property
    def tokens(self) -> int:
        """T: the rows that meet the weight."""
        return self.batch * self.m


@dataclass(frozen=True)
class ThreeDAxes:
    """Which grid group plays which part in a 3-D matmul (see the module docstring).

    ``gather_input``: the group X[a, c] is split over (b); ``gather_weight``: W's (a);
    ``scatter_output``: Y's reduce-scatter (c). The default is the first matmul of a chain;
    the next one swaps ``gather_input`` and ``scatter_output`` (``swapped()``).
    """

    gather_input: str = "row"
    gather_weight: str = "col"
    scatter_output: str = "depth"

    def __post_init__(self) -> None:
        roles = (self.gather_input, self.gather_weight, self.scatter_output)
        if sorted(roles) != sorted(("row", "col", "depth")):
            raise ValueError(f"ThreeDAxes must use row, col and depth once each, got {roles}")

    def swapped(self) -> ThreeDAxes:
        """The axes of the next matmul in a chain: it reads Y[a, b] split over c as its X."""
        return ThreeDAxes(self.scatter_output, self.gather_weight, self.gather_input)


@dataclass(frozen=True)
class Grid:
    """A tensor-parallel arrangement: ``family`` over ``q x q x d`` devices (1-D: ``q`` = p, d = 1;
    2-D: d = 1; 3-D: d = q)."""

    family: str
    q: int
    d: int = 1

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        for name in ("q", "d"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Grid.{name} must be a positive integer, got {value!r}")
        if self.family in ("1d_column", "1d_row", "2d") and self.d != 1:
            raise ValueError(f"a {self.family} grid has no depth; got d={self.d}")
        if self.family == "3d" and self.d != self.q:
            raise ValueError(f"a 3-D grid is q x q x q; got q={self.q}, d={self.d}")

    @property
    def devices(self) -> int:
        """Devices in the grid."""
        return self.q if self.family.startswith("1d") else self.q * self.q * self.d

    def group_ranks(self, ranks: Sequence[int], group: str) -> list[list[int]]:
        """Every group of kind ``group`` ("tp", "row", "col", "depth") as lists of global ranks."""
        if len(ranks) != self.devices:
            raise ValueError(f"a {self.family} grid of {self.devices} devices needs {self.devices} "
                             f"ranks, got {len(ranks)}")
        if group == "tp" or self.family.startswith("1d"):
            return [list(ranks)]
        q, d = self.q, self.d

        def at(i: int, j: int, k: int) -> int:
            return ranks[k * q * q + i * q + j]
        if group == "row":
            return [[at(i, j, k) for j in range(q)] for k in range(d) for i in range(q)]
        if group == "col":
            return [[at(i, j, k) for i in range(q)] for k in range(d) for j in range(q)]
        if group == "depth":
            return [[at(i, j, k) for k in range(d)] for i in range(q) for j in range(q)]
        raise ValueError(f"group must be one of {', '.join(GROUPS)}, got {group!r}")


def candidate_grids(devices: int) -> list[Grid]:
    """Every block-layout grid on exactly ``devices`` devices: 2-D q x q, 2.5-D q x q x d with
    1 < d <= q (deeper than q, the weight blocks would outweigh the activations' saving for any
    sensible shape and ``planner.strategy.SummaLayout`` forbids it), and 3-D q x q x q; q >= 2.
    Both 2.5-D and 3-D are listed when d = q: they are different algorithms on the same grid."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    grids = []
    for q in range(2, int(devices ** 0.5) + 2):
        if devices % (q * q):
            continue
        depth = devices // (q * q)
        if depth == 1:
            grids.append(Grid("2d", q))
        elif depth <= q:
            grids.append(Grid("2.5d", q, depth))
            if depth == q:
                grids.append(Grid("3d", q, q))
    return grids


@dataclass(frozen=True)
class Transfer:
    """One kind of collective a matmul issues: ``count`` times ``kind`` of ``size_bytes`` (the
    size in ``collective_time``'s sense: the whole tensor for broadcast, reduce, all-reduce, and
    the gathered tensor for all-gather / reduce-scatter) on every group of kind ``group``."""

    phase: str  # "forward" or "backward"
    kind: str  # broadcast, reduce, all_reduce, all_gather, reduce_scatter
    group: str
    group_size: int
    size_bytes: float
    count: int
    seconds: float  # one of them, on the slowest group of that kind

    @property
    def bytes_per_device(self) -> float:
        """Bytes one device sends (or receives) over all ``count`` of them: the bandwidth term
        of the algorithm (broadcast and reduce S, ring all-reduce 2(n-1)/n S, all-gather and
        reduce-scatter (n-1)/n S), 0 in a group of one."""
        n, size = self.group_size, self.size_bytes
        if n <= 1:
            return 0.0
        per = {"broadcast": size, "reduce": size, "all_reduce": 2 * (n - 1) / n * size,
               "all_gather": (n - 1) / n * size, "reduce_scatter": (n - 1) / n * size}[self.kind]
        return self.count * per


@dataclass(frozen=True)
class MatmulCost:
    """One matmul's cost per device (seconds, bytes).

    ``forward_s`` / ``backward_s`` are the phase times with the overlap the algorithm allows
    (SUMMA rounds pipelined); ``*_compute_s`` the local matmuls alone; ``*_comm_s`` the
    collectives alone, as if nothing overlapped. Memory: ``weight_bytes`` (this device's
    weight shard; its gradient is as large), ``activation_bytes`` (saved for backward),
    ``buffer_bytes`` (peak transient: received blocks, gathered operands, partial sums).
    """

    grid: Grid
    forward_compute_s: float
    backward_compute_s: float
    forward_s: float
    backward_s: float
    weight_bytes: float
    activation_bytes: float
    buffer_bytes: float
    transfers: tuple[Transfer, ...] = field(default=())
    kept_bytes: float = 0.0  # 3-D with kept gathers: saved beyond the shards (gathered X and W)

    def comm_s(self, phase: str) -> float:
        """Seconds of the phase's collectives, not overlapped."""
        return sum(t.count * t.seconds for t in self.transfers if t.phase == phase)

    def bytes_per_device(self, phase: str | None = None) -> float:
        """Bytes one device moves over its links in ``phase`` (both phases when None)."""
        return sum(t.bytes_per_device for t in self.transfers if phase in (None, t.phase))

    @property
    def total_s(self) -> float:
        """Forward plus backward."""
        return self.forward_s + self.backward_s


def pipelined_rounds(rounds: int, compute_s: float, prefetch_s: float, drain_s: float = 0.0) -> float:
    """Seconds of ``rounds`` SUMMA rounds when communication overlaps the local matmuls.

    Round l waits for its broadcast, then computes (``compute_s``) while the next round's
    broadcast (``prefetch_s``, for l < rounds-1) and the previous round's reduction
    (``drain_s``, for l > 0) run; the last reduction runs after the last matmul:

        prefetch + sum_{l=0}^{rounds-1} max(compute, prefetch [l < rounds-1] + drain [l > 0]) + drain
    """
    total = prefetch_s + drain_s
    for index in range(rounds):
        communication = (prefetch_s if index < rounds - 1 else 0.0) + (drain_s if index > 0 else 0.0)
        total += max(compute_s, communication)
    return total


def matmul_cost(shape: MatmulShape, grid: Grid, cluster: Cluster, ranks: Sequence[int],
                precision: str = "bf16", axes: ThreeDAxes = ThreeDAxes(), keep_gathered: bool = False) -> MatmulCost:
    """The cost of ``shape`` under ``grid`` on ``ranks`` of ``cluster`` (see the module docstring).

    Args:
        shape: the matmul.
        grid: the layout family and its q, d.
        cluster: the cluster the ranks live on.
        ranks: the grid's global ranks, depth slowest, column fastest.
        precision: activations' and weights' precision ("fp32", "bf16", "fp16").
        axes: 3-D only: which group gathers X, gathers W, scatters Y.
        keep_gathered: 3-D only: the backward reuses the forward's gathered X and W.
    """
    if keep_gathered and grid.family != "3d":
        raise ValueError(f"only 3-D matmuls keep their gathered operands, not {grid.family}")
    check_precision(precision)
    dtype, element = PRECISIONS[precision]
    device = cluster.device_of(ranks[0]) if ranks else None
    grid.group_ranks(ranks, "tp")  # checks the rank count
    pricer = _Pricer(grid, cluster, ranks)
    T, K, N = shape.tokens, shape.k, shape.n

    def matmul_s(rows: float, inner: float, cols: float) -> float:
        # One local [rows, inner] x [inner, cols] product: 2 r i c FLOPs, reading both operands
        # and writing the result once.
        return roofline_time(2 * rows * inner * cols, element * (rows * inner + inner * cols + rows * cols),
                             device, dtype)

    if grid.family.startswith("1d"):
        p = grid.q
        if grid.family == "1d_column":
            compute = matmul_s(T, K, N / p)
            dx = pricer.transfer("backward", "all_reduce", "tp", T * K * element)
            # dX is computed first; its all-reduce runs while the weight gradient is computed
            # (Megatron-LM's asynchronous tensor-parallel all-reduce).
            backward = compute + max(compute, dx.seconds)
            return MatmulCost(grid, compute, 2 * compute, compute, backward,
                              weight_bytes=K * N / p * element, activation_bytes=T * K * element,
                              buffer_bytes=T * K * element, transfers=(dx,))  # dX before its all-reduce
        compute = matmul_s(T, K / p, N)
        y = pricer.transfer("forward", "all_reduce", "tp", T * N * element)
        return MatmulCost(grid, compute, 2 * compute, compute + y.seconds, 2 * compute,
                          weight_bytes=K * N / p * element, activation_bytes=T * K / p * element,
                          buffer_bytes=T * N * element, transfers=(y,))  # Y's partial sums

    q, d = grid.q, grid.d
    if grid.family in ("2d", "2.5d"):
        x_block, w_block = T * K / (d * q * q), K * N / (q * q)
        per_round = matmul_s(T / (d * q), K / q, N / q)
        x_bcast = pricer.transfer("forward", "broadcast", "row", x_block * element, q)
        w_bcast = pricer.transfer("forward", "broadcast", "col", w_block * element, q)
        forward = pipelined_rounds(q, per_round, x_bcast.seconds + w_bcast.seconds)
        # dX pass: W broadcast along columns, dX reduced along rows.
        w_again = pricer.transfer("backward", "broadcast", "col", w_block * element, q)
        dx_reduce = pricer.transfer("backward", "reduce", "row", x_block * element, q)
        # dW pass: X broadcast along rows, dW reduced along columns.
        x_again = pricer.transfer("backward", "broadcast", "row", x_block * element, q)
        dw_reduce = pricer.transfer("backward", "reduce", "col", w_block * element, q)
        backward = (pipelined_rounds(q, per_round, w_again.seconds, dx_reduce.seconds)
                    + pipelined_rounds(q, per_round, x_again.seconds, dw_reduce.seconds))
        transfers = [x_bcast, w_bcast, w_again, dx_reduce, x_again, dw_reduce]
        if d > 1:
            # Depth slices hold the same weight blocks but saw different rows: sum their
            # weight gradients (not overlapped here; a program may overlap it with the
            # previous layer's backward, as data-parallel gradients are).
            depth = pricer.transfer("backward", "all_reduce", "depth", w_block * element)
            backward += depth.seconds
            transfers.append(depth)
        return MatmulCost(grid, q * per_round, 2 * q * per_round, forward, backward,
                          weight_bytes=w_block * element, activation_bytes=x_block * element,
                          # two rounds in flight (the current and the prefetched one) of an
                          # X and a W block, plus the reduction's partial block in backward
                          buffer_bytes=(2 * (x_block + w_block) + max(x_block, w_block)) * element,
                          transfers=tuple(transfers))

    # 3-D: gathered operands [T/q, K/q] and [K/q, N/q], partial output [T/q, N/q].
    x_gathered, w_gathered, y_partial = T * K / (q * q), K * N / (q * q), T * N / (q * q)
    compute = matmul_s(T / q, K / q, N / q)
    forward_transfers = [pricer.transfer("forward", "all_gather", axes.gather_input, x_gathered * element),
                         pricer.transfer("forward", "all_gather", axes.gather_weight, w_gathered * element),
                         pricer.transfer("forward", "reduce_scatter", axes.scatter_output, y_partial * element)]
    gathers = [pricer.transfer("backward", "all_gather", axes.scatter_output, y_partial * element)]
    if not keep_gathered:
        gathers += [pricer.transfer("backward", "all_gather", axes.gather_input, x_gathered * element),
                    pricer.transfer("backward", "all_gather", axes.gather_weight, w_gathered * element)]
    dx_scatter = pricer.transfer("backward", "reduce_scatter", axes.gather_input, x_gathered * element)
    dw_scatter = pricer.transfer("backward", "reduce_scatter", axes.gather_weight, w_gathered * element)
    # The gathers must land before the product and the scatter needs the product: no overlap
    # inside the forward. The backward computes dX first and reduce-scatters it while dW is
    # computed; dW's reduce-scatter ends the op.
    backward = sum(t.seconds for t in gathers) + compute + max(compute, dx_scatter.seconds) + dw_scatter.seconds
    # Saved for backward: the shards of X (1/q^3), or, kept, the gathered X and W (1/q^2).
    saved = (x_gathered + w_gathered) if keep_gathered else x_gathered / q
    return MatmulCost(grid, compute, 2 * compute,
                      compute + sum(t.seconds for t in forward_transfers), backward,
                      weight_bytes=w_gathered / q * element, activation_bytes=saved * element,
                      buffer_bytes=(x_gathered + w_gathered + y_partial) * element,
                      transfers=tuple(forward_transfers + gathers + [dx_scatter, dw_scatter]),
                      kept_bytes=(saved - x_gathered / q) * element)


class _Pricer:
    """Prices one collective on every group of a kind; the slowest group sets the time."""

    def __init__(self, grid: Grid, cluster: Cluster, ranks: Sequence[int]) -> None:
        self.grid, self.cluster, self.ranks = grid, cluster, ranks

    def transfer(self, phase: str, kind: str, group: str, size_bytes: float, count: int = 1) -> Transfer:
        groups = self.grid.group_ranks(self.ranks, group)
        # All groups of one kind communicate at the same moment; those with members on the
        # same node share its network (at most: the most groups any one node takes part in).
        touching = Counter(node for members in groups
                           for node in {self.cluster.node_of(rank) for rank in members})
        model_kind = "broadcast" if kind == "reduce" else kind
        seconds = max(collective_time(model_kind, size_bytes, self.cluster, members, max(touching.values()))
                      for members in groups)
        return Transfer(phase, kind, group, len(groups[0]), size_bytes, count, seconds)
