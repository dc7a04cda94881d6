"""Links per pair of sites (``[[links]]``, ``Cluster.link_between``) and collectives priced by the
links they cross, flat and hierarchical across sites (``cost_model.site_collectives``), each
worked out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_model.collectives import collective_time, group_shape, site_algorithm_times
from planner.cluster_links import best_tour, crossed_link
from planner.cluster import Cluster, DeviceSpec, LinkSpec, NodeSpec, PairLink
from planner.errors import ClusterError

REPO = Path(__file__).resolve().parents[1]
RACKS = REPO / "examples/clusters/three-racks.toml"
DEVICE = DeviceSpec("cpu", {"float32": 50e9}, 2**33, 10e9)
INSIDE = LinkSpec(bandwidth=2e9, latency=50e-6)  # between the nodes of one site
BETWEEN = LinkSpec(bandwidth=0.5e9, latency=2e-3)  # between sites
SLOW = LinkSpec(bandwidth=0.1e9, latency=5e-3)


def one_device_nodes(sites: tuple[str, ...], links: tuple[PairLink, ...] = (), between=BETWEEN) -> Cluster:
    """One one-device node per entry of ``sites``, over gloo (the alpha-beta model)."""
    nodes = tuple(NodeSpec(DEVICE, 1, INSIDE, site=site) for site in sites)
    return Cluster("links", nodes, INSIDE, "gloo", inter_site_link=between, links=links)


def test_the_racks_file_declares_a_link_per_pair_and_round_trips(tmp_path) -> None:
    racks = Cluster.load(RACKS)
    for suffix in (".toml", ".json"):  # Cluster.save writes between = [...] as an array, not tables
        racks.save(tmp_path / f"saved{suffix}")
        assert Cluster.load(tmp_path / f"saved{suffix}") == racks
    uplink = LinkSpec(bandwidth=400e9 / 8 / 16, latency=20e-6)  # rack c's 400 Gb/s port over 16 GPUs
    assert racks.sites == ("a", "b", "c") and racks.derived_from is None
    assert racks.link_between("a", "c") == racks.link_between("c", "b") == uplink
    assert racks.link_between("a", "b") == LinkSpec(25e9, 8e-6)  # [inter_site], the default
    assert racks.link_between("a", "a") == racks.inter_link  # no link of its own: [inter_node]
    assert racks.link_between("c", "c") == LinkSpec(400e9 / 8 / 8, 15e-6)  # rack c's own network
    assert Cluster.from_dict(racks.to_dict()) == racks
    # Ranks: rack a 0-15, rack b 16-31, rack c 32-47 (two 8-GPU nodes each).
    assert group_shape(racks, [0, 8]).inter == racks.inter_link  # two nodes of rack a
    assert group_shape(racks, [32, 40]).inter == racks.link_between("c", "c")
    assert group_shape(racks, [0, 16]).inter == LinkSpec(25e9, 8e-6)  # a and b, through the spine
    assert group_shape(racks, [0, 32]).inter == uplink
    # A ring over one rank of each rack crosses a-b, b-c and c-a: the uplink decides.
    assert group_shape(racks, [0, 16, 32]).inter == uplink


def test_bad_links_are_one_line_each(tmp_path) -> None:
    text = RACKS.read_text()
    for broken, message in (
        (text.replace('between = ["a", "c"]', 'between = ["a", "d"]'), "links[1] names site 'd', which no node is at"),
        (text.replace('between = ["b", "c"]', 'between = ["c", "a"]'), "links[2].between repeats the pair ['a', 'c']"),
        (text.replace('between = ["b", "c"]', 'between = "b"'), "links[2].between must be two site names"),
        (text.replace('between = ["b", "c"]', 'between = ["b", "c"]\nspeed = 1'), "unknown key links[2].speed"),
        (text.replace('between = ["b", "c"]\nbandwidth = 3.125e9', 'between = ["b", "c"]\nbandwidth = -1'),
         "links[2].bandwidth"),
        (text.replace('between = ["b", "c"]\nbandwidth = 3.125e9\n', 'between = ["b", "c"]\n'),
         "links[2].bandwidth is missing"),
        (text.replace("[inter_site]", "[no_such_table]"), "unknown key no_such_table"),
        (text.replace("[inter_site]\nbandwidth = 25e9      # bytes/s per GPU between racks a and b: the same spine "
                      "at full bisection\nlatency = 8e-6        # seconds\n", ""),
         "inter_site_link is missing: sites 'a' and 'b' have no link between them"),
    ):
        assert broken != text, message
        path = tmp_path / "c.toml"
        path.write_text(broken)
        with pytest.raises(ClusterError) as error:
            Cluster.load(path)
        assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
    # Every pair linked by its own table: no [inter_site] needed.
    pairs = (PairLink(("a", "b"), BETWEEN),)
    assert one_device_nodes(("a", "b"), pairs, between=None).link_between("b", "a") == BETWEEN
    with pytest.raises(ClusterError, match="sites 'a' and 'c' have no link"):
        one_device_nodes(("a", "b", "c"), (PairLink(("a", "b"), BETWEEN), PairLink(("b", "c"), BETWEEN)), None)


def test_a_ring_tours_the_sites_over_the_fastest_links() -> None:
    # Four sites w, x, y, z in rank order; w-y and x-z are slow. Rank order's tour w-x-y-z-w
    # crosses no slow link; so does the best tour. Put the slow links on w-x and y-z instead:
    # rank order crosses them, the tour w-y-x-z-w (or w-z-x-y-w) does not.
    slow = (PairLink(("w", "x"), SLOW), PairLink(("y", "z"), SLOW))
    cluster = one_device_nodes(("w", "x", "y", "z"), slow)
    order, bottleneck = best_tour(cluster, ["w", "x", "y", "z"])
    assert bottleneck == BETWEEN and order in (("w", "y", "x", "z"), ("w", "z", "x", "y"))
    # A flat all-reduce of S over n = 4 ranks, p = 1: 2(n-1)/n * S/beta + 2(n-1) alpha at BETWEEN,
    # or the tree 2 S/beta + 2 * log2(4) * alpha, whichever is less.
    size = 8e6
    ring = 2 * 3 / 4 * size / 0.5e9 + 2 * 3 * 2e-3  # 0.024 + 0.012 = 0.036
    tree = 2 * size / 0.5e9 + 2 * 2 * 2e-3  # 0.032 + 0.008 = 0.040
    assert collective_time("all_reduce", size, cluster, [0, 1, 2, 3]) == pytest.approx(min(ring, tree))
    # Two ranks at w and x cross their slow link both ways: SLOW prices them.
    assert crossed_link(cluster, [0, 1]) == SLOW
    assert collective_time("all_reduce", size, cluster, [0, 1]) == pytest.approx(size / 0.1e9 + 2 * 5e-3)


def test_hierarchical_collectives_keep_traffic_inside_each_site() -> None:
    # Sites a, a, b, b of one-device nodes: m = 2 ranks per site, K = 2 sites, n = 4.
    cluster = one_device_nodes(("a", "a", "b", "b"))
    size, ranks = 64e6, [0, 1, 2, 3]
    beta_e, alpha_e, beta_s, alpha_s = 2e9, 50e-6, 0.5e9, 2e-3
    # Inside a site: a ring over 2 ranks on 2 nodes, (m-1)/m * S/beta_e + (m-1) alpha_e.
    inside = 1 / 2 * size / beta_e + alpha_e  # 0.016 + 0.00005
    # Across: the 2 same-index pairs each all-reduce S/m = 32e6 over K = 2 sites at beta_s (one
    # device per node, one group rank per node: each flow has its device's whole share):
    # ring 2(K-1)/K * (S/m)/beta_s + 2(K-1) alpha_s = 0.064 + 0.004; the tree's 2 * (S/m)/beta_s
    # + 2 * log2(2) * alpha_s = 0.128 + 0.004 is slower.
    across = 2 * 1 / 2 * (size / 2) / beta_s + 2 * alpha_s
    times = site_algorithm_times("all_reduce", size, cluster, ranks)
    assert times["hierarchical-sites"] == pytest.approx(inside + across + inside)  # 0.1001 s
    # The flat ring at the slowest link crossed: 2 * 3/4 * S/beta_s + 6 alpha_s = 0.192 + 0.012.
    assert times["ring"] == pytest.approx(2 * 3 / 4 * size / beta_s + 6 * alpha_s)
    assert collective_time("all_reduce", size, cluster, ranks) == pytest.approx(inside + across + inside)
    # all_gather: the slices across first, (K-1)/K * (S/m)/beta_s + (K-1) alpha_s, then inside.
    slices = 1 / 2 * (size / 2) / beta_s + alpha_s  # 0.032 + 0.002
    for kind in ("all_gather", "reduce_scatter"):
        assert site_algorithm_times(kind, size, cluster, ranks)["hierarchical-sites"] == pytest.approx(slices + inside)
        # flat ring (n-1)/n * S/beta_s + (n-1) alpha_s = 0.096 + 0.006, twice as slow
        assert collective_time(kind, size, cluster, ranks) == pytest.approx(slices + inside)
    # Sites holding different numbers of the group's ranks: the slices would not line up.
    uneven = one_device_nodes(("a", "a", "a", "b"))
    assert "hierarchical-sites" not in site_algorithm_times("all_reduce", size, uneven, ranks)
    # One site only: nothing to keep inside.
    assert "hierarchical-sites" not in site_algorithm_times("all_reduce", size, cluster, [0, 1])


def test_sharing_the_link_between_sites_when_a_node_sends_several_slices() -> None:
    # Two sites of one 2-device node each; 2 groups of this shape at once (concurrent_groups = 2):
    # p = 2 group ranks per node and c = 2 put 4 flows on a node of D = 2 device shares, so each
    # flow gets beta_s * D / max(D, p * c) = beta_s / 2.
    nodes = (NodeSpec(DEVICE, 2, INSIDE, site="a"), NodeSpec(DEVICE, 2, INSIDE, site="b"))
    cluster = Cluster("pairs", nodes, INSIDE, "gloo", inter_site_link=BETWEEN)
    size = 64e6
    inside = 1 / 2 * size / 2e9 + 50e-6  # ring reduce-scatter over the node's 2 devices
    across = 2 * 1 / 2 * (size / 2) / (0.5e9 / 2) + 2 * 2e-3
    times = site_algorithm_times("all_reduce", size, cluster, [0, 1, 2, 3], concurrent_groups=2)
    assert times["hierarchical-sites"] == pytest.approx(inside + across + inside)
