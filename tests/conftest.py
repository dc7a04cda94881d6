"""Session-wide fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from launch_groups import ParityLaunches, registered_groups  # this folder is on sys.path under pytest
from test_parity import LAUNCH_TIMEOUT, check_many


@pytest.fixture(scope="session")
def parity_launches(request, tmp_path_factory) -> ParityLaunches:
    """One parity launch per world size for every module's registered programs
    (``tests/launch_groups.py``); only modules with a selected test take part (not only
    those whose tests name a launch fixture: some ask for theirs by name at run time)."""
    selected = {item.module.__name__ for item in request.session.items if getattr(item, "module", None)}
    groups = [group for group in registered_groups() if group.module in selected]
    return ParityLaunches(tmp_path_factory, groups, check_many, LAUNCH_TIMEOUT)
