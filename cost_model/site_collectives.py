"""Collectives over ranks at two or more sites, priced by the links they cross.

A site is a named set of nodes (``planner.cluster``): a building, a rack, the nodes behind one
switch. Between two sites runs the link ``Cluster.link_between`` gives (the pair's own
``[[links]]`` table, else ``[inter_site]``), and inside one site the network between its nodes
(``inter_link``, or the site's own link when ``[[links]]`` names it twice).

Links a flat ring crosses (``crossed_link``)
--------------------------------------------
A flat ring over the group visits the sites in some order and hops once from each site to the
next; inside a site it hops between the site's nodes over the site's own network. Every step of
a ring waits for its slowest hop, so the ring runs at the least bandwidth and the largest
latency among the links it crosses: the site links of the sites where it touches two or more
nodes, and the K links of its tour of the K sites. The tour is chosen to cross the fastest
links (every order of the sites is tried up to ``MAX_TOUR_SITES``: a bottleneck tour; beyond,
the sites in rank order), as NCCL's topology search orders its rings to avoid the slowest
paths (NVIDIA/nccl ``src/graph/search.cc``). ``cost_model.collectives.group_shape`` takes this
link as the group's ``inter``, so every flat algorithm there is priced at what it crosses.

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

Implemented in: ``site_members``, ``best_tour``, ``crossed_link``, ``site_hierarchical_time``.
Cost-model layer: imports only ``planner.cluster``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from planner.cluster import Cluster, LinkSpec

__all__ = ["MAX_TOUR_SITES", "best_tour", "crossed_link", "site_hierarchical_time", "site_members"]

MAX_TOUR_SITES = 7  # 6! = 720 tours of 7 sites; beyond, the sites in rank order

# (kind, size, ranks) -> seconds of the cheapest algorithm on one site (cost_model.collectives).
SiteTime = Callable[[str, float, Sequence[int]], float]


def site_members(cluster: Cluster, ranks: Sequence[int]) -> dict[str, list[int]]:
    """The group's ranks at each site it touches, sites in the order of their first rank."""
    members: dict[str, list[int]] = {}
    for rank in ranks:
        members.setdefault(cluster.nodes[cluster.node_of(rank)].site, []).append(rank)
    return members


def _slowest(links: Sequence[LinkSpec]) -> LinkSpec:
    """One link as slow as all of ``links``: least bandwidth, largest latency."""
    return LinkSpec(bandwidth=min(link.bandwidth for link in links), latency=max(link.latency for link in links))


def best_tour(cluster: Cluster, sites: Sequence[str]) -> tuple[tuple[str, ...], LinkSpec]:
    """The order of ``sites`` whose closed tour crosses the fastest links, and the bottleneck
    of that tour (least bandwidth, then least latency, among its K hops; ties: the first order
    in rank order). One site: no hop, its own link."""
    sites = tuple(sites)
    if len(sites) == 1:
        return sites, cluster.link_between(sites[0], sites[0])

    def bottleneck(order: tuple[str, ...]) -> LinkSpec:
        hops = zip(order, order[1:] + order[:1])
        return _slowest([cluster.link_between(a, b) for a, b in hops])

    orders = ([sites[:1] + rest for rest in itertools.permutations(sites[1:])]
              if len(sites) <= MAX_TOUR_SITES else [sites])
    best = max(orders, key=lambda order: (bottleneck(order).bandwidth, -bottleneck(order).latency))
    return best, bottleneck(best)


def crossed_link(cluster: Cluster, ranks: Sequence[int]) -> LinkSpec | None:
    """The slowest link between nodes a flat ring over ``ranks`` crosses (module docstring):
    None for a group on one node."""
    members = site_members(cluster, ranks)
    crossed = []
    for site, site_ranks in members.items():
        if len({cluster.node_of(rank) for rank in site_ranks}) > 1:
            crossed.append(cluster.link_between(site, site))
    if len(members) > 1:
        crossed.append(best_tour(cluster, list(members))[1])
    return _slowest(crossed) if crossed else None


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
