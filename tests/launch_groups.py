"""One parity launch per world size for the whole pytest session, shared by many modules.

Each launch of ``dist_check_many.py`` starts ``world`` Python processes that each import
torch and set up gloo before checking anything: seconds of a 2-core CI machine, paid once per
launch. Test modules used to launch once per module-scoped fixture; now a module registers
the programs it wants checked as a *group*:

    SEARCHED = register_group(2, _prepare_searched)   # at import, i.e. at collection

    @pytest.fixture(scope="module")
    def searched(parity_launches):
        (plans, folders), launch = parity_launches.result(SEARCHED)
        return plans, folders, launch

where ``_prepare_searched(root, world)`` plans and compiles into ``root`` and returns
``(value, programs)`` or ``(value, programs, programs_in_float64)``. The first time any
group of a world size is asked for, ``parity_launches`` (a session fixture in conftest.py)
prepares every registered group of that world size whose module has a test selected in
this session, and checks all their programs in ONE launch (a group asked for later gets its own). Each module's tests then read the
``RESULT`` line of their own program from it, as they read their own launch before, so a
failure still names the program and the test keeps its name.

A group's own failure stays its own: an exception while preparing it fails only that
group's fixture (with that exception), not the others'. A launch that fails as a whole (a
crash, a hang past the timeout) fails every group in it, with the launch's output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


@dataclass(frozen=True)
class Group:
    """Programs one module wants parity-checked on ``world`` ranks."""

    name: str  # "<module>.<prepare function>.world<N>": unique, and names the group's folder
    module: str  # the test module that registered it
    world: int
    prepare: Callable[[Path, int], tuple]  # (root, world) -> (value, programs[, programs in float64])


_REGISTERED: dict[str, Group] = {}


def register_group(world: int, prepare: Callable[[Path, int], tuple]) -> Group:
    """Register ``prepare`` (called at most once per session, with an empty folder of its
    own and ``world``) as a group of programs checked on ``world`` ranks in the session's
    launch of that size."""
    name = f"{prepare.__module__}.{prepare.__name__.lstrip('_')}.world{world}"
    group = Group(name, prepare.__module__, world, prepare)
    assert _REGISTERED.get(group.name, group) == group, f"two groups named {group.name}"
    _REGISTERED[group.name] = group
    return group


def registered_groups() -> list[Group]:
    """Every group registered so far (at collection: every collected module's)."""
    return list(_REGISTERED.values())


@dataclass
class _Prepared:
    value: Any = None
    programs: list[Path] | None = None
    in_float64: list[Path] | None = None
    error: BaseException | None = None


class ParityLaunches:
    """The session's launches, one per world size, made on first use (see the module doc)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, groups: list[Group],
                 check_many: Callable[..., Any], timeout_per_group: float) -> None:
        """``groups``: those to prepare when their world size is first asked for (a group
        asked for is prepared even if not listed). ``check_many(world, programs, cwd,
        in_float64, timeout=...)`` makes one launch (``test_parity.check_many``), given
        ``timeout_per_group`` seconds per group in it."""
        self._tmp = tmp_path_factory
        self._groups = groups
        self._check_many = check_many
        self._timeout_per_group = timeout_per_group
        self._prepared: dict[str, _Prepared] = {}
        self._launches: dict[str, Any] = {}  # group name -> its Launch, or the exception that failed it

    def result(self, group: Group) -> tuple[Any, Any]:
        """``(value, launch)`` of ``group``: what its ``prepare`` returned first, and the
        finished launch whose RESULT lines include its programs'."""
        if group.name not in self._prepared:
            self._launch(group)
        prepared = self._prepared[group.name]
        if prepared.error is not None:
            raise prepared.error
        launch = self._launches[group.name]
        if isinstance(launch, BaseException):
            raise launch
        return prepared.value, launch

    def _launch(self, asking: Group) -> None:
        # A group asked for after its world size's launch (not listed) gets a launch of its own.
        groups = [group for group in self._groups
                  if group.world == asking.world and group != asking and group.name not in self._prepared]
        groups.insert(0, asking)
        for group in groups:
            self._prepared[group.name] = self._prepare(group)
        ready = [self._prepared[group.name] for group in groups if self._prepared[group.name].error is None]
        programs = [program for prepared in ready for program in prepared.programs]
        in_float64 = [program for prepared in ready for program in prepared.in_float64]
        if not programs + in_float64:
            self._launches.update({group.name: None for group in groups})
            return
        root = self._tmp.mktemp(f"launch_world{asking.world}")
        try:
            # The timeout only stops a hung collective: each group keeps the one its own launch had.
            launch = self._check_many(
                asking.world, programs, root, in_float64, timeout=self._timeout_per_group * len(ready))
        except (AssertionError, pytest.fail.Exception) as error:
            launch = error
        self._launches.update({group.name: launch for group in groups})

    def _prepare(self, group: Group) -> _Prepared:
        try:
            value, programs, *in_float64 = group.prepare(self._tmp.mktemp(group.name), group.world)
        except (Exception, pytest.fail.Exception, pytest.skip.Exception) as error:  # noqa: BLE001 - raised again by this group's fixture only
            return _Prepared(error=error)
        return _Prepared(value, list(programs), list(in_float64[0]) if in_float64 else [])
