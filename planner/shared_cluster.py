"""Jobs sharing one cluster: the checks ``planner colocate`` and ``plan --co-runner`` share.

Two jobs can share devices only when they were planned for the same cluster: the same
devices, links and backend, rank by rank. ``check_same_cluster`` says which plan differs, in
one line; ``load_co_runner`` reads the job already there.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Sequence

from planner.cluster import Cluster
from planner.errors import ArgumentError

if TYPE_CHECKING:  # imports torch: the CLI checks its arguments before loading it
    from planner.plans import Plan


def check_same_cluster(names: Sequence[str], clusters: Sequence[Cluster]) -> None:
    """Raise ``ArgumentError`` naming the jobs unless every cluster has the size and the
    devices, links and backend of the first (jobs sharing devices must be planned for them)."""
    sizes = [cluster.world_size for cluster in clusters]
    if len(set(sizes)) > 1:
        listed = ", ".join(f"{name}: {size}" for name, size in zip(names, sizes))
        raise ArgumentError(f"the plans are for clusters of different sizes ({listed} devices); "
                            f"plan every job for the same cluster to compare sharing it")
    first = _shape(clusters[0])
    for name, cluster in zip(names[1:], clusters[1:]):
        if _shape(cluster) != first:
            raise ArgumentError(f"{names[0]} is planned for {clusters[0].describe()} but {name} for "
                                f"{cluster.describe()}; plan both jobs for the same cluster to share it")


def _shape(cluster: Cluster) -> dict:
    """What two jobs sharing devices must agree on: everything but the cluster's name."""
    shape = cluster.to_dict()
    shape.pop("name", None)
    return shape


def load_co_runner(plan: "Plan | str | os.PathLike") -> "Plan":
    """``plan`` itself, or the plan saved at that path (``PlanFileError`` names a bad file)."""
    from planner.plans import Plan, load_plan

    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return load_plan(plan)
    raise ArgumentError(f"co_runner takes a Plan or the path of a saved plan (str or pathlib.Path), "
                        f"got {type(plan).__name__}")
