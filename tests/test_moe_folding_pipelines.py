"""The search's folded pipelines of a HuggingFace MoE model (issue 26, Deliver 3's Mixtral row).

Megatron-Core's folded layout of Mixtral-8x22B on 64 H100s (TP4 x EP8 x PP8 x DP2, 128
micro-batches, ZeRO-1) was a plan the search never built: folded plans of HuggingFace blocks
came only with ``--mesh tp=..``, and their pipelines only with ``--mesh pp=P``, 1F1B over P
micro-batches, DDP, no recomputation. The pipeline grid now prices tensor-parallel stages with
the experts folded over each stage's dp x tp ranks (``search.moe_folding.folded_stage_variants``),
choosing micro-batches, schedule, ZeRO-1 and recomputation as it does for every pipeline.

Checked against exhaustive enumeration: tiny ``hf:mixtral`` (4 layers, 4 experts, batch 16) on
two nodes of 4 CPU ranks under ``--mesh pp=2,tp=2`` (so pp2 x dp2 x tp2): every folded plan of
that mesh with the grid's expert layout (EP4, the largest, ``STAGE_EP_OPTIONS``) that the
builder ``search.moe_folding.folded_plan`` makes (1, 2, 4 or 8 micro-batches per step; DDP or
ZeRO-1; no or full recomputation; Megatron's even split, 1F1B), simulated. The search's plan
must be no slower than the fastest of them. Before the grid priced folded stages, the search
had only the 2-micro-batch DDP plans, slower than the enumeration's best (which runs one
micro-batch: on these latency-bound CPU ranks each micro-batch costs a round of collectives).
Left alone: here EP2 (two copies of each expert) is faster still; the grid prices one EP per
mesh to keep DeepSeek-V3's planning time, and EP2 comes only with ``folded_candidates``' 1F1B
over 2 micro-batches.
"""

from __future__ import annotations

import functools
import itertools

import pytest

import planner
from planner.api import prepare_model
from planner.constraints import SearchConstraints
from planner.model_spec import ModelSpec
from planner.strategy import Mesh
from search.budget import SearchBudget
from search.context import SearchContext
from search.moe_folding import folded_candidates, folded_plan, folded_stage_variants
from moe_plans import HF_MOE

SPEC = ModelSpec("hf:mixtral", {**HF_MOE["mixtral"], "num_hidden_layers": 4, "batch_size": 16})
CLUSTER = "cpu:2x4"
MESH = Mesh((("pp", 2), ("dp", 2), ("tp", 2)))


@functools.lru_cache(maxsize=1)
def searched_folded_pipeline() -> planner.Plan:
    """The plan of ``planner plan`` (tiny ``SPEC``) ``--cluster cpu:2x4 --mesh pp=2,tp=2``, planned
    once per session (``tests/test_moe_folding_parity.py`` checks its parity at world 8)."""
    return planner.plan(SPEC, CLUSTER, progress=False, constraints={"mesh": {"pp": 2, "tp": 2}})


@pytest.fixture(scope="module")
def searched():
    return searched_folded_pipeline()


@pytest.fixture(scope="module")
def traced():
    return prepare_model(SPEC, CLUSTER)


def test_folded_pipeline_search_matches_exhaustive_enumeration(searched, traced):
    graph, spec, name, cluster = traced
    enumerated = {
        (micro_batches, flavour, recompute): folded_plan(
            graph, cluster, spec, name, MESH, 4, micro_batches=micro_batches, dp_flavour=flavour, recompute=recompute)
        for micro_batches, flavour, recompute in itertools.product((1, 2, 4, 8), ("ddp", "zero1"), ("none", "full"))
    }
    fitting = {key: plan.estimate.step_time_s for key, plan in enumerated.items() if plan.estimate.fits}
    best = min(fitting.values())
    # What the search offered before: P = 2 micro-batches, DDP, no recomputation (EP4's, and
    # EP2's, which folded_candidates still offers).
    before = min(fitting[(2, "ddp", "none")],
                 folded_plan(graph, cluster, spec, name, MESH, 2, micro_batches=2).estimate.step_time_s)
    assert before > best * 1.05, "the case no longer tells the old search from the new"
    assert "moe-folding" in searched.sections and searched.pipeline is not None, searched.name
    assert searched.mesh == MESH
    assert searched.estimate.fits
    assert searched.estimate.step_time_s <= best * (1 + 1e-9), (searched.name, searched.estimate.step_time_s, best)


def test_folded_stages_split_experts_only_under_a_priced_dispatch(searched, traced):
    """Compiled pipelines run whole experts (ETP 1, ``codegen.pipeline_emit``): the grid's
    folded stages split experts (ETP 2) only under a ``--moe-dispatch`` other than compiled,
    and the plan chosen under the default keeps them whole."""
    graph = traced[0]
    # 4 experts of width 48 over a stage's 4 ranks: EP4 whole (the largest EP of ETP 1), EP2 x ETP2.
    compiled = folded_stage_variants(graph, None, MESH, "compiled")
    priced = folded_stage_variants(graph, None, MESH, "deduplicated")
    assert sorted(compiled) == ["folded-ep4-etp1"]
    assert sorted(priced) == ["folded-ep2-etp2", "folded-ep4-etp1"]
    assert {layout.tensor_parallel for layout in priced["folded-ep2-etp2"]} == {2}
    assert all(layout.tensor_parallel == 1 and layout.axis == "dp*tp" for layout in searched.expert_layouts)
    # A stage mesh without dp, or no stages at all, folds nothing here.
    assert folded_stage_variants(graph, None, Mesh((("pp", 2), ("tp", 4)))) == {}
    assert folded_stage_variants(graph, None, Mesh((("dp", 4), ("tp", 2)))) == {}


def test_huggingface_blocks_fold_with_whole_experts_under_the_compiled_dispatch(traced):
    """Without a pipeline, compiled folded programs split experts (ETP > 1) only for
    ``examples/moe.py``'s routed GELU layers (``codegen.moe_folding_emit`` refuses HuggingFace
    blocks so): under ``--mesh dp=4,tp=2`` the search's HuggingFace candidates keep whole
    experts, and price split ones only under another dispatch."""
    graph, spec, name, cluster = traced

    def candidates(dispatch: str):
        context = SearchContext(
            graph=graph, cluster=cluster, spec=spec, model_name=name, search="ilp", budget=SearchBudget(), seed=0,
            warnings=(), precision="fp32", constraints=SearchConstraints(mesh={"dp": 4, "tp": 2}), routing=None,
            tp_layouts="1d", meshes=[Mesh((("dp", 4), ("tp", 2)))], moe_layouts=True, moe_dispatch=dispatch)
        return {(layout.placement.devices, layout.tensor_parallel)
                for plan in folded_candidates(context) for layout in plan.expert_layouts}

    # 4 experts of width 48 over 8 ranks: EP 2 or 4 whole, or split in two (ETP2): EP4 x ETP2
    # covers the ranks (what routed GELU layers compile), EP2 x ETP2 has copies.
    assert candidates("compiled") == {(2, 1), (4, 1)}
    assert candidates("deduplicated") == {(2, 1), (4, 1), (2, 2), (4, 2)}
