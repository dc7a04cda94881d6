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
  1-D tensor parallelism over the same devices or inside a node with data parallelism
  around it, or when the latter's weights would not fit (``summa_matters``); at most
  ``MAX_AUTO_MESHES`` of them, the fastest. Small models on one node, where 1-D wins, so
  plan as fast as before.
"""

from __future__ import annotations

from cost_model.collectives import collective_time
from cost_model.compute import PRECISIONS
from cost_model.parameter_bytes import bytes_per_parameter
from cost_model.summa import Grid, MatmulShape, candidate_grids, matmul_cost
from planner.cluster import Cluster
from planner.graph import OpGraph
from planner.strategy import Mesh

TP_LAYOUTS = ("auto", "summa", "1d")
# SUMMA meshes ``auto`` searches at most (the fastest grids for the model's linears): each is
# one more per-mesh search, and planning time should grow by a bounded amount.
MAX_AUTO_MESHES = 3
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


def summa_matters(graph: OpGraph, cluster: Cluster, grid: Grid, dp: int, precision: str) -> float | None:
    """The seconds of the graph's linears on ``grid`` (each priced alone by
    ``cost_model.summa``, the batch split over ``dp``) when the grid can beat 1-D tensor
    parallelism on the same devices, else None.

    1-D here is the better of (i) 1-D over all the grid's devices and (ii) 1-D over one
    node's devices with the rest of the grid as data parallelism (its rows split further,
    plus the once-per-step all-reduce of its weight gradients over those replicas), each
    linear column- or row-parallel, whichever is faster. A grid also matters, whatever the
    times, when (ii)'s linear weights with their gradients and Adam states would not fit a
    device (it spans nodes because one node's split is not enough).
    """
    devices = grid.devices
    per_node = min(cluster.devices_per_node, devices)
    replicas = devices // per_node
    _, gradient_bytes, state_bytes = bytes_per_parameter(precision)
    weight_bytes = PRECISIONS[precision][1]
    grid_ranks = list(range(devices))
    node_ranks = list(range(per_node))
    replica_ranks = [index * per_node for index in range(replicas)]
    summa_s = one_d_s = node_s = node_bytes = 0.0
    cache: dict[MatmulShape, tuple[float, float, float]] = {}
    for shape in linear_shapes(graph):
        local = _rows_over(shape, dp)
        if local not in cache:
            within_node = _rows_over(local, replicas)
            sync = (collective_time("all_reduce", local.k * local.n / per_node * gradient_bytes, cluster, replica_ranks)
                    if replicas > 1 else 0.0)
            cache[local] = (
                # 3-D timed gathering its operands again in the backward, not keeping them:
                # a grid must win without trading memory to be searched (the search may then
                # keep the gathers); the kept variant would add a 3-D mesh to small models'
                # searches for margins of a few percent on their matmuls alone.
                matmul_cost(local, grid, cluster, grid_ranks, precision).total_s,
                _best_one_d(local, devices, cluster, grid_ranks, precision),
                _best_one_d(within_node, per_node, cluster, node_ranks, precision) + sync,
            )
        summa_s += cache[local][0]
        one_d_s += cache[local][1]
        node_s += cache[local][2]
        node_bytes += local.k * local.n / per_node * (weight_bytes + gradient_bytes + state_bytes)
    crowded = replicas > 1 and node_bytes > cluster.min_device_memory
    return summa_s if crowded or summa_s < min(one_d_s, node_s) else None


def _rows_over(shape: MatmulShape, ways: int) -> MatmulShape:
    """``shape`` with its rows (batch first, else m) split ``ways`` ways (at least one row)."""
    if shape.batch > 1:
        return MatmulShape(max(1, shape.batch // ways), shape.m, shape.k, shape.n)
    return MatmulShape(1, max(1, shape.m // ways), shape.k, shape.n)


def _best_one_d(shape: MatmulShape, devices: int, cluster: Cluster, ranks: list[int], precision: str) -> float:
    return min(matmul_cost(shape, Grid(family, devices), cluster, ranks, precision).total_s
               for family in ("1d_column", "1d_row"))


def summa_meshes(graph: OpGraph, cluster: Cluster, precision: str, tp_layouts: str) -> list[Mesh]:
    """The SUMMA meshes the search gets for ``tp_layouts`` (see the module docstring)."""
    if tp_layouts == "1d" or not cluster.is_homogeneous:
        return []
    grids = summa_grids(cluster, graph.batch_size)
    if tp_layouts == "summa":
        return [grid_mesh(grid, dp) for grid, dp in grids]
    timed = [(seconds, position) for position, (grid, dp) in enumerate(grids)
             if (seconds := summa_matters(graph, cluster, grid, dp, precision)) is not None]
    # The fastest few, in their enumeration order: each mesh is one more CP-SAT solve.
    kept = sorted(position for _, position in sorted(timed)[:MAX_AUTO_MESHES])
    return [grid_mesh(*grids[position]) for position in kept]
