"""The cluster model: nodes of devices joined by links, with a per-pair link where two sites differ.

A ``Cluster`` is a tuple of ``NodeSpec`` (one per node, so nodes may differ), a per-device
share of the inter-node network, the links between sites, and a collective backend. Ranks are
node-major: node 0 holds ranks ``0 .. d0-1``, node 1 the next ``d1``, and so on. The parts
(``DeviceSpec``, ``LinkSpec``, ``NodeSpec``, ``PairLink``) are in ``planner.cluster_specs``, the
reading of a file's tables in ``planner.cluster_files``; this module re-exports their names.

Units everywhere: FLOP/s (dense), bytes, bytes/s per direction per device, seconds.

Clusters come from three edges, all validated by the dataclasses' ``__post_init__``:
  * presets (``planner/presets.py``), e.g. ``Cluster.preset("dgx-h100", nodes=2)``;
  * the CLI string ``PRESET``, ``PRESET:NODES``, ``PRESET:NODESxDEVICES`` or a file path;
  * TOML/JSON files with ``name``, ``backend``, ``[inter_node]`` and ``[[nodes]]`` groups
    (``count``, ``devices``, optional ``preset``, ``site``, ``[nodes.device]``,
    ``[nodes.intra_node]``), ``[inter_site]`` and ``[[links]]`` when the groups name two or
    more sites (docs/cluster_files.md).

Sites and links per pair. A site is a named set of nodes (a building, a data centre, a rack,
the nodes behind one switch): ``NodeSpec.site``. Nodes of one site talk over ``inter_link``;
nodes of two different sites over the link declared for that pair (``[[links]]``, a
``PairLink``), else over ``inter_site_link`` (``[inter_site]``, the default between sites).
A ``[[links]]`` table naming one site twice replaces ``inter_link`` inside that site (a rack
behind a slower switch). Every pair of sites needs a link: one of its own or the default.
``Cluster.link_between(site_a, site_b)`` answers which; ``cost_model.collectives`` prices a
collective by the links its ranks cross (``cost_model.site_collectives``,
``planner.cluster_links``).

Vocabulary layer: imports only the standard library, ``planner.errors``, ``planner.cluster_specs``,
``planner.cluster_files``, ``planner.cluster_values`` (checks of values and their text),
``planner.outputs`` (atomic writes), ``planner.json_files`` (bounded reading of files) and the
pure-data ``planner.presets`` (pure data, with ``planner.gpu_presets``); never torch.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.cluster_files import built, parse_device, parse_link, parse_pair_links
from planner.cluster_specs import (
    ATTENTION_KERNELS,
    BACKENDS,
    CALIBRATION_KEYS,
    DTYPE_KEYS,
    HEADLINE_DTYPES,
    SHORT_DTYPE,
    DeviceSpec,
    LinkSpec,
    NodeSpec,
    PairLink,
)
from planner.cluster_values import (
    CLUSTER_FILE_HEADER,
    FILE_RANGES,
    MAX_RANKS,
    check_instance,
    check_rank_count,
    checked_name,
    checked_table,
    cluster_file_suffix,
    format_si,
    is_cluster_file_we_wrote,
    merged_table,
    positive_int,
    preset_data,
    preset_names,
    preset_table,
    required_value,
    toml_lines,
)
from planner.errors import ClusterError, one_line
from planner.json_files import MAX_NESTING, check_nesting, parse_json, read_text
from planner.outputs import check_output_file, write_text_atomically
from planner.presets import PRESETS

# The cluster model's names, and those of planner.cluster_specs and planner.cluster_values
# other modules import from here.
__all__ = [
    "ATTENTION_KERNELS", "BACKENDS", "CALIBRATION_KEYS", "CLUSTER_FILE_HEADER", "DTYPE_KEYS", "FILE_RANGES",
    "MAX_RANKS", "Cluster", "ClusterError", "DeviceSpec", "LinkSpec", "NodeSpec", "PairLink", "format_si",
    "is_cluster_file_we_wrote", "preset_names", "preset_table",
]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

_CLI_FORMS = "PRESET, PRESET:NODES, PRESET:NODESxDEVICES (e.g. cpu:1x4) or a .toml/.json file"
_CLI_RE = re.compile(r"([A-Za-z0-9._-]+)(?::(\d+)(?:[xX](\d+))?)?")


@dataclass(frozen=True)
class Cluster:
    """Nodes (possibly different), the per-device inter-node link share, and the backend.

    ``derived_from`` names the preset the cluster was built from: ``Cluster.preset`` sets it,
    a file whose every node group names one preset sets it to that preset, and an edit of
    such a cluster keeps it (``planner.cluster_edits``, ``dataclasses.replace``,
    ``cost_model.calibration.with_calibration``); None for a cluster described from scratch
    (``planner profile``, hand-built). The cost model keeps what was measured on the preset's
    hardware for a derived cluster, scaled for the links it changed
    (``planner.cluster_edits.link_scales``); ``to_dict`` writes it as each node group's
    ``preset`` key, so it survives a file and a plan.
    """

    name: str
    nodes: tuple[NodeSpec, ...]
    inter_link: LinkSpec
    backend: str
    derived_from: str | None = None
    # The link between nodes at different sites (per device, as inter_link): the default for
    # every pair of sites that ``links`` does not name; ignored on one site.
    inter_site_link: LinkSpec | None = None
    # Links per pair of sites where they differ from the defaults (module docstring).
    links: tuple[PairLink, ...] = ()

    def __post_init__(self) -> None:
        checked_name(self.name, "Cluster.name")
        object.__setattr__(self, "nodes", tuple(self.nodes))
        if not self.nodes:
            raise ClusterError("Cluster.nodes is empty; give at least one NodeSpec")
        for index, node in enumerate(self.nodes):
            check_instance(node, NodeSpec, f"Cluster.nodes[{index}]")
        check_instance(self.inter_link, LinkSpec, "Cluster.inter_link")
        object.__setattr__(self, "_sites", tuple(dict.fromkeys(node.site for node in self.nodes)))
        if self.inter_site_link is not None:
            check_instance(self.inter_site_link, LinkSpec, "Cluster.inter_site_link")
        self._check_links()
        if self.backend not in BACKENDS:
            raise ClusterError(f"Cluster.backend must be \"nccl\" (GPUs) or \"gloo\" (CPU), "
                               f"got {self.backend!r}")
        if self.derived_from is not None and self.derived_from not in PRESETS:
            raise ClusterError(f"Cluster.derived_from must be None or a preset "
                               f"({', '.join(preset_names())}), got {self.derived_from!r}")
        # First rank of each node, for node_of's binary search.
        object.__setattr__(self, "_node_starts", tuple(itertools.accumulate(
            (node.devices for node in self.nodes[:-1]), initial=0)))
        # Hashed once: the cost model's caches key on the cluster, and hashing 128 nodes a call adds up.
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, field.name) for field in dataclasses.fields(self))))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def _check_links(self) -> None:
        """Every link names the cluster's sites, once per pair; every pair of sites has a link."""
        object.__setattr__(self, "links", tuple(self.links))
        sites, seen = self.sites, set()
        for index, pair in enumerate(self.links):
            check_instance(pair, PairLink, f"Cluster.links[{index}]")
            unknown = [site for site in pair.sites if site not in sites]
            if unknown:
                raise ClusterError(f"Cluster.links[{index}] names site {unknown[0][:60]!r}, which no node is at; the "
                                   f"sites are {', '.join(repr(site) for site in sites)[:120]}")
            if pair.sites in seen:
                raise ClusterError(f"Cluster.links[{index}] repeats the pair {list(pair.sites)!r}; give each pair of "
                                   f"sites one link")
            seen.add(pair.sites)
        object.__setattr__(self, "_pair_links", {pair.sites: pair.link for pair in self.links})
        if self.inter_site_link is None:
            for first, second in itertools.combinations(sorted(sites), 2):
                if (first, second) not in seen:
                    raise ClusterError(
                        f"Cluster.inter_site_link is missing: sites {first[:60]!r} and {second[:60]!r} have no link "
                        f"between them; add an [inter_site] table (the default between sites) or a [[links]] table "
                        f"with between = [{first[:60]!r}, {second[:60]!r}], bandwidth and latency")

    def link_between(self, site: str, other: str) -> LinkSpec:
        """The link (per device) between a node at ``site`` and a node at ``other``: the pair's
        own link when ``links`` names it, else ``inter_link`` inside one site and
        ``inter_site_link`` between two. ClusterError for a site no node is at."""
        for name in (site, other):
            if name not in self.sites:
                raise ClusterError(f"cluster {self.name!r} has no site {str(name)[:60]!r}; its sites are "
                                   f"{', '.join(repr(s) for s in self.sites)[:120]}")
        declared = self._pair_links.get(tuple(sorted((site, other))))  # type: ignore[attr-defined]
        if declared is not None:
            return declared
        if site == other:
            return self.inter_link
        assert self.inter_site_link is not None  # _check_links: every pair has a link
        return self.inter_site_link

    @property
    def world_size(self) -> int:
        """Total number of devices (ranks)."""
        # From the node starts made at construction: planning asks this once per rank of
        # every group it prices, so summing 128 nodes each time adds up.
        return self._node_starts[-1] + self.nodes[-1].devices  # type: ignore[attr-defined]

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return len(self.nodes)

    @property
    def devices_per_node(self) -> int:
        """Devices in every node; ClusterError when nodes hold different counts."""
        counts = sorted({node.devices for node in self.nodes})
        if len(counts) > 1:
            raise ClusterError(f"cluster {self.name!r} has nodes with {counts} devices; "
                               f"read nodes[i].devices instead of devices_per_node")
        return counts[0]

    @property
    def is_homogeneous(self) -> bool:
        """True when every node is identical (device, device count and intra-node link; the
        site aside, which only the links between nodes see)."""
        first = self.nodes[0]
        return all((node.device, node.devices, node.intra_link) == (first.device, first.devices, first.intra_link)
                   for node in self.nodes)

    @property
    def sites(self) -> tuple[str, ...]:
        """The sites the nodes name, in node order (``("",)``: one unnamed site)."""
        # Made at construction: pricing a collective asks it for every pair of sites it crosses.
        return self._sites  # type: ignore[attr-defined]

    @property
    def min_device_memory(self) -> int:
        """Smallest device memory in the cluster, in bytes."""
        return min(node.device.memory_bytes for node in self.nodes)

    @property
    def min_devices_per_node(self) -> int:
        """Devices of the smallest node: how far tensor parallelism can go inside a node."""
        return min(node.devices for node in self.nodes)

    def node_of(self, rank: int) -> int:
        """Index of the node that holds ``rank`` (ranks are node-major)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ClusterError(f"rank {rank!r} is outside cluster {self.name!r}; "
                               f"ranks are 0..{self.world_size - 1}")
        return bisect.bisect_right(self._node_starts, rank) - 1  # type: ignore[attr-defined]

    def device_of(self, rank: int) -> DeviceSpec:
        """The DeviceSpec of ``rank``."""
        return self.nodes[self.node_of(rank)].device

    def describe(self) -> str:
        """One line for reports, e.g. ``dgx-a100-80g: 2 nodes x 8 A100-SXM4-80GB (...)``."""
        groups = []
        for node, count in _group_nodes(self.nodes):
            dev = node.device
            # Headline training dtype: the fastest of bf16/fp16/fp32, preferring bf16 on ties.
            best = max((k for k in HEADLINE_DTYPES if k in dev.peak_flops), key=dev.peak_flops.get,
                       default=next(iter(dev.peak_flops)))
            nodes = f"{count} node{'s' if count > 1 else ''}"
            groups.append(f"{nodes} x {node.devices} {dev.name} "
                          f"({format_si(dev.memory_bytes, 'B')}, "
                          f"{format_si(dev.peak_flops[best], 'FLOP/s')} {SHORT_DTYPE[best]}, "
                          f"intra-node {format_si(node.intra_link.bandwidth, 'B/s')})")
        inter = (f"; inter-node {format_si(self.inter_link.bandwidth, 'B/s')} per device"
                 if self.num_nodes > 1 else "")
        if len(self.sites) > 1 and self.inter_site_link is not None:
            inter += (f"; {len(self.sites)} sites ({', '.join(self.sites)}), "
                      f"{format_si(self.inter_site_link.bandwidth, 'B/s')} per device between them")
        elif len(self.sites) > 1:
            inter += f"; {len(self.sites)} sites ({', '.join(self.sites)})"
        for pair in self.links:
            inter += f"; {' - '.join(pair.sites)} {format_si(pair.link.bandwidth, 'B/s')} per device"
        return f"{self.name}: {' + '.join(groups)}{inter}; {self.backend}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict in the cluster-file layout; ``from_dict`` rebuilds an equal Cluster."""
        def link(spec: LinkSpec) -> dict[str, float]:
            return {"bandwidth": spec.bandwidth, "latency": spec.latency}
        def device(spec: DeviceSpec) -> dict[str, Any]:
            table = {"name": spec.name, "memory_bytes": spec.memory_bytes,
                     "memory_bandwidth": spec.memory_bandwidth,
                     "peak_flops": dict(spec.peak_flops)}
            if spec.calibration:  # TOML has no null: unmeasured fields are left out
                table["calibration"] = spec.calibration
            if spec.attention_kernel != ATTENTION_KERNELS[0]:
                table["attention_kernel"] = spec.attention_kernel
            return table
        # A derived cluster's groups name its preset: every field is written out too, so the
        # preset only supplies the provenance (and would supply a field a reader left out).
        named = {"preset": self.derived_from} if self.derived_from is not None else {}
        groups = [{"count": count, "devices": node.devices, **named, **({"site": node.site} if node.site else {}),
                   "device": device(node.device), "intra_node": link(node.intra_link)}
                  for node, count in _group_nodes(self.nodes)]
        sites = ({"inter_site": link(self.inter_site_link)}
                 if len(self.sites) > 1 and self.inter_site_link is not None else {})
        pairs = {"links": [{"between": list(pair.sites), **link(pair.link)} for pair in self.links]} if self.links else {}
        return {"name": self.name, "backend": self.backend,
                "inter_node": link(self.inter_link), **sites, **pairs, "nodes": groups}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str | None = None) -> Cluster:
        """Build and validate a Cluster from the file layout.

        Args:
            data: the parsed TOML/JSON table.
            source: prefix for error messages (e.g. ``cluster file x.toml``).
        Returns:
            The Cluster; ClusterError names the offending field on bad data.
        """
        try:
            return _cluster_from_table(data)
        except ClusterError as err:
            raise ClusterError(f"{source}: {err}" if source else str(err)) from None

    @classmethod
    def preset(cls, name: str, nodes: int = 1, devices_per_node: int | None = None) -> Cluster:
        """A built-in cluster (see ``preset_names()``) with optional node/device counts."""
        data = preset_data(name)
        per_node = data["devices_per_node"] if devices_per_node is None else devices_per_node
        node = NodeSpec(parse_device(data["device"], "device"),
                        positive_int(per_node, f"preset {name!r} devices_per_node"),
                        parse_link(data["intra_node"], "intra_node"))
        count = positive_int(nodes, f"preset {name!r} nodes")
        check_rank_count(count * node.devices, f"cluster {name}:{count}x{node.devices}")
        return cls(name=name.lower(), nodes=(node,) * count,
                   inter_link=parse_link(data["inter_node"], "inter_node"),
                   backend=data["backend"], derived_from=name.lower())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Cluster:
        """Read a cluster from a ``.toml`` or ``.json`` file (missing ``name``: the file stem)."""
        path = Path(path)
        source = f"cluster file {path}"
        suffix = cluster_file_suffix(path)
        fix = "fix it, or write one with `planner profile -o FILE`"
        text = read_text(path, source, fix, ClusterError,
                         missing=f"not found; check the path, or use a preset ({', '.join(preset_names())})")
        if suffix == ".json":
            data = parse_json(text, source, fix, ClusterError)
        else:
            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as err:  # its message ends "(at line L, column C)"
                raise ClusterError(f"{source} is not valid TOML: {one_line(err)}; fix the syntax") from None
            except RecursionError:  # tomllib recurses into nested arrays and inline tables
                raise ClusterError(f"{source} is nested deeper than {MAX_NESTING} levels; {fix}") from None
            check_nesting(data, source, fix, ClusterError)
        if isinstance(data, dict):
            data.setdefault("name", path.stem)
        return cls.from_dict(data, source=source)

    @classmethod
    def parse(cls, text: str | os.PathLike[str]) -> Cluster:
        """Parse the CLI form: ``PRESET``, ``PRESET:NODES``, ``PRESET:NODESxDEVICES`` or a path."""
        if not isinstance(text, (str, os.PathLike)):
            raise ClusterError(f"cannot read cluster {text!r}: expected a string or path; use {_CLI_FORMS}")
        text = os.fspath(text).strip()
        if text.lower().endswith((".toml", ".json")):
            return cls.load(text)
        match = _CLI_RE.fullmatch(text)
        if (match is None or match[1].lower() not in PRESETS) and os.path.isfile(text):
            return cls.load(text)  # an existing file with another suffix: say which suffixes
        if match is None or "/" in text or os.sep in text:
            raise ClusterError(f"cannot read cluster {text!r}; use {_CLI_FORMS}")
        name, nodes, devices = match.groups()
        if 0 in [int(count) for count in (nodes, devices) if count is not None]:
            raise ClusterError(f"cluster {text!r} asks for zero nodes or devices; counts must be "
                               f">= 1 in {_CLI_FORMS}")
        return cls.preset(name, nodes=int(nodes or 1),
                          devices_per_node=int(devices) if devices else None)

    def save(self, path: str | os.PathLike[str], *, comment: str | None = None,
             force: bool = False) -> None:
        """Write the cluster as TOML or JSON, chosen by the suffix; ``load`` reads it back equal.

        Both forms start with the ``CLUSTER_FILE_HEADER`` (a TOML comment, JSON's ``comment``
        key), which tells a cluster file soap-planner wrote apart from a user's: only those
        are overwritten unless ``force``. The file is written atomically.

        Args:
            path: a ``.toml`` or ``.json`` file.
            comment: lines written as ``#`` comments under the TOML header (e.g. how a profile
                was measured); JSON has no comments, so a JSON file leaves it out.
            force: overwrite a file that is not a cluster file written by soap-planner.

        Raises:
            ClusterError: the suffix is not .toml/.json. OutputError: the folder is missing
                or not writable, ``path`` is a folder, or it holds a user's file.
        """
        path = Path(path)
        data = self.to_dict()
        if cluster_file_suffix(path) == ".json":
            text = json.dumps({"comment": CLUSTER_FILE_HEADER, **data}, indent=2) + "\n"
        else:
            notes = "".join(f"# {line}".rstrip() + "\n" for line in (comment or "").splitlines())
            text = (f"# {CLUSTER_FILE_HEADER}\n" + notes + "\n".join(toml_lines(data, "")) + "\n")
        path = check_output_file(path, what="cluster file", is_ours=is_cluster_file_we_wrote, force=force)
        try:
            write_text_atomically(path, text)
        except OSError as err:
            raise ClusterError(f"cannot write cluster file {path} ({err}); check the directory "
                               f"exists and is writable") from None


# ---- file layout -> model: checks structure; the dataclasses check values ----


def _cluster_from_table(data: Any) -> Cluster:
    top = checked_table(data, "", ("name", "backend", "inter_node", "inter_site", "links", "nodes", "comment"))
    if not isinstance(top.get("comment", ""), str):
        raise ClusterError(f"comment must be a string, got {top['comment']!r}")
    groups = top.get("nodes")
    if not isinstance(groups, list) or not groups:
        raise ClusterError("nodes must be a non-empty list of [[nodes]] tables; add one with "
                           "devices = N and a preset or a [nodes.device] table")
    nodes: list[NodeSpec] = []
    presets: list[dict[str, Any]] = []
    groups_built: list[tuple[NodeSpec, int]] = []
    ranks = 0
    for index, raw in enumerate(groups):
        where = f"nodes[{index}]"
        group = checked_table(raw, where, ("count", "devices", "preset", "site", "device", "intra_node"))
        preset = preset_data(group["preset"], f"{where}.preset") if "preset" in group else {}
        presets += [preset] if preset else []
        # A preset supplies device, intra_node and devices; the group's own keys override it.
        fields = {"device": merged_table(preset.get("device"), group.get("device"), f"{where}.device"),
                  "devices": group.get("devices", preset.get("devices_per_node")),
                  "intra_node": merged_table(preset.get("intra_node"), group.get("intra_node"),
                                             f"{where}.intra_node")}
        for key, what in (("device", "a [nodes.device] table"), ("devices", "devices = N"),
                          ("intra_node", "a [nodes.intra_node] table")):
            required_value(fields, key, where, f"{what} or a preset key ({', '.join(preset_names())})")
        node = built(NodeSpec, where, device=parse_device(fields["device"], f"{where}.device"),
                      devices=fields["devices"],
                      intra_link=parse_link(fields["intra_node"], f"{where}.intra_node"),
                      site=group.get("site", ""))
        groups_built.append((node, positive_int(group.get("count", 1), f"{where}.count")))
        ranks += groups_built[-1][1] * node.devices
        check_rank_count(ranks, "the cluster")
    for node, count in groups_built:  # only once the counts are known to be sane
        nodes += [node] * count
    # backend and inter_node default to the named presets' values when all of those agree.
    fields = {"name": top.get("name"),
              "backend": top.get("backend", _agreed([p["backend"] for p in presets])),
              "inter_node": merged_table(_agreed([p["inter_node"] for p in presets]),
                                         top.get("inter_node"), "inter_node")}
    for key, what in (("name", "name = \"...\""),
                      ("backend", "backend = \"nccl\" (GPUs) or \"gloo\" (CPU)"),
                      ("inter_node", "an [inter_node] table with bandwidth and latency")):
        required_value(fields, key, "", what)
    sites = set(node.site for node in nodes)
    if "inter_site" in top and len(sites) < 2:
        raise ClusterError("inter_site is given but every node is at one site; give the [[nodes]] groups a "
                           "site = \"...\" each, or drop [inter_site]")
    cluster = built(Cluster, "", name=fields["name"], nodes=tuple(nodes),
                     inter_link=parse_link(fields["inter_node"], "inter_node"),
                     backend=fields["backend"],
                     inter_site_link=parse_link(top["inter_site"], "inter_site") if "inter_site" in top else None,
                     links=parse_pair_links(top["links"]) if "links" in top else ())
    named = {group["preset"].lower() for group in groups if "preset" in group}
    # A preset's measured collectives are of one site's network: not of a cluster spanning
    # sites, nor of one whose links differ from the preset's.
    if len(named) == 1 and len(presets) == len(groups) and len(sites) < 2 and not cluster.links:
        return dataclasses.replace(cluster, derived_from=named.pop())
    if not named and not cluster.links and _is_preset_as_built(cluster):  # a file written before derived_from was
        return dataclasses.replace(cluster, derived_from=cluster.name.lower())
    return cluster


def _is_preset_as_built(cluster: Cluster) -> bool:
    """Whether ``cluster`` is named after a preset and holds exactly its nodes' device and
    links, backend and network (any node count and devices per node): how a preset's cluster
    reads from a plan or file written before ``Cluster.derived_from`` existed."""
    if cluster.name.lower() not in PRESETS:
        return False
    reference = Cluster.preset(cluster.name)
    node = reference.nodes[0]
    return (cluster.backend == reference.backend and cluster.inter_link == reference.inter_link
            and all(n.device == node.device and n.intra_link == node.intra_link for n in cluster.nodes))


def _agreed(values: list[Any]) -> Any:
    """The common value of a non-empty list whose items are all equal, else None."""
    return values[0] if values and all(value == values[0] for value in values) else None


# ---- small formatting helpers ----

def _group_nodes(nodes: tuple[NodeSpec, ...]) -> list[tuple[NodeSpec, int]]:
    """Runs of consecutive identical nodes, as (node, count)."""
    runs: list[tuple[NodeSpec, int]] = []
    for node in nodes:
        if runs and runs[-1][0] == node:
            runs[-1] = (node, runs[-1][1] + 1)
        else:
            runs.append((node, 1))
    return runs


