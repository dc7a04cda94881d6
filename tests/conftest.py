"""Session-wide fixtures shared by the test modules."""

from __future__ import annotations

import os

import pytest
import torch

from launch_groups import ParityLaunches, registered_groups  # this folder is on sys.path under pytest
from test_parity import LAUNCH_TIMEOUT, check_many

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on the two cores of the CI machine: one intra-op thread each, so their
    # OpenMP threads (which spin while waiting) do not compete for the cores, as the ranks
    # the tests launch already run with OMP_NUM_THREADS=1.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def parity_launches(request, tmp_path_factory) -> ParityLaunches:
    """One parity launch per world size for every module's registered programs
    (``tests/launch_groups.py``); only modules with a selected test take part (not only
    those whose tests name a launch fixture: some ask for theirs by name at run time)."""
    selected = {item.module.__name__ for item in request.session.items if getattr(item, "module", None)}
    groups = [group for group in registered_groups() if group.module in selected]
    return ParityLaunches(tmp_path_factory, groups, check_many, LAUNCH_TIMEOUT)


def pytest_itemcollected(item) -> None:
    """Under pytest-xdist's ``--dist loadgroup`` (pyproject's addopts), keep each test module
    on one worker (its module-scoped fixtures, often a torchrun launch, then run once), and
    every module that registers a parity launch group on the same worker: the session's
    grouped launches (``parity_launches``) are made once, by that worker, for all of them.
    Marked as each item is collected, before any ``pytest_collection_modifyitems`` (xdist's
    reads the marks there, and the order of those hooks differs between pytest versions); a
    module registers its groups when imported, before its items are collected."""
    # Read where xdist reads it: a worker's ``dist`` is "no", its ``loadgroup`` set.
    if not getattr(item.config.option, "loadgroup", False):  # one process (-n 0), or no xdist
        return
    module = getattr(item, "module", None)
    name = module.__name__ if module is not None else item.nodeid.split("::")[0]
    launching = any(group.module == name for group in registered_groups())
    item.add_marker(pytest.mark.xdist_group("parity_launches" if launching else name))
