"""Clusters derived from a preset: the edits, what they changed, and what stays measured.

A cluster built from a preset (``Cluster.preset``, a file whose node groups name the preset)
carries ``Cluster.derived_from``; the edits here keep it, so the cost model keeps what was
measured on the preset's hardware:

  * ``with_attention_kernel``, ``with_memory``, ``with_power_limit``: the device's fused
    attention kernel, its memory size or bandwidth, the peak FLOP/s its board power limit
    allows (``planner.power_limit``). NCCL's collectives do not depend on them: the preset's
    measured curves and the compute/communication contention stay exactly as they were.
  * ``with_intra_node``, ``with_inter_node``: a link class's bandwidth or latency. The preset's
    measured curves of that link class are scaled by the ratio of the new figure to the
    preset's (``link_scales``); the other link class keeps its curves unchanged.

Why scaling by the ratio is the right first-order model: nccl-tests reports a collective's
"bus bandwidth" (busbw = algorithm bandwidth times 2(n-1)/n for all-reduce, (n-1)/n for
all-gather and reduce-scatter: nccl-tests ``doc/PERFORMANCE.md``) precisely so that it is the
speed of the bottleneck link whatever the rank count, and NCCL's own tuning model predicts it
as the link speed it detected times the channel count times per-protocol factors
(``ncclTopoTuneModel`` in NVIDIA/nccl ``src/graph/tuning.cc``: ``busBw = nChannels * bw`` with
``bw`` the intra- or inter-node link speed). So the measured busbw is the link's rate times an
efficiency of NCCL's protocols, and that efficiency, not the raw rate, is what the measurement
adds: a link twice as slow gives half the busbw. NCCL's latency is a software base per
algorithm and protocol plus one hop latency per step on each link class (same file,
``baseLat`` and ``hwLat``); only the hop term belongs to the link, so only it scales by the
ratio of the link latencies. Second-order effects (NCCL choosing fewer channels on a slower
link, a changed link moving the LL/LL128/Simple crossovers) are left out.

The preset's measurements apply to a derived cluster whose backend is the preset's (nccl),
whose nodes hold the preset's device count (the measurements are of the whole node, its
NVSwitch and one NIC per GPU) and share one intra-node link; otherwise collectives use the
α–β model of ``cost_model.collectives`` on the cluster's own links, as any cluster described
from scratch does.

Vocabulary layer: imports only ``planner.cluster``, ``planner.power_limit`` and ``planner.presets``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from planner.cluster import ATTENTION_KERNELS, Cluster, LinkSpec, NodeSpec, format_si
from planner.errors import ClusterError
from planner.power_limit import H100_NAMES, peak_scale_at_power_limit
from planner.presets import PRESETS


@dataclass(frozen=True)
class LinkScales:
    """How a derived cluster's links compare with its preset's: each the cluster's figure
    over the preset's (1.0: unchanged).

    Attributes:
        preset: the preset whose measurements are scaled.
        intra_bandwidth, intra_latency: intra-node link (NVLink) bandwidth and latency ratios.
        inter_bandwidth, inter_latency: inter-node link (per-device network share) ratios.
    """

    preset: str
    intra_bandwidth: float = 1.0
    intra_latency: float = 1.0
    inter_bandwidth: float = 1.0
    inter_latency: float = 1.0

    def changed(self) -> list[str]:
        """The scaled terms in words, e.g. ``["inter-node bandwidth x0.5"]`` (empty: none)."""
        ratios = (("intra-node bandwidth", self.intra_bandwidth), ("intra-node latency", self.intra_latency),
                  ("inter-node bandwidth", self.inter_bandwidth), ("inter-node latency", self.inter_latency))
        return [f"{what} x{ratio:.3g}" for what, ratio in ratios if ratio != 1.0]


@functools.lru_cache(maxsize=None)
def _preset_node(name: str) -> tuple[NodeSpec, LinkSpec, str]:
    """The preset's node as built, its inter-node link and its backend."""
    reference = Cluster.preset(name)
    return reference.nodes[0], reference.inter_link, reference.backend


def has_measured_collectives(preset: str) -> bool:
    """Whether ``preset`` comes with published nccl-tests figures (``planner.presets``)."""
    return "nccl_tests" in PRESETS.get(preset, {})


def link_scales(cluster: Cluster) -> LinkScales | None:
    """The scales of the preset's measured collective curves for ``cluster``, or None when
    its collectives use the α–β model (see the module docstring for when and why).

    A preset itself gets every ratio 1.0 (its measurements as published).
    """
    return None if _why_alpha_beta(cluster) else _scales(cluster)


def _scales(cluster: Cluster) -> LinkScales:
    node, inter, _ = _preset_node(cluster.derived_from)
    intra = cluster.nodes[0].intra_link
    return LinkScales(preset=cluster.derived_from,
                      intra_bandwidth=intra.bandwidth / node.intra_link.bandwidth,
                      intra_latency=intra.latency / node.intra_link.latency,
                      inter_bandwidth=cluster.inter_link.bandwidth / inter.bandwidth,
                      inter_latency=cluster.inter_link.latency / inter.latency)


def _why_alpha_beta(cluster: Cluster) -> str:
    """Why the preset's measurements do not describe ``cluster`` ("" when they do)."""
    preset = cluster.derived_from
    if preset is None:
        return "not derived from a preset"
    if not has_measured_collectives(preset):
        return f"no published NCCL figures for {preset}"
    node, _, backend = _preset_node(preset)
    if cluster.backend != backend:
        return f"backend {cluster.backend}, the measurements are of {backend}"
    counts = sorted({n.devices for n in cluster.nodes if n.devices != node.devices})
    if counts:
        return f"nodes of {'/'.join(map(str, counts))} devices, the measurements are of {node.devices}"
    if len({n.intra_link for n in cluster.nodes}) > 1:
        return "nodes with different intra-node links"
    return ""


def preset_changes(cluster: Cluster) -> list[str]:
    """What ``cluster`` changed from the preset it derives from, in words, e.g.
    ``["inter-node bandwidth 25 GB/s -> 12.5 GB/s", "memory 80 GB -> 40 GB"]`` (empty for a
    preset as built, and for a cluster not derived from one). Node and device counts are not
    changes: a preset takes any (``PRESET:NODESxDEVICES``)."""
    if cluster.derived_from is None:
        return []
    node, inter, backend = _preset_node(cluster.derived_from)
    changes: list[str] = []
    pairs = [(n.device, node.device, "") for n in cluster.nodes] + [(n.intra_link, node.intra_link, "intra-node ")
                                                                   for n in cluster.nodes]
    for spec, reference, prefix in [*pairs, (cluster.inter_link, inter, "inter-node ")]:
        for field in dataclasses.fields(spec):
            text = _change(prefix, field.name, getattr(reference, field.name), getattr(spec, field.name))
            if text and text not in changes:
                changes.append(text)
    if cluster.backend != backend:
        changes.append(f"backend {backend} -> {cluster.backend}")
    return changes


_UNITS = {"bandwidth": "B/s", "latency": "s", "memory_bytes": "B", "memory_bandwidth": "B/s"}
_WORDS = {"name": "device", "memory_bytes": "memory", "peak_flops": "peak FLOP/s",
          "attention_kernel": "attention kernel"}


def _change(prefix: str, field: str, before: object, after: object) -> str:
    """One changed field in words ("" when equal)."""
    if before == after:
        return ""
    what = prefix + _WORDS.get(field, field.replace("_", " "))
    if field == "latency":
        return f"{what} {before * 1e6:.3g} us -> {after * 1e6:.3g} us"
    if field in _UNITS:
        return f"{what} {format_si(before, _UNITS[field])} -> {format_si(after, _UNITS[field])}"
    if field == "peak_flops":
        return f"{what} {_flops(before)} -> {_flops(after)}"
    return f"{what} {'default' if before is None else before} -> {after}"


def _flops(table) -> str:
    return ", ".join(f"{dtype} {format_si(value, 'FLOP/s')}" for dtype, value in table.items())


def provenance(cluster: Cluster) -> str:
    """Where a derived cluster comes from and how its collectives are priced, for the report.

    Empty for a cluster not derived from a preset, and for a preset as built (its name says
    it) unless its node size loses the measured collectives. E.g. ``derived from preset
    dgx-a100-80g (inter-node bandwidth 25 GB/s -> 12.5 GB/s); collectives: NCCL as measured
    on dgx-a100-80g, inter-node bandwidth x0.5``.
    """
    preset = cluster.derived_from
    if preset is None:
        return ""
    changes = preset_changes(cluster)
    why = _why_alpha_beta(cluster)
    if not changes and cluster.name == preset and not (why and has_measured_collectives(preset)):
        return ""  # the preset as built (its name says it), or one with no measurements to lose
    origin = f"derived from preset {preset}" + (f" ({'; '.join(changes)})" if changes else "")
    if why:
        return f"{origin}; collectives: alpha-beta on its own links ({why})"
    scaled = _scales(cluster).changed()
    return f"{origin}; collectives: NCCL as measured on {preset}" + (f", {', '.join(scaled)}" if scaled else "")


# ---- the edits ----

def _with_devices(cluster: Cluster, **changes: object) -> Cluster:
    nodes = tuple(dataclasses.replace(node, device=dataclasses.replace(node.device, **changes))
                  for node in cluster.nodes)
    return dataclasses.replace(cluster, nodes=nodes)


def with_attention_kernel(cluster: Cluster, kernel: str) -> Cluster:
    """``cluster`` with every device running the fused attention kernel ``kernel``
    (``planner.cluster.ATTENTION_KERNELS``); collectives priced as before."""
    if kernel not in ATTENTION_KERNELS:
        raise ClusterError(f"attention kernel must be one of {', '.join(ATTENTION_KERNELS)}, got {kernel!r}")
    return _with_devices(cluster, attention_kernel=kernel)


def with_memory(cluster: Cluster, memory_bytes: int | None = None,
                memory_bandwidth: float | None = None) -> Cluster:
    """``cluster`` with every device's memory size (bytes) and/or bandwidth (bytes/s)
    replaced (None: kept); collectives priced as before."""
    changes = {key: value for key, value in (("memory_bytes", memory_bytes), ("memory_bandwidth", memory_bandwidth))
               if value is not None}
    return _with_devices(cluster, **changes)


def with_power_limit(cluster: Cluster, watts: float) -> Cluster:
    """``cluster`` with every device's peak FLOP/s (every dtype: the power limit lowers the
    clock all units share) at the clock a board limited to ``watts`` holds
    (``planner.power_limit.peak_scale_at_power_limit``); memory bandwidth and collectives priced
    as before. Only H100 devices have the datasheet points the scaling rests on. The scale
    multiplies the devices' peaks as they are: apply it once, to devices at their datasheet
    (700 W) peaks."""
    names = sorted({node.device.name for node in cluster.nodes
                    if not any(key in node.device.name.upper() for key in H100_NAMES)})
    if names:
        raise ClusterError(f"a power limit can only be applied to H100 devices (the datasheet points of "
                           f"planner.power_limit), not {', '.join(names)}; set the device's peak_flops instead")
    try:
        scale = peak_scale_at_power_limit(watts)
    except ValueError as error:
        raise ClusterError(str(error)) from None
    nodes = tuple(dataclasses.replace(node, device=dataclasses.replace(
        node.device, peak_flops={dtype: flops * scale for dtype, flops in node.device.peak_flops.items()}))
        for node in cluster.nodes)
    return dataclasses.replace(cluster, nodes=nodes)


def with_intra_node(cluster: Cluster, bandwidth: float | None = None, latency: float | None = None) -> Cluster:
    """``cluster`` with every node's intra-node link given a new bandwidth (bytes/s per
    direction per device) and/or latency (s) (None: kept). A preset's measured intra-node
    curves are scaled by the ratios (see the module docstring)."""
    nodes = tuple(dataclasses.replace(node, intra_link=_edited(node.intra_link, bandwidth, latency))
                  for node in cluster.nodes)
    return dataclasses.replace(cluster, nodes=nodes)


def with_inter_node(cluster: Cluster, bandwidth: float | None = None, latency: float | None = None) -> Cluster:
    """``cluster`` with its inter-node link (per device) given a new bandwidth (bytes/s per
    direction) and/or latency (s) (None: kept). A preset's measured inter-node curves are
    scaled by the ratios (see the module docstring)."""
    return dataclasses.replace(cluster, inter_link=_edited(cluster.inter_link, bandwidth, latency))


def _edited(link: LinkSpec, bandwidth: float | None, latency: float | None) -> LinkSpec:
    return LinkSpec(bandwidth=link.bandwidth if bandwidth is None else bandwidth,
                    latency=link.latency if latency is None else latency)

