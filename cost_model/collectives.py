"""α–β costs of collectives on one process group.

Every time is latency + volume / bandwidth: a message of ``m`` bytes over a link
``(β bytes/s per direction, α seconds)`` costs ``α + m/β`` (Hockney's model, as used by Thakur,
Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH",
IJHPCA 2005). Ring algorithms follow Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", JPDC 2009; the tree all-reduce is NCCL's pipelined
double binary tree (NVIDIA, "Massively Scale Your Deep Learning Training with NCCL 2.4",
developer blog 2019; NCCL user guide); the two-level all-reduce is the
hierarchical / "2D ring" scheme of Horovod (``HOROVOD_HIERARCHICAL_ALLREDUCE``) and of
Jia et al., "Highly Scalable Deep Learning Training System with Mixed-Precision" (2018); the
two-level all-to-all is the "2DH" all-to-all of Tutel (Hwang et al., MLSys 2023).

Notation
--------
  S      size_bytes (meaning per collective: see ``collective_time``)
  n      ranks in the group                     k   distinct nodes the group touches
  p      group ranks per node (max over nodes)  D   fewest devices on any of those nodes
  c      concurrent_groups                      L(x) = ⌈log2 x⌉ (0 for x ≤ 1)
  β_i α_i  intra-node link (the slowest among the group's nodes: least β, largest α)
  β_e α_e  inter-node link, per device
  β_m    inter-node bandwidth one member gets = β_e · D / max(D, p·c)
  β_f α_f  flat link of a group spanning nodes = (min(β_i, β_m), max(α_i, α_e)), or
           (β_m, α_e) when p = 1 (no intra-node hop in the ring)

Sharing the inter-node network (``member_bandwidth``): a node's network capacity is D · β_e
(one NIC share per device). The c groups of the same shape running at the same moment put
p · c members on each node; they split the capacity evenly, so one member gets
D · β_e / (p · c) — but never more than its own device's share β_e (a NIC cannot be borrowed
from an idle device through the PCIe switch in this model). E.g. 8 data-parallel groups of a
tp=8 × dp mesh on 8-device nodes: p = 1, c = 8, β_m = β_e; 16 such groups: β_m = β_e / 2.
Intra-node links are per device through a non-blocking switch (NVSwitch), so concurrency does
not slow them.

Formulas (each algorithm's name is its key in ``algorithm_times``)
--------------------------------------------------------------------
Group inside one node (k = 1), link (β_i, α_i):
  all_reduce      ring  2(n−1)/n · S/β + 2(n−1)α       (reduce-scatter + all-gather rings)
                  tree  2 · S/β + 2 · L(n) · α          (pipelined double binary tree: reduce up,
                                                         broadcast down; each of the two trees
                                                         carries half the data)
  all_gather,     ring  (n−1)/n · S/β + (n−1)α          (S = the full, unsharded tensor)
  reduce_scatter
  broadcast       pipelined  S/β + L(n) · α             (pipelined tree/ring: the message streams
                                                         through in chunks; L(n) hops of latency)
  all_to_all      pairwise  (n−1)/n · S/β + R(n−1)·α     (S = bytes each rank sends, S/n to each
                                                         rank including itself; R(x) rounds of
                                                         peers: ``exchange_rounds``)
  send_recv       direct  S/β + α

Group spanning nodes (k > 1); the cheapest algorithm is taken. "Even" means every touched
node holds p members (n = k·p); hierarchical algorithms need an even group with p > 1.
  all_reduce      ring  2(n−1)/n · S/β_f + 2(n−1)α_f    (a step waits for its slowest hop)
                  tree  2 · S/β_f + 2(L(k)·α_e + L(p)·α_i)
                        (NCCL: a tree across nodes, chained inside each node; depth L(k)+L(p))
                  hierarchical  RS_intra + AR_inter + AG_intra, where
                        RS_intra = AG_intra = (p−1)/p · S/β_i + (p−1)α_i  (ring over p ranks)
                        AR_inter = min(2(k−1)/k · (S/p)/β_m + 2(k−1)α_e,
                                       2 · (S/p)/β_m + 2 L(k) α_e)
                        (after the intra reduce-scatter each of the p members holds S/p and
                        all-reduces it with its k peers of the same local index; the p inter
                        all-reduces run at once, each on its member's share β_m)
  all_gather      ring  (n−1)/n · S/β_f + (n−1)α_f
                  hierarchical  (k−1)/k · (S/p)/β_m + (k−1)α_e + (p−1)/p · S/β_i + (p−1)α_i
                        (all_gather: inter-node all-gather of the S/n shards among same-index
                        ranks, giving S/p each, then intra-node all-gather of S;
                        reduce_scatter: the mirror, intra-node reduce-scatter of S to S/p, then
                        inter-node reduce-scatter of S/p to S/n — same cost)
  reduce_scatter  same as all_gather
  broadcast       pipelined  S/β_f + L(k)·α_e + L(p)·α_i
  all_to_all      pairwise  max(intra, inter)  (all sends posted at once; the node's NVLink and
                        network traffic overlap), with m = max(1, n − (k−1)p) the fewest
                        members on a node (m = p when even):
                        intra = (p−1)/n · S/β_i + R(p−1)α_i
                        inter = (n−m)/n · S/β_m + R(n−m)α_e   ((k−1)/k of S crosses when even)
                  hierarchical  (p−1)/p · S/β_i + R(p−1)α_i + (k−1)/k · S/β_m + R(k−1)α_e
                        (phase 1, intra-node all-to-all: rank (a, i) gives rank (a, j) all its
                        data for local index j on every node — this both gathers the node's
                        traffic per destination and does the final scatter's work in advance;
                        phase 2, inter-node all-to-all among same-index ranks: (a, j) sends
                        p·S/n to each (b, j), which then holds exactly its own data. Fewer,
                        larger inter-node messages (k−1 instead of n−m): wins on latency
                        where peers go one at a time (gloo), not under NCCL, whose peers'
                        latencies overlap (R below); loses on bandwidth to the overlapped
                        flat exchange)
  send_recv       direct  S/β_m + α_e with p = 1 (one member per node)

Rounds of an all-to-all (``exchange_rounds``): R(x) = ⌈x / f⌉ for x peers, f being how many
peers the backend exchanges with at once (``peers_in_flight``). An all-to-all posts every send
and receive together, so the peers' latencies overlap within a round: NCCL progresses 256 peers
at once (see ``NCCL_PEERS_IN_FLIGHT``), so up to 257 ranks pay one α, not n−1. Gloo keeps f = 1
(each peer's latency in turn), as this model always priced it.

Sites and links per pair (``cost_model.site_collectives``): a group's ``inter`` is the slowest
link a flat ring over it crosses (the site links it hops between nodes on, the links of its
tour of the sites), and a group spanning sites that each hold m > 1 of its ranks also gets the
``"hierarchical-sites"`` all-reduce / all-gather / reduce-scatter (``site_algorithm_times``):
reduce inside each site, one slice of S/m per rank across the sites, gather inside again.

GPU presets with published NCCL measurements (DGX A100, DGX H100) are priced by
``cost_model.nccl`` instead (measured bus bandwidths, NCCL's algorithms, protocols and
latencies), unless the cluster has sites or links per pair; ``collective_time`` picks the model,
``algorithm_times`` is always the α–β one.

Implemented in: ``group_shape`` (how ranks lie on the cluster), ``member_bandwidth`` (sharing),
``algorithm_times`` (every candidate above), ``collective_time`` (the cheapest).

The older per-link helpers (``group_link``, ``ring_all_reduce_time``, ``all_gather_time``,
``reduce_scatter_time``) remain for ``cost_model.analytic``: one link, ring algorithms only.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from cost_model.nccl import nccl_algorithm_times, nccl_profile
from cost_model.site_collectives import site_hierarchical_time
from planner.cluster import Cluster, LinkSpec
from planner.cluster_links import crossed_link, site_members

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
               "send_recv")


@dataclass(frozen=True)
class GroupShape:
    """How a process group lies on the cluster.

    Attributes:
        size: ranks in the group (n).
        nodes: distinct nodes it touches (k).
        per_node: group ranks per node, the maximum over its nodes (p).
        intra: the slowest intra-node link among its nodes (least bandwidth, largest latency).
        inter: the slowest link between nodes a flat ring over the group crosses (the cluster's
            per-device inter-node link on one site; ``planner.cluster_links.crossed_link``
            with sites or links per pair); None when the group is on one node.
        node_devices: fewest devices on any of its nodes (D): sizes each node's network
            capacity, D × inter.bandwidth.
    """

    size: int
    nodes: int
    per_node: int
    intra: LinkSpec
    inter: LinkSpec | None
    node_devices: int

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= self.size or not 1 <= self.per_node <= self.size \
                or self.size > self.nodes * self.per_node:
            raise ValueError(f"GroupShape(size={self.size}, nodes={self.nodes}, "
                             f"per_node={self.per_node}) is impossible; need 1 <= nodes <= size "
                             f"<= nodes * per_node")
        if (self.inter is None) != (self.nodes == 1):
            raise ValueError(f"GroupShape.inter must be None exactly when the group is on one "
                             f"node; got nodes={self.nodes}, inter={self.inter!r}")
        if self.node_devices < 1:
            raise ValueError(f"GroupShape.node_devices must be >= 1, got {self.node_devices}")

    @property
    def is_even(self) -> bool:
        """True when every node it touches holds ``per_node`` members (size = nodes × per_node)."""
        return self.size == self.nodes * self.per_node


def group_shape(cluster: Cluster, ranks: Sequence[int]) -> GroupShape:
    """Describe how ``ranks`` lie on ``cluster`` (ranks are node-major).

    Args:
        cluster: the cluster.
        ranks: distinct global ranks of the group, in any order.
    Returns:
        The GroupShape. ValueError on an empty group or a repeated rank; ClusterError on a rank
        outside the cluster.
    """
    if len(ranks) == 0:
        raise ValueError("a process group needs at least one rank; got an empty list")
    if len(set(ranks)) != len(ranks):
        repeated = sorted(rank for rank, count in Counter(ranks).items() if count > 1)
        raise ValueError(f"ranks {list(ranks)} repeat {repeated}; a group lists each rank once")
    members = Counter(cluster.node_of(rank) for rank in ranks)
    specs = [cluster.nodes[index] for index in members]
    intra = LinkSpec(bandwidth=min(node.intra_link.bandwidth for node in specs),
                     latency=max(node.intra_link.latency for node in specs))
    inter = cluster.inter_link
    if len(members) > 1 and (cluster.links or cluster.inter_site_link is not None):
        # Sites, or links per pair: the rings and trees wait for the slowest link they cross.
        inter = crossed_link(cluster, ranks)
    return GroupShape(size=len(ranks), nodes=len(members), per_node=max(members.values()),
                      intra=intra, inter=inter if len(members) > 1 else None,
                      node_devices=min(node.devices for node in specs))


def member_bandwidth(shape: GroupShape, concurrent_groups: int = 1) -> float:
    """Inter-node bytes/s per direction one member gets: β_e · D / max(D, p · c).

    The node's network capacity D · β_e is split between the p · c group members on it (c
    groups of this shape at once); a member never gets more than its own device's share β_e.
    ValueError for a group on one node (it has no inter-node link).
    """
    if shape.inter is None:
        raise ValueError("a group on one node uses no inter-node bandwidth")
    _check_concurrency(concurrent_groups)
    devices = shape.node_devices
    return shape.inter.bandwidth * devices / max(devices, shape.per_node * concurrent_groups)


def algorithm_times(kind: str, size_bytes: float, shape: GroupShape,
                    concurrent_groups: int = 1, in_flight: int = 1) -> dict[str, float]:
    """Seconds of every algorithm the model considers for one collective (see module docstring).

    Args:
        kind: one of ``COLLECTIVES``.
        size_bytes: as in ``collective_time``.
        shape: the group, from ``group_shape``; for send_recv a group of [src, dst].
        concurrent_groups: groups of this shape running it at the same moment.
        in_flight: all_to_all only: peers the backend exchanges with at once
            (``peers_in_flight``); 1 prices each peer's latency in turn.
    Returns:
        {algorithm name: seconds}, e.g. {"ring": ..., "tree": ..., "hierarchical": ...};
        every value is 0.0 for an empty message or a group of one.
    """
    _check_kind(kind)
    _check_size(size_bytes)
    _check_concurrency(concurrent_groups)
    if kind == "send_recv" and shape.size > 2:
        raise ValueError(f"send_recv is between two ranks [src, dst]; got a group of {shape.size}")
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
        raise ValueError(f"in_flight must be an integer >= 1, got {in_flight!r}")
    if shape.nodes == 1:
        times = _intra_node_times(kind, float(size_bytes), shape, in_flight)
    else:
        times = _spanning_times(kind, float(size_bytes), shape, concurrent_groups, in_flight)
    if size_bytes == 0 or shape.size == 1:
        return {name: 0.0 for name in times}
    return times


def collective_time(kind: str, size_bytes: float, cluster: Cluster, ranks: Sequence[int],
                    concurrent_groups: int = 1) -> float:
    """Seconds for one collective over ``ranks``: the cheapest algorithm.

    On a GPU preset with published NCCL measurements (``cost_model.nccl.nccl_profile``) the
    algorithms are NCCL's, priced from those measurements (``nccl_algorithm_times``); on any
    other cluster (CPU/gloo, custom or calibrated files) they are this module's α–β
    ``algorithm_times``.

    Args:
        kind: one of ``COLLECTIVES``.
        size_bytes: the full (unsharded) tensor for all_gather / reduce_scatter / all_reduce /
            broadcast; the total bytes each rank sends for all_to_all; the message for
            send_recv (``ranks`` = [src, dst]).
        cluster: the cluster the ranks live on.
        ranks: the group's global ranks.
        concurrent_groups: how many groups of the same shape run this collective at the same
            moment and share the inter-node network (e.g. the 8 data-parallel groups of a
            tp=8 × dp=N mesh): each node's network capacity (devices_per_node ×
            inter.bandwidth) is split between all group members on that node; a group never
            gets more than its own members' share.
    Returns:
        Seconds; 0.0 for size 0, a group of one, or a send_recv with src == dst. ValueError for
        an unknown kind, a negative size, concurrent_groups < 1, or send_recv without exactly
        two ranks.
    """
    _check_kind(kind)
    if kind == "send_recv":
        if len(ranks) != 2:
            raise ValueError(f"send_recv takes ranks = [src, dst]; got {list(ranks)}")
        if ranks[0] == ranks[1]:
            group_shape(cluster, ranks[:1])  # still reject a rank outside the cluster
            _check_size(size_bytes)
            return 0.0
    _check_size(size_bytes)
    _check_concurrency(concurrent_groups)
    if cluster.links or cluster.inter_site_link is not None:  # ranks checked by group_shape inside
        return _cheapest_over_sites(kind, float(size_bytes), cluster, tuple(ranks), concurrent_groups)
    shape = group_shape(cluster, ranks)
    if kind == "send_recv" and shape.size > 2:
        raise ValueError(f"send_recv is between two ranks [src, dst]; got a group of {shape.size}")
    profile = nccl_profile(cluster)
    if profile is not None:
        return min(nccl_algorithm_times(kind, size_bytes, shape, profile, concurrent_groups).values())
    return min(algorithm_times(kind, size_bytes, shape, concurrent_groups, peers_in_flight(cluster)).values())


@functools.lru_cache(maxsize=4096)
def _cheapest_over_sites(kind: str, size: float, cluster: Cluster, ranks: tuple[int, ...], concurrent: int) -> float:
    """``site_algorithm_times``' least, remembered: a simulated step asks for the same
    collectives over and over, and finding the links a group crosses walks its ranks and sites."""
    return min(site_algorithm_times(kind, size, cluster, ranks, concurrent).values())


def site_algorithm_times(kind: str, size_bytes: float, cluster: Cluster, ranks: Sequence[int],
                         concurrent_groups: int = 1) -> dict[str, float]:
    """``algorithm_times`` of the group, priced at the links it crosses
    (``cost_model.site_collectives``), plus ``"hierarchical-sites"`` when the group spans
    sites that each hold the same number (> 1) of its ranks: reduce inside each site, across
    the sites one slice per rank, gather inside each site again."""
    times = algorithm_times(kind, size_bytes, group_shape(cluster, ranks), concurrent_groups,
                            peers_in_flight(cluster))
    if len(site_members(cluster, ranks)) < 2:
        return times

    def on_one_site(phase: str, size: float, site_ranks: Sequence[int]) -> float:
        return min(algorithm_times(phase, size, group_shape(cluster, site_ranks), concurrent_groups).values())

    across = site_hierarchical_time(kind, float(size_bytes), cluster, ranks, concurrent_groups, on_one_site)
    if across is not None:
        times["hierarchical-sites"] = 0.0 if size_bytes == 0 else across
    return times


# ---- how many peers an all-to-all exchanges with at once ----

# NCCL runs an all-to-all as one group of ncclSend/ncclRecv to every peer (PyTorch's
# all_to_all_single; NCCL's own ncclAlltoAll the same) and progresses the peers concurrently
# (NVIDIA/nccl at commit 5067397c): each peer's transfer is striped over p2pnChannelsPerPeer of
# the communicator's p2pnChannels channels, and each channel runs up to
# NCCL_MAX_DEV_WORK_P2P_PER_BATCH = 8 peers in one batch (src/include/device.h;
# src/enqueue.cc addP2pToPlan: "maxConcurrent = p2pnChannels / nChannelsMax *
# NCCL_MAX_DEV_WORK_P2P_PER_BATCH"). On more than one node NCCL halves the channels per peer
# until every peer fits in one round (src/graph/paths.cc ncclTopoComputeP2pChannels: "to fit all
# the peers within a single round"). With 32 p2p channels (estimate: the channel count NCCL
# builds on an 8-GPU node with 8 NICs; MAXCHANNELS is 64) that is 32 x 8 = 256 peers at once.
# Measured: DeepEP's low-latency dispatch of 128 tokens takes 192 us at EP128 and 194 us at
# EP256 (deepseek-ai/DeepEP README at commit 567632dd, H800 + CX7 400 Gb/s), so doubling the
# peers adds no latency, where a per-peer sequential 8 us would add 1 ms.
_NCCL_P2P_CHANNELS = 32
_NCCL_P2P_PER_BATCH = 8  # NCCL_MAX_DEV_WORK_P2P_PER_BATCH, src/include/device.h
NCCL_PEERS_IN_FLIGHT = _NCCL_P2P_CHANNELS * _NCCL_P2P_PER_BATCH


def peers_in_flight(cluster: Cluster) -> int:
    """Peers one rank's all-to-all exchanges with at once on ``cluster``'s backend: NCCL's
    ``NCCL_PEERS_IN_FLIGHT``; gloo 1 (each peer's latency in turn, as this model always priced
    it; gloo's own concurrency is not modelled)."""
    return NCCL_PEERS_IN_FLIGHT if cluster.backend == "nccl" else 1


def exchange_rounds(peers: int, in_flight: int) -> int:
    """Latencies an all-to-all pays for ``peers`` peers, ``in_flight`` of them at once: ⌈peers /
    in_flight⌉ (0 for no peer)."""
    return -(-peers // in_flight) if peers > 0 else 0


# ---- the formulas ----

def _log2_ceil(count: int) -> int:
    """⌈log2 count⌉: hops from the root to the deepest leaf of a binary tree (0 for one rank)."""
    return math.ceil(math.log2(count)) if count > 1 else 0


def _ring_all_gather(size: float, count: int, bandwidth: float, latency: float) -> float:
    """(n−1)/n · S/β + (n−1)α: n−1 ring steps of S/n (also reduce-scatter and pairwise a2a)."""
    if count <= 1:
        return 0.0
    return (count - 1) / count * size / bandwidth + (count - 1) * latency


def _pairwise_all_to_all(size: float, count: int, bandwidth: float, latency: float, in_flight: int) -> float:
    """(n−1)/n · S/β + R(n−1)·α: S/n to each of n−1 peers, their latencies overlapping
    ``in_flight`` at a time (``exchange_rounds``)."""
    if count <= 1:
        return 0.0
    return (count - 1) / count * size / bandwidth + exchange_rounds(count - 1, in_flight) * latency


def _ring_all_reduce(size: float, count: int, bandwidth: float, latency: float) -> float:
    """2(n−1)/n · S/β + 2(n−1)α: a ring reduce-scatter then a ring all-gather."""
    return 2 * _ring_all_gather(size, count, bandwidth, latency)


def _tree_all_reduce(size: float, bandwidth: float, depth_latency: float) -> float:
    """2 · S/β + 2 · (latency of one root-to-leaf path): pipelined reduce up, broadcast down."""
    return 2 * size / bandwidth + 2 * depth_latency


def _intra_node_times(kind: str, size: float, shape: GroupShape, in_flight: int) -> dict[str, float]:
    n, beta, alpha = shape.size, shape.intra.bandwidth, shape.intra.latency
    if kind == "all_reduce":
        return {"ring": _ring_all_reduce(size, n, beta, alpha),
                "tree": _tree_all_reduce(size, beta, _log2_ceil(n) * alpha)}
    if kind in ("all_gather", "reduce_scatter"):
        return {"ring": _ring_all_gather(size, n, beta, alpha)}
    if kind == "broadcast":
        return {"pipelined": size / beta + _log2_ceil(n) * alpha}
    if kind == "all_to_all":
        return {"pairwise": _pairwise_all_to_all(size, n, beta, alpha, in_flight)}
    return {"direct": size / beta + alpha}  # send_recv


def _spanning_times(kind: str, size: float, shape: GroupShape,
                    concurrent_groups: int, in_flight: int) -> dict[str, float]:
    assert shape.inter is not None  # nodes > 1
    n, k, p = shape.size, shape.nodes, shape.per_node
    beta_i, alpha_i = shape.intra.bandwidth, shape.intra.latency
    alpha_e = shape.inter.latency
    beta_m = member_bandwidth(shape, concurrent_groups)
    # A flat ring over node-major ranks crosses both link classes when p > 1; every step waits
    # for its slowest hop.
    beta_f, alpha_f = ((min(beta_i, beta_m), max(alpha_i, alpha_e)) if p > 1
                       else (beta_m, alpha_e))
    tree_depth = _log2_ceil(k) * alpha_e + _log2_ceil(p) * alpha_i
    two_level = shape.is_even and p > 1

    if kind == "all_reduce":
        times = {"ring": _ring_all_reduce(size, n, beta_f, alpha_f),
                 "tree": _tree_all_reduce(size, beta_f, tree_depth)}
        if two_level:
            intra = _ring_all_gather(size, p, beta_i, alpha_i)  # = intra reduce-scatter
            inter = min(_ring_all_reduce(size / p, k, beta_m, alpha_e),
                        _tree_all_reduce(size / p, beta_m, _log2_ceil(k) * alpha_e))
            times["hierarchical"] = intra + inter + intra
        return times
    if kind in ("all_gather", "reduce_scatter"):
        times = {"ring": _ring_all_gather(size, n, beta_f, alpha_f)}
        if two_level:
            times["hierarchical"] = (_ring_all_gather(size / p, k, beta_m, alpha_e)
                                     + _ring_all_gather(size, p, beta_i, alpha_i))
        return times
    if kind == "broadcast":
        return {"pipelined": size / beta_f + tree_depth}
    if kind == "all_to_all":
        fewest = max(1, n - (k - 1) * p)  # members on the emptiest node
        intra = (p - 1) / n * size / beta_i + exchange_rounds(p - 1, in_flight) * alpha_i
        inter = (n - fewest) / n * size / beta_m + exchange_rounds(n - fewest, in_flight) * alpha_e
        times = {"pairwise": max(intra, inter)}
        if two_level:
            times["hierarchical"] = (_pairwise_all_to_all(size, p, beta_i, alpha_i, in_flight)
                                     + _pairwise_all_to_all(size, k, beta_m, alpha_e, in_flight))
        return times
    return {"direct": size / beta_m + alpha_e}  # send_recv: p = 1 on each node


# ---- argument checks ----

def _check_kind(kind: str) -> None:
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; choose one of {', '.join(COLLECTIVES)}")


def _check_size(size_bytes: float) -> None:
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, (int, float)) \
            or not math.isfinite(size_bytes) or size_bytes < 0:
        raise ValueError(f"size_bytes must be a finite number >= 0, got {size_bytes!r}")


def _check_concurrency(concurrent_groups: int) -> None:
    if isinstance(concurrent_groups, bool) or not isinstance(concurrent_groups, int) \
            or concurrent_groups < 1:
        raise ValueError(f"concurrent_groups must be an integer >= 1, got {concurrent_groups!r}")


# ---- single-link helpers used by cost_model.analytic (ring algorithms on one link) ----

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
