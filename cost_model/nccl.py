"""Collectives as NCCL runs them on DGX A100 / DGX H100: published measurements, cited.

The α–β model of ``cost_model.collectives`` prices a collective from datasheet link rates. NCCL
never reaches those rates (protocol overhead: an A100 node's NVLink is 300 GB/s per direction,
NCCL's all-reduce bus bandwidth on it is 232 GB/s), and its latency depends on the algorithm
and protocol it picks per message size. The GPU presets come with public nccl-tests
measurements of their links (``planner/presets.py``, ``nccl_tests``), so ``collective_time``
prices their collectives here instead, and those of every cluster derived from them (a file
naming the preset, an edit, a calibration: ``Cluster.derived_from``), with the curves of each
link class it changed scaled by the ratio of its link to the preset's
(``planner.cluster_edits``, whose docstring says why that is the right first-order model).
Every other cluster (CPU/gloo, a profiled machine, a file describing nodes from scratch)
keeps the α–β model.

The model is NCCL's own tuning model (``src/graph/tuning.cc``, NVIDIA/nccl at commit
5067397c; NCCL picks the algorithm/protocol pair of least predicted time the same way), fed
with published achieved bandwidths instead of NCCL's internal per-channel estimates:

    time(algorithm, protocol) = latency(algorithm, protocol, span) + bus bytes / bus bandwidth

  * bus bytes (nccl-tests ``doc/PERFORMANCE.md``): all_reduce 2(n−1)/n·S; all_gather,
    reduce_scatter and all_to_all (n−1)/n·S; broadcast and send_recv S. "Bus bandwidth" is what
    nccl-tests reports as busbw, so a measured busbw is the model's bandwidth directly.
  * bus bandwidth of the Simple protocol = the published large-message busbw (``NcclProfile``);
    LL runs at 1/2 of it and LL128 at 0.92 (tuning.cc: LL moves 8 bytes of data per 16, LL128
    120 per 128). So the achieved bandwidth grows with the message: small messages pay latency
    and run on LL, large ones reach the measured plateau on Simple.
  * span: a group inside one node runs on NVLink at the node's ring busbw. A group across nodes
    is bounded by the network share it gets: p members on a node, of c groups running at once,
    share the node's D NICs (one per GPU on a DGX, rail-optimised), each delivering the measured
    per-NIC ``nic_busbw``; p × min(1, D / (p·c)) NICs' worth, never more than the NVLink ring.
  * latency (µs, tuning.cc ``ncclTunerConstantsDefaults``): a base per (algorithm, protocol)
    plus one hop latency per ring step, NVLink hops for steps inside a node and network hops for
    the 2(k−1) (all-reduce) or k−1 steps that cross nodes; with one rank per node every hop is a
    network hop at the tree latency (tuning.cc: "With ppn=1 latencies are fully exposed"). A
    multi-node ring all-reduce on Simple pays its latency 1.4× (tuning.cc "plateau effect of
    ring", compute capability >= 8.0).

Algorithms (``nccl_algorithm_times`` keys are ``"algorithm/protocol"``):
  ring  every collective. all_reduce = reduce-scatter + all-gather rings.
  tree  all_reduce only: NCCL's double binary tree across nodes, a chain inside each node.
        Its bus bandwidth is 0.92 × the ring's (tuning.cc), LL at 1/3.8 and LL128 at 7/9 (one
        node) or 120/128 (several); its time is 2S/B inside a node and, across k nodes, the
        larger of the chain's 2S/B_intra and the network's S_net/B_net with S_net = S for two
        nodes (each node sends half the data up one tree and half down the other) and 2S beyond
        (interior nodes send partial sums up and results down) — why tree beats ring on two
        nodes (NVIDIA/nccl-tests#196, NVIDIA/nccl#812). Latency: base + 2((p−1) NVLink hops +
        ⌈log2 k⌉ network hops).
  nvls  all_reduce inside one DGX H100 (NVLink SHARP: the NVSwitch reduces), Simple only:
        S / ``nvls_algbw`` + 25 µs (tuning.cc's NVLS hop latency). Only for 5+ GPUs: at 2-4
        GPUs NVLS measures no faster than ring (NVIDIA/nccl#1455).
  p2p   send_recv and all_to_all (NCCL runs all-to-all as grouped sends): one step of ring
        latency; all_to_all moves (p−1)/n·S over NVLink and the (n−m)/n·S bound for other nodes
        over the member's network share at the same time (the slower decides, as nccl-tests
        reads it: NVIDIA/nccl-tests#130).

Overlap is not free: ``OVERLAP_COMPUTE_SLOWDOWN`` (per profile) is the fraction by which a
compute kernel slows while a collective runs beside it; the simulator charges it for the time
each compute task overlaps the data-parallel collectives (``TaskGraph.contend``). A derived
cluster keeps it unchanged: it is the compute kernels' loss to NCCL's SMs and memory traffic,
measured across GPU generations, not a property of a link's speed.

Not modelled: NVLSTree (NVLS inside nodes + tree across, H100 multi-node all-reduce), PAT,
CollNet/SHARP in the network switches, the tree's size-dependent correction factors, and
NCCL's channel count limits for small messages. ``benchmarks/nccl_fidelity.py`` prints the
model next to the published figures it can be checked against.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from planner.cluster import Cluster
from planner.cluster_edits import LinkScales, link_scales
from planner.presets import PRESETS

PROTOCOLS = ("LL", "LL128", "Simple")

# ---- NCCL's tuning constants (NVIDIA/nccl src/graph/tuning.cc, ncclTunerConstantsDefaults,
# commit 5067397c, 2026-06), microseconds, in protocol order LL, LL128, Simple ----
_BASE_LATENCY_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)}  # baseLatencies
_NVLINK_HOP_US = {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4)}  # hwLatencies[NVLINK]
_NETWORK_HOP_US = {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0)}  # hwLatencies[NET]
_NVLS_LATENCY_US = 25.0  # hwLatencies[NVLINK][NVLS][Simple]; baseLatencies[NVLS] are 0
_RING_PLATEAU = 1.4  # multi-node Simple ring all-reduce latency factor, compute capability >= 8.0
# Bandwidth of each protocol as a fraction of Simple's (tuning.cc "model refinements").
_RING_PROTOCOL_SHARE = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}
_TREE_SHARE = 0.92  # tree all-reduce bus bandwidth against the ring's
_TREE_PROTOCOL_SHARE_ONE_NODE = {"LL": 1 / 3.8, "LL128": 7 / 9, "Simple": 1.0}
_TREE_PROTOCOL_SHARE_NODES = {"LL": 1 / 3.8, "LL128": 120 / 128, "Simple": 1.0}
_NVLS_MIN_RANKS = 5  # NVIDIA/nccl#1455: NVLS busbw equals ring's at 2-4 H100s, exceeds it at 5+

# Compute kernels slow down while NCCL kernels run beside them (NCCL's channels each hold an
# SM, and they share memory bandwidth): 18.9% on average, 40.0% at most, measured for GPT and
# LLaMA training kernels on 4 A100s, H100s, MI250s and MI210s (Agrawal et al.,
# "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
# Learning: Performance and Power Implications", arXiv:2507.03114, 2025, abstract).
OVERLAP_COMPUTE_SLOWDOWN = 0.189


@dataclass(frozen=True)
class NcclProfile:
    """Published nccl-tests figures for one preset's hardware (bytes/s), as a cluster sees
    them: scaled for the links a derived cluster changed (``scaled_profile``).

    Attributes:
        preset: the preset whose clusters these measurements describe.
        ring_busbw: large-message bus bandwidth inside one node on the ring (Simple): what
            all_reduce (ring), all_gather, reduce_scatter reach on NVLink.
        nic_busbw: large-message bandwidth one NIC delivers to NCCL across nodes.
        nvls_algbw: NVLink SHARP all-reduce algorithm bandwidth (S / time) inside a node of
            8, or None where the NVSwitch cannot reduce (A100).
        sources: where each figure was published.
        overlap_slowdown: fraction by which a compute kernel slows while a collective runs
            beside it (``OVERLAP_COMPUTE_SLOWDOWN``).
        nvlink_latency_scale, network_latency_scale: factors on NCCL's per-hop latencies of
            the intra-node and inter-node links (1.0 on the preset's own links).
    """

    preset: str
    ring_busbw: float
    nic_busbw: float
    nvls_algbw: float | None
    sources: str
    overlap_slowdown: float = OVERLAP_COMPUTE_SLOWDOWN
    nvlink_latency_scale: float = 1.0
    network_latency_scale: float = 1.0


# The presets' published figures (planner/presets.py cites each).
PROFILES: dict[str, NcclProfile] = {
    name: NcclProfile(preset=name, **data["nccl_tests"]) for name, data in PRESETS.items() if "nccl_tests" in data
}

_MATCHED: dict[int, tuple[Cluster, NcclProfile | None]] = {}


def nccl_profile(cluster: Cluster) -> NcclProfile | None:
    """The measurements that describe ``cluster``, or None (then the α–β model applies).

    A cluster is described when it is a preset with a profile or derived from one
    (``Cluster.derived_from``) with the preset's backend and devices per node
    (``planner.cluster_edits.link_scales``, any node count): the preset's figures, scaled
    for the links it changed (``scaled_profile``); a change of anything else (memory,
    attention kernel, calibrated efficiencies) leaves them as published. Answers are
    remembered per cluster object.
    """
    known = _MATCHED.get(id(cluster))
    if known is not None and known[0] is cluster:
        return known[1]
    scales = link_scales(cluster)
    profile = None if scales is None else scaled_profile(PROFILES[scales.preset], scales)
    _MATCHED[id(cluster)] = (cluster, profile)
    while len(_MATCHED) > 16:
        del _MATCHED[next(iter(_MATCHED))]
    return profile


def scaled_profile(profile: NcclProfile, scales: LinkScales) -> NcclProfile:
    """``profile`` on links ``scales`` times the preset's: each bus bandwidth measured on a
    link class times that class's bandwidth ratio, each hop latency times its latency ratio
    (NCCL's base latencies are software and stay). Ratios of 1.0 give ``profile`` back,
    figure for figure. Why this is the right first-order model: ``planner.cluster_edits``."""
    return dataclasses.replace(
        profile,
        ring_busbw=profile.ring_busbw * scales.intra_bandwidth,
        nic_busbw=profile.nic_busbw * scales.inter_bandwidth,
        nvls_algbw=None if profile.nvls_algbw is None else profile.nvls_algbw * scales.intra_bandwidth,
        nvlink_latency_scale=scales.intra_latency,
        network_latency_scale=scales.inter_latency,
    )


def bus_bytes(kind: str, size_bytes: float, ranks: int) -> float:
    """Bytes nccl-tests divides by time to report busbw (nccl-tests doc/PERFORMANCE.md)."""
    if kind == "all_reduce":
        return 2 * (ranks - 1) / ranks * size_bytes
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (ranks - 1) / ranks * size_bytes
    return float(size_bytes)  # broadcast, send_recv


def nccl_algorithm_times(kind: str, size_bytes: float, shape, profile: NcclProfile,
                         concurrent_groups: int = 1) -> dict[str, float]:
    """Seconds of every (algorithm, protocol) NCCL could run, keyed ``"ring/LL"`` etc.

    Args:
        kind: one of ``cost_model.collectives.COLLECTIVES``.
        size_bytes: as in ``cost_model.collectives.collective_time``.
        shape: the group's ``GroupShape``.
        profile: the cluster's measurements (``nccl_profile``).
        concurrent_groups: groups of this shape running at once (share the NICs).
    Returns:
        {name: seconds}; all 0.0 for an empty message or a group of one.
    """
    n, k, p = shape.size, shape.nodes, shape.per_node
    intra = profile.ring_busbw
    if k == 1:
        network = math.inf
    else:
        devices = shape.node_devices
        network = p * profile.nic_busbw * devices / max(devices, p * concurrent_groups)
    flat = min(intra, network) if p > 1 else network  # p = 1: no NVLink hop in the ring
    if kind in ("send_recv", "all_to_all"):
        times = _p2p_times(kind, size_bytes, shape, intra, network / p if k > 1 else math.inf, profile)
    else:
        times = _ring_times(kind, size_bytes, shape, flat, profile)
        if kind == "all_reduce":
            times.update(_tree_times(size_bytes, shape, intra, network, profile))
            if k == 1 and profile.nvls_algbw is not None and n >= _NVLS_MIN_RANKS:
                nvls_latency_us = _NVLS_LATENCY_US * profile.nvlink_latency_scale
                times["nvls/Simple"] = nvls_latency_us * 1e-6 + size_bytes / profile.nvls_algbw
    if size_bytes == 0 or n == 1:
        return {name: 0.0 for name in times}
    return times


def _hop_latency(algorithm: str, protocol: int, shape, steps: int, network_steps: int,
                 profile: NcclProfile) -> float:
    """Base latency plus ``steps`` hops, ``network_steps`` of them across nodes (µs)."""
    network = _NETWORK_HOP_US["tree" if shape.per_node == 1 else algorithm][protocol] * profile.network_latency_scale
    nvlink = (network if shape.per_node == 1 and shape.nodes > 1
              else _NVLINK_HOP_US[algorithm][protocol] * profile.nvlink_latency_scale)
    return (_BASE_LATENCY_US[algorithm][protocol] + (steps - network_steps) * nvlink
            + network_steps * network)


def _ring_times(kind: str, size: float, shape, bandwidth: float, profile: NcclProfile) -> dict[str, float]:
    n, k = shape.size, shape.nodes
    all_reduce = kind == "all_reduce"
    steps = 2 * (n - 1) if all_reduce else n - 1
    network_steps = 0 if k == 1 else (2 * (k - 1) if all_reduce else k - 1)
    moved = bus_bytes(kind, size, n)
    times = {}
    for index, protocol in enumerate(PROTOCOLS):
        latency = _hop_latency("ring", index, shape, steps, network_steps, profile)
        if all_reduce and k > 1 and protocol == "Simple":
            latency *= _RING_PLATEAU
        times[f"ring/{protocol}"] = latency * 1e-6 + moved / (bandwidth * _RING_PROTOCOL_SHARE[protocol])
    return times


def _tree_times(size: float, shape, intra: float, network: float, profile: NcclProfile) -> dict[str, float]:
    k, p = shape.nodes, shape.per_node
    shares = _TREE_PROTOCOL_SHARE_ONE_NODE if k == 1 else _TREE_PROTOCOL_SHARE_NODES
    chain = 2 * size / intra if p > 1 else 0.0
    across = 0.0 if k == 1 else (size if k == 2 else 2 * size) / network
    depth = math.ceil(math.log2(k)) if k > 1 else 0
    times = {}
    for index, protocol in enumerate(PROTOCOLS):
        hops = ((p - 1) * (_NVLINK_HOP_US["tree"][index] * profile.nvlink_latency_scale)
                + depth * (_NETWORK_HOP_US["tree"][index] * profile.network_latency_scale))
        latency = _BASE_LATENCY_US["tree"][index] + 2 * hops
        times[f"tree/{protocol}"] = latency * 1e-6 + max(chain, across) / (_TREE_SHARE * shares[protocol])
    return times


def _p2p_times(kind: str, size: float, shape, intra: float, member_network: float,
               profile: NcclProfile) -> dict[str, float]:
    n, k, p = shape.size, shape.nodes, shape.per_node
    if kind == "send_recv":
        seconds = size / (intra if k == 1 else member_network)
    else:
        fewest = max(1, n - (k - 1) * p)  # members on the emptiest node
        over_nvlink = (p - 1) / n * size / intra
        over_network = (n - fewest) / n * size / member_network if k > 1 else 0.0
        seconds = max(over_nvlink, over_network)
    times = {}
    for index, protocol in ((0, "LL"), (2, "Simple")):  # p2p runs on LL or Simple
        latency = _hop_latency("ring", index, shape, 1, 1 if k > 1 else 0, profile)
        times[f"p2p/{protocol}"] = latency * 1e-6 + seconds / _RING_PROTOCOL_SHARE[protocol]
    return times
