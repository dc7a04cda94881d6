"""Uneven tensor parallelism between layers (ACCPAR's inter-layer cost), without processes: the
groups whose activation may stay split, the chain DP against enumeration, a fused group's
costs worked by hand, and the section's checks of ``fused``.

- ``fusable_groups``: GPT's MLP (c_fc -> gelu -> c_proj) is one; its attention (c_attn ->
  attention -> c_proj) is not.
- ``best_chain`` equals the least total over every way to cover a small chain with single
  layers (split or whole) and groups.
- On the mixed CPU cluster with kernel overheads 0 (as ``tests/test_uneven_tp.py``): c_fc
  and c_proj fused at 96/96/32/32 of 256 features take 96/256 / 2 = 0.1875 of the slow
  device's whole layer on the fast ranks (the stragglers), and so does the gelu between
  them; c_fc's only collective is the backward all-reduce of its input's gradient (256 x 64),
  c_proj's the forward all-reduce of its partial outputs (256 x 64): no gather-v.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_model.collectives import collective_time
from cost_model.compute import op_times
from cost_model.simulator import simulated
from planner.cluster import Cluster
from planner.errors import PlanFileError
from planner.families.uneven_tp.candidates import uneven_tp_plan
from planner.families.uneven_tp.ratios import LayerChoice, best_chain
from planner.families.uneven_tp.regions import fusable_groups
from planner.families.uneven_tp.section import LayerSplit, UnevenTpSection
from planner.model_spec import ModelSpec
from planner.plans import Plan

REPO = Path(__file__).resolve().parents[1]
MIXED = REPO / "examples/clusters/mixed.toml"


# ---------------------------------------------------------------------------- the chain DP


def least_by_enumeration(whole, singles, groups, start: int = 0) -> float | None:
    """The least total covering layers ``start..`` one by one (split or whole) or by groups."""
    if start == len(singles):
        return 0.0
    totals = []
    for seconds, stop in ([(singles[start].seconds, start + 1)] if singles[start] is not None else []) + \
            ([(whole[start], start + 1)] if whole[start] is not None else []) + \
            [(choice.seconds, end) for (begin, end), choice in groups.items() if begin == start and choice is not None]:
        rest = least_by_enumeration(whole, singles, groups, stop)
        if rest is not None:
            totals.append(seconds + rest)
    return min(totals) if totals else None


maybe_seconds = st.one_of(st.none(), st.integers(0, 20).map(float))


@st.composite
def chains(draw):
    count = draw(st.integers(1, 6))
    whole = draw(st.lists(maybe_seconds, min_size=count, max_size=count))
    singles = [None if s is None else LayerChoice("column", (1, 1), s)
               for s in draw(st.lists(maybe_seconds, min_size=count, max_size=count))]
    spans = draw(st.lists(st.tuples(st.integers(0, count - 1), st.integers(2, 3)), max_size=4))
    groups = {(start, min(count, start + length)): draw(st.one_of(st.none(), st.integers(-5, 30).map(
        lambda s: LayerChoice("fused", (1, 1), float(s))))) for start, length in spans if start + 2 <= count}
    return whole, singles, groups


@settings(max_examples=120, deadline=None)
@given(chains())
def test_the_chain_dp_equals_enumeration(chain) -> None:
    whole, singles, groups = chain
    found = best_chain(whole, singles, groups)
    least = least_by_enumeration(whole, singles, groups)
    if least is None:
        assert found is None
        return
    steps, seconds = found
    assert seconds == pytest.approx(least)
    # The steps cover the chain in order, each a choice that was offered, and add up.
    assert [step.start for step in steps] == [0] + [step.stop for step in steps[:-1]] and steps[-1].stop == len(singles)
    total = 0.0
    for step in steps:
        if step.stop - step.start > 1 or (step.choice is not None and step.choice.kind == "fused"):
            assert groups[(step.start, step.stop)] == step.choice
        elif step.choice is None:
            assert whole[step.start] is not None
        else:
            assert singles[step.start] == step.choice
        total += whole[step.start] if step.choice is None else step.choice.seconds
    assert total == pytest.approx(seconds)


# --------------------------------------------------------------------- the groups and costs


@pytest.fixture(scope="module")
def accpar() -> Plan:
    from planner.api import prepare_model

    cluster = Cluster.load(MIXED)
    nodes = tuple(dataclasses.replace(n, device=dataclasses.replace(n.device, kernel_overhead_s=0.0)) for n in cluster.nodes)
    graph, spec, name, cluster = prepare_model(ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8}),
                                               dataclasses.replace(cluster, nodes=nodes))
    return uneven_tp_plan(graph, cluster, spec, name, "fp32")


def test_the_mlp_is_a_group_and_the_attention_is_not(accpar) -> None:
    groups = fusable_groups(accpar.graph)
    assert [(g.columns, g.row, g.dim) for g in groups] == [
        (("blocks.0.mlp.c_fc",), "blocks.0.mlp.c_proj", 256), (("blocks.1.mlp.c_fc",), "blocks.1.mlp.c_proj", 256)]
    by_name = {node.name: node for node in accpar.graph.nodes}
    assert [by_name[name].op for name in groups[0].between] == ["aten.gelu.default"]


def test_a_fused_groups_costs_worked_by_hand(accpar) -> None:
    graph, cluster = accpar.graph, accpar.cluster
    shares = (96, 96, 32, 32)
    fused = (LayerSplit("blocks.0.mlp.c_fc", "column", shares, fused=True),
             LayerSplit("blocks.0.mlp.c_proj", "row", shares, fused=True))
    plan = simulated(dataclasses.replace(accpar, sections={"uneven-tp": UnevenTpSection(fused)}), graph)
    costs = {s.node: s.cost for s in plan.strategies}
    slow = cluster.nodes[1].device
    reduce = collective_time("all_reduce", 256 * 64 * 4, cluster, range(4))  # 256 rows x 64 features, fp32
    group = fusable_groups(graph)[0]
    fc, gelu, proj = (next(n for n in graph.nodes if n.module == group.columns[0] and n.op == "aten.linear.default"),
                      next(n for n in graph.nodes if n.name == group.between[0]),
                      next(n for n in graph.nodes if n.module == group.row and n.op == "aten.linear.default"))
    for node, communication in ((fc, reduce), (gelu, 0.0), (proj, reduce)):
        whole = sum(op_times(node, 1.0, slow, "fp32"))
        assert costs[node.name].compute_s == pytest.approx(0.1875 * whole, rel=1e-9), node.module
        assert costs[node.name].communication_s == pytest.approx(communication, rel=1e-9), node.module
    # Not fused, the same shares gather c_fc's output and c_proj's input gradient (a gather-v
    # each: every rank sends 4 x the largest slice, 96 x 256 rows) and run the gelu whole.
    apart = simulated(dataclasses.replace(accpar, sections={"uneven-tp": UnevenTpSection(
        tuple(dataclasses.replace(layer, fused=False) for layer in fused))}), graph)
    gather = collective_time("all_to_all", 4 * 96 * 256 * 4, cluster, range(4))
    apart_costs = {s.node: s.cost for s in apart.strategies}
    assert apart_costs[fc.name].communication_s == pytest.approx(gather + reduce, rel=1e-9)
    assert apart_costs[gelu.name].compute_s == pytest.approx(sum(op_times(gelu, 1.0, slow, "fp32")), rel=1e-12)


# ----------------------------------------------------------------------------- the section


def test_fused_round_trips_and_is_checked(accpar) -> None:
    section = accpar.sections["uneven-tp"]
    data = json.loads(json.dumps(accpar.to_dict()))
    assert any(layer.get("fused") for layer in data["uneven-tp"]["layers"])
    assert Plan.from_dict(data).sections["uneven-tp"] == section
    with pytest.raises(PlanFileError, match=r"'uneven-tp.layers\[\].fused' of fc must be true or false"):
        UnevenTpSection.from_json({"layers": [{"module": "fc", "kind": "row", "shares": [1, 1], "fused": "yes"}]}, "p")
    with pytest.raises(PlanFileError, match="only for a column or row split"):
        UnevenTpSection.from_json({"layers": [{"module": "fc", "kind": "batch", "shares": [1, 1], "fused": True}]}, "p")

    def problem(*layers) -> str:
        with pytest.raises(ValueError) as error:
            dataclasses.replace(accpar, sections={"uneven-tp": UnevenTpSection(layers)})
        assert "\n" not in str(error.value)
        return str(error.value)

    half = (64, 64, 64, 64)
    assert "fuses part of the group blocks.0.mlp.c_fc -> blocks.0.mlp.c_proj: fuse all of them" in problem(
        LayerSplit("blocks.0.mlp.c_fc", "column", half, fused=True))
    assert "at the same shares" in problem(LayerSplit("blocks.0.mlp.c_fc", "column", half, fused=True),
                                           LayerSplit("blocks.0.mlp.c_proj", "row", (96, 96, 32, 32), fused=True))
    assert "'blocks.0.attn.c_attn', whose activation cannot stay split" in problem(
        LayerSplit("blocks.0.attn.c_attn", "column", (48,) * 4, fused=True),
        LayerSplit("blocks.0.attn.c_proj", "row", (16,) * 4, fused=True))
