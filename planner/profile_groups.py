"""``planner profile --cluster FILE --group DEVICE``: profiling a cluster of several device
groups one group at a time.

``planner profile`` measures the host it runs on (``cost_model.profile``). A heterogeneous
cluster's groups are on different hosts, so each is measured on one of its own nodes: the
run with ``--group`` writes the cluster file with that group's devices replaced by what it
measured (``planner.device_groups.with_group_measured``: peak FLOP/s per dtype, memory and
its bandwidth, efficiencies, per-op overhead; the group keeps its name), and its intra-node
link too when the profile ran as many processes as the group's nodes hold devices. The
other groups and the network between nodes stay as the file gave them, and the command says
so: run it again on a node of each other group, each run reading the file the last wrote.

CLI layer: imports the vocabulary; ``profile`` is the ``MachineProfile`` the command measured.
"""

from __future__ import annotations

from planner.cluster import Cluster
from planner.device_groups import device_groups, with_group_measured
from planner.errors import ClusterError

__all__ = ["measured_group", "profiled_group"]


def profiled_group(cluster_file: str | None, group: str | None) -> Cluster | None:
    """The cluster of ``cluster_file`` when ``group`` names one of its device groups, None
    without either; checked before anything is measured.

    Raises:
        ClusterError: one of the two without the other, the file cannot be read, or no group
            has that name (one line each).
    """
    if (cluster_file is None) != (group is None):
        raise ClusterError("planner profile: --cluster and --group go together (a cluster file and the device "
                           "group this host is one of); give both or neither")
    if cluster_file is None:
        return None
    cluster = Cluster.load(cluster_file)
    with_group_measured(cluster, group, cluster.device_of(0), None)  # the one-line error for an unknown group
    return cluster


def measured_group(cluster: Cluster, group: str, profile) -> tuple[Cluster, str, str]:
    """``(cluster with group measured, the file's comment, words on what was kept)`` for the
    ``MachineProfile`` ``profile`` taken on a node of ``group``."""
    node = next(node for node in cluster.nodes if node.device.name == group)
    same_width = profile.nproc == node.devices
    measured_node = profile.cluster.nodes[0]
    measured = with_group_measured(cluster, group, measured_node.device,
                                   measured_node.intra_link if same_width else None)
    others = [g.device.name for g in device_groups(cluster) if g.device.name != group]
    kept = (f"groups {', '.join(others)} keep the file's figures: run planner profile --group NAME on one of "
            f"their nodes" if others else "no other group")
    link = ("its intra-node link measured too" if same_width else
            f"its intra-node link kept (measured with --nproc {profile.nproc}; its nodes hold {node.devices})")
    notes = (f"{cluster.name}: device group {group!r} measured on this host ({link}); the other groups and the "
             f"network between nodes as the file gave them.\n{profile.notes()}")
    return measured, notes, f"{kept}; {link}"
