"""Optimizer-state shares by memory (Cephalo) in uneven data parallelism: the parts of the
flat parameter vector, the weights chosen by memory (against enumeration), the elements the
program's reduce-scatter-v and all-gather-v move (worked by hand), the plan setting read as
untrusted JSON, and the program that runs them. Its parity with one device is checked in
the uneven programs' launch (``tests/test_uneven_program.py``)."""

from __future__ import annotations

import itertools

import pytest

from planner.errors import PlanFileError
from planner.families.uneven_dp.section import UnevenSection
from planner.families.uneven_dp.state_shares import exchange_elements, memory_state_weights, state_parts


def test_parts_follow_the_weights_and_sum_exactly() -> None:
    # 10 elements by 1:1:3:3 -> exact 1.25, 1.25, 3.75, 3.75: floors 1, 1, 3, 3 (8), the two
    # largest remainders (0.75, ranks 2 and 3) take the 2 left over.
    assert state_parts(10, (1, 1, 3, 3)) == (1, 1, 4, 4)
    # 7 by 1:1:1 -> 2.33 each: floors 2, 2, 2, the one left over to the lowest rank on a tie.
    assert state_parts(7, (1, 1, 1)) == (3, 2, 2)
    assert state_parts(5, (0, 2)) == (0, 5)  # a rank of weight 0 holds nothing
    with pytest.raises(ValueError, match="some positive"):
        state_parts(5, (0, 0))


def test_memory_weights_maximise_the_least_room_left_as_enumeration_does() -> None:
    # Every split of 6 units of 600 bytes over three ranks, against the greedy's.
    for rooms in ((1000.0, 400.0, 400.0), (300.0, 300.0, 900.0), (100.0, 700.0, 250.0), (500.0, 500.0, 500.0)):
        best = max(min(room - 100 * w for room, w in zip(rooms, split))
                   for split in itertools.product(range(7), repeat=3) if sum(split) == 6)
        weights = memory_state_weights(rooms, 600.0, scale=6)
        assert sum(weights) == 6
        assert min(room - 100 * w for room, w in zip(rooms, weights)) == best, (rooms, weights)
    # By hand: rooms 1000/400/400, 600 bytes: level t with (1000 - t) + 2 max(0, 400 - t) = 600
    # -> t = 400: all of it on rank 0.
    assert memory_state_weights((1000.0, 400.0, 400.0), 600.0, scale=6) == (6, 0, 0)


def test_the_busiest_rank_of_an_uneven_exchange_by_hand() -> None:
    # Parts 1/1/4/4 of 10 over 4 ranks: rank 2 sends 10 - 4 = 6 and receives 3 x 4 = 12, so the
    # busiest moves 12 (a ring-v would pass the largest part 3 times: 12 too); rank 0 sends 9,
    # receives 3.
    assert exchange_elements((1, 1, 4, 4)) == 12
    # Even parts 3/3/3/3 of 12: each sends 9 and receives 9 = (n - 1) / n x 12, a ring's figure.
    assert exchange_elements((3, 3, 3, 3)) == 9
    # One part of 10 beside three of 0: each other rank sends rank 3 its 10 elements, so rank 3
    # receives 3 x 10 = 30 (and sends nothing).
    assert exchange_elements((0, 0, 0, 10)) == 30


def test_the_setting_is_read_as_untrusted_json_with_one_line_errors() -> None:
    section = UnevenSection.from_json({"shares": [3, 3, 1, 1], "state_shares": [100, 100, 400, 400]}, "p.json")
    assert section.state_shares == (100, 100, 400, 400)
    assert section.to_json()["state_shares"] == [100, 100, 400, 400]
    assert "state_shares" not in UnevenSection((3, 3, 1, 1)).to_json()  # plans without it unchanged
    for bad in ([1, 2], [1, 2, 3, "4"], [0, 0, 0, 0], [1, 2, 3, -1], [1, 2, 3, True], [1, 2, 3, 10**7]):
        with pytest.raises(PlanFileError) as error:
            UnevenSection.from_json({"shares": [3, 3, 1, 1], "state_shares": bad}, "p.json")
        assert "\n" not in str(error.value) and "uneven.state_shares" in str(error.value)
    with pytest.raises(PlanFileError, match="must be a list"):
        UnevenSection.from_json({"shares": [3, 3, 1, 1], "state_shares": "1,1,3,3"}, "p.json")
