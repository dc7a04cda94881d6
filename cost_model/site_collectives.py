"""Collectives over ranks at two or more sites, priced by the links they cross.

A site is a named set of nodes (``planner.cluster``): a building, a rack, the nodes behind one
switch. Between two sites runs the link ``Cluster.link_between`` gives (the pair's own
``[[links]]`` table, else ``[inter_site]``), and inside one site the network between its nodes
(``inter_link``, or the site's own link when ``[[links]]`` names it twice).

Links a flat ring crosses: ``planner.cluster_links.crossed_link`` (the slowest link of the
site networks it spans nodes on and of its best tour of the sites);
``cost_model.collectives.group_shape`` takes it as the group's ``inter``, so every flat
algorithm there is priced at what it crosses.

Hierarchical across sites (``site_hierarchical_time``)
------------------------------------------------------
With m group ranks at each of the K sites (n = K·m, m > 1), the two-level scheme of Horovod's
``HOROVOD_HIERARCHICAL_ALLREDUCE`` and of Jia et al. ("Highly Scalable Deep Learning Training
System with Mixed-Precision", 2018), lifted from nodes to sites, as Huawei's HCCL documents its
hierarchical ReduceScatter / AllGather / AllReduce (HCCL user guide, "Hierarchical Communication
Principles"), keeps most traffic inside each site:

  all_reduce      RS_site(S) + AR_across(S/m) + AG_site(S)
  all_gather      AG_across(S/m) + AG_site(S)
  reduce_scatter  RS_site(S) + RS_across(S/m)

RS_site / AG_site: the reduce-scatter / all-gather of S over one site's m ranks, priced as any
group on one site (``algorithm_times``: ring, or two-level over the site's nodes), the slowest
site deciding (the sites run at once). After it, the j-th rank of every site holds the same
S/m slice; the m same-index groups of K ranks (one rank per site) each exchange their slice
across the sites at once. One flow per rank, as NCCL runs one channel per NIC on
rail-optimised nodes (every GPU has its own NIC share): each flow gets its own device's share of
the link between sites, β_s · D / max(D, p · c) (``member_bandwidth``'s sharing rule: p group
ranks per node, c concurrent groups, D devices per node):

  AR_across  min(ring 2(K−1)/K · (S/m)/β + 2(K−1)α,  tree 2 · (S/m)/β + 2⌈log2 K⌉α)
  AG_across = RS_across  (K−1)/K · (S/m)/β + (K−1)α

with (β, α) the bottleneck of the best tour of the sites. Against a flat ring, the bytes on the
slow link shrink by m (each rank sends 2(K−1)/K · S/m across, not 2(n−1)/n · S). Sites holding
different numbers of the group's ranks, or one rank each, get no hierarchical algorithm (the
slices would not line up): their collectives are the flat ones at the links crossed.

Implemented in: ``site_hierarchical_time``.
Cost-model layer: imports only ``planner.cluster`` and ``planner.cluster_links``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from planner.cluster import Cluster
from planner.cluster_links import best_tour, site_members

__all__ = ["site_hierarchical_time"]

# (kind, size, ranks) -> seconds of the cheapest algorithm on one site (cost_model.collectives).
SiteTime = Callable[[str, float, Sequence[int]], float]


def site_hierarchical_time(kind: str, size: float, cluster: Cluster, ranks: Sequence[int], concurrent_groups: int,
                           on_one_site: SiteTime) -> float | None:
    """Seconds of the hierarchical algorithm across sites (module docstring), or None when it
    does not apply: ``kind`` is not all_reduce / all_gather / reduce_scatter, the group is at
    one site, or its sites hold different numbers of its ranks or one each.

    Args:
        on_one_site: prices a collective over one site's ranks (the cheapest of
            ``cost_model.collectives.algorithm_times``).
    """
    members = site_members(cluster, ranks)
    counts = {len(site_ranks) for site_ranks in members.values()}
    if kind not in ("all_reduce", "all_gather", "reduce_scatter") or len(members) < 2 or len(counts) != 1:
        return None
    per_site = counts.pop()
    if per_site < 2:
        return None
    sites = len(members)
    link = best_tour(cluster, list(members))[1]
    nodes = {cluster.node_of(rank) for rank in ranks}
    per_node = max(sum(1 for rank in ranks if cluster.node_of(rank) == node) for node in nodes)
    devices = min(cluster.nodes[node].devices for node in nodes)
    beta = link.bandwidth * devices / max(devices, per_node * concurrent_groups)
    alpha, slice_bytes = link.latency, size / per_site
    ring_steps = (sites - 1) / sites * slice_bytes / beta + (sites - 1) * alpha
    across = {"all_reduce": min(2 * ring_steps, 2 * slice_bytes / beta + 2 * math.ceil(math.log2(sites)) * alpha),
              "all_gather": ring_steps, "reduce_scatter": ring_steps}[kind]

    def inside(phase: str) -> float:  # the sites run at once: the slowest decides
        return max(on_one_site(phase, size, site_ranks) for site_ranks in members.values())

    if kind == "all_reduce":
        return inside("reduce_scatter") + across + inside("all_gather")
    return across + inside(kind)
