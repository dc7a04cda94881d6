"""The cluster model: nodes of devices joined by two classes of links (three across sites).

A ``Cluster`` is a tuple of ``NodeSpec`` (one per node, so nodes may differ), a per-device
share of the inter-node network, and a collective backend. Ranks are node-major: node 0
holds ranks ``0 .. d0-1``, node 1 the next ``d1``, and so on.

Units everywhere: FLOP/s (dense), bytes, bytes/s per direction per device, seconds.

Clusters come from three edges, all validated by the dataclasses' ``__post_init__``:
  * presets (``planner/presets.py``), e.g. ``Cluster.preset("dgx-h100", nodes=2)``;
  * the CLI string ``PRESET``, ``PRESET:NODES``, ``PRESET:NODESxDEVICES`` or a file path;
  * TOML/JSON files with ``name``, ``backend``, ``[inter_node]`` and ``[[nodes]]`` groups
    (``count``, ``devices``, optional ``preset``, ``site``, ``[nodes.device]``,
    ``[nodes.intra_node]``), and ``[inter_site]`` when the groups name two or more sites.

Sites. Nodes at different sites (buildings, data centres) talk over a slower link than the
network inside a site: ``Cluster.inter_site_link``, per device as ``inter_link``. A collective
whose group spans sites is priced over the slowest link it crosses (``cost_model.collectives``).

Calibration. A device may carry measured efficiencies (``python -m planner profile`` writes
them; ``cost_model/profile.py`` defines how each is measured), all optional, each falling back
to the documented default in ``cost_model/defaults.py`` when absent:
  * ``matmul_efficiency``: achieved fraction of ``peak_flops`` for large matmuls, in (0, 1];
  * ``memory_efficiency``: achieved fraction of ``memory_bandwidth`` for streaming ops, in (0, 1];
  * ``kernel_overhead_s``: fixed cost per op (dispatch and launch), seconds, >= 0;
  * ``dtensor_op_overhead_s``: extra cost of each op dispatched on DTensors, seconds, >= 0:
    DTensor's sharding propagation and Python dispatch, which a plain tensor does not pay.
    A program that replays the traced graph (every plan that is not plain data parallel:
    tensor parallel, pipelines, searched layouts) pays it on every traced op, forward and
    backward; optimizer steps on DTensor parameters (FSDP, ZeRO-2, graph programs) on each of
    their ops. Absent: 0. ``planner calibrate`` fits it (``cost_model/calibration.py``).
  * ``redistribute_overhead_s``: extra cost of each collective a graph program issues from
    inside its forward or backward (DTensor's redistribute of an operand, the gradient
    all-reduce of a replicated activation), seconds, >= 0: planning the redistribute, the
    functional collective's wrapper and its wait, which the step pays in line. The
    collectives of data parallelism (DDP buckets, FSDP's gathers) run on their own threads
    or streams and do not pay it. Absent: 0. ``planner calibrate`` fits it.
They are flat fields of ``DeviceSpec``; in files they live in their own table, so measured
numbers stand apart from datasheet ones::

    [nodes.device.calibration]
    matmul_efficiency = 0.93
    memory_efficiency = 0.71
    kernel_overhead_s = 2.2e-06

(``"calibration": {...}`` inside ``"device"`` in JSON; keys left out mean "use the default").
Measured collective α and β need no new field: they are a ``LinkSpec``'s latency and bandwidth.

Attention kernel. ``DeviceSpec.attention_kernel`` names the fused attention kernel the training
software runs on a GPU (``ATTENTION_KERNELS``): ``"flash-attention-2"`` (PyTorch's SDPA flash
backend, the default), ``"flash-attention-triton"`` (the Triton FlashAttention kernel, e.g.
llm-foundry's ``attn_impl: triton``) or ``"cudnn-fused-attention"`` (cuDNN's flash attention,
which Transformer Engine's ``DotProductAttention`` picks on Hopper); ``cost_model.gpu_kernels``
prices each. Files write it as
``attention_kernel = "..."`` in ``[nodes.device]`` (left out: the default).

Vocabulary layer: imports only the standard library, ``planner.errors``, ``planner.cluster_values``
(checks of values and their text), ``planner.outputs``
(atomic writes), ``planner.json_files`` (bounded reading of files) and the pure-data
``planner.presets`` (pure data, with ``planner.gpu_presets``); never torch.
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

from planner.cluster_values import (
    CLUSTER_FILE_HEADER,
    FILE_RANGES,
    MAX_RANKS,
    FlopsTable,
    check_file_range,
    check_instance,
    check_rank_count,
    checked_name,
    checked_table,
    cluster_file_suffix,
    efficiency_value,
    format_si,
    is_cluster_file_we_wrote,
    merged_table,
    overhead_value,
    positive_float,
    positive_int,
    preset_data,
    preset_names,
    preset_table,
    required_value,
    toml_lines,
    unknown_key,
)
from planner.errors import ClusterError, one_line
from planner.json_files import MAX_NESTING, check_nesting, parse_json, read_text
from planner.outputs import check_output_file, write_text_atomically
from planner.presets import PRESETS

# The cluster model's names, and those of planner.cluster_values other modules import from here.
__all__ = [
    "ATTENTION_KERNELS", "BACKENDS", "CALIBRATION_KEYS", "CLUSTER_FILE_HEADER", "DTYPE_KEYS", "FILE_RANGES",
    "MAX_RANKS", "Cluster", "ClusterError", "DeviceSpec", "LinkSpec", "NodeSpec", "format_si",
    "is_cluster_file_we_wrote", "preset_names", "preset_table",
]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

DTYPE_KEYS = ("float32", "tf32", "bfloat16", "float16", "float8")
BACKENDS = ("nccl", "gloo")
_DTYPE_ALIASES = {
    "float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16",
    "fp16": "float16", "fp8": "float8", "float8_e4m3fn": "float8", "float8_e5m2": "float8",
    "float8_e4m3fnuz": "float8", "float8_e5m2fnuz": "float8",
}
_SHORT_DTYPE = {"float32": "fp32", "tf32": "tf32", "bfloat16": "bf16", "float16": "fp16",
                "float8": "fp8"}
_HEADLINE = ("bfloat16", "float16", "float32")  # in order of preference on ties
CALIBRATION_KEYS = ("matmul_efficiency", "memory_efficiency", "kernel_overhead_s", "dtensor_op_overhead_s",
                    "redistribute_overhead_s")
# Fused attention kernels a device's software may run (see the module docstring); first: default.
ATTENTION_KERNELS = ("flash-attention-2", "flash-attention-triton", "cudnn-fused-attention")
_CLI_FORMS = "PRESET, PRESET:NODES, PRESET:NODESxDEVICES (e.g. cpu:1x4) or a .toml/.json file"
_CLI_RE = re.compile(r"([A-Za-z0-9._-]+)(?::(\d+)(?:[xX](\d+))?)?")


# ---- the model ----

@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU worker process): peak dense FLOP/s per dtype, memory, bandwidth.

    The calibration fields are None unless measured (see the module docstring); the cost
    model then uses ``cost_model.defaults``.
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bytes: int
    memory_bandwidth: float
    matmul_efficiency: float | None = None  # fraction of peak_flops, large matmuls
    memory_efficiency: float | None = None  # fraction of memory_bandwidth, streaming ops
    kernel_overhead_s: float | None = None  # seconds per op, dispatch + launch
    dtensor_op_overhead_s: float | None = None  # seconds more per op on DTensors (dispatch)
    redistribute_overhead_s: float | None = None  # seconds more per in-step collective of a graph program
    attention_kernel: str = ATTENTION_KERNELS[0]  # fused attention kernel (ATTENTION_KERNELS)

    def __post_init__(self) -> None:
        checked_name(self.name, "DeviceSpec.name")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ClusterError(f"DeviceSpec.attention_kernel must be one of {', '.join(ATTENTION_KERNELS)}, "
                               f"got {self.attention_kernel!r}")
        check_instance(self.peak_flops, Mapping, "DeviceSpec.peak_flops")
        if not self.peak_flops:
            raise ClusterError("DeviceSpec.peak_flops is empty; add at least float32 = <FLOP/s>")
        for key in self.peak_flops:
            if key not in DTYPE_KEYS:
                raise unknown_key(key, DTYPE_KEYS, "DeviceSpec.peak_flops")
        flops = {key: positive_float(self.peak_flops[key], f"DeviceSpec.peak_flops.{key}")
                 for key in DTYPE_KEYS if key in self.peak_flops}  # canonical order
        object.__setattr__(self, "peak_flops", FlopsTable(flops))
        positive_int(self.memory_bytes, "DeviceSpec.memory_bytes")
        object.__setattr__(self, "memory_bandwidth",
                           positive_float(self.memory_bandwidth, "DeviceSpec.memory_bandwidth"))
        for key in ("matmul_efficiency", "memory_efficiency"):
            object.__setattr__(self, key, efficiency_value(getattr(self, key), f"DeviceSpec.{key}"))
        for key in ("kernel_overhead_s", "dtensor_op_overhead_s", "redistribute_overhead_s"):
            object.__setattr__(self, key, overhead_value(getattr(self, key), f"DeviceSpec.{key}"))

    @property
    def calibration(self) -> dict[str, float]:
        """The measured calibration fields that are set, in file order (empty: none measured)."""
        values = {key: getattr(self, key) for key in CALIBRATION_KEYS}
        return {key: value for key, value in values.items() if value is not None}

    def flops_for(self, dtype: Any) -> float:
        """Peak dense FLOP/s for a dtype.

        Args:
            dtype: a torch-style name ("float32", "bfloat16", "torch.float16", "bf16", ...) or a
                torch.dtype; names without an entry (e.g. bf16 on a V100, or int64) fall back to
                float32.
        Returns:
            FLOP/s. Raises ClusterError when neither the dtype nor float32 has an entry.
        """
        key = str(dtype).removeprefix("torch.").lower()
        key = _DTYPE_ALIASES.get(key, key)
        for candidate in (key, "float32"):
            if candidate in self.peak_flops:
                return self.peak_flops[candidate]
        raise ClusterError(f"device {self.name!r} has no peak_flops for {key!r} nor float32; "
                           f"add float32 = <FLOP/s> to its peak_flops")


@dataclass(frozen=True)
class LinkSpec:
    """A link class: bandwidth in bytes/s per direction per device, latency in seconds."""

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth", positive_float(self.bandwidth, "LinkSpec.bandwidth"))
        object.__setattr__(self, "latency", positive_float(self.latency, "LinkSpec.latency"))


@dataclass(frozen=True)
class NodeSpec:
    """One node: ``devices`` identical devices joined by ``intra_link``, at ``site`` (a
    building or data centre; empty: the cluster's one site)."""

    device: DeviceSpec
    devices: int
    intra_link: LinkSpec
    site: str = ""

    def __post_init__(self) -> None:
        check_instance(self.device, DeviceSpec, "NodeSpec.device")
        positive_int(self.devices, "NodeSpec.devices")
        check_instance(self.intra_link, LinkSpec, "NodeSpec.intra_link")
        if not isinstance(self.site, str) or len(self.site) > 60 or not self.site.isprintable():
            raise ClusterError(f"NodeSpec.site must be a printable name of at most 60 characters (or empty), "
                               f"got {str(self.site)[:40]!r}")


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
    # The link between nodes at different sites (per device, as inter_link); needed when the
    # nodes name two or more sites, ignored otherwise.
    inter_site_link: LinkSpec | None = None

    def __post_init__(self) -> None:
        checked_name(self.name, "Cluster.name")
        object.__setattr__(self, "nodes", tuple(self.nodes))
        if not self.nodes:
            raise ClusterError("Cluster.nodes is empty; give at least one NodeSpec")
        for index, node in enumerate(self.nodes):
            check_instance(node, NodeSpec, f"Cluster.nodes[{index}]")
        check_instance(self.inter_link, LinkSpec, "Cluster.inter_link")
        if self.inter_site_link is not None:
            check_instance(self.inter_site_link, LinkSpec, "Cluster.inter_site_link")
        elif len(self.sites) > 1:
            raise ClusterError(f"Cluster.inter_site_link is missing: the nodes are at sites "
                               f"{', '.join(repr(site) for site in self.sites)[:120]}; add an [inter_site] table "
                               f"with the bandwidth and latency between them")
        if self.backend not in BACKENDS:
            raise ClusterError(f"Cluster.backend must be \"nccl\" (GPUs) or \"gloo\" (CPU), "
                               f"got {self.backend!r}")
        if self.derived_from is not None and self.derived_from not in PRESETS:
            raise ClusterError(f"Cluster.derived_from must be None or a preset "
                               f"({', '.join(preset_names())}), got {self.derived_from!r}")
        # First rank of each node, for node_of's binary search.
        object.__setattr__(self, "_node_starts", tuple(itertools.accumulate(
            (node.devices for node in self.nodes[:-1]), initial=0)))

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
        return tuple(dict.fromkeys(node.site for node in self.nodes))

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
            best = max((k for k in _HEADLINE if k in dev.peak_flops), key=dev.peak_flops.get,
                       default=next(iter(dev.peak_flops)))
            nodes = f"{count} node{'s' if count > 1 else ''}"
            groups.append(f"{nodes} x {node.devices} {dev.name} "
                          f"({format_si(dev.memory_bytes, 'B')}, "
                          f"{format_si(dev.peak_flops[best], 'FLOP/s')} {_SHORT_DTYPE[best]}, "
                          f"intra-node {format_si(node.intra_link.bandwidth, 'B/s')})")
        inter = (f"; inter-node {format_si(self.inter_link.bandwidth, 'B/s')} per device"
                 if self.num_nodes > 1 else "")
        if len(self.sites) > 1:
            inter += (f"; {len(self.sites)} sites ({', '.join(self.sites)}), "
                      f"{format_si(self.inter_site_link.bandwidth, 'B/s')} per device between them")
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
        sites = {"inter_site": link(self.inter_site_link)} if len(self.sites) > 1 else {}
        return {"name": self.name, "backend": self.backend,
                "inter_node": link(self.inter_link), **sites, "nodes": groups}

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
        node = NodeSpec(_parse_device(data["device"], "device"),
                        positive_int(per_node, f"preset {name!r} devices_per_node"),
                        _parse_link(data["intra_node"], "intra_node"))
        count = positive_int(nodes, f"preset {name!r} nodes")
        check_rank_count(count * node.devices, f"cluster {name}:{count}x{node.devices}")
        return cls(name=name.lower(), nodes=(node,) * count,
                   inter_link=_parse_link(data["inter_node"], "inter_node"),
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

def _build(kind: type, where: str, **fields: Any) -> Any:
    """``kind(**fields)``, with ``Kind.field`` in its error message renamed to the file path."""
    try:
        return kind(**fields)
    except ClusterError as err:
        raise ClusterError(str(err).replace(f"{kind.__name__}.", where + "." if where else "", 1)
                           ) from None


def _parse_link(raw: Any, where: str) -> LinkSpec:
    table = checked_table(raw, where, ("bandwidth", "latency"))
    link = _build(LinkSpec, where, bandwidth=required_value(table, "bandwidth", where, "bytes/s"),
                  latency=required_value(table, "latency", where, "seconds"))
    for key in ("bandwidth", "latency"):
        check_file_range(getattr(link, key), key, f"{where}.{key}")
    return link


def _parse_device(raw: Any, where: str) -> DeviceSpec:
    table = checked_table(raw, where, ("name", "peak_flops", "memory_bytes", "memory_bandwidth",
                                "calibration", "attention_kernel"))
    memory = required_value(table, "memory_bytes", where, "bytes")
    if isinstance(memory, float) and memory.is_integer():
        memory = int(memory)  # files may write 80e9, a TOML float, for a byte count
    flops = checked_table(required_value(table, "peak_flops", where, "a [nodes.device.peak_flops] table"),
                   f"{where}.peak_flops", DTYPE_KEYS)
    calibration = checked_table(table.get("calibration", {}), f"{where}.calibration", CALIBRATION_KEYS)
    # Checked here too, so that an error names the file's path (….calibration.key).
    for key, check in zip(CALIBRATION_KEYS, (efficiency_value, efficiency_value, overhead_value, overhead_value, overhead_value)):
        check(calibration.get(key), f"{where}.calibration.{key}")
    device = _build(DeviceSpec, where, name=required_value(table, "name", where, "the device name"),
                    peak_flops=flops, memory_bytes=memory,
                    memory_bandwidth=required_value(table, "memory_bandwidth", where, "bytes/s"),
                    attention_kernel=table.get("attention_kernel", ATTENTION_KERNELS[0]),
                    **{key: calibration.get(key) for key in CALIBRATION_KEYS})
    for dtype, value in device.peak_flops.items():
        check_file_range(value, "peak_flops", f"{where}.peak_flops.{dtype}")
    for key in ("memory_bytes", "memory_bandwidth"):
        check_file_range(getattr(device, key), key, f"{where}.{key}")
    for key in ("kernel_overhead_s", "dtensor_op_overhead_s", "redistribute_overhead_s"):
        check_file_range(getattr(device, key), key, f"{where}.calibration.{key}")
    return device


def _cluster_from_table(data: Any) -> Cluster:
    top = checked_table(data, "", ("name", "backend", "inter_node", "inter_site", "nodes", "comment"))
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
        node = _build(NodeSpec, where, device=_parse_device(fields["device"], f"{where}.device"),
                      devices=fields["devices"],
                      intra_link=_parse_link(fields["intra_node"], f"{where}.intra_node"),
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
    cluster = _build(Cluster, "", name=fields["name"], nodes=tuple(nodes),
                     inter_link=_parse_link(fields["inter_node"], "inter_node"),
                     backend=fields["backend"],
                     inter_site_link=_parse_link(top["inter_site"], "inter_site") if "inter_site" in top else None)
    named = {group["preset"].lower() for group in groups if "preset" in group}
    # A preset's measured collectives are of one site's network: not of a cluster spanning sites.
    if len(named) == 1 and len(presets) == len(groups) and len(sites) < 2:  # every group names the same preset
        return dataclasses.replace(cluster, derived_from=named.pop())
    if not named and _is_preset_as_built(cluster):  # a file written before derived_from was
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


