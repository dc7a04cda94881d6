"""Which links a set of ranks crosses: the sites it touches, the best tour of them, the slowest
link a flat ring over the ranks crosses. A property of the cluster (``planner.cluster``: sites,
``Cluster.link_between``), used by the cost model to price collectives
(``cost_model.site_collectives``) and by reports to name the links a group crosses.

Links a flat ring crosses (``crossed_link``): a flat ring over the group visits the sites in
some order and hops once from each site to the next; inside a site it hops between the site's
nodes over the site's own network. Every step of a ring waits for its slowest hop, so the ring
runs at the least bandwidth and the largest latency among the links it crosses: the site links
of the sites where it touches two or more nodes, and the K links of its tour of the K sites.
The tour is chosen to cross the fastest links (every order of the sites is tried up to
``MAX_TOUR_SITES``: a bottleneck tour; beyond, the sites in rank order), as NCCL's topology
search orders its rings to avoid the slowest paths (NVIDIA/nccl ``src/graph/search.cc``).

Vocabulary layer: imports only ``planner.cluster``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from planner.cluster import Cluster, LinkSpec

__all__ = ["MAX_TOUR_SITES", "best_tour", "crossed_link", "site_members", "slowest_link"]

MAX_TOUR_SITES = 7  # 6! = 720 tours of 7 sites; beyond, the sites in rank order


def site_members(cluster: Cluster, ranks: Sequence[int]) -> dict[str, list[int]]:
    """The group's ranks at each site it touches, sites in the order of their first rank."""
    members: dict[str, list[int]] = {}
    for rank in ranks:
        members.setdefault(cluster.nodes[cluster.node_of(rank)].site, []).append(rank)
    return members


def slowest_link(links: Sequence[LinkSpec]) -> LinkSpec:
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
        return slowest_link([cluster.link_between(a, b) for a, b in hops])

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
    return slowest_link(crossed) if crossed else None
