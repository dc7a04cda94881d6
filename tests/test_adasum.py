"""The ``adasum`` family: the combination rule, its section, its price and its program.

The distributed test runs Adasum over 8 real gloo processes: the recursive doubling over
2, 4 and 8 ranks and the compiled program's DDP hook (hierarchical: 4 nodes of 2) against
the single-process reference ``adasum_tree`` (``tests/adasum_worker.py``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import planner
from cost_model.collectives import collective_time
from cost_model.compute import roofline_time
from cost_model.simulator import Simulator
from planner.cluster import Cluster
from planner.errors import PlanFileError, PlanningError
from planner.families.adasum.costs import adasum_bucket_seconds
from planner.families.adasum.runtime import adasum_pair, adasum_tree
from planner.families.adasum.section import AdasumSection
from planner.model_spec import ModelSpec
from torchrun_run import torchrun

REPO = Path(__file__).resolve().parents[1]
MLP = ModelSpec(str(REPO / "examples/mlp.py"), {"batch_size": 16, "in_features": 8, "hidden": 8, "out_features": 4,
                                                 "layers": 2})


# ------------------------------------------------------------------------------ the rule


def test_the_pair_rule_worked_by_hand() -> None:
    # g1 = (1, 0), g2 = (1, 1): g1.g2 = 1, |g1|^2 = 1, |g2|^2 = 2, so
    # (1 - 1/2) (1, 0) + (1 - 1/4) (1, 1) = (0.5 + 0.75, 0.75) = (1.25, 0.75).
    got = adasum_pair(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(got, torch.tensor([1.25, 0.75]))
    # Equal gradients give their average (each coefficient 1/2), orthogonal ones their sum.
    g = torch.tensor([3.0, -4.0])
    torch.testing.assert_close(adasum_pair(g, g), g)
    torch.testing.assert_close(adasum_pair(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 5.0])), torch.tensor([2.0, 5.0]))
    # A zero gradient keeps coefficient 1: the other passes unchanged (no division by zero).
    torch.testing.assert_close(adasum_pair(torch.zeros(2), g), g)


def test_the_tree_combines_neighbours_first_and_tensor_by_tensor() -> None:
    a, b, c, d = (torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 2.0]), torch.tensor([0.0, 2.0]))
    # ((a, b), (c, d)): (1.25, 0.75) and (0, 2) -> dot 1.5, norms 2.125 and 4:
    # (1 - 1.5/4.25) (1.25, 0.75) + (1 - 1.5/8) (0, 2).
    first, second = 1 - 1.5 / 4.25, 1 - 1.5 / 8
    expected = torch.tensor([first * 1.25, first * 0.75 + second * 2])
    torch.testing.assert_close(adasum_tree([a, b, c, d], [2]), expected)
    # Per tensor (as Horovod): (1, 2) and (1, -2) cut into two one-element tensors give
    # 1 and 1 -> equal -> 1; 2 and -2 -> dot -4, norms 4 -> (1 + 1/2) 2 + (1 + 1/2) (-2) = 0.
    # As one tensor they would give dot -3, norms 5: 1.3 (1, 2) + 1.3 (1, -2) = (2.6, 0).
    g1, g2 = torch.tensor([1.0, 2.0]), torch.tensor([1.0, -2.0])
    torch.testing.assert_close(adasum_tree([g1, g2], [1, 1]), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(adasum_tree([g1, g2], [2]), torch.tensor([2.6, 0.0]))
    with pytest.raises(ValueError, match="power of two of gradients, got 3"):
        adasum_tree([a, b, c], [2])


# ------------------------------------------------------------------------------ the section


@pytest.fixture(scope="module")
def adasum_plan() -> planner.Plan:
    """The MLP on 4 nodes of 2 CPU devices, ``--family adasum``: hierarchical, 4 copies."""
    return planner.plan(MLP, "cpu:4x2", constraints={"families": ["adasum"]}, precision="fp32")


def test_the_search_builds_hierarchical_adasum_only_when_asked(adasum_plan) -> None:
    assert adasum_plan.sections["adasum"] == AdasumSection(2)
    assert adasum_plan.dp_flavour == "ddp" and adasum_plan.mesh.names == ("dp",)
    assert "adasum 4 nodes x avg 2" in adasum_plan.name
    # Without --family adasum the search never picks it: it is not a speed-up.
    plain = planner.plan(MLP, "cpu:4x2", precision="fp32")
    assert "adasum" not in plain.sections and all("adasum" not in p.name for p in plain.runners_up)


def test_the_section_round_trips_and_refuses_bad_input_in_one_line(adasum_plan, tmp_path) -> None:
    saved = tmp_path / "p.json"
    adasum_plan.save(saved)
    assert json.loads(saved.read_text())["adasum"] == {"local": 2}
    assert planner.load_plan(saved).sections["adasum"] == AdasumSection(2)
    for data, why in (([], "must be a JSON object"), ({"local": 2, "x": 1}, "unknown key 'x'"), ({}, "is missing"),
                      ({"local": True}, "must be an integer from 1"), ({"local": 0}, "must be an integer from 1")):
        with pytest.raises(PlanFileError) as error:
            AdasumSection.from_json(data, "plan file 'p.json'")
        assert why in str(error.value) and len(str(error.value).splitlines()) == 1


def test_a_count_that_is_not_a_power_of_two_is_refused_in_one_line(adasum_plan) -> None:
    with pytest.raises(PlanningError) as error:
        planner.plan(MLP, "cpu:1x3", constraints={"families": ["adasum"]}, precision="fp32")
    message = str(error.value)
    assert message.startswith("Adasum combines gradients pairwise, so it needs a power of two of copies") \
        and "has 3 ranks; use 2 devices" in message and len(message.splitlines()) == 1
    # 3 nodes of 2 average inside nodes and then need 3 copies: refused too, naming nodes.
    twelve = ModelSpec(MLP.source, {**MLP.overrides, "batch_size": 12})
    with pytest.raises(PlanningError, match="has 3 nodes; use 4 devices"):
        planner.plan(twelve, "cpu:3x2", constraints={"families": ["adasum"]}, precision="fp32")
    with pytest.raises(ValueError, match="a ddp plan on a mesh of dp alone, but the plan is fsdp"):
        dataclasses.replace(adasum_plan, dp_flavour="fsdp")


# ------------------------------------------------------------------------------ the price


def test_a_bucket_costs_the_node_all_reduce_then_log2_swaps_and_combinations() -> None:
    cluster = Cluster.preset("dgx-a100-80g", nodes=4)  # 4 nodes of 8: 4 copies, 2 swaps
    ranks, size = list(range(32)), 25 * 2**20
    device = cluster.device_of(0)
    # By hand: one all-reduce over the node's 8 ranks; swaps at distance 1 and 2 nodes
    # (ranks 0 <-> 8 and 0 <-> 16, 8 pairs per node at once); after each, 9 flops and 9
    # passes over a bucket-sized buffer per element (dots 4, combination 5; fp32: 25 MiB / 4 B).
    elements = size / 4
    combine = roofline_time(9 * elements, 9 * size, device, "float32")
    expected = (collective_time("all_reduce", size, cluster, ranks[:8])
                + collective_time("send_recv", size, cluster, [0, 8], 8) + combine
                + collective_time("send_recv", size, cluster, [0, 16], 8) + combine)
    assert adasum_bucket_seconds(cluster, device, ranks, 8, size, "fp32") == pytest.approx(expected)
    # Flat over 4 single-device nodes (local 1): no all-reduce, the same two swaps, alone.
    flat = Cluster.preset("dgx-a100-80g", nodes=4, devices_per_node=1)
    expected_flat = sum(collective_time("send_recv", size, flat, [0, d], 1) + combine for d in (1, 2))
    assert adasum_bucket_seconds(flat, device, [0, 1, 2, 3], 1, size, "fp32") == pytest.approx(expected_flat)


def test_the_simulated_step_carries_the_adasum_tasks(adasum_plan) -> None:
    # The MLP's fp32 gradients fill one bucket (under DDP's 1 MiB first bucket): one hooked
    # bucket of all of them, priced by adasum_bucket_seconds (worked by hand above).
    elements = sum(meta.numel for meta in adasum_plan.graph.parameters.values())
    events = {event.name: event.duration_s for event in Simulator(adasum_plan, adasum_plan.graph).run().timeline
              if event.name.startswith("adasum grads")}
    assert len(events) == 1
    cluster = adasum_plan.cluster
    expected = adasum_bucket_seconds(cluster, cluster.device_of(0), list(range(8)), 2, elements * 4, "fp32")
    assert list(events.values())[0] == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------------------ the program


@pytest.mark.distributed
def test_adasum_over_8_gloo_ranks_equals_the_single_process_reference(adasum_plan, tmp_path) -> None:
    folder = planner.compile(adasum_plan, tmp_path / "out")
    source = (folder / "model_spmd.py").read_text()
    assert "ddp.register_comm_hook(state, adasum_hook)" in source and "LOCAL_RANKS = 2" in source
    stdout = torchrun(8, str(REPO / "tests/adasum_worker.py"), str(folder))
    # 3 exchanges (2, 4, 8 ranks) and the program's 4 parameters (2 linear layers).
    assert "adasum ok 7" in stdout
    # --check has no one-device step to match: refused before the process group starts.
    refused = torchrun(1, str(folder / "launch.py"), "--check", fails=True)
    assert "error: --check compares with one device's step, but Adasum combines the ranks' gradients" in refused
