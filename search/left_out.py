"""The search's record of the devices its chosen plan leaves idle (search layer).

The families that may leave slow devices out (uneven data parallelism's and the
heterogeneous pipelines' plans on the fastest devices alone) each compare against their own
plans; only the search sees every family's. So when it chooses a plan on fewer ranks than
the cluster has, it records here which devices stay idle and the best fitting plan it found
that used every device, for the report (``planner.left_out_devices``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from planner.cluster import Cluster
from planner.device_groups import rank_devices
from planner.left_out_devices import LeftOutDevices
from planner.plans import Plan


def left_out_record(chosen: Plan, cluster: Cluster, fitting: Iterable[Plan]) -> LeftOutDevices | None:
    """The devices of ``cluster`` that ``chosen`` leaves idle, with the fastest plan of
    ``fitting`` on every device of ``cluster``; None when ``chosen`` uses every device."""
    if chosen.cluster.world_size >= cluster.world_size:
        return None
    idle = Counter(device.name for device in rank_devices(cluster))
    idle.subtract(device.name for device in rank_devices(chosen.cluster))
    # Device kinds in the order the cluster lists them; the chosen plan's kinds drop out.
    devices = tuple((name, count) for name, count in idle.items() if count > 0)
    with_all = [plan for plan in fitting if plan.cluster.world_size == cluster.world_size]
    if not with_all:
        return LeftOutDevices(devices, cluster.world_size)
    best = min(with_all, key=lambda plan: plan.estimate.step_time_s)
    return LeftOutDevices(devices, cluster.world_size, best.name, best.estimate.step_time_s)
