"""DeepEP's deduplicated all-to-all in the search and at compile time: offered only when the
user says the trainer runs it (``--moe-dispatch deduplicated``), only where the experts span
nodes, and refused by ``compile`` in one line (compiled programs run flat or two-level)."""

from __future__ import annotations

import dataclasses

import pytest

import planner
from codegen.plan_checks import check_expert_layouts
from planner.api import compile_blocker, prepare_model
from planner.cli import main
from planner.errors import PlanFileError, PlanningError
from planner.plans import Plan
from search.moe_search import layer_candidates, search_moe_plan
from tests.moe_plans import moe_plan
from tests.test_moe_search import SMALL, two_nodes


def _algorithms(cluster, moe_dispatch):
    graph, _, _, cluster = prepare_model(SMALL, cluster)
    block = graph.moe_blocks[0]
    loads = tuple(1 / block.experts for _ in range(block.experts))
    layouts = layer_candidates(block, loads, "uniform", cluster, 1024, "fp32", moe_dispatch=moe_dispatch)
    return {layout.all_to_all for layout in layouts if layout.mode == "expert_parallel"}


def test_deduplicated_is_a_candidate_only_when_asked_and_across_nodes():
    assert _algorithms(two_nodes(), "compiled") == {"flat", "hierarchical"}
    assert _algorithms(two_nodes(), "deduplicated") == {"flat", "hierarchical", "deduplicated"}
    assert _algorithms("cpu:1x4", "deduplicated") == {"flat"}  # one node: nothing to deduplicate


def test_search_with_deepep_is_no_slower_and_uses_it_where_experts_move_across_nodes():
    """The deduplicated all-to-all sends at most the flat one's network bytes, so the search
    over a superset of layouts finds a plan at least as fast; on two nodes over a 10x slower
    network it wins every expert-parallel layer of the plan."""
    cluster = two_nodes()
    graph, spec, name, _ = prepare_model(SMALL, cluster)
    compiled, _ = search_moe_plan(graph, cluster, spec, name)
    deepep, _ = search_moe_plan(graph, cluster, spec, name, moe_dispatch="deduplicated")
    assert deepep.estimate.step_time_s <= compiled.estimate.step_time_s * (1 + 1e-9)
    assert all(layout.all_to_all != "deduplicated" for layout in compiled.expert_layouts)
    parallel = [layout for layout in deepep.expert_layouts if layout.mode == "expert_parallel"]
    assert parallel and all(layout.all_to_all == "deduplicated" for layout in parallel)


def test_compile_refuses_a_deduplicated_layout_in_one_line(tmp_path):
    plan = moe_plan(4, "expert_parallel", "round-robin", nodes=2, all_to_all="hierarchical")
    priced_only = dataclasses.replace(plan, expert_layouts=tuple(
        dataclasses.replace(layout, all_to_all="deduplicated") for layout in plan.expert_layouts))
    assert compile_blocker(plan) is None
    assert Plan.from_dict(priced_only.to_dict()).expert_layouts == priced_only.expert_layouts  # the plan file keeps it
    assert "DeepEP's deduplicated all-to-all, which compiled programs do not run" in compile_blocker(priced_only)
    with pytest.raises(PlanningError, match="plan without --moe-dispatch deduplicated to compile"):
        planner.compile(priced_only, tmp_path / "out")
    # The compiler's own check, for a caller that skips compile_blocker: never compiled as flat.
    model = plan.model.build("meta")[0]
    with pytest.raises(PlanFileError, match=r"expert_layouts\[0\].all_to_all' is 'deduplicated'"):
        check_expert_layouts(priced_only, model)


def test_an_unknown_dispatch_is_one_line(capsys):
    assert main(["plan", "examples/moe.py", "--moe-dispatch", "deepep"]) != 0
    err = capsys.readouterr().err
    assert "argument --moe-dispatch: invalid choice: 'deepep'" in err and "Traceback" not in err
    with pytest.raises(planner.errors.ArgumentError, match="moe_dispatch"):
        planner.plan(SMALL, "cpu:1x2", moe_dispatch="deepep")
