"""A grouped parity launch that crashes part-way checks its unchecked programs again, and says so.

Once in CI a world-8 launch of ``dist_check_many.py`` aborted (gloo, while making a process
group of its 18th program) after 17 programs had printed ``ok``, and every group in it failed.
``test_parity.check_many`` now relaunches the programs without a RESULT line once, warns
with the crash's cause, and fails only if the fresh launch fails too.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from test_parity import MODELS, _compile, check_many, result_of  # this folder is on sys.path under pytest

pytestmark = pytest.mark.distributed

# Appended to a compiled program: rank 1 aborts the process the first time the program is
# loaded (as a C++ abort in gloo does: exit status -6), and loads normally afterwards.
CRASH_ONCE = '''

import os as _os
from pathlib import Path as _Path

_MARKER = _Path(__file__).with_name("crashed_once")
if _os.environ.get("RANK") == "1" and not _MARKER.exists():
    _MARKER.touch()
    _os.abort()
'''


def test_a_launch_that_crashed_part_way_checks_the_rest_in_a_fresh_launch(tmp_path: Path) -> None:
    first = _compile(*MODELS["mlp"], 2, "ddp", tmp_path / "first")
    crashing = shutil.copytree(first, tmp_path / "crashing")
    (crashing / "model_spmd.py").write_text((crashing / "model_spmd.py").read_text() + CRASH_ONCE)
    last = shutil.copytree(first, tmp_path / "last")

    with pytest.warns(UserWarning, match=r"crashed at world size 2 \(exit status -6\) with 2 of 3 programs not passed"):
        launch = check_many(2, [first, crashing, last], tmp_path)

    assert (crashing / "crashed_once").exists()  # it did crash the first launch
    assert launch.returncode == 0, launch.describe()
    for folder in (first, crashing, last):
        assert result_of(launch, folder).startswith("ok parity ok"), launch.describe()
    assert "the fresh launch of the programs not passed" in launch.stderr
