"""What a user fixes before the search: mesh axis sizes, upper bounds, the families allowed.

``planner plan --mesh tp=8 --max pp=4 --family fsdp,tp,pipeline`` (and
``planner.plan(..., constraints=...)``) prune the search space before any search runs: a
mesh whose axes break a constraint is never searched, a family left out is never tried, and
the plan chosen is the fastest that fits among those the constraints allow. An impossible
constraint is one error naming it and why, found before the model is traced where the
cluster alone decides (``check_cluster``) and before the search where the batch does
(``check_batch``).

* ``mesh``: axis sizes fixed exactly; an axis a mesh does not have counts as size 1, so
  ``tp=1`` forbids tensor parallelism and ``pp=1`` pipelines.
* ``max``: upper bounds on axis sizes.
* ``families``: the families that may compete (``planner.families``); a plan competes only
  when every family it uses is among them. None: all of them.

Vocabulary layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from planner.errors import ArgumentError, PlanningError
from planner.families import data_parallel_names, families_for_axis, family_names, families_of, family_of_axis

if TYPE_CHECKING:
    from planner.cluster import Cluster
    from planner.plans import Plan
    from planner.strategy import Mesh

# Mesh axes a constraint may name (planner.plan_fields.MESH_AXES).
CONSTRAINED_AXES = ("dp", "tp", "pp", "row", "col", "dep")
# Larger than any cluster a plan is made for; keeps a typo from becoming a huge number.
_MAX_AXIS_SIZE = 1 << 20


class ConstraintError(PlanningError):
    """A constraint that no plan can meet (it names the constraint and why)."""


def _axis_sizes(values: Mapping[str, Any], flag: str) -> dict[str, int]:
    sizes = {}
    for axis, size in values.items():
        if axis not in CONSTRAINED_AXES:
            raise ArgumentError(f"{flag} {axis}=...: no mesh axis '{str(axis)[:40]}'; axes are {', '.join(CONSTRAINED_AXES)}")
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= _MAX_AXIS_SIZE:
            raise ArgumentError(f"{flag} {axis}={str(size)[:40]}: the size must be an integer from 1 to {_MAX_AXIS_SIZE}")
        sizes[axis] = size
    return sizes


@dataclass(frozen=True)
class SearchConstraints:
    """Axis sizes fixed (``mesh``), axis sizes bounded (``max``) and families allowed."""

    mesh: Mapping[str, int] = field(default_factory=dict)
    max: Mapping[str, int] = field(default_factory=dict)
    families: frozenset[str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh", _axis_sizes(dict(self.mesh), "--mesh"))
        object.__setattr__(self, "max", _axis_sizes(dict(self.max), "--max"))
        if self.families is not None:
            families = frozenset(self.families)
            unknown = sorted(str(name)[:40] for name in families if name not in family_names())
            if unknown:
                raise ArgumentError(
                    f"--family {unknown[0]}: no such family; families are {', '.join(family_names())} (planner families)"
                )
            if not families:
                raise ArgumentError(f"--family needs at least one family of {', '.join(family_names())}")
            object.__setattr__(self, "families", families)
        for axis, size in self.mesh.items():
            if axis in self.max and size > self.max[axis]:
                raise ArgumentError(f"--mesh {axis}={size} is above --max {axis}={self.max[axis]}; drop one of them")
            needed = family_of_axis(axis)
            if size > 1 and needed and self.families is not None and needed not in self.families:
                raise ArgumentError(
                    f"--mesh {axis}={size} needs the '{needed}' family, which --family {self._families_text()} leaves out"
                )
        if self.mesh.get("dp", 1) > 1 and self.families is not None and not self.families & set(data_parallel_names()):
            raise ArgumentError(
                f"--mesh dp={self.mesh['dp']} needs a data-parallel family ({', '.join(data_parallel_names())}), "
                f"which --family {self._families_text()} leaves out"
            )

    @classmethod
    def from_options(cls, mesh: Iterable[str] = (), max: Iterable[str] = (), families: Iterable[str] = ()) -> "SearchConstraints":
        """From the command line: ``--mesh tp=8`` / ``--max pp=4`` items (each may hold several
        ``axis=size`` pairs separated by commas) and ``--family a,b`` items."""
        names = [name.strip() for item in families for name in item.split(",") if name.strip()]
        return cls(
            mesh=_parse_sizes(mesh, "--mesh"), max=_parse_sizes(max, "--max"),
            families=frozenset(names) if names else None,
        )

    @classmethod
    def coerce(cls, value: Any) -> "SearchConstraints":
        """``planner.plan``'s ``constraints`` argument: None, a ``SearchConstraints`` or a dict
        with keys ``mesh``, ``max`` (``{axis: size}``) and ``families`` (names)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(str(key)[:40] for key in value if key not in ("mesh", "max", "families"))
            if unknown:
                raise ArgumentError(f"constraints: unknown key '{unknown[0]}'; keys are mesh, max, families")
            mesh, bounds, families = value.get("mesh", {}), value.get("max", {}), value.get("families")
            if not isinstance(mesh, Mapping) or not isinstance(bounds, Mapping):
                raise ArgumentError("constraints: 'mesh' and 'max' must be dicts of axis -> size, e.g. {'tp': 8}")
            if isinstance(families, str) or (families is not None and not isinstance(families, Iterable)):
                raise ArgumentError("constraints: 'families' must be a list of family names, e.g. ['fsdp', 'tp']")
            return cls(mesh=mesh, max=bounds, families=None if families is None else frozenset(families))
        raise ArgumentError(
            f"constraints must be a SearchConstraints or a dict (mesh, max, families), got {type(value).__name__}"
        )

    @property
    def any(self) -> bool:
        return bool(self.mesh or self.max or self.families is not None)

    def _families_text(self) -> str:
        return ",".join(name for name in family_names() if self.families and name in self.families)

    def describe(self) -> str:
        """The constraints as the command line says them, e.g. ``--mesh tp=8 --family fsdp,tp``."""
        parts = []
        if self.mesh:
            parts.append("--mesh " + ",".join(f"{axis}={size}" for axis, size in self.mesh.items()))
        if self.max:
            parts.append("--max " + ",".join(f"{axis}={size}" for axis, size in self.max.items()))
        if self.families is not None:
            parts.append(f"--family {self._families_text()}")
        return " ".join(parts)

    def allows_family(self, name: str) -> bool:
        return self.families is None or name in self.families

    def allows_sizes(self, sizes: Mapping[str, int]) -> bool:
        """Whether a mesh with these axis sizes (absent axes: 1) meets ``mesh`` and ``max``
        and needs no family left out."""
        if any(sizes.get(axis, 1) != size for axis, size in self.mesh.items()):
            return False
        if any(sizes.get(axis, 1) > bound for axis, bound in self.max.items()):
            return False
        if sizes.get("dp", 1) > 1 and not any(self.allows_family(name) for name in data_parallel_names()):
            return False
        return all(
            any(self.allows_family(name) for name in needed)
            for axis, size in sizes.items()
            if size > 1 and (needed := families_for_axis(axis))
        )

    def allows_mesh(self, mesh: "Mesh") -> bool:
        return self.allows_sizes(dict(mesh.axes))

    def allows_plan(self, plan: "Plan") -> bool:
        """Whether ``plan``'s mesh meets the sizes and every family it uses is allowed."""
        if not self.allows_mesh(plan.mesh):
            return False
        return self.families is None or families_of(plan) <= self.families

    def check_cluster(self, cluster: "Cluster") -> None:
        """Raise ``ConstraintError`` for sizes no mesh of ``cluster`` can have."""
        world = cluster.world_size
        for axis, size in self.mesh.items():
            if world % size:
                raise ConstraintError(
                    f"--mesh {axis}={size}: {size} does not divide the cluster's {world} devices; "
                    f"choose a divisor of {world}"
                )
        fixed = 1
        for size in self.mesh.values():
            fixed *= size
        if world % fixed:
            raise ConstraintError(
                f"--mesh {self.describe_mesh()}: the axes multiply to {fixed} devices, which does not divide the "
                f"cluster's {world}"
            )
        per_node = cluster.min_devices_per_node
        tp = self.mesh.get("tp", 1)
        if tp > per_node:
            raise ConstraintError(
                f"--mesh tp={tp}: tensor parallelism stays inside a node, which has {per_node} devices; "
                f"use tp <= {per_node} (pipelines and data parallelism span nodes)"
            )
        if self.families is not None and world > 1 and not self.families - {"moe"}:
            raise ConstraintError(
                "--family moe alone splits nothing but the MoE layers; add a data-parallel family "
                f"({', '.join(data_parallel_names())}) for the rest of the model"
            )

    def check_batch(self, batch_size: int) -> None:
        """Raise ``ConstraintError`` when the fixed ``dp`` does not split the global batch."""
        dp = self.mesh.get("dp", 1)
        if batch_size % dp:
            raise ConstraintError(
                f"--mesh dp={dp}: the global batch of {batch_size} does not split over {dp} data-parallel ranks; "
                f"choose a dp that divides it"
            )

    def describe_mesh(self) -> str:
        return ",".join(f"{axis}={size}" for axis, size in self.mesh.items())

    def nothing_allowed(self) -> ConstraintError:
        """The error when the search found no plan these constraints allow."""
        return ConstraintError(
            f"no plan meets {self.describe()}: no mesh of this cluster and batch has those axis sizes with the "
            f"families allowed; loosen a constraint (planner families lists the families)"
        )


def _parse_sizes(items: Iterable[str], flag: str) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for item in items:
        for pair in item.split(","):
            axis, equals, size = pair.strip().partition("=")
            axis, size = axis.strip(), size.strip()
            if not equals or not axis or not (size.isascii() and size.isdigit()):
                raise ArgumentError(f"{flag} {pair.strip()[:40]!r}: expected AXIS=SIZE, e.g. {flag} tp=8")
            if axis in sizes:
                raise ArgumentError(f"{flag} names axis '{axis[:40]}' twice")
            # More digits than any axis size has: out of range, without parsing a huge number.
            sizes[axis] = int(size) if len(size) <= 9 else _MAX_AXIS_SIZE + 1
    return sizes
