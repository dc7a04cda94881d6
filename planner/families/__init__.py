"""The registry of parallelism families: what ``planner families`` lists, ``--family``
chooses among, and the search, the simulator, the compiler and the report loop over.

A family is one folder here, ``planner/families/<folder>/``, found by listing this package
(as tinygrad finds its backends): its ``__init__.py`` declares ``FAMILIES``, a tuple of
``Family`` (a folder may declare several flavours that share their parts, as
``data_parallel`` declares ddp, zero1, zero2 and fsdp). Each part of a family is named by a
``"module:function"`` reference that the layer using it resolves when it needs it, so the
registry itself imports nothing above the vocabulary:

===============  ==============  ============================================================
part             its layer       what it is
===============  ==============  ============================================================
``section``      vocabulary      a frozen dataclass stored under the family's own key of the
                                 plan JSON: ``check(plan)``, ``to_json()``,
                                 ``from_json(data, source)``, ``describe(plan)`` (the words
                                 it adds to the plan's name)
``candidates``   search          ``(SearchContext) -> list[Plan]``: the family's plans for
                                 the search to compare (``search.context``)
``costs``        cost model      a ``cost_model.step_contributor.StepContributor`` class:
                                 what the family adds to the simulated step, as tasks and
                                 memory, for the plans it ``uses``; its ``takes_over``
                                 names the contributors it replaces on them
``emitter``      codegen         ``(Plan) -> str``: ``model_spmd.py`` for the plans that
                                 ``claims`` says it compiles
``report``       vocabulary      ``(Plan) -> list[str]``: the family's lines of the report
===============  ==============  ============================================================

A part in a family's own folder lives in a file named after its layer (``section.py``,
``candidates.py``, ``costs.py``, ``emit.py``/``runtime.py``, ``report.py``), and
``tests/test_import_layering.py`` holds each file to its layer's imports. The families that
came before the registry keep their parts where they were (``search/``, ``codegen/``) and
declare them here: one place to find what a family is made of.

A plan belongs to every family whose parallelism it uses: ``megatron (pp=2 x dp=2 x tp=2;
...; zero1)`` is ``pipeline``, ``tp`` and ``zero1``. A plan on one device uses none.
Recomputation and gradient accumulation are not families: they change what a step keeps in
memory, not how the work is split, and every family may use them.

Vocabulary layer: declarations import the vocabulary only (never ``planner.plans``, which
imports this registry to read plan sections: ``Plan`` appears in annotations only).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from planner.plans import Plan

# The layer each part belongs to, and the file name it has in a family's own folder.
PART_LAYERS = {"candidates": "search", "costs": "cost_model", "emitter": "codegen", "report": "vocabulary"}


@dataclass(frozen=True)
class Family:
    """One parallelism family and where its parts are.

    Attributes:
        name: what ``--family`` and ``planner families`` call it.
        summary: one line for ``planner families``.
        uses: whether a plan uses the family (``families_of``).
        axes: the mesh axes only this family uses (a mesh with one larger than 1 needs it).
        also_on_axes: mesh axes another family owns that this one's plans run on with a
            program of their own (``uneven-tp`` on ``tp``): a mesh with such an axis is
            allowed when either family is (``families_for_axis``).
        data_parallel: the family splits the batch over the ``dp`` axis (any ``dp`` larger
            than 1 needs one such family).
        refines: families a plan of this one would otherwise be counted in (a HSDP plan is
            an FSDP plan with a section: it is ``hsdp``, not ``fsdp``).
        section: the class of the family's plan section, stored under the plan JSON key
            ``name`` (``Plan.sections[name]``); None for a family without one.
        candidates, costs, emitter, report: ``"module:name"`` references to the parts
            (see the module docstring); empty for a part the family does not have.
        claims: which plans ``emitter`` compiles; the families are asked in ``emit_order``.
        search_order: when the search asks for ``candidates`` (plans found earlier are
            in ``SearchContext.found``: a pipeline grid is searched only when they fall short).
    """

    name: str
    summary: str
    uses: Callable[["Plan"], bool]
    axes: tuple[str, ...] = ()
    also_on_axes: tuple[str, ...] = ()
    data_parallel: bool = False
    refines: tuple[str, ...] = ()
    section: type | None = None
    candidates: str = ""
    costs: str = ""
    emitter: str = ""
    report: str = ""
    claims: Callable[["Plan"], bool] | None = None
    search_order: int = 100
    emit_order: int = 100

    def part(self, role: str) -> Callable[..., Any]:
        """The function a part reference names, imported on first use."""
        reference = getattr(self, role)
        if not reference:
            raise LookupError(f"the '{self.name}' family has no {role} part")
        return resolve(reference)


@cache
def resolve(reference: str) -> Callable[..., Any]:
    """The function a ``"module:function"`` reference names."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


@cache
def registered() -> tuple[Family, ...]:
    """Every family of every folder of this package, in search order (then by name)."""
    found: list[Family] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if info.ispkg:
            found += importlib.import_module(f"{__name__}.{info.name}").FAMILIES
    names = [family.name for family in found]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise RuntimeError(f"parallelism family '{twice[0]}' is declared twice in planner/families")
    return tuple(sorted(found, key=lambda family: (family.search_order, family.name)))


def family(name: str) -> Family:
    """The family called ``name`` (``KeyError`` when there is none)."""
    for candidate in registered():
        if candidate.name == name:
            return candidate
    raise KeyError(name)


def family_names() -> tuple[str, ...]:
    """The names of every family, in the order ``planner families`` lists them."""
    return tuple(family.name for family in _listed())


def data_parallel_names() -> tuple[str, ...]:
    """The families that split the batch over ``dp``."""
    return tuple(family.name for family in _listed() if family.data_parallel)


def _listed() -> tuple[Family, ...]:
    # Data-parallel flavours first, from the least to the most sharded, as users meet them.
    return tuple(sorted(registered(), key=lambda family: (not family.data_parallel, family.search_order, family.name)))


def families_of(plan: "Plan") -> frozenset[str]:
    """The names of the families ``plan`` uses."""
    used = [family for family in registered() if family.uses(plan)]
    refined = {name for family in used for name in family.refines}
    return frozenset(family.name for family in used if family.name not in refined)


def family_of_axis(axis: str) -> str | None:
    """The family a mesh axis larger than 1 needs (``tp`` -> ``tp``, ``pp`` -> ``pipeline``),
    or None for ``dp``, which any data-parallel family uses."""
    return next((family.name for family in registered() if axis in family.axes), None)


def families_for_axis(axis: str) -> tuple[str, ...]:
    """Every family whose plans may have ``axis`` larger than 1: its owner
    (``family_of_axis``) and the families that run on it too (``Family.also_on_axes``)."""
    owner = family_of_axis(axis)
    return ((owner,) if owner else ()) + tuple(family.name for family in registered() if axis in family.also_on_axes)


def family_table() -> list[tuple[str, str]]:
    """(name, one line) for every family, as ``planner families`` prints them."""
    return [(family.name, family.summary) for family in _listed()]


def section_families() -> tuple[Family, ...]:
    """The families with a plan section, whose JSON key is their name."""
    return tuple(family for family in registered() if family.section is not None)


def with_part(role: str) -> tuple[Family, ...]:
    """The families that have part ``role``, in search order."""
    return tuple(family for family in registered() if getattr(family, role))


def emitting_family(plan: "Plan") -> Family | None:
    """The family whose emitter compiles ``plan``: the first in ``emit_order`` that claims it."""
    emitters = sorted(with_part("emitter"), key=lambda family: (family.emit_order, family.name))
    return next((family for family in emitters if family.claims is not None and family.claims(plan)), None)
