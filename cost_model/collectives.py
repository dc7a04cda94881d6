"""α–β costs of collectives on one process group (Thakur et al., "Optimization of
Collective Communication Operations in MPICH", IJHPCA 2005; Patarasuk & Yuan 2009 for ring
all-reduce).

A group inside one node uses that node's intra-node links; a group that spans nodes is
bounded by the inter-node link (each device's share of its node's network).
"""

from __future__ import annotations

from planner.cluster import Cluster, LinkSpec


def group_link(cluster: Cluster, ranks: list[int]) -> LinkSpec:
    """The link that bounds a collective over ``ranks``: intra-node if they share a node."""
    nodes = {cluster.node_of(rank) for rank in ranks}
    if len(nodes) == 1:
        return cluster.nodes[nodes.pop()].intra_link
    return cluster.inter_link


def ring_all_reduce_time(size_bytes: float, group_size: int, link: LinkSpec) -> float:
    """Ring all-reduce: 2(n−1)/n · S/β + 2(n−1)·α."""
    if group_size <= 1 or size_bytes <= 0:
        return 0.0
    n = group_size
    return 2 * (n - 1) / n * size_bytes / link.bandwidth + 2 * (n - 1) * link.latency


def all_gather_time(size_bytes: float, group_size: int, link: LinkSpec) -> float:
    """Ring all-gather of a tensor of ``size_bytes`` in total: (n−1)/n · S/β + (n−1)·α."""
    if group_size <= 1 or size_bytes <= 0:
        return 0.0
    n = group_size
    return (n - 1) / n * size_bytes / link.bandwidth + (n - 1) * link.latency


def reduce_scatter_time(size_bytes: float, group_size: int, link: LinkSpec) -> float:
    """Ring reduce-scatter of ``size_bytes`` in total: same volume as all-gather."""
    return all_gather_time(size_bytes, group_size, link)
