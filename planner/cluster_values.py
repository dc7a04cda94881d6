"""The values a cluster is made of, checked, and their text: the helpers ``planner.cluster``
validates its dataclasses and cluster files with (positive numbers, calibration fractions and
times, the ranges a file may give, names, unknown keys, tables), the read-only FLOP/s table a
``DeviceSpec`` holds, and the TOML and SI text a cluster file and a report are written in.

Split out of ``planner.cluster`` so that the cluster model stays one idea; ``planner.cluster``
re-exports ``FILE_RANGES``, ``MAX_RANKS`` and ``format_si``.

Also the names of the presets and the test for a cluster file soap-planner wrote.

Vocabulary layer: imports only the standard library, ``planner.errors``, ``planner.json_files``
and the pure-data ``planner.presets``.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from planner.errors import ClusterError, one_line
from planner.json_files import finite_number, peek_json
from planner.presets import PRESETS

# Ranges a number in a cluster file must lie in (inclusive): wide enough for any device, link
# or calibration measured or yet to come, narrow enough that every time and byte count the cost
# model and the search derive from them stays a finite number (1e-300 B/s would make a
# collective last 1e300 s, beyond the search's integer costs). Code may build a DeviceSpec or
# LinkSpec outside them (idealised test clusters); files may not.
FILE_RANGES: dict[str, tuple[float, float, str]] = {  # key: (lowest, highest, the range in words)
    "peak_flops": (1e6, 1e18, "1e6..1e18 FLOP/s"),
    "memory_bytes": (2**20, 2**50, "1 MiB..1 PiB (2**20..2**50 bytes)"),
    "memory_bandwidth": (1e6, 1e16, "1e6..1e16 bytes/s"),
    "bandwidth": (1e6, 1e16, "1e6..1e16 bytes/s"),
    "latency": (1e-12, 10.0, "1e-12..10 s"),
    "kernel_overhead_s": (0.0, 10.0, "0..10 s"),
    "dtensor_op_overhead_s": (0.0, 10.0, "0..10 s"),
    "redistribute_overhead_s": (0.0, 10.0, "0..10 s"),
}


# Most devices (ranks) a cluster may have: the largest training clusters hold ~10^5 devices;
# a cluster file or CLI string asking for more is refused before its nodes are built.
MAX_RANKS = 2**20


def positive_float(value: Any, where: str) -> float:
    number = finite_number(value)
    if number is None or number <= 0:
        raise ClusterError(f"{where} must be a positive finite number, got {shown_value(value)}")
    return number


def positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ClusterError(f"{where} must be a positive integer, got {shown_value(value)}")
    return value


def shown_value(value: Any) -> str:
    """A value from a file for a message: numbers in short form (``1e+300``, not 300 digits),
    anything else by ``repr``, cut to 40 characters."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**16:
        return f"{value:.3e}" if finite_number(value) is not None else f"an integer of {len(str(abs(value)))} digits"
    return one_line(repr(value))[:40]  # a float's repr is short: 8.0, 1e+300, inf


def efficiency_value(value: Any, where: str) -> float | None:
    """A calibration fraction: None (use the default) or a number in (0, 1]."""
    if value is None:
        return None
    number = finite_number(value)
    if number is None or not 0 < number <= 1:
        raise ClusterError(f"{where} must be a fraction in (0, 1], got {shown_value(value)}")
    return number


def overhead_value(value: Any, where: str) -> float | None:
    """A calibration time: None (use the default) or a finite number of seconds >= 0."""
    if value is None:
        return None
    number = finite_number(value)
    if number is None or number < 0:
        raise ClusterError(f"{where} must be a finite number of seconds >= 0, got {shown_value(value)}")
    return number


def check_file_range(value: Any, key: str, where: str) -> None:
    """Refuse a number of a cluster file outside ``FILE_RANGES[key]`` (its type and sign are
    checked by the dataclasses, which name the problem first)."""
    low, high, words = FILE_RANGES[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and not low <= value <= high:
        raise ClusterError(f"{where} is {shown_value(value)}, outside the {words} soap-planner accepts from a file; "
                           f"check the number and its unit")


def check_rank_count(ranks: int, where: str) -> None:
    """Refuse a cluster of more than ``MAX_RANKS`` devices, before any node is built."""
    if ranks > MAX_RANKS:
        count = f"{ranks:,}" if ranks < 10**16 else shown_value(ranks)
        raise ClusterError(f"{where} has {count} devices, more than the {MAX_RANKS:,} soap-planner plans for; "
                           f"check the node and device counts")


def checked_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip() or not value.isprintable():
        raise ClusterError(f"{where} must be a non-empty printable string, got {value!r}")
    return value


def check_instance(value: Any, kind: type, where: str) -> None:
    if not isinstance(value, kind):
        raise ClusterError(f"{where} must be a {kind.__name__}, got {type(value).__name__}")


def unknown_key(key: Any, allowed: tuple[str, ...], where: str) -> ClusterError:
    close = difflib.get_close_matches(str(key), allowed, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"expected one of {', '.join(allowed)}"
    return ClusterError(f"unknown key {where + '.' if where else ''}{key}; {hint}")


class FlopsTable(Mapping):
    """Read-only, hashable dtype -> FLOP/s table, so a DeviceSpec can key a cache."""

    def __init__(self, items: Mapping[str, float]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> float:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


def checked_table(value: Any, where: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ClusterError(f"{where or 'cluster'} must be a table, got {value!r}")
    for key in value:
        if key not in allowed:
            raise unknown_key(key, allowed, where)
    return value


def required_value(table: Mapping[str, Any], key: str, where: str, what: str) -> Any:
    if table.get(key) is None:
        raise ClusterError(f"{where + '.' if where else ''}{key} is missing; add {what}")
    return table[key]


def merged_table(base: Mapping[str, Any] | None, override: Any, where: str) -> Any:
    """A preset's table with the user's keys laid over it (peak_flops merged per dtype)."""
    if override is None or base is None:
        return override if override is not None else base
    if not isinstance(override, Mapping):
        raise ClusterError(f"{where} must be a table, got {override!r}")
    merged = dict(base)
    for key, value in override.items():
        both = isinstance(value, Mapping) and isinstance(merged.get(key), Mapping)
        merged[key] = {**merged[key], **value} if both else value
    return merged


def format_si(value: float, unit: str) -> str:
    """``312e12, 'FLOP/s'`` -> ``'312 TFLOP/s'`` (decimal prefixes, 3 significant digits)."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, "")):
        if value >= scale:
            break
    scaled = value / scale
    return f"{scaled:.0f} {prefix}{unit}" if scaled >= 100 else f"{scaled:.3g} {prefix}{unit}"


def cluster_file_suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ClusterError(f"cluster file {path} must end in .toml or .json, got {suffix!r}")
    return suffix


def toml_value(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # printable names: JSON escapes are TOML
    if isinstance(value, float):
        text = repr(value)
        if "e" not in text and abs(value) >= 1e6:  # 2.039e+12 reads better than 2039000000000.0
            text = next(t for p in range(17) if float(t := f"{value:.{p}e}") == value)
        return text
    if isinstance(value, list):  # an array of scalars, e.g. a [[links]] table's between
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return str(value)


def _is_table_array(value: Any) -> bool:
    """Whether ``value`` is written as an array of tables (``[[nodes]]``), not an inline array."""
    return isinstance(value, list) and bool(value) and all(isinstance(item, dict) for item in value)


def toml_lines(table: Mapping[str, Any], prefix: str) -> list[str]:
    """TOML for our layout: scalars (and arrays of scalars), then sub-tables, then arrays of tables."""
    lines = [f"{key} = {toml_value(value)}" for key, value in table.items()
             if not isinstance(value, dict) and not _is_table_array(value)]
    for key, value in table.items():
        if isinstance(value, dict):
            lines += ["", f"[{prefix}{key}]", *toml_lines(value, f"{prefix}{key}.")]
        elif _is_table_array(value):
            for item in value:
                lines += ["", f"[[{prefix}{key}]]", *toml_lines(item, f"{prefix}{key}.")]
    return lines


# First line of every cluster file soap-planner writes (planner profile, Cluster.save).
CLUSTER_FILE_HEADER = ("soap-planner cluster file. Units: FLOP/s, bytes, bytes/s per direction "
                       "per device, seconds.")


def is_cluster_file_we_wrote(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a cluster file written by ``Cluster.save`` (``planner profile``):
    it starts with ``CLUSTER_FILE_HEADER``."""
    try:
        with open(path, encoding="utf-8") as stream:
            if stream.read(len(CLUSTER_FILE_HEADER) + 2) == f"# {CLUSTER_FILE_HEADER}":
                return True
    except (OSError, UnicodeDecodeError):
        return False
    data = peek_json(path)
    return isinstance(data, dict) and data.get("comment") == CLUSTER_FILE_HEADER


def preset_names() -> list[str]:
    """Names of the built-in presets, in the order ``planner presets`` shows them."""
    return list(PRESETS)


def preset_table() -> list[tuple[str, str]]:
    """(name, one-line description) per preset, for the ``planner presets`` command."""
    return [(name, f"{data['description']} [default 1x{data['devices_per_node']}, "
                   f"{data['backend']}]") for name, data in PRESETS.items()]


def preset_data(name: Any, where: str = "") -> dict[str, Any]:
    key = name.lower() if isinstance(name, str) else None
    if key not in PRESETS:
        raise ClusterError(f"{where + ': ' if where else ''}unknown cluster preset {name!r}; "
                           f"choose one of {', '.join(preset_names())}")
    return PRESETS[key]
