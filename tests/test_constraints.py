"""User constraints on the search (``planner.constraints``): ``--mesh``, ``--max``, ``--family``.

What a user relies on: an impossible constraint is one line naming it and why, before any
tracing where the cluster decides; a possible one gives the fastest plan among those it
allows (never faster than the unconstrained search, which saw more), only such plans appear
as runners-up, and the report says which constraints applied.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import planner
from planner.cli import main
from planner.cluster import Cluster
from planner.constraints import ConstraintError, SearchConstraints
from planner.errors import ArgumentError
from planner.families import family_names, families_of
from user_errors import assert_api_error, assert_user_error

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "examples" / "mlp.py")
GPT = str(ROOT / "examples" / "gpt.py")


# ------------------------------------------------------------------ parsing, checks


def test_command_line_items_parse_into_sizes_and_families():
    constraints = SearchConstraints.from_options(["tp=2", "dp=2,pp=1"], ["pp=4"], ["fsdp,tp", "pipeline"])
    assert dict(constraints.mesh) == {"tp": 2, "dp": 2, "pp": 1}
    assert dict(constraints.max) == {"pp": 4}
    assert constraints.families == {"fsdp", "tp", "pipeline"}
    assert constraints.describe() == "--mesh tp=2,dp=2,pp=1 --max pp=4 --family fsdp,tp,pipeline"
    assert not SearchConstraints().any


@pytest.mark.parametrize(
    "mesh, bounds, families, fragment",
    [
        (["tp"], [], [], "expected AXIS=SIZE"),
        (["tp=two"], [], [], "expected AXIS=SIZE"),
        (["tp=²"], [], [], "expected AXIS=SIZE"),  # a digit to str.isdigit, not to int()
        (["xp=2"], [], [], "no mesh axis 'xp'"),
        (["tp=0"], [], [], "from 1 to"),
        (["tp=99999999999999999999"], [], [], "from 1 to"),
        (["tp=2,tp=4"], [], [], "names axis 'tp' twice"),
        (["pp=8"], ["pp=4"], [], "above --max pp=4"),
        ([], [], ["zero4"], "no such family; families are ddp"),
        (["tp=2"], [], ["fsdp"], "needs the 'tp' family"),
        (["pp=2"], [], ["ddp,tp"], "needs the 'pipeline' family"),
        (["dp=2"], [], ["tp"], "needs a data-parallel family"),
    ],
)
def test_malformed_or_contradictory_constraints_are_one_argument_error(mesh, bounds, families, fragment):
    assert_api_error(lambda: SearchConstraints.from_options(mesh, bounds, families), ArgumentError, fragment)


@pytest.mark.parametrize(
    "mesh, families, cluster, fragment",
    [
        (["tp=3"], [], "cpu:1x4", "3 does not divide the cluster's 4 devices"),
        (["tp=8"], [], "cpu:2x4", "tensor parallelism stays inside a node, which has 4 devices"),
        (["dp=4,tp=2"], [], "cpu:1x4", "multiply to 8 devices"),
        ([], ["moe"], "cpu:1x4", "add a data-parallel family"),
    ],
)
def test_constraints_no_mesh_of_the_cluster_meets_are_refused_before_tracing(mesh, families, cluster, fragment):
    constraints = SearchConstraints.from_options(mesh, [], families)
    assert_api_error(lambda: constraints.check_cluster(Cluster.parse(cluster)), ConstraintError, fragment)


def test_api_takes_a_dict_and_refuses_a_bad_one():
    assert SearchConstraints.coerce({"mesh": {"tp": 2}, "families": ["tp", "ddp"]}).describe() == (
        "--mesh tp=2 --family ddp,tp"
    )
    assert_api_error(lambda: SearchConstraints.coerce({"meshes": {}}), ArgumentError, "unknown key 'meshes'")
    assert_api_error(lambda: SearchConstraints.coerce({"families": "fsdp"}), ArgumentError, "list of family names")
    assert_api_error(lambda: SearchConstraints.coerce(["tp=2"]), ArgumentError, "SearchConstraints or a dict")


# ------------------------------------------------------------------ the search obeys


@pytest.fixture(scope="module")
def unconstrained():
    return planner.plan(GPT, "cpu:1x4", progress=False, effort=0.25)


@pytest.mark.parametrize(
    "constraints, check",
    [
        ({"mesh": {"tp": 2}}, lambda plan: plan.mesh.axis_size("tp") == 2),
        ({"families": ["fsdp"]}, lambda plan: families_of(plan) == {"fsdp"} and plan.mesh.names == ("dp",)),
        ({"mesh": {"pp": 2}}, lambda plan: plan.pipeline is not None and plan.pipeline.stages == 2),
        ({"max": {"tp": 1, "pp": 1}, "families": ["ddp", "zero2"]},
         lambda plan: set(plan.mesh.names) == {"dp"} and plan.dp_flavour in ("ddp", "zero2")),
    ],
    ids=["mesh-tp2", "family-fsdp", "mesh-pp2", "max-and-families"],
)
def test_the_plan_meets_its_constraints_and_is_no_faster_than_the_free_search(unconstrained, constraints, check):
    chosen = planner.plan(GPT, "cpu:1x4", progress=False, effort=0.25, constraints=constraints)
    parsed = SearchConstraints.coerce(constraints)
    assert check(chosen), chosen.name
    assert parsed.allows_plan(chosen)
    # The free search saw every plan the constrained one saw (same work per mesh, same seed).
    assert chosen.estimate.step_time_s >= unconstrained.estimate.step_time_s * (1 - 1e-9)
    assert chosen.search_summary.startswith(f"constrained by {parsed.describe()};")
    assert f"constrained by {parsed.describe()}" in " ".join(chosen.report().split())
    # Runners-up are plans the constraints allowed too (their names carry their mesh).
    for axis, size in parsed.mesh.items():
        assert all(f"{axis}={size}" in alternative.name for alternative in chosen.runners_up)


def test_data_parallel_only_search_obeys_families_too():
    chosen = planner.plan(MLP, "cpu:1x2", progress=False, search="dp", constraints={"families": ["zero1"]})
    assert chosen.dp_flavour == "zero1"
    assert_api_error(
        lambda: planner.plan(MLP, "cpu:1x2", progress=False, dp_flavour="ddp", constraints={"families": ["fsdp"]}),
        ConstraintError, "not among the families",
    )


# ------------------------------------------------------------------ the command line


def test_families_lists_every_family_in_one_line_each(capsys):
    assert main(["families"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    names = [line.split()[0] for line in out.splitlines()]
    assert names == list(family_names())
    assert all(len(line) <= 80 for line in out.splitlines())


def test_an_impossible_mesh_is_one_line_before_tracing(capsys):
    assert_user_error(capsys, ["plan", GPT, "--cluster", "cpu:1x4", "--mesh", "tp=3"], "--mesh tp=3", "does not divide")
    assert_user_error(capsys, ["plan", GPT, "--cluster", "cpu:1x4", "--family", "zero4"], "no such family")


def test_a_dp_the_batch_cannot_take_is_one_line(capsys):
    # A global batch of 6 on 4 devices: dp=4 divides the devices but not the batch (known
    # only once the model is built, so this one comes after tracing).
    assert_user_error(
        capsys, ["plan", MLP, "--cluster", "cpu:1x4", "--set", "batch_size=6", "--mesh", "dp=4"],
        "--mesh dp=4", "does not split over 4",
    )
