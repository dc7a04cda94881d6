"""The busiest device's load of one micro-batch (``cost_model.expert_load``), by hand."""

from __future__ import annotations

import random

import pytest

from cost_model.expert_load import busiest_load, expected_maximum_of_normals


def test_blom_expected_maximum_of_normals():
    # Phi^-1((D - 0.375) / (D + 0.25)): D = 2 -> Phi^-1(0.7222) = 0.5895 (exact 1/sqrt(pi) =
    # 0.5642); D = 4 -> Phi^-1(0.8529) = 1.0491 (exact 1.0294).
    assert expected_maximum_of_normals(1) == 0.0
    assert expected_maximum_of_normals(2) == pytest.approx(0.5895, abs=1e-4)
    assert expected_maximum_of_normals(4) == pytest.approx(1.0491, abs=1e-4)


def test_even_shares_still_leave_one_device_busiest():
    # 8 devices expecting 1024 of 8192 copies each: sigma = sqrt(1024 x 7/8) = 29.93, z_8 =
    # Phi^-1(7.625 / 8.25) = 1.4342, so the busiest carries 1024 + 42.93 = 1066.93 (4.2% over
    # the mean); at 1/64 of the batch (128 each) sigma = 10.58 and it is 15.2 = 11.9% over.
    assert busiest_load([1024.0] * 8, 8192) == pytest.approx(1024 + 1.4342 * (1024 * 7 / 8) ** 0.5, rel=1e-4)
    assert busiest_load([128.0] * 8, 1024) == pytest.approx(128 + 1.4342 * (128 * 7 / 8) ** 0.5, rel=1e-4)


def test_the_estimate_matches_sampled_routing():
    """Against the stated distribution itself: 8,192 copies dropped uniformly on 8 devices,
    2,000 micro-batches; the mean busiest count is within 1% of the estimate."""
    draw = random.Random(7)
    busiest = []
    for _ in range(2000):
        counts = [0] * 8
        for _ in range(8192):
            counts[draw.randrange(8)] += 1
        busiest.append(max(counts))
    assert sum(busiest) / len(busiest) == pytest.approx(busiest_load([1024.0] * 8, 8192), rel=0.01)


def test_a_single_device_or_no_copies_has_no_chance_excess():
    assert busiest_load([300.0], 300) == 300.0
    assert busiest_load([0.0, 0.0], 0) == 0.0
    assert busiest_load([], 10) == 0.0
    assert busiest_load([1.0, 1.0], 2) <= 2.0  # never more than every copy
