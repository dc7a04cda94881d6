"""Meshes for 2-D, 2.5-D and 3-D tensor parallelism, and which of them are worth searching.

A SUMMA mesh factors ``t = q * q * d`` tensor-parallel devices (q >= 2, so t >= 4) into the
axes ``row`` (q), ``col`` (q) and, for 2.5-D and 3-D, ``dep`` (d), in the order
``planner.strategy.SummaLayout`` fixes (2-D ``row x col``, 2.5-D ``dep x row x col``, 3-D
``row x col x dep``), with ``dp = world / t`` outermost. Unlike the 1-D ``tp`` axis, a grid
may span nodes: its point is to move fewer bytes per device when the devices are many.

``tp_layouts`` (the ``--tp-layouts`` flag) says which meshes the search gets:

* ``"1d"``: none of these (the 1-D ``dp x tp`` meshes only);
* ``"summa"``: only these (the matmul-like ops then take SUMMA layouts wherever the mesh
  allows them, ``search.auto.node_strategies``);
* ``"auto"``: these beside the 1-D meshes, where they can matter: a grid is kept when the
  model's linears, priced alone by ``cost_model.summa.matmul_cost``, run faster on it than
  1-D tensor parallelism over the same devices (``summa_matters``). Small models on one
  node, where 1-D wins, so plan as fast as before.
"""

from __future__ import annotations

from cost_model.summa import Grid, MatmulShape, candidate_grids, matmul_cost
from planner.cluster import Cluster
from planner.graph import OpGraph
from planner.strategy import Mesh

TP_LAYOUTS = ("auto", "summa", "1d")
AXES = {"2d": ("row", "col"), "2.5d": ("dep", "row", "col"), "3d": ("row", "col", "dep")}


def grid_mesh(grid: Grid, dp: int) -> Mesh:
    """The mesh of one SUMMA grid with ``dp`` data-parallel replicas outside it."""
    sizes = {"row": grid.q, "col": grid.q, "dep": grid.d}
    axes = (("dp", dp),) if dp > 1 else ()
    return Mesh(axes + tuple((name, sizes[name]) for name in AXES[grid.family]))


def summa_grids(cluster: Cluster, batch_size: int) -> list[tuple[Grid, int]]:
    """(grid, dp) for every SUMMA grid of ``t`` devices, t >= 4 dividing the world, whose
    rows (the batch) split evenly: over dp x d x q for 2-D / 2.5-D, dp x q x q for 3-D."""
    world = cluster.world_size
    found = []
    for devices in range(4, world + 1):
        if world % devices:
            continue
        dp = world // devices
        for grid in candidate_grids(devices):
            rows = dp * (grid.q * grid.q if grid.family == "3d" else grid.d * grid.q)
            if batch_size % rows == 0:
                found.append((grid, dp))
    return found


def linear_shapes(graph: OpGraph) -> list[MatmulShape]:
    """The matmuls of the graph's linears (x ``(B, ..., K)``, W ``(N, K)``), whole batch."""
    shapes = []
    for node in graph.nodes:
        if node.op != "aten.linear.default" or len(node.input_meta) < 2 or len(node.input_meta[1].shape) != 2:
            continue
        x, (n, k) = node.input_meta[0].shape, node.input_meta[1].shape
        rows = 1
        for size in x[1:-1]:
            rows *= size
        shapes.append(MatmulShape(x[0], rows, k, n) if len(x) > 2 else MatmulShape(1, x[0], k, n))
    return shapes


def summa_matters(graph: OpGraph, cluster: Cluster, grid: Grid, dp: int, precision: str) -> bool:
    """Whether the graph's linears, each priced alone on one grid (the batch split over
    ``dp``), are faster under ``grid`` than under 1-D tensor parallelism on the same devices
    (each linear as the better of column and row parallel)."""
    ranks = list(range(grid.devices))
    one_d = (Grid("1d_column", grid.devices), Grid("1d_row", grid.devices))
    summa_s = one_d_s = 0.0
    cache: dict[MatmulShape, tuple[float, float]] = {}
    for shape in linear_shapes(graph):
        local = MatmulShape(max(1, shape.batch // dp), shape.m, shape.k, shape.n) if shape.batch > 1 else \
            MatmulShape(1, max(1, shape.m // dp), shape.k, shape.n)
        if local not in cache:
            cache[local] = (matmul_cost(local, grid, cluster, ranks, precision).total_s,
                            min(matmul_cost(local, g, cluster, ranks, precision).total_s for g in one_d))
        summa_s += cache[local][0]
        one_d_s += cache[local][1]
    return summa_s < one_d_s


def summa_meshes(graph: OpGraph, cluster: Cluster, precision: str, tp_layouts: str) -> list[Mesh]:
    """The SUMMA meshes the search gets for ``tp_layouts`` (see the module docstring)."""
    if tp_layouts == "1d" or not cluster.is_homogeneous:
        return []
    return [grid_mesh(grid, dp) for grid, dp in summa_grids(cluster, graph.batch_size)
            if tp_layouts == "summa" or summa_matters(graph, cluster, grid, dp, precision)]
