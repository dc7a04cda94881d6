"""The uneven tensor-parallel section of a plan (ACCPAR): for each linear layer, how it is split
over the ranks and how much of it each rank takes.

A plan with this section runs every op on every rank of a ``tp`` mesh alike (activations
replicated) except the linear layers it names. Each of those is split one of three ways
(Song et al., "AccPar", HPCA 2020, section III: the complete partition space of a layer),
each rank taking ``shares[r]`` of the split dimension, in proportion to its device's speed:

- ``batch``: the input's rows (dim 0); the weight whole on every rank, its gradient summed.
- ``column``: the output features (the weight's rows): each rank computes its columns of
  the output, which are gathered.
- ``row``: the input features (the weight's columns): each rank multiplies its slice of the
  input and the partial outputs are summed.

A layer may be ``fused`` (``regions.py``): column splits whose output stays split, through
elementwise ops, into a row split of the same shares (no gather between them; ACCPAR's
inter-layer cost of zero for that switch).

Stored under the plan JSON key ``"uneven-tp"`` as ``{"layers": [{"module": "blocks.0.mlp.c_fc",
"kind": "column", "shares": [96, 96, 32, 32], "fused": true}, ...], "busy_s": [...],
"memory_bytes": [...]}`` (``fused`` only where true; ``busy_s`` and ``memory_bytes``: each
rank's predicted compute seconds and bytes, for the report; empty when not simulated).

Vocabulary layer: imports only the planner's vocabulary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from planner.cluster import MAX_RANKS
from planner.errors import PlanFileError, one_line
from planner.families.uneven_tp.regions import fusable_groups, split_dimensions

if TYPE_CHECKING:
    from planner.plans import Plan

JSON_KEY = "uneven-tp"
KINDS = ("batch", "column", "row")
LAYER_KEYS = ("module", "kind", "shares")
OPTIONAL_LAYER_KEYS = ("fused",)
KEYS = ("layers", "busy_s", "memory_bytes")
MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")


@dataclass(frozen=True)
class LayerSplit:
    """One linear layer's split: the module path, the partition ``kind`` (``KINDS``), each
    rank's share of the split dimension (rank 0 the first slice), and whether it is
    ``fused`` with its neighbours (a column's output kept split, a row's input arriving
    split; ``regions.py``).

    Raises:
        ValueError: a malformed field; one line naming it.
    """

    module: str
    kind: str
    shares: tuple[int, ...]
    fused: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.module, str) or len(self.module) > 200 or not MODULE_PATH.fullmatch(self.module):
            raise ValueError(f"field '{JSON_KEY}.layers[].module' must be a module path such as 'blocks.0.mlp.c_fc', "
                             f"got {_shown(self.module)}")
        if self.kind not in KINDS:
            raise ValueError(f"field '{JSON_KEY}.layers[].kind' must be one of {', '.join(KINDS)}, "
                             f"got {_shown(self.kind)}")
        shares = tuple(self.shares) if isinstance(self.shares, (list, tuple)) else self.shares
        if not isinstance(shares, tuple) or not 2 <= len(shares) <= MAX_RANKS or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shares
        ):
            raise ValueError(f"field '{JSON_KEY}.layers[].shares' of {self.module} must be a list of 2 or more "
                             f"positive integers (one per tp rank), got {_shown(self.shares)}")
        object.__setattr__(self, "shares", shares)
        if not isinstance(self.fused, bool) or (self.fused and self.kind == "batch"):
            raise ValueError(f"field '{JSON_KEY}.layers[].fused' of {self.module} must be true or false, and only "
                             f"for a column or row split, got {_shown(self.fused)} ({self.kind})")

    def offsets(self) -> tuple[int, ...]:
        """The first index of each rank's slice of the split dimension."""
        return tuple(sum(self.shares[:rank]) for rank in range(len(self.shares)))


@dataclass(frozen=True)
class UnevenTpSection:
    """The split of each named linear layer (``LayerSplit``), and each rank's predicted
    compute seconds and bytes (``costs.plan_rank_memories``; empty: not simulated).

    Raises:
        ValueError: no layer, a layer named twice, or ``busy_s`` or ``memory_bytes``
            malformed; one line.
    """

    layers: tuple[LayerSplit, ...]
    busy_s: tuple[float, ...] = ()
    memory_bytes: tuple[int, ...] = ()
    # Node costs read the splits (costs.py): the simulator's node-cost cache keys on the section.
    changes_op_costs: ClassVar[bool] = True

    def __post_init__(self) -> None:
        layers = tuple(self.layers) if isinstance(self.layers, (list, tuple)) else self.layers
        if not isinstance(layers, tuple) or not layers or not all(isinstance(layer, LayerSplit) for layer in layers):
            raise ValueError(f"field '{JSON_KEY}.layers' must list one split per linear layer, got {_shown(layers)}")
        modules = [layer.module for layer in layers]
        twice = sorted({module for module in modules if modules.count(module) > 1})
        if twice:
            raise ValueError(f"field '{JSON_KEY}.layers' names {twice[0]!r} twice; give each layer one split")
        ranks = {len(layer.shares) for layer in layers}
        if len(ranks) != 1:
            raise ValueError(f"field '{JSON_KEY}.layers' gives different numbers of shares ({sorted(ranks)}); "
                             f"give one share per tp rank to every layer")
        for key, kind in (("busy_s", float), ("memory_bytes", int)):
            values = tuple(getattr(self, key))
            if values and (len(values) != len(layers[0].shares) or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf") for v in values
            )):
                raise ValueError(f"field '{JSON_KEY}.{key}' must be empty or one finite non-negative number per rank, "
                                 f"got {_shown(values)}; drop it and simulate the plan again")
            object.__setattr__(self, key, tuple(kind(v) for v in values))
        object.__setattr__(self, "layers", layers)

    def check(self, plan: "Plan") -> None:
        """Raise ``ValueError`` (one line naming the field and the fix) unless this section
        fits ``plan``: a mesh of ``tp`` alone with one share per rank, every op replicated,
        no pipeline, expert layouts, accumulation or other section; every layer a linear
        module of the traced model whose split dimension the shares add up to."""
        if (plan.mesh.names != ("tp",) or plan.pipeline is not None or plan.expert_layouts
                or plan.accumulation_steps != 1 or set(plan.sections) - {JSON_KEY}):
            raise ValueError(f"field '{JSON_KEY}' needs a plan on a mesh of tp alone, without pipeline, expert "
                             f"layouts, gradient accumulation or other sections, but the plan is {plan.name}; "
                             f"drop the uneven-tp section")
        tp = plan.mesh.axis_size("tp")
        if len(self.layers[0].shares) != tp:
            raise ValueError(f"field '{JSON_KEY}.layers' has {len(self.layers[0].shares)} shares per layer for "
                             f"tp={tp} ranks; give one per rank")
        if plan.graph is None:
            return
        dims = split_dimensions(plan.graph)
        for layer in self.layers:
            if layer.module not in dims:
                raise ValueError(f"field '{JSON_KEY}.layers' names {layer.module!r}, which is not a linear layer "
                                 f"of the traced model; re-plan")
            wanted = dims[layer.module][layer.kind]
            if sum(layer.shares) != wanted:
                raise ValueError(f"field '{JSON_KEY}.layers' gives {layer.module!r} ({layer.kind}) shares summing "
                                 f"to {sum(layer.shares)}, not its {wanted}; make them add up to {wanted}")
        self._check_fused(plan.graph)

    def _check_fused(self, graph) -> None:
        """Every fused layer in a fusable group (``regions.py``) whose layers are all fused,
        columns as column splits and the row as a row split, at the same shares. A layer may
        sit in two groups (the row of one and the column of the next, as in a chain of
        linears with ReLUs between): it must complete one of them."""
        fused = [layer.module for layer in self.layers if layer.fused]
        if not fused:
            return
        covered = {module for group in complete_fused_groups(graph, self.layers) for module in group.modules}
        left = [module for module in fused if module not in covered]
        if not left:
            return
        for group in fusable_groups(graph):
            if any(module in group.modules for module in left):
                raise ValueError(f"field '{JSON_KEY}.layers' fuses part of the group {', '.join(group.columns)} -> "
                                 f"{group.row}: fuse all of them, {group.row!r} as a row split and the others as "
                                 f"column splits, at the same shares, or drop 'fused'")
        raise ValueError(f"field '{JSON_KEY}.layers' fuses {left[0]!r}, whose activation cannot stay "
                         f"split (ops between it and the next split layer are not elementwise); drop 'fused'")

    def layer(self, module: str) -> LayerSplit | None:
        """The split of ``module``, or None when it runs whole on every rank."""
        return next((layer for layer in self.layers if layer.module == module), None)

    def describe(self, plan: "Plan") -> str:
        """The words this section adds to the plan's name: ``"uneven tp 3 column, 2 row"``."""
        counts = [f"{sum(layer.kind == kind for layer in self.layers)} {kind}" for kind in KINDS
                  if any(layer.kind == kind for layer in self.layers)]
        return f"uneven tp {', '.join(counts)}"

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored under the plan's ``"uneven-tp"`` key."""
        return {"layers": [{"module": layer.module, "kind": layer.kind, "shares": list(layer.shares),
                            **({"fused": True} if layer.fused else {})}
                           for layer in self.layers], "busy_s": list(self.busy_s),
                "memory_bytes": list(self.memory_bytes)}

    @classmethod
    def from_json(cls, data: Any, source: str) -> "UnevenTpSection":
        """The section stored under a plan file's ``"uneven-tp"`` key, every field checked.

        Raises:
            PlanFileError: one line naming ``source`` and the malformed field.
        """
        if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
            raise PlanFileError(f"{source}: field '{JSON_KEY}' must be a JSON object with a list 'layers', "
                                f"got {_shown(data)}")
        unknown = [key for key in data if key not in KEYS]
        if unknown:
            raise PlanFileError(f"{source}: field '{JSON_KEY}' has an unknown key {_shown(unknown[0])}; "
                                f"its keys are {', '.join(KEYS)}")
        for key in ("busy_s", "memory_bytes"):
            if not isinstance(data.get(key, []), list):
                raise PlanFileError(f"{source}: field '{JSON_KEY}.{key}' must be a list")
        try:
            layers = []
            for entry in data["layers"]:
                if (not isinstance(entry, dict) or not set(LAYER_KEYS) <= set(entry)
                        or not set(entry) <= set(LAYER_KEYS + OPTIONAL_LAYER_KEYS)):
                    raise ValueError(f"field '{JSON_KEY}.layers[]' must be an object with keys "
                                     f"{', '.join(LAYER_KEYS)} (and optionally fused), got {_shown(entry)}")
                if not isinstance(entry["shares"], list):
                    raise ValueError(f"field '{JSON_KEY}.layers[].shares' must be a list, got {_shown(entry['shares'])}")
                layers.append(LayerSplit(entry["module"], entry["kind"], tuple(entry["shares"]),
                                         entry.get("fused", False)))
            return cls(tuple(layers), tuple(data.get("busy_s", ())), tuple(data.get("memory_bytes", ())))
        except ValueError as error:
            raise PlanFileError(f"{source}: {error}") from None


def _shown(value: Any) -> str:
    """``value`` as a message quotes it: one line, at most 40 characters."""
    return one_line(repr(value))[:40]


def complete_fused_groups(graph, layers) -> tuple:
    """The fusable groups (``regions.fusable_groups``) of ``graph`` that ``layers`` fuse whole:
    every column a fused column split and the row a fused row split, all at the same shares."""
    fused = {layer.module: layer for layer in layers if layer.fused}
    complete = []
    for group in fusable_groups(graph):
        members = [fused.get(module) for module in group.modules]
        kinds = ["column"] * len(group.columns) + ["row"]
        if all(members) and [m.kind for m in members] == kinds and len({m.shares for m in members}) == 1:
            complete.append(group)
    return tuple(complete)
