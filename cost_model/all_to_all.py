"""The bytes and time of one expert-parallel dispatch (or combine) when the group spans nodes.

An expert-parallel layer sends every routed copy of a token to a device holding its expert
(dispatch) and back (combine). How many of those bytes cross the inter-node network
(InfiniBand) depends on the algorithm:

- ``flat``: one all-to-all; every copy bound for another node crosses the network on its
  own, so a token routed to 3 experts on one remote node crosses 3 times. Per device, of
  its ``C`` copies, ``(n - m) / n`` cross the network and ``(p - 1) / n`` stay on NVLink
  (``cost_model.collectives``, "all_to_all pairwise"; the two links overlap).
- ``hierarchical`` (Tutel's 2DH all-to-all, Hwang et al., MLSys 2023; what
  ``codegen.runtime.moe_exchange`` compiles): an all-to-all inside the node, then one across
  nodes among devices of the same local index. Copies are not merged, so as many bytes cross
  the network as with ``flat``, in fewer, larger messages, and the two phases run one after
  the other.
- ``deduplicated`` (DeepEP's normal kernels, deepseek-ai/DeepEP; DeepSeek-V3 technical
  report, arXiv 2412.19437, section 3.2.2): a token crosses the network **once per
  destination node**, to the device of its own local index there, which forwards it over
  NVLink to every device of that node that holds one of its experts. The network and NVLink
  legs overlap ("communications via IB and NVLink are fully overlapped", ibid.), so one
  dispatch takes the longer of the two. Per device, ``T x R`` rows cross the network, ``R``
  being the distinct remote nodes a token reaches, and ``(p - 1) / p`` of its ``C`` copies
  move over NVLink (each copy's node-entry device is the destination itself with chance
  ``1 / p``).

**Node-limited routing** (DeepSeek-V3's group-limited gating: ``n_group`` groups of
consecutive experts, each token picks ``topk_group`` groups, then its top-k experts among
theirs; HF config ``n_group``/``topk_group``) bounds ``R``: when each group lies on one node,
a token reaches at most ``topk_group`` nodes. With a placement that scatters every group over
many nodes (round-robin), it bounds nothing, and ``node_fanout`` says so.

The routing distribution behind ``R`` is stated, not measured: each token's top-k experts are
a uniformly random set of distinct experts (among those of a uniformly random set of
``topk_group`` groups when routing is group-limited), independent of the node the token
starts on. An expert with copies on several nodes counts on the node of its first copy.
Then a node holding ``e`` of the ``N`` experts a token may pick is reached with probability
``1 - C(N - e, k) / C(N, k)`` (hypergeometric: none of its ``k`` picks falls on that node).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cost_model.collectives import GroupShape, algorithm_times, exchange_rounds, member_bandwidth
from planner.cluster import Cluster
from planner.strategy import ExpertPlacement

# The algorithms priced here; ``planner.strategy.ALL_TO_ALL_ALGORITHMS`` names those a layout
# may choose.
DISPATCH_ALGORITHMS = ("flat", "hierarchical", "deduplicated")


@dataclass(frozen=True)
class RoutingGroups:
    """Group-limited routing: ``groups`` groups of consecutive experts, each token choosing
    its experts among those of ``per_token`` of them (DeepSeek-V3: 8 groups, 4 per token)."""

    groups: int
    per_token: int

    def __post_init__(self) -> None:
        if not 1 <= self.per_token <= self.groups:
            raise ValueError(f"group-limited routing needs 1 <= groups per token <= groups, got "
                             f"{self.per_token} of {self.groups}")


@dataclass(frozen=True)
class NodeFanout:
    """How many nodes one token's routed copies reach, in expectation (see the module
    docstring): ``reached`` counting the token's own node, ``remote`` the others; ``nodes``
    is how many nodes the group spans."""

    nodes: int
    reached: float
    remote: float


@dataclass(frozen=True)
class DispatchTraffic:
    """One dispatch on the busiest device: the bytes it sends over NVLink and over the
    network, and the seconds each leg and the whole take."""

    algorithm: str
    nvlink_bytes: float
    network_bytes: float
    nvlink_s: float
    network_s: float
    time_s: float


def node_fanout(placement: ExpertPlacement, cluster: Cluster, ranks: Sequence[int], top_k: int,
                groups: RoutingGroups | None = None) -> NodeFanout:
    """``NodeFanout`` of tokens routed top-``top_k`` over ``placement``'s devices ``ranks``.

    Raises:
        ValueError: the groups do not divide the experts, or the chosen groups hold fewer
            experts than ``top_k``.
    """
    experts = placement.experts
    node_of_expert = [cluster.node_of(ranks[copies[0][0]]) for copies in placement.replicas]
    nodes = sorted(set(cluster.node_of(rank) for rank in ranks))
    if groups is None:
        groups = RoutingGroups(1, 1)  # every token may pick any expert
    if experts % groups.groups:
        raise ValueError(f"{groups.groups} routing groups do not divide {experts} experts")
    size = experts // groups.groups
    eligible = size * groups.per_token
    if eligible < top_k:
        raise ValueError(f"tokens pick top-{top_k} among {groups.per_token} group(s) of {size} experts: too few")
    reached = {}
    for node in nodes:
        per_group = [sum(1 for e in range(g * size, (g + 1) * size) if node_of_expert[e] == node)
                     for g in range(groups.groups)]
        missed = sum(chance * math.comb(eligible - held, top_k) / math.comb(eligible, top_k)
                     for held, chance in _held_among_chosen(per_group, groups.per_token).items())
        reached[node] = 1.0 - missed
    starts = [cluster.node_of(rank) for rank in ranks]
    own = sum(reached[node] for node in starts) / len(starts)  # the token's own node, by where tokens start
    total = sum(reached.values())
    return NodeFanout(len(nodes), total, total - own)


def dispatch_traffic(algorithm: str, copies: float, tokens: float, row_bytes: float, shape: GroupShape,
                     fanout: NodeFanout | None = None, concurrent_groups: int = 1,
                     in_flight: int = 1) -> DispatchTraffic:
    """One dispatch in which the busiest device sends ``copies`` routed copies of its
    ``tokens`` tokens, ``row_bytes`` each, over a group of ``shape`` (see the module
    docstring). ``fanout`` is needed by ``deduplicated`` only. ``flat`` and ``hierarchical``
    are ``cost_model.collectives.algorithm_times``' all-to-all; a group on one node sends
    nothing over the network whatever the algorithm (and ``deduplicated`` is ``flat``).
    ``in_flight``: peers the backend exchanges with at once
    (``cost_model.collectives.peers_in_flight``): every leg pays one link latency per round of
    that many peers (``exchange_rounds``), not one per peer."""
    if algorithm not in DISPATCH_ALGORITHMS:
        raise ValueError(f"dispatch algorithm must be one of {DISPATCH_ALGORITHMS}, got {algorithm!r}")
    n, k, p = shape.size, shape.nodes, shape.per_node
    size = copies * row_bytes  # what the device sends in all
    if n == 1 or size == 0:
        return DispatchTraffic(algorithm, 0.0, 0.0, 0.0, 0.0, 0.0)
    if k == 1:
        time = algorithm_times("all_to_all", size, shape, concurrent_groups, in_flight)["pairwise"]
        return DispatchTraffic(algorithm, size * (n - 1) / n, 0.0, time, 0.0, time)
    beta_i, alpha_i = shape.intra.bandwidth, shape.intra.latency
    beta_m, alpha_e = member_bandwidth(shape, concurrent_groups), shape.inter.latency

    def rounds(peers: int) -> int:
        return exchange_rounds(peers, in_flight)

    if algorithm == "deduplicated":
        if fanout is None:
            raise ValueError("the deduplicated dispatch needs the tokens' node fan-out (node_fanout)")
        network = tokens * fanout.remote * row_bytes
        nvlink = size * (p - 1) / p
        network_s = network / beta_m + rounds(k - 1) * alpha_e if network else 0.0
        nvlink_s = nvlink / beta_i + rounds(p - 1) * alpha_i if nvlink else 0.0
        return DispatchTraffic(algorithm, nvlink, network, nvlink_s, network_s, max(network_s, nvlink_s))
    times = algorithm_times("all_to_all", size, shape, concurrent_groups, in_flight)
    if algorithm == "hierarchical" and "hierarchical" in times:
        nvlink, network = size * (p - 1) / p, size * (k - 1) / k
        nvlink_s = nvlink / beta_i + rounds(p - 1) * alpha_i if p > 1 else 0.0
        network_s = network / beta_m + rounds(k - 1) * alpha_e
        return DispatchTraffic(algorithm, nvlink, network, nvlink_s, network_s, times["hierarchical"])
    fewest = max(1, n - (k - 1) * p)  # members on the emptiest node
    nvlink, network = size * (p - 1) / n, size * (n - fewest) / n
    nvlink_s = nvlink / beta_i + rounds(p - 1) * alpha_i if p > 1 else 0.0
    network_s = network / beta_m + rounds(n - fewest) * alpha_e
    return DispatchTraffic("flat", nvlink, network, nvlink_s, network_s, times["pairwise"])


def _held_among_chosen(per_group: Sequence[int], chosen: int) -> dict[int, float]:
    """{x: the chance that ``chosen`` groups picked uniformly at random hold ``x`` of one
    node's experts}, ``per_group[g]`` being how many group ``g`` holds. Counted by dynamic
    programming over the groups (subsets of each size by their sum), not by listing subsets."""
    ways: list[dict[int, int]] = [dict() for _ in range(chosen + 1)]
    ways[0][0] = 1
    for held in per_group:
        for size in range(chosen, 0, -1):
            for total, count in ways[size - 1].items():
                ways[size][total + held] = ways[size].get(total + held, 0) + count
    subsets = math.comb(len(per_group), chosen)
    return {total: count / subsets for total, count in ways[chosen].items()}
