"""Routing statistics of a Mixture-of-Experts model: which share of the tokens each expert
of each MoE layer receives.

Expert placement is only as good as what it knows about the routing, and routing is data
dependent: the planner cannot see it on meta tensors. It takes it from one of three places:
recorded by a compiled program while it trains, written by the user from their own training
logs, or synthetic for what-if studies (``uniform``, ``zipf:ALPHA``).

The JSON schema (``ROUTING_FORMAT``, version ``ROUTING_VERSION``)::

    {
      "format": "soap-planner-routing",
      "version": 1,
      "source": "recorded by launch.py over 100 steps",     # free text, shown in reports
      "layers": {
        "blocks.0.moe": {
          "experts": 8,
          "top_k": 2,
          "token_share": [0.20, 0.05, ...],                 # one per expert, >= 0, sums to 1
          "coselection": [[0, 120], [120, 0], ...]          # optional: experts x experts counts
        },
        ...
      }
    }

``token_share[e]`` is the fraction of the layer's routed token copies (tokens x top-k) that
went to expert ``e``; ``coselection[a][b]`` how often experts ``a`` and ``b`` were chosen for
the same token (symmetric, zero diagonal). A layer missing from the file is routed
uniformly. Everything in the file is untrusted input: every field is checked, and a bad one
is named in a one-line ``RoutingError``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import PlannerError, one_line
from planner.json_files import finite_number, peek_json, read_json
from planner.outputs import write_text_atomically

ROUTING_FORMAT = "soap-planner-routing"
ROUTING_VERSION = 1
SHARE_TOLERANCE = 1e-6  # how far from 1 the shares of a layer may sum (rounding in files)
_LAYER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


class RoutingError(PlannerError):
    """Routing statistics (a file or a ``--routing`` option) are invalid."""


@dataclass(frozen=True)
class LayerRouting:
    """One MoE layer's routing: each expert's share of the routed token copies, and
    optionally how often each pair of experts is chosen together."""

    token_share: tuple[float, ...]
    top_k: int = 1
    coselection: tuple[tuple[float, ...], ...] = ()

    @property
    def experts(self) -> int:
        return len(self.token_share)

    def imbalance(self) -> float:
        """The busiest expert's share over the mean share (1 when uniform)."""
        return max(self.token_share) * self.experts


@dataclass(frozen=True)
class RoutingStats:
    """Routing statistics per MoE layer (by module path), and where they came from."""

    layers: Mapping[str, LayerRouting] = field(default_factory=dict)
    source: str = "uniform (no statistics given)"

    def layer(self, name: str, experts: int, top_k: int) -> LayerRouting:
        """The statistics of layer ``name``, uniform when there are none for it.

        Raises:
            RoutingError: the statistics give the layer another number of experts.
        """
        found = self.layers.get(name)
        if found is None:
            return uniform_layer(experts, top_k)
        if found.experts != experts:
            raise RoutingError(
                f"routing statistics give layer {name!r} {found.experts} experts but the model has {experts}; "
                f"record them again for this model, or drop the layer from the file"
            )
        return found

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (see the module docstring)."""
        return {
            "format": ROUTING_FORMAT,
            "version": ROUTING_VERSION,
            "source": self.source,
            "layers": {
                name: {
                    "experts": layer.experts,
                    "top_k": layer.top_k,
                    "token_share": list(layer.token_share),
                    **({"coselection": [list(row) for row in layer.coselection]} if layer.coselection else {}),
                }
                for name, layer in self.layers.items()
            },
        }

    def save(self, path: str | Path) -> None:
        """Write the JSON form to ``path`` through a temporary file renamed into place (the
        caller checked ``path`` first: ``planner.outputs.check_output_file``, ``is_routing_file``)."""
        write_text_atomically(Path(path), json.dumps(self.to_dict(), indent=1) + "\n")


def is_routing_file(path: str | Path) -> bool:
    """Whether ``path`` holds routing statistics in soap-planner's format (of any version):
    the files ``launch.py --record-routing`` may replace without ``--force``."""
    data = peek_json(path)
    return isinstance(data, dict) and data.get("format") == ROUTING_FORMAT


def uniform_layer(experts: int, top_k: int = 1) -> LayerRouting:
    """Every expert receives the same share."""
    _check_counts(experts, top_k, "uniform routing")
    return LayerRouting(tuple(1.0 / experts for _ in range(experts)), top_k)


def _zipf_weight(expert: int, alpha: float) -> float:
    """1 / (expert + 1) ** alpha, and 0 where the power overflows (an exponent such as 1e45).
    The expression stays the one placements were tuned on: an equal value computed another way
    (exp(-alpha log(e + 1))) differs in the last bit, which can flip a near tie in expert
    placement (tests/test_expert_placement.py)."""
    try:
        return 1.0 / (expert + 1) ** alpha
    except OverflowError:
        return 0.0


def zipf_layer(experts: int, alpha: float, top_k: int = 1) -> LayerRouting:
    """Expert ``e`` (0-based) receives a share proportional to ``1 / (e + 1) ** alpha``: a few
    hot experts and a long tail, as routers settle into without a strong balancing loss."""
    _check_counts(experts, top_k, f"zipf:{alpha} routing")
    if not math.isfinite(alpha) or alpha < 0:
        raise RoutingError(f"zipf routing needs a finite exponent >= 0, got {alpha}; e.g. --routing zipf:1.2")
    weights = [_zipf_weight(expert, alpha) for expert in range(experts)]
    total = sum(weights)
    return LayerRouting(tuple(w / total for w in weights), top_k)


def synthetic(kind: str, layers: Mapping[str, tuple[int, int]]) -> RoutingStats:
    """Statistics for what-if studies: ``uniform`` or ``zipf:ALPHA`` on every layer of
    ``layers`` (module path -> (experts, top_k)).

    Raises:
        RoutingError: ``kind`` is neither.
    """
    text = str(kind).strip()
    if text == "uniform":
        built = {name: uniform_layer(e, k) for name, (e, k) in layers.items()}
        return RoutingStats(built, "uniform (synthetic)")
    match = re.fullmatch(r"zipf:([0-9]*\.?[0-9]+)", text)
    if match:
        alpha = float(match[1])
        if not math.isfinite(alpha):  # checked here too: a --routing option is checked before the layers are known
            raise RoutingError(f"zipf routing needs a finite exponent >= 0, got {match[1][:20]}...; e.g. --routing zipf:1.2")
        built = {name: zipf_layer(e, alpha, k) for name, (e, k) in layers.items()}
        return RoutingStats(built, f"zipf with exponent {alpha} (synthetic)")
    raise RoutingError(
        f"unknown synthetic routing {one_line(text)!r}; use 'uniform' or 'zipf:ALPHA' (e.g. zipf:1.2), "
        f"or give a routing statistics file"
    )


def load_routing(path: str | Path) -> RoutingStats:
    """Read and check a routing statistics file (schema in the module docstring).

    Raises:
        RoutingError: the file is missing, not JSON, or a field is invalid (named).
    """
    path = Path(path)
    data = read_json(
        path, f"routing statistics file '{path}'",
        "record the statistics again with launch.py --record-routing, or write them by the schema in planner/routing.py",
        RoutingError,
    )
    return routing_from_dict(data, str(path))


def routing_from_dict(data: Any, where: str = "routing statistics") -> RoutingStats:
    """Check and build statistics from their JSON form (see ``load_routing``)."""
    if not isinstance(data, dict):
        raise RoutingError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != ROUTING_FORMAT:
        raise RoutingError(f"{where}: field 'format' must be {ROUTING_FORMAT!r}; this is not a routing statistics file")
    if data.get("version") != ROUTING_VERSION:
        raise RoutingError(
            f"{where}: field 'version' is {one_line(data.get('version'))[:20]} but this soap-planner reads version "
            f"{ROUTING_VERSION}; record the statistics again"
        )
    source = data.get("source", "")
    if not isinstance(source, str):
        raise RoutingError(f"{where}: field 'source' must be a string")
    layers = data.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise RoutingError(f"{where}: field 'layers' must be an object with one entry per MoE layer")
    built = {}
    for name, layer in layers.items():
        if not isinstance(name, str) or not _LAYER_NAME.fullmatch(name):
            raise RoutingError(f"{where}: layer name {one_line(name)[:80]!r} is not a module path (e.g. 'blocks.0.moe')")
        built[name] = _layer_from_dict(layer, f"{where}: layer {name!r}")
    return RoutingStats(built, one_line(source)[:200] or f"read from {where}")


def _layer_from_dict(layer: Any, where: str) -> LayerRouting:
    if not isinstance(layer, dict):
        raise RoutingError(f"{where}: expected an object with 'experts', 'top_k' and 'token_share'")
    experts, top_k = layer.get("experts"), layer.get("top_k", 1)
    for key, value in (("experts", experts), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RoutingError(f"{where}: field {key!r} must be a positive integer, got {one_line(value)[:40]!r}")
    _check_counts(experts, top_k, where)
    shares = _numbers(layer.get("token_share"), experts, f"{where}: field 'token_share'")
    if any(share < 0 for share in shares):
        raise RoutingError(f"{where}: field 'token_share' has a negative share; shares are fractions of the tokens")
    if abs(sum(shares) - 1.0) > SHARE_TOLERANCE:
        raise RoutingError(f"{where}: field 'token_share' sums to {sum(shares):.6g}, not 1; normalise the counts")
    coselection: tuple[tuple[float, ...], ...] = ()
    if "coselection" in layer:
        rows = layer["coselection"]
        if not isinstance(rows, list) or len(rows) != experts:
            raise RoutingError(f"{where}: field 'coselection' must be a list of {experts} rows (experts x experts)")
        coselection = tuple(_numbers(row, experts, f"{where}: field 'coselection[{i}]'") for i, row in enumerate(rows))
        for a in range(experts):
            if coselection[a][a] != 0 or any(coselection[a][b] != coselection[b][a] or coselection[a][b] < 0 for b in range(experts)):
                raise RoutingError(f"{where}: field 'coselection' must be symmetric, >= 0, with a zero diagonal")
    return LayerRouting(shares, top_k, coselection)


def _numbers(values: Any, count: int, where: str) -> tuple[float, ...]:
    if not isinstance(values, list) or len(values) != count:
        raise RoutingError(f"{where} must be a list of {count} numbers")
    if any(finite_number(v) is None for v in values):
        raise RoutingError(f"{where} must hold finite numbers only")
    return tuple(float(v) for v in values)


def _check_counts(experts: int, top_k: int, where: str) -> None:
    if experts < 1 or not 1 <= top_k <= experts:
        raise RoutingError(f"{where}: needs at least one expert and 1 <= top_k <= experts, got {experts} and {top_k}")


def layer_loads(shares: Sequence[float], tokens: float, top_k: int) -> list[float]:
    """Token copies each expert receives when ``tokens`` tokens are routed to ``top_k``
    experts each with these shares."""
    return [share * tokens * top_k for share in shares]


def read_routing_option(value: Any) -> "RoutingStats | str | None":
    """Check a ``routing`` argument (``--routing``) before any tracing: None (uniform), a
    synthetic kind (``uniform``, ``zipf:ALPHA``; returned as text, applied once the layers
    are known), ``RoutingStats``, or the path of a statistics file (read and checked now).

    Raises:
        RoutingError: anything else, a bad synthetic kind, or a bad or missing file (one line).
    """
    if value is None or isinstance(value, RoutingStats):
        return value
    if not isinstance(value, (str, Path)):
        raise RoutingError(
            f"routing must be 'uniform', 'zipf:ALPHA' or the path of a routing statistics file, got {type(value).__name__}"
        )
    text = str(value).strip()
    if text == "uniform" or text.startswith("zipf:"):
        synthetic(text, {})  # checks the kind; the layers come after tracing
        return text
    if not os.path.exists(text):  # os.path's: False, not an error, for a name too long to exist
        raise RoutingError(
            f"routing {one_line(text)[:120]!r} is neither 'uniform', 'zipf:ALPHA' (e.g. zipf:1.2) nor an existing "
            f"routing statistics file"
        )
    return load_routing(text)


def routing_for_layers(option: "RoutingStats | str | None", layers: Mapping[str, tuple[int, int]]) -> RoutingStats:
    """The statistics the planner uses for a model's MoE ``layers`` (module path ->
    (experts, top_k)) from a checked option (``read_routing_option``): uniform for None,
    the synthetic kind on every layer, or the file's (layers it does not cover are uniform).

    Raises:
        RoutingError: the statistics name a layer the model does not have, or give a layer
            another number of experts.
    """
    if option is None:
        return RoutingStats()
    if isinstance(option, str):
        return synthetic(option, layers)
    unknown = [name for name in option.layers if name not in layers]
    if unknown:
        known = ", ".join(list(layers)[:4]) or "none"
        raise RoutingError(
            f"routing statistics give layer {one_line(unknown[0])[:80]!r}, which is not an MoE layer of this model "
            f"(its MoE layers: {known}{', ...' if len(layers) > 4 else ''})"
        )
    for name, (experts, top_k) in layers.items():
        option.layer(name, experts, top_k)
    return option
