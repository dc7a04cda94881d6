"""Nodes at two or more sites (``NodeSpec.site``, ``Cluster.inter_site_link``): the cluster
file's ``site`` and ``[inter_site]`` keys, and collectives priced over the slowest link they
cross (``cost_model.collectives.group_shape``), worked out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_model.collectives import collective_time, group_shape
from planner.cluster import Cluster, DeviceSpec, LinkSpec, NodeSpec
from planner.errors import ClusterError

REPO = Path(__file__).resolve().parents[1]
DEVICE = DeviceSpec("cpu", {"float32": 50e9}, 2**33, 10e9)
INSIDE = LinkSpec(bandwidth=2e9, latency=50e-6)  # the network inside a site
BETWEEN = LinkSpec(bandwidth=0.5e9, latency=2e-3)  # the link between sites


def two_sites(sites=("a", "b")) -> Cluster:
    """Two one-device nodes over gloo (the alpha-beta model, no measured curves)."""
    nodes = tuple(NodeSpec(DEVICE, 1, INSIDE, site=site) for site in sites)
    return Cluster("sites", nodes, INSIDE, "gloo", inter_site_link=BETWEEN if len(set(sites)) > 1 else None)


def test_an_all_reduce_across_sites_runs_at_the_link_between_them() -> None:
    # Ring all-reduce of S bytes over n = 2 ranks: 2(n-1) alpha + 2(n-1)/n * S / beta
    # = 2 alpha + S / beta, with alpha and beta of the slowest link crossed.
    size = 64e6
    across, inside = two_sites(), two_sites(("a", "a"))
    assert group_shape(across, [0, 1]).inter == BETWEEN
    assert group_shape(inside, [0, 1]).inter == INSIDE
    assert collective_time("all_reduce", size, across, [0, 1]) == pytest.approx(2 * 2e-3 + size / 0.5e9)
    assert collective_time("all_reduce", size, inside, [0, 1]) == pytest.approx(2 * 50e-6 + size / 2e9)


def test_sites_in_a_file_round_trip_and_bad_ones_are_one_line(tmp_path) -> None:
    lab = Cluster.load(REPO / "examples/clusters/two-sites.toml")
    assert lab.sites == ("north", "south") and lab.inter_site_link.bandwidth == 100e9 / 8 / 8
    assert lab.is_homogeneous and lab.derived_from is None  # the preset's measured curves are of one site
    assert Cluster.from_dict(lab.to_dict()) == lab
    assert group_shape(lab, [0, 8]).inter == lab.inter_link  # two nodes in the north building
    assert group_shape(lab, [0, 16]).inter.bandwidth == 100e9 / 8 / 8
    text = (REPO / "examples/clusters/two-sites.toml").read_text()
    for broken, message in (
        (text.replace("[inter_site]", "[unused_table]"), "unknown key unused_table"),
        ("\n".join(line for line in text.splitlines() if not line.startswith(("[inter_site]", "bandwidth = 1.5625",
                                                                                "latency = 60e-6"))),
         "inter_site_link is missing"),
        (text.replace('site = "south"', 'site = "north"'), "inter_site is given but every node is at one site"),
        (text.replace('site = "south"', "site = 3"), "site must be a printable name"),
    ):
        path = tmp_path / "c.toml"
        path.write_text(broken)
        with pytest.raises(ClusterError) as error:
            Cluster.load(path)
        assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
