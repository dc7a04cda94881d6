"""The op-by-op search skips a mesh whose plans cannot beat a fitting plan found already
(``search.mesh_search.compute_lower_bound``): the bound must never exceed what the simulator
then charges, or a mesh that could win would be skipped."""

from __future__ import annotations

import pytest

from planner.api import prepare_model
from planner.cluster import Cluster
from planner.model_spec import ModelSpec
from planner.strategy import Mesh
from search.budget import SearchBudget
from search.mesh_search import compute_lower_bound, mesh_tables, searched_plans

SPEC = ModelSpec("examples/gpt.py", {"n_layer": 2, "n_embd": 256, "n_head": 4, "seq_len": 128, "vocab_size": 1024,
                                     "batch_size": 8})
MESHES = (Mesh((("dp", 4),)), Mesh((("dp", 2), ("tp", 2))), Mesh((("tp", 4),)))


@pytest.fixture(scope="module")
def traced():
    cluster = Cluster.preset("dgx-a100-80g", nodes=1, devices_per_node=4)
    graph, _, name, cluster = prepare_model(SPEC, cluster)
    return graph, cluster, name


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_bound_is_below_the_searched_plans_compute(traced, mesh):
    """Every plan the search returns on the mesh (the searched one, recomputing, other dp
    flavours) computes at least the bound on its busiest compute stream."""
    graph, cluster, name = traced
    _, tables = mesh_tables(graph, cluster, None, name, mesh, "bf16")
    bound = compute_lower_bound(tables)
    plans = searched_plans(graph, cluster, None, name, mesh, "ilp", SearchBudget(effort=0.1), 0, (), "bf16", [])
    assert plans and bound > 0
    for plan in plans:
        assert bound <= plan.estimate.compute_s * (1 + 1e-9) <= plan.estimate.step_time_s * (1 + 1e-9)


def test_a_mesh_that_cannot_beat_a_found_plan_is_not_searched(traced):
    """Given a fitting plan's step no slower than the bound, the mesh returns no plan and the
    summary says why; given a slower one, it is searched as before."""
    graph, cluster, name = traced
    mesh = MESHES[1]
    _, tables = mesh_tables(graph, cluster, None, name, mesh, "bf16")
    bound = compute_lower_bound(tables)
    notes: list[str] = []
    budget = SearchBudget(effort=0.1)
    assert searched_plans(graph, cluster, None, name, mesh, "ilp", budget, 0, (), "bf16", notes, beat=bound) == []
    assert notes == [f"mesh {mesh}: not searched, its ops' compute alone takes {bound:.3g} s, no faster than the "
                     f"{bound:.3g} s of a plan found already"]
    assert searched_plans(graph, cluster, None, name, mesh, "ilp", budget, 0, (), "bf16", [], beat=2 * bound)
