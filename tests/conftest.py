"""Session-wide fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from launch_groups import ParityLaunches  # this folder is on sys.path under pytest
from test_parity import LAUNCH_TIMEOUT, check_many


@pytest.fixture(scope="session")
def parity_launches(request, tmp_path_factory) -> ParityLaunches:
    """One parity launch per world size for every module's registered programs
    (``tests/launch_groups.py``); only modules with a test selected in this session take part."""
    selected = {item.module.__name__ for item in request.session.items if getattr(item, "module", None)}
    return ParityLaunches(tmp_path_factory, selected, check_many, LAUNCH_TIMEOUT)
