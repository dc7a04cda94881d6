"""Cluster files (TOML/JSON) read into the parts of a cluster: each table's structure checked here,
its values by the dataclasses of ``planner.cluster_specs``; ``planner.cluster`` joins the parts
into a ``Cluster`` (``Cluster.from_dict``, ``Cluster.load``).

Every error is one ``ClusterError`` line naming the file's path of the field (``nodes[1].device
.memory_bytes``, ``links[0].between``) and what to write instead.

Vocabulary layer: imports only ``planner.cluster_values``, ``planner.cluster_specs`` and
``planner.errors``.
"""

from __future__ import annotations

from typing import Any

from planner.cluster_specs import ATTENTION_KERNELS, CALIBRATION_KEYS, DTYPE_KEYS, DeviceSpec, LinkSpec, PairLink
from planner.cluster_values import (
    check_file_range,
    checked_table,
    efficiency_value,
    overhead_value,
    required_value,
)
from planner.errors import ClusterError

__all__ = ["built", "parse_device", "parse_link", "parse_pair_links"]


def built(kind: type, where: str, **fields: Any) -> Any:
    """``kind(**fields)``, with ``Kind.field`` in its error message renamed to the file path."""
    try:
        return kind(**fields)
    except ClusterError as err:
        raise ClusterError(str(err).replace(f"{kind.__name__}.", where + "." if where else "", 1)
                           ) from None


def parse_link(raw: Any, where: str) -> LinkSpec:
    """A ``[bandwidth, latency]`` table at ``where`` as a LinkSpec, each value in the file's range."""
    table = checked_table(raw, where, ("bandwidth", "latency"))
    link = built(LinkSpec, where, bandwidth=required_value(table, "bandwidth", where, "bytes/s"),
                  latency=required_value(table, "latency", where, "seconds"))
    for key in ("bandwidth", "latency"):
        check_file_range(getattr(link, key), key, f"{where}.{key}")
    return link


def parse_device(raw: Any, where: str) -> DeviceSpec:
    """A ``[nodes.device]`` table at ``where`` as a DeviceSpec (its calibration table flattened)."""
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
    device = built(DeviceSpec, where, name=required_value(table, "name", where, "the device name"),
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



def parse_pair_links(raw: Any) -> tuple[PairLink, ...]:
    """The ``[[links]]`` tables: each ``between = ["site-a", "site-b"]`` with ``bandwidth``
    (bytes/s per direction per device) and ``latency`` (seconds). The sites are checked
    against the nodes' by ``Cluster`` itself."""
    if not isinstance(raw, list) or not raw:
        raise ClusterError("links must be a non-empty list of [[links]] tables, each with between = "
                           "[\"site-a\", \"site-b\"], bandwidth and latency; or drop it")
    found: list[PairLink] = []
    for index, item in enumerate(raw):
        where = f"links[{index}]"
        table = checked_table(item, where, ("between", "bandwidth", "latency"))
        between = required_value(table, "between", where, 'the two sites it joins, between = ["a", "b"]')
        link = parse_link({key: value for key, value in table.items() if key != "between"}, where)
        try:
            pair = built(PairLink, where, sites=between, link=link)
        except ClusterError as err:  # the file calls PairLink.sites "between"
            raise ClusterError(str(err).replace(f"{where}.sites", f"{where}.between", 1)) from None
        if any(earlier.sites == pair.sites for earlier in found):
            raise ClusterError(f"{where}.between repeats the pair {list(pair.sites)!r}; give each pair of sites "
                               f"one [[links]] table")
        found.append(pair)
    return tuple(found)
