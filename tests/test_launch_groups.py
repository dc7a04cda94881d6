"""The session's shared parity launches (``tests/launch_groups.py``), with a stand-in for
``check_many`` that records each launch instead of starting processes: groups of one world
size share one launch, a group's failure to prepare stays its own, a failed launch fails
every group in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch_groups import Group, ParityLaunches


class Recorder:
    """``check_many``'s signature; returns a stand-in launch naming what it was given."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[int, list[str], list[str], float]] = []
        self.fail = fail

    def __call__(self, world, programs, cwd, in_float64, timeout):
        self.calls.append((world, [Path(p).name for p in programs], [Path(p).name for p in in_float64], timeout))
        assert not self.fail, f"dist_check_many.py failed at world size {world}"
        return f"launch {len(self.calls)}"


def group(name: str, world: int, programs: tuple[str, ...] = (), float64: tuple[str, ...] = (), error: str = "") -> Group:
    def prepare(root: Path, asked_world: int):
        assert asked_world == world
        if error:
            raise RuntimeError(error)
        return f"value of {name}", [root / p for p in programs], [root / p for p in float64]
    return Group(f"m.{name}.world{world}", "m", world, prepare)


def test_groups_of_one_world_size_share_one_launch(tmp_path_factory) -> None:
    a, b = group("a", 2, ("a1", "a2")), group("b", 2, ("b1",), float64=("b64",))
    c = group("c", 4, ("c1",))
    recorder = Recorder()
    launches = ParityLaunches(tmp_path_factory, [a, b, c], recorder, timeout_per_group=300)
    assert launches.result(b) == ("value of b", "launch 1")
    assert launches.result(a) == ("value of a", "launch 1")  # no second launch
    # The group asked for first, then the others; each group's timeout summed (2 x 300 s).
    assert recorder.calls == [(2, ["b1", "a1", "a2"], ["b64"], 600)]
    assert launches.result(c) == ("value of c", "launch 2")
    assert recorder.calls[1] == (4, ["c1"], [], 300)


def test_a_group_that_fails_to_prepare_fails_alone(tmp_path_factory) -> None:
    good, bad = group("good", 2, ("g1",)), group("bad", 2, ("x",), error="no such model")
    recorder = Recorder()
    launches = ParityLaunches(tmp_path_factory, [good, bad], recorder, timeout_per_group=300)
    with pytest.raises(RuntimeError, match="no such model"):
        launches.result(bad)
    assert launches.result(good) == ("value of good", "launch 1")
    assert recorder.calls == [(2, ["g1"], [], 300)]


def test_a_failed_launch_fails_every_group_in_it(tmp_path_factory) -> None:
    a, b = group("a", 8, ("a1",)), group("b", 8, ("b1",))
    launches = ParityLaunches(tmp_path_factory, [a, b], Recorder(fail=True), timeout_per_group=300)
    for each in (a, b):
        with pytest.raises(AssertionError, match="failed at world size 8"):
            launches.result(each)


def test_a_group_not_listed_is_still_prepared_when_asked_for(tmp_path_factory) -> None:
    listed, unlisted = group("listed", 2, ("l1",)), group("unlisted", 2, ("u1",))
    recorder = Recorder()
    launches = ParityLaunches(tmp_path_factory, [listed], recorder, timeout_per_group=300)
    assert launches.result(unlisted) == ("value of unlisted", "launch 1")
    assert recorder.calls == [(2, ["u1", "l1"], [], 600)]


def test_a_group_asked_for_after_its_world_sizes_launch_gets_its_own(tmp_path_factory) -> None:
    early, late = group("early", 2, ("e1",)), group("late", 2, ("l1",))
    recorder = Recorder()
    launches = ParityLaunches(tmp_path_factory, [early], recorder, timeout_per_group=300)
    assert launches.result(early) == ("value of early", "launch 1")
    assert launches.result(late) == ("value of late", "launch 2")
    assert recorder.calls == [(2, ["e1"], [], 300), (2, ["l1"], [], 300)]
