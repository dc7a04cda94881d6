"""Which device each rank runs on, grouped: the per-rank facts a heterogeneous cluster adds.

A ``Cluster`` holds one ``NodeSpec`` per node (``planner.cluster``), so nodes may carry
different devices. What the planner needs from that, rank by rank, is here: the device of
every rank (``rank_devices``), the ranks grouped by device (``device_groups``: one group per
distinct ``DeviceSpec``, in rank order), each device's peak FLOP/s for a training dtype and
its memory. The cluster's own ``device_of(rank)`` answers for one rank; these answer for all
of them at once, as a search comparing device groups asks.

Vocabulary layer: imports only ``planner.cluster``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.cluster import Cluster, DeviceSpec, LinkSpec, NodeSpec
from planner.errors import ClusterError

__all__ = ["DeviceGroup", "device_groups", "group_names", "rank_devices", "sub_cluster", "with_group_measured"]


@dataclass(frozen=True)
class DeviceGroup:
    """The ranks of a cluster that run on one kind of device (equal ``DeviceSpec``)."""

    device: DeviceSpec
    ranks: tuple[int, ...]

    def peak_flops(self, dtype: str) -> float:
        """The group's device's peak dense FLOP/s for ``dtype`` (``DeviceSpec.flops_for``)."""
        return self.device.flops_for(dtype)

    @property
    def memory_bytes(self) -> int:
        """Memory of one device of the group, bytes."""
        return self.device.memory_bytes


def rank_devices(cluster: Cluster) -> tuple[DeviceSpec, ...]:
    """The device of every rank, in rank order (ranks are node-major)."""
    return tuple(node.device for node in cluster.nodes for _ in range(node.devices))


def device_groups(cluster: Cluster) -> tuple[DeviceGroup, ...]:
    """The cluster's ranks grouped by device, groups in the order of their first rank."""
    ranks: dict[DeviceSpec, list[int]] = {}
    for rank, device in enumerate(rank_devices(cluster)):
        ranks.setdefault(device, []).append(rank)
    return tuple(DeviceGroup(device, tuple(members)) for device, members in ranks.items())


def sub_cluster(cluster: Cluster, device: DeviceSpec) -> Cluster | None:
    """The cluster of ``cluster``'s nodes whose devices are ``device`` alone (the other nodes
    left out; links unchanged, less those naming a site left out), or None when no node has
    it. Named ``<name>-<device>``."""
    nodes: tuple[NodeSpec, ...] = tuple(node for node in cluster.nodes if node.device == device)
    if not nodes:
        return None
    sites = {node.site for node in nodes}
    return Cluster(name=f"{cluster.name}-{device.name}"[:120], nodes=nodes, inter_link=cluster.inter_link,
                   backend=cluster.backend, derived_from=None, inter_site_link=cluster.inter_site_link,
                   links=tuple(pair for pair in cluster.links if set(pair.sites) <= sites))


def group_names(cluster: Cluster) -> tuple[str, ...]:
    """The device name of each of the cluster's groups, in group order."""
    return tuple(group.device.name for group in device_groups(cluster))


def with_group_measured(cluster: Cluster, group: str, device: DeviceSpec, intra_link: LinkSpec | None) -> Cluster:
    """``cluster`` with the devices of group ``group`` (the device name the cluster gives them)
    replaced by ``device`` as measured (``planner profile`` on one of those nodes), keeping the
    group's name so plans and reports still tell the groups apart, and, when given, the
    group's nodes' intra-node link replaced by ``intra_link``. The other groups, the network
    between nodes and the backend are unchanged: each group is profiled on its own nodes.

    Raises:
        ClusterError: no group of ``cluster`` has that name (one line listing the names).
    """
    names = group_names(cluster)
    if group not in names:
        raise ClusterError(f"cluster {cluster.name!r} has no device group {group[:60]!r}; its groups are "
                           f"{', '.join(repr(name) for name in names)[:200]}: pass one of them to --group")
    old = next(g.device for g in device_groups(cluster) if g.device.name == group)
    measured = dataclasses.replace(device, name=group)
    nodes = tuple(
        dataclasses.replace(node, device=measured, intra_link=intra_link or node.intra_link)
        if node.device == old else node for node in cluster.nodes
    )
    return dataclasses.replace(cluster, nodes=nodes, derived_from=None)
