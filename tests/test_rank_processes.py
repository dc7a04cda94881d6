"""``tests/rank_processes.py`` starts ranks as torchrun's workers and stops them as torchrun does."""

from __future__ import annotations

import time
from pathlib import Path

from rank_processes import launch_ranks  # this folder is on sys.path under pytest

# A rank that prints its environment as torchrun's worker sees it, then fails with status 3 as
# rank 1, or waits a minute (a rank blocked in a collective the failed rank never joins). The
# failing rank first waits (up to 20 s) until every rank has printed: otherwise, on a loaded
# machine, a rank still starting Python is killed before it prints (seen in a full-suite run).
SCRIPT = """
import os, sys, time
from pathlib import Path
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
print(" ".join(f"{name}={os.environ[name]}" for name in names), flush=True)
print("said on stderr", file=sys.stderr, flush=True)
Path(f"printed.{os.environ['RANK']}").touch()
if os.environ["RANK"] == sys.argv[1]:
    deadline = time.monotonic() + 20
    while len(list(Path().glob("printed.*"))) < int(os.environ["WORLD_SIZE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
time.sleep(60)
"""


def test_a_failed_rank_stops_the_others_and_gives_the_launch_its_status(tmp_path: Path) -> None:
    (tmp_path / "rank.py").write_text(SCRIPT)
    started = time.monotonic()
    status, stdout, stderr = launch_ranks(3, tmp_path / "rank.py", ["1"], tmp_path, timeout=50)
    assert status == 3 and time.monotonic() - started < 30  # not the 60 s the others would wait
    assert stdout.splitlines() == [
        f"RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1" for rank in range(3)
    ]
    assert stderr.splitlines() == ["said on stderr"] * 3


def test_a_launch_past_its_timeout_is_killed_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "rank.py").write_text(SCRIPT)
    started = time.monotonic()
    status, _, _ = launch_ranks(2, tmp_path / "rank.py", ["none"], tmp_path, timeout=1)
    # Both ranks would sleep 60 s: back well before, they were killed (launch_ranks waits for them).
    assert status is None and time.monotonic() - started < 30


def test_every_rank_exiting_zero_is_status_zero(tmp_path: Path) -> None:
    (tmp_path / "rank.py").write_text("import os; print(os.environ['RANK'])")
    assert launch_ranks(2, tmp_path / "rank.py", [], tmp_path, timeout=50)[:2] == (0, "0\n1\n")
