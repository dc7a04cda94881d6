"""Uneven tensor parallelism (``planner/families/uneven_tp/``, ACCPAR), without processes: the
exact per-layer choice, the section, the costs worked by hand, the search and the report.

- ``best_layer_split`` equals the best kind and integer shares found by enumerating
  every split on small cases, and says None when nothing fits.
- The section round-trips through the plan JSON; each malformed value is one line naming the
  field; a section that does not fit its plan is refused when the plan is made.
- Costs: on the mixed CPU cluster with kernel overheads 0 every op's time is linear in its
  work and a fast device does twice a slow one's work in the same time. A layer split with
  shares 96/96/32/32 of 256 then takes, on the fast ranks, 96/256 / 2 = 0.1875 of the slow
  device's time for the whole layer (the slow ranks 32/256 = 0.125): the fast ranks are its
  stragglers. The collectives: ``collective_time`` for the sizes worked out below.
- The search: the shares follow speed (2:1 on the mixed cluster), beat the even split, and
  ``--family uneven-tp`` gives the plan; one kind of device gets none.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import planner
from cost_model.collectives import collective_time
from cost_model.compute import op_times
from cost_model.simulator import simulated
from planner.cluster import Cluster
from planner.constraints import SearchConstraints
from planner.errors import PlanFileError
from planner.families import families_of
from planner.families.uneven_tp.candidates import choose_splits, memory_fractions, uneven_tp_candidates, uneven_tp_plan
from planner.families.uneven_tp.ratios import KindTerms, best_layer_split, layer_objective
from planner.families.uneven_tp.costs import layer_terms, whole_op_seconds
from planner.families.uneven_tp.regions import split_dimensions
from planner.families.uneven_tp.section import LayerSplit, UnevenTpSection
from planner.model_spec import ModelSpec
from planner.plans import Plan

REPO = Path(__file__).resolve().parents[1]
MIXED = REPO / "examples/clusters/mixed.toml"
SOURCE = "plan file 'p.json'"


# ------------------------------------------------------------------------------ the ratios


def best_by_enumeration(options: list[KindTerms]) -> float | None:
    """The least modelled seconds over every kind and every integer split (1..cap each)."""
    best = None
    for terms in options:
        for shares in itertools.product(*(range(1, min(cap, terms.dim) + 1) for cap in terms.caps)):
            if sum(shares) == terms.dim:
                value = layer_objective(terms, shares)
                best = value if best is None else min(best, value)
    return best


kind_terms = st.builds(
    lambda kind, dim, ranks, comm, per_max: KindTerms(
        kind, dim, tuple(r[0] * 1e-3 for r in ranks), tuple(r[1] * 1e-4 for r in ranks), tuple(r[2] for r in ranks),
        comm * 1e-3, per_max * 1e-4),
    st.sampled_from(("batch", "column", "row")), st.integers(2, 9),
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9), st.integers(0, 7)), min_size=3, max_size=3),
    st.integers(0, 4), st.integers(0, 6),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(kind_terms, min_size=1, max_size=3, unique_by=lambda terms: terms.kind))
def test_the_best_kind_and_shares_equal_enumeration(options) -> None:
    choice = best_layer_split(options)
    best = best_by_enumeration(options)
    if best is None:
        assert choice is None
        return
    assert choice is not None
    terms = next(t for t in options if t.kind == choice.kind)
    assert sum(choice.shares) == terms.dim and all(1 <= s <= c for s, c in zip(choice.shares, terms.caps))
    assert choice.seconds == pytest.approx(best, rel=1e-12)


def test_shares_follow_speed_stop_at_memory_and_weigh_the_gather() -> None:
    # Rank 1 three times slower per unit: of 8 units rank 0 takes 6 (6 x 1 = 2 x 3).
    fast_slow = KindTerms("column", 8, (0.0, 0.0), (1.0, 3.0), (8, 8), 0.0, 0.0)
    assert best_layer_split([fast_slow]).shares == (6, 2)
    # Its memory holds 4: the slow rank takes the rest.
    assert best_layer_split([dataclasses.replace(fast_slow, caps=(4, 8))]).shares == (4, 4)
    # A padded gather costs 10 per unit of the largest share: 6/2 costs 6 + 60 = 66, 4/4
    # costs 12 + 40 = 52, 5/3 costs 9 + 50 = 59: the gather pulls the shares back to even.
    assert best_layer_split([dataclasses.replace(fast_slow, per_max=10.0)]).shares == (4, 4)
    # Of two kinds, the cheaper: a row split whose all-reduce costs 1 more than the column's gather.
    row = dataclasses.replace(fast_slow, kind="row", comm=1.0)
    assert best_layer_split([row, fast_slow]).kind == "column"
    # Nothing fits: a rank with no room, or the caps below the dimension.
    assert best_layer_split([dataclasses.replace(fast_slow, caps=(0, 8))]) is None
    assert best_layer_split([dataclasses.replace(fast_slow, caps=(3, 4))]) is None


# ----------------------------------------------------------------------------- the section


@pytest.fixture(scope="module")
def mixed_gpt() -> tuple:
    """The GPT example (batch 8) traced on the mixed CPU cluster with kernel overheads 0."""
    from planner.api import prepare_model

    cluster = Cluster.load(MIXED)
    nodes = tuple(dataclasses.replace(n, device=dataclasses.replace(n.device, kernel_overhead_s=0.0)) for n in cluster.nodes)
    return prepare_model(ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8}),
                         dataclasses.replace(cluster, nodes=nodes))


@pytest.fixture(scope="module")
def accpar(mixed_gpt) -> Plan:
    graph, spec, name, cluster = mixed_gpt
    return uneven_tp_plan(graph, cluster, spec, name, "fp32")


def test_the_section_round_trips(accpar) -> None:
    data = json.loads(json.dumps(accpar.to_dict()))
    assert data["uneven-tp"]["layers"][0]["kind"] in ("batch", "column", "row")
    again = Plan.from_dict(data)
    assert again.sections["uneven-tp"] == accpar.sections["uneven-tp"]
    assert again.name == accpar.name and again.name.startswith("accpar (tp=4; uneven tp")


@pytest.mark.parametrize("data, field", [
    ([], "field 'uneven-tp' must be a JSON object"),
    ({"layers": [], "ratio": 1}, "unknown key 'ratio'"),
    ({"layers": []}, "'uneven-tp.layers' must list one split"),
    ({"layers": [{"module": "fc", "kind": "diagonal", "shares": [1, 1]}]}, "'uneven-tp.layers[].kind' must be one of"),
    ({"layers": [{"module": "fc;import os", "kind": "row", "shares": [1, 1]}]}, "'uneven-tp.layers[].module' must be"),
    ({"layers": [{"module": "fc", "kind": "row", "shares": [1, 0]}]}, "'uneven-tp.layers[].shares' of fc must"),
    ({"layers": [{"module": "fc", "kind": "row", "shares": "11"}]}, "'uneven-tp.layers[].shares' must be a list"),
    ({"layers": [{"module": "fc", "kind": "row"}]}, "'uneven-tp.layers[]' must be an object with keys"),
    ({"layers": [{"module": "fc", "kind": "row", "shares": [1, 1]}] * 2}, "names 'fc' twice"),
    ({"layers": [{"module": "fc", "kind": "row", "shares": [1, 1]}], "busy_s": [1.0]}, "'uneven-tp.busy_s' must be"),
])
def test_a_malformed_section_is_one_line_naming_the_field(data, field) -> None:
    with pytest.raises(PlanFileError) as error:
        UnevenTpSection.from_json(data, SOURCE)
    assert field in str(error.value) and "\n" not in str(error.value) and str(error.value).startswith(SOURCE)


def test_a_section_that_does_not_fit_its_plan_is_refused(accpar) -> None:
    def problem(*layers) -> str:
        with pytest.raises(ValueError) as error:
            dataclasses.replace(accpar, sections={"uneven-tp": UnevenTpSection(layers)})
        return str(error.value)

    assert "3 shares per layer for tp=4" in problem(LayerSplit("lm_head", "column", (100, 100, 56)))
    assert "shares summing to 257, not its 256" in problem(LayerSplit("lm_head", "column", (100, 100, 56, 1)))
    assert "'blocks.0.ln_1', which is not a linear layer" in problem(LayerSplit("blocks.0.ln_1", "row", (16,) * 4))
    accumulating = dataclasses.replace(accpar, sections={}, accumulation_steps=2)
    with pytest.raises(ValueError, match="without pipeline, expert layouts, gradient accumulation"):
        dataclasses.replace(accumulating, sections={"uneven-tp": accpar.sections["uneven-tp"]})


# ------------------------------------------------------------------------- costs by hand


def test_costs_worked_by_hand_on_the_mixed_cluster(accpar) -> None:
    graph, cluster = accpar.graph, accpar.cluster
    slow = cluster.nodes[1].device
    ranks = range(4)
    splits = (
        # input (8, 32, 64) -> 256 features: N = 256 rows, i = 64, o = 256.
        LayerSplit("blocks.0.mlp.c_fc", "column", (96, 96, 32, 32)),
        # input (8, 32, 256) -> 64 features.
        LayerSplit("blocks.0.mlp.c_proj", "row", (96, 96, 32, 32)),
        # input (8, 32, 64) -> 64 features and a bias; B = 8, 32 rows per sample.
        LayerSplit("blocks.0.attn.c_proj", "batch", (3, 3, 1, 1)),
    )
    plan = simulated(dataclasses.replace(accpar, sections={"uneven-tp": UnevenTpSection(splits)}), graph)
    costs = {s.node: s.cost for s in plan.strategies}
    node_of = {n.module: n for n in graph.nodes if n.op == "aten.linear.default"}
    # A gather-v is one all-to-all in which each rank sends its slice to all 4 ranks; the
    # largest share's rank sends the most, so it is priced as every rank sending 4 x its slice.
    gather = lambda elements: collective_time("all_to_all", elements * 4, cluster, ranks)  # noqa: E731 fp32
    reduce = lambda elements: collective_time("all_reduce", elements * 4, cluster, ranks)  # noqa: E731
    expected = {
        # fast ranks: 96/256 of the layer at twice the speed = 0.1875 of the slow device's layer
        # (the slow ranks 32/256 = 0.125); forward: gather of 4 x 96 x 256 rows, backward:
        # all-reduce of the input's gradient, 256 x 64.
        "blocks.0.mlp.c_fc": (0.1875, gather(4 * 96 * 256) + reduce(256 * 64)),
        # forward: all-reduce of the partial outputs 256 x 64; backward: gather of 4 x 96 x 256.
        "blocks.0.mlp.c_proj": (0.1875, reduce(256 * 64) + gather(4 * 96 * 256)),
        # fast ranks 3/8 at twice the speed = 0.1875 (slow 1/8); forward: gather of 4 x 3
        # samples x 32 rows x 64, backward: the same for the input's gradient and the
        # all-reduce of the weight's gradient, 64 x 64 + 64.
        "blocks.0.attn.c_proj": (0.1875, 2 * gather(4 * 3 * 32 * 64) + reduce(64 * 64 + 64)),
    }
    for module, (fraction, communication) in expected.items():
        node = node_of[module]
        whole = sum(op_times(node, 1.0, slow, "fp32"))
        assert costs[node.name].compute_s == pytest.approx(fraction * whole, rel=1e-9), module
        assert costs[node.name].communication_s == pytest.approx(communication, rel=1e-9), module
    # An op every rank runs whole: the slow device's time, no DTensor dispatch.
    norm = next(n for n in graph.nodes if n.module == "blocks.0.ln_1")
    assert costs[norm.name].compute_s == pytest.approx(sum(op_times(norm, 1.0, slow, "fp32")), rel=1e-12)
    assert costs[norm.name].communication_s == 0


# ------------------------------------------------------------------------------ the search


def test_the_shares_follow_speed_and_beat_the_even_split(mixed_gpt, accpar) -> None:
    graph, spec, name, cluster = mixed_gpt
    section = accpar.sections["uneven-tp"]
    # 4 linears in each of 2 blocks and the head; the attention's 64 x 64 output projections
    # stay whole: their best split's gather-v costs more than the compute it spreads.
    chosen = {layer.module: layer for layer in section.layers}
    assert sorted(set(split_dimensions(graph)) - set(chosen)) == ["blocks.0.attn.c_proj", "blocks.1.attn.c_proj"]
    node = next(n for n in graph.nodes if n.module == "blocks.0.attn.c_proj" and n.op == "aten.linear.default")
    options = [layer_terms(node, kind, cluster, "fp32", (10**6,) * 4) for kind in ("batch", "column", "row")]
    assert sum(whole_op_seconds(node, cluster, "fp32")) < best_layer_split(options).seconds
    # The MLPs fused: c_fc's output stays split through the gelu into c_proj, same shares.
    for block in (0, 1):
        fc, proj = chosen[f"blocks.{block}.mlp.c_fc"], chosen[f"blocks.{block}.mlp.c_proj"]
        assert (fc.kind, proj.kind, fc.fused, proj.fused, fc.shares) == ("column", "row", True, True, proj.shares)
    for layer in section.layers:
        fast, slow = layer.shares[0], layer.shares[2]
        # Two to one within a unit (the dimension need not divide by 6).
        assert layer.shares[0] == layer.shares[1] and layer.shares[2] == layer.shares[3]
        assert abs(fast - 2 * slow) <= 2, layer
    even = uneven_tp_plan(graph, cluster, spec, name, "fp32", even=True)
    assert {len(set(layer.shares)) for layer in even.sections["uneven-tp"].layers} == {1}
    assert accpar.estimate.step_time_s < even.estimate.step_time_s
    # The fast ranks do about twice the slow ranks' share of the split layers: busier by less.
    assert section.busy_s[0] < section.busy_s[2]


def test_shares_stop_at_each_ranks_memory(accpar) -> None:
    graph = accpar.graph
    # The split layers' weights, gradients and AdamW states: 4 + 4 + 8 bytes per fp32 element.
    states = 16 * sum(math.prod(graph.parameters[p].shape) for p in graph.parameters
                      if p.split(".")[-2] in ("c_attn", "c_proj", "c_fc", "lm_head"))
    rest = accpar.estimate.memory.total - states
    fast, slow = accpar.cluster.nodes
    # The fast devices hold everything else and a quarter of those states.
    small = dataclasses.replace(fast, device=dataclasses.replace(fast.device, memory_bytes=int(rest + states / 4)))
    tight = dataclasses.replace(accpar, cluster=dataclasses.replace(accpar.cluster, nodes=(small, slow)), sections={})
    assert memory_fractions(tight, graph) == pytest.approx((0.25, 0.25, 1.0, 1.0))
    for layer in choose_splits(tight, graph):
        dim = sum(layer.shares)
        assert layer.kind != "batch" and max(layer.shares[:2]) <= dim // 4, layer  # was about dim / 3


def test_family_uneven_tp_alone_gives_the_accpar_plan_and_one_kind_gets_none() -> None:
    spec = ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8})
    plan = planner.plan(spec, str(MIXED), progress=False, constraints=SearchConstraints(families=("uneven-tp",)))
    assert "uneven-tp" in plan.sections and plan.mesh.names == ("tp",), plan.name
    assert families_of(plan) == frozenset({"uneven-tp"})
    # The candidates part on one kind of device (the rest of the context is not read).
    one_kind = SimpleNamespace(whole_batch_only=False, summa_only=False, constraints=SearchConstraints(),
                               cluster=Cluster.parse("cpu:1x4"))
    assert uneven_tp_candidates(one_kind) == []
    # Unasked (no --family), after an uneven data-parallel plan that fits on every device: no
    # time spent splitting. After an even one only (a batch too small for uneven shares), the
    # split plan is offered.
    shared = SimpleNamespace(estimate=SimpleNamespace(fits=True), world_size=4,
                             sections={"uneven": SimpleNamespace(shares=(3, 3, 1, 1))})
    found = SimpleNamespace(whole_batch_only=False, summa_only=False, constraints=SearchConstraints(),
                            cluster=plan.cluster, found=[shared], graph=plan.graph, spec=plan.model,
                            model_name="gpt", precision=plan.precision, warnings=())
    assert uneven_tp_candidates(found) == []
    found.found = [SimpleNamespace(estimate=SimpleNamespace(fits=True), world_size=4, sections={})]
    assert [p.sections["uneven-tp"] for p in uneven_tp_candidates(found)] == [plan.sections["uneven-tp"]]
    # Even batch shares (optimizer states split by memory alone) do not use the devices by speed.
    found.found = [SimpleNamespace(estimate=SimpleNamespace(fits=True), world_size=4,
                                   sections={"uneven": SimpleNamespace(shares=(1, 1, 1, 1))})]
    assert [p.sections["uneven-tp"] for p in uneven_tp_candidates(found)] == [plan.sections["uneven-tp"]]


def test_the_report_gives_each_ranks_share_of_each_split_tensor(accpar) -> None:
    from planner.report import render_report

    text = " ".join(render_report(accpar, width=160).split())
    assert "each rank's share of each split tensor" in text
    layer = accpar.sections["uneven-tp"].layers[0]
    assert f"{layer.shares[0]} ({layer.shares[0] / sum(layer.shares):.0%})" in text
    assert "cpu-fast" in text and "cpu-slow" in text and "The busiest rank is 2 (cpu-slow)" in text
    # Every rank's memory against its own device (8 GiB each), the fullest the estimate's.
    held = accpar.sections["uneven-tp"].memory_bytes
    assert len(held) == 4 and max(held) == accpar.estimate.memory.total and held[0] > held[2]
    cells = " ".join(text.replace("│", " ").split())  # the table's rows, borders dropped
    for rank, device in enumerate(("cpu-fast", "cpu-fast", "cpu-slow", "cpu-slow")):
        assert f"{rank} {device} {accpar.sections['uneven-tp'].busy_s[rank] * 1e3:.3f} ms {held[rank] / 2**20:.2f} MiB " \
               f"{held[rank] / 2**33:.2%} of 8.00 GiB" in cells
