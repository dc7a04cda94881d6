"""Expert placement (``search.expert_placement``): EPLB's replication and packing worked by
hand, our LP shares and swaps never worse than EPLB, round-robin as the baseline."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import PlanningError
from planner.routing import zipf_layer
from planner.strategy import ExpertPlacement
from search.expert_placement import (
    balanced,
    balanced_packing,
    best_shares,
    eplb,
    load_balance,
    replica_counts,
    round_robin,
)


def test_replicas_go_to_the_largest_load_per_copy():
    # [6, 3, 1] with 5 slots: one each, then 6/1 is largest (-> 2 copies), then 3.0 vs 3.0:
    # the lower index wins (-> expert 0 has 3).
    assert replica_counts([6, 3, 1], 5) == [3, 1, 1]
    assert replica_counts([1, 1], 2) == [1, 1]
    with pytest.raises(PlanningError, match="cannot hold 3 experts"):
        replica_counts([1, 1, 1], 2)


def test_balanced_packing_heaviest_first_into_the_lightest_pack_with_room():
    # 5 -> p0, 4 -> p1, 3 -> p2, 3 -> p2 (lightest), 2 -> p1, 1 -> p0: every pack weighs 6.
    assert balanced_packing([5, 4, 3, 3, 2, 1], 3) == [[0, 5], [1, 4], [2, 3]]
    with pytest.raises(PlanningError, match="do not split evenly"):
        balanced_packing([1, 2, 3], 2)


def test_eplb_worked_by_hand():
    # Loads [6, 3, 1, 2], 2 devices x 3 slots: copies [3, 1, 1, 1] (expert 0's copies weigh 2
    # each). Packing: expert 1 (3) -> d0; e0 (2) -> d1; e0 -> d1; e0 -> d0; e3 (2) -> d1;
    # e2 (1) -> d0. Device 1 holds two copies of expert 0: one copy with both shares.
    placement = eplb([6, 3, 1, 2], devices=2, slots_per_device=3)
    assert placement.replicas[0] == ((0, pytest.approx(1 / 3)), (1, pytest.approx(2 / 3)))
    assert placement.replicas[1:] == (((0, 1.0),), ((0, 1.0),), ((1, 1.0),))
    assert placement.device_loads([6, 3, 1, 2]) == pytest.approx([6, 6])
    assert placement.method == "EPLB (global)"


def test_eplb_hierarchical_keeps_each_group_on_one_node():
    loads = [8, 1, 1, 1, 4, 4, 1, 1]  # 4 groups of 2 experts: group loads 9, 2, 8, 2
    placement = eplb(loads, devices=4, slots_per_device=3, devices_per_node=2, groups=4)
    assert placement.method == "EPLB (hierarchical)"
    node_of = {e: {d // 2 for d, _ in copies} for e, copies in enumerate(placement.replicas)}
    for group in range(4):
        assert len(node_of[2 * group] | node_of[2 * group + 1]) == 1
    # Group loads 9, 2, 8, 2 packed two per node: 9 -> node 0, 8 -> node 1, 2 (group 1) -> node 1
    # (lighter), 2 (group 3) -> node 0.
    assert node_of[0] == node_of[6] == {0} and node_of[4] == node_of[2] == {1}


def test_shares_from_the_lp_balance_a_hot_expert_exactly():
    # Expert 0 (load 5) on both devices, expert 1 (load 1) on device 1: device loads 5a and
    # 5(1 - a) + 1 are equal at a = 0.6, both 3 (EPLB's equal thirds give 3.33 and 2.67).
    placement = best_shares([5, 1], [[0, 1], [1]], devices=2, method="test")
    assert placement.replicas[0] == ((0, pytest.approx(0.6)), (1, pytest.approx(0.4)))
    assert placement.device_loads([5, 1]) == pytest.approx([3, 3])
    assert max(eplb([5, 1], 2, 2).device_loads([5, 1])) == pytest.approx(10 / 3)
    assert max(balanced([5, 1], 2, 2).device_loads([5, 1])) == pytest.approx(3)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 20), min_size=4, max_size=8), st.sampled_from([1, 2]))
def test_ours_is_never_worse_than_eplb(loads, extra_slots):
    loads = [float(v) + 0.5 for v in loads]
    devices = 2 if len(loads) % 2 == 0 else 1
    slots = len(loads) // devices + extra_slots
    ours, theirs = balanced(loads, devices, slots), eplb(loads, devices, slots)
    assert max(ours.device_loads(loads)) <= max(theirs.device_loads(loads)) + 1e-9
    # The busiest device is at least the mean and at least any single expert's share of it.
    assert max(ours.device_loads(loads)) >= sum(loads) / devices - 1e-9


def test_lp_shares_reach_the_best_split_over_the_holders_found_by_enumeration():
    # For fixed holders the LP's busiest load is the least any shares give: compare with a
    # grid over the shares of the two copied experts.
    loads, holders = [7.0, 4.0, 2.0, 1.0], [[0, 1], [1, 2], [2], [0]]
    placement = best_shares(loads, holders, 3, "test")
    best = min(
        max(7 * a + 1, 7 * (1 - a) + 4 * b, 4 * (1 - b) + 2)
        for a, b in itertools.product([i / 200 for i in range(201)], repeat=2)
    )
    assert max(placement.device_loads(loads)) == pytest.approx(best, abs=0.05)


def test_sixty_four_zipf_experts_on_sixty_four_devices():
    """Round-robin's busiest device carries the hottest expert whole; EPLB's copies spread
    it; ours evens the copies' shares out further."""
    loads = list(zipf_layer(64, 1.2).token_share)
    rr = load_balance(round_robin(64, 64), loads)[1]
    theirs = load_balance(eplb(loads, 64, 2, devices_per_node=8), loads)[1]
    ours = load_balance(balanced(loads, 64, 2, devices_per_node=8), loads)[1]
    assert rr == pytest.approx(64 * loads[0])  # the hottest expert alone on a device
    assert ours <= theirs < rr and ours < 1.1


def test_placements_are_checked():
    with pytest.raises(ValueError, match="sum to"):
        ExpertPlacement(2, (((0, 0.5),),))
    with pytest.raises(ValueError, match="two copies on one device"):
        ExpertPlacement(2, (((0, 0.5), (0, 0.5)),))
    with pytest.raises(ValueError, match="devices must be in 0..1"):
        ExpertPlacement(2, (((2, 1.0),),))
    with pytest.raises(PlanningError, match="divide evenly"):
        round_robin(6, 4)
    with pytest.raises(PlanningError, match="at least 2 slots"):
        eplb([1.0] * 6, devices=4, slots_per_device=1)


def test_copy_groups_only_of_grids():
    # A grid: 4 experts, 2 per device, each on 2 devices; devices 1 and 3 hold experts 0-1.
    grid = ExpertPlacement(4, (((1, 0.5), (3, 0.5)),) * 2 + (((0, 0.5), (2, 0.5)),) * 2)
    assert grid.copy_groups == ((0, 2), (1, 3)) and grid.copies_per_expert == 2
    assert ExpertPlacement.copied_grid(8, 32, 1).copy_groups == tuple(tuple(range(4 * g, 4 * g + 4)) for g in range(8))
    assert ExpertPlacement.copied_grid(4, 4, 4).copy_groups == ((0, 1, 2, 3),)
    assert ExpertPlacement.round_robin(4, 4).copy_groups == ((0,), (1,), (2,), (3,))  # one copy each: a grid of 1
    # Not grids: a hot expert copied beside single ones; a device holding no expert; copies of
    # one expert on devices that hold different experts; groups of different sizes.
    assert ExpertPlacement(2, (((0, 0.5), (1, 0.5)), ((1, 1.0),))).copy_groups is None
    assert ExpertPlacement(3, (((0, 0.5), (1, 0.5)), ((0, 0.5), (1, 0.5)))).copy_groups is None
    assert ExpertPlacement(4, (((0, 0.5), (1, 0.5)), ((1, 0.5), (2, 0.5)), ((3, 1.0),))).copy_groups is None
    assert ExpertPlacement(3, (((0, 0.5), (1, 0.5)), ((2, 1.0),))).copy_groups is None
    with pytest.raises(ValueError, match="3 experts per device do not divide 8 experts"):
        ExpertPlacement.copied_grid(8, 32, 3)
    with pytest.raises(ValueError, match="8 groups of 1 expert"):
        ExpertPlacement.copied_grid(8, 12, 1)


def _loads_one_by_one(placement: ExpertPlacement, expert_loads: list[float]) -> list[float]:
    """``device_loads`` as its definition reads: every copy of every expert, in expert order."""
    loads = [0.0] * placement.devices
    for expert, copies in enumerate(placement.replicas):
        for device, share in copies:
            loads[device] += expert_loads[expert] * share
    return loads


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=16, max_size=16))
def test_device_loads_are_the_per_copy_sums_bit_for_bit(expert_loads):
    # Grids and round-robin take the per-copy-set path, the hand-made ones (a hot expert's copy
    # beside a single expert, uneven shares) the per-copy loop; every sum is the same float
    # (the grid's predicted step times do not move by a bit).
    placements = [ExpertPlacement.copied_grid(16, 64, 16), ExpertPlacement.copied_grid(16, 32, 4),
                  ExpertPlacement.round_robin(16, 8),
                  ExpertPlacement(4, (((0, 0.3), (1, 0.7)),) + tuple(((e % 4, 1.0),) for e in range(1, 16))),
                  ExpertPlacement(4, (((0, 0.25), (1, 0.75)),) * 8 + (((2, 0.5), (3, 0.5)),) * 8)]
    for placement in placements:
        assert placement.device_loads(expert_loads) == _loads_one_by_one(placement, expert_loads)


def test_a_copied_grid_holds_one_tuple_of_copies_per_group():
    # 256 experts copied over 2,048 devices (DeepSeek-V3 at EP1 over 2,048 dp ranks): the same
    # pairs as one tuple per expert, but 2,048 of them held once, not 256 x 2,048.
    grid = ExpertPlacement.copied_grid(256, 2048, 256)
    assert all(copies is grid.replicas[0] for copies in grid.replicas)
    assert grid.replicas[255] == tuple((device, 1.0 / 2048) for device in range(2048))
    eight = ExpertPlacement.copied_grid(256, 2048, 32)  # EP8: 8 groups of 32 experts, 256 copies each
    assert eight.replicas[33] is eight.replicas[63] and eight.replicas[33] == tuple(
        (256 + copy, 1.0 / 256) for copy in range(256))
    assert eight.device_loads([1.0] * 256) == [32 / 256] * 2048
