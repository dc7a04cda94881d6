"""HuggingFace MoE blocks inside pipeline stages: laid out over each stage's dp ranks by the
pipeline search, priced per micro-batch over that group, and compiled (as their traced ops when
replicated; their stacked experts replaced by the expert-parallel call when expert parallel,
whose parity ``test_pipeline_parity.py`` checks at world 8).
"""

from __future__ import annotations

import dataclasses

import pytest

import planner
from cost_model.collectives import collective_time
from cost_model.moe_layers import price_layout, routing_sync_time
from cost_model.parameter_bytes import bytes_per_parameter
from planner.api import prepare_model
from planner.constraints import SearchConstraints
from planner.model_spec import ModelSpec
from planner.plans import Plan
from planner.strategy import ExpertLayout, ExpertPlacement, Mesh
from search.stage_experts import FASTEST, runs_in_stages, stage_expert_variants, stage_layer_seconds
from moe_plans import HF_MOE

# Four layers of the tiny Mixtral (4 experts, top-2), 16 sequences: two layers per stage.
MIXTRAL = {**HF_MOE["mixtral"], "num_hidden_layers": 4, "batch_size": 16}
SPEC = ModelSpec("hf:mixtral", MIXTRAL)
STAGES = Mesh((("pp", 2), ("dp", 4)))


@pytest.fixture(scope="module")
def mixtral_pipeline() -> Plan:
    """What ``planner plan hf:mixtral (tiny) --cluster cpu:2x4 --mesh pp=2`` chooses."""
    return planner.plan(SPEC, "cpu:2x4", constraints=SearchConstraints(mesh={"pp": 2}), progress=False)


def test_hf_moe_blocks_get_layouts_over_their_stage_dp_ranks(mixtral_pipeline: Plan) -> None:
    plan = mixtral_pipeline
    assert plan.pipeline is not None and plan.mesh == STAGES
    assert [layout.module for layout in plan.expert_layouts] == [f"model.layers.{i}.mlp" for i in range(4)]
    for layout in plan.expert_layouts:
        assert layout.axis == "dp" and layout.mode in ("expert_parallel", "data_parallel")
        assert layout.placement is None or layout.placement.devices == 4
    assert plan.estimate.fits


def test_hf_blocks_are_laid_out_in_stages_by_the_search() -> None:
    graph = prepare_model(SPEC, "cpu:2x4")[0]
    assert runs_in_stages(graph)
    graph, _, _, cluster = prepare_model(SPEC, "cpu:2x4")
    variants = stage_expert_variants(graph, cluster, None, "fp32", STAGES, 2)
    # Every layer has a layout in every variant, priced over the stage's 4 ranks.
    for layouts in variants.values():
        assert len(layouts) == 4
        assert all(layout.placement is None or layout.placement.devices == 4 for layout in layouts)
    assert FASTEST in variants


def test_replicated_hf_experts_in_a_stage_all_reduce_their_gradients_over_the_stage_group() -> None:
    """A replicated layer's seconds: its two micro-batches' expert compute and routing
    all-gather over the stage's 4 ranks, plus one all-reduce of its expert gradients over
    them: 4 experts x 3 matmuls (SwiGLU) x 32 hidden x 48 ffn = 18,432 parameters of 4 bytes
    (fp32 gradients), 73,728 bytes."""
    graph, _, _, cluster = prepare_model(SPEC, "cpu:2x4")
    block = graph.moe_blocks[0]
    assert block.expert_parameters == 4 * 3 * 32 * 48
    assert bytes_per_parameter("fp32")[1] == 4
    layout = ExpertLayout(block.module, "data_parallel", block.experts, block.top_k, block.capacity_factor, axis="dp")
    tokens = 16 * 8  # 16 sequences of 8 tokens
    group = (0, 1, 2, 3)  # stage 0's dp ranks
    replicated = stage_layer_seconds(block, layout, tokens, cluster, "fp32", group, 2)
    all_reduce = collective_time("all_reduce", 73_728, cluster, list(group))
    per_micro = price_layout(block, layout, tokens, cluster, "fp32", 2, group)
    assert all_reduce > 0 and per_micro.total_s > 0
    assert replicated == pytest.approx(2 * (per_micro.total_s + routing_sync_time(block, cluster, group)) + all_reduce)


def test_experts_a_stage_rank_holds_alone_are_never_sharded_by_the_dp_flavour() -> None:
    """Round-robin over a stage's 4 dp ranks, each rank holds 1 of the 4 experts of every
    layer alone: 4 x 3 x 32 x 48 / 4 = 4,608 elements per layer, which ZeRO-1 cannot shard
    (no other rank of the stage has them). Replicated experts are shared by all 4 ranks."""
    graph, _, _, cluster = prepare_model(SPEC, "cpu:2x4")
    from cost_model.simulator import Simulator
    from search.pipeline_search import PipelineGrid, PipelineSpace
    from search.pipeline_search import Configuration

    block = graph.moe_blocks[0]
    layouts = {
        mode: tuple(ExpertLayout(b.module, mode, b.experts, b.top_k, b.capacity_factor, axis="dp",
                                 placement=ExpertPlacement.round_robin(4, 4) if mode == "expert_parallel" else None)
                    for b in graph.moe_blocks)
        for mode in ("expert_parallel", "data_parallel")
    }
    grid = PipelineGrid(graph, cluster, "fp32", PipelineSpace(flavours=("ddp", "zero1"), tensor_parallel=(1,),
                                                              expert_layouts=lambda mesh, m: layouts))
    config = Configuration(1, 2, 4, 2, 2, "1f1b", 1, "zero1", "none", experts="expert_parallel")
    profiles = grid._profile(config)
    moe_profiles = [p for p in profiles if p.block]
    assert moe_profiles and all(p.per_rank_elements == 4 * 3 * 32 * 48 / 4 for p in moe_profiles)
    weights, grads, states = bytes_per_parameter("fp32")
    costs = grid._segment_costs(config, "none")
    for profile, cost in zip(profiles, costs):
        shared = profile.param_elements - profile.per_rank_elements
        assert cost.static_bytes == pytest.approx(shared * (weights + grads + states / 4)
                                                  + profile.per_rank_elements * (weights + grads + states))
    replicated = grid._profile(dataclasses.replace(config, experts="data_parallel"))
    assert all(p.per_rank_elements == 0 for p in replicated)
    assert block.expert_parameters == 4 * 3 * 32 * 48


def test_stage_placements_pack_routing_groups_onto_the_stage_nodes() -> None:
    """DeepSeek-V3's group-limited routing (here 4 groups of 4 consecutive experts, 2 per
    token) bounds the nodes a token reaches only when each group lies on one node: the
    stage's EPLB candidate over 4 dp ranks of 2 nodes (2 ranks each) packs them so, where
    round-robin (expert e on rank e mod 4) spreads every group over both nodes."""
    from planner.moe_blocks import HF_STACKED_EXPERTS, MoEBlock
    from search.stage_experts import stage_layer_candidates

    block = MoEBlock("model.layers.1.mlp", 16, 2, 0.0, 32, 40, 3, "gate.weight",
                     ("experts.gate_up_proj", "experts.down_proj"), "test", HF_STACKED_EXPERTS, (4, 2))
    layouts = stage_layer_candidates(block, (1 / 16,) * 16, "uniform", 4, 2)
    eplb = [layout for layout in layouts if layout.placement is not None and "EPLB" in layout.placement.method]
    assert eplb
    replicas = eplb[0].placement.replicas  # per expert: ((device, share), ...)
    for group in range(4):
        nodes = {device // 2 for expert in range(4 * group, 4 * group + 4) for device, _ in replicas[expert]}
        assert len(nodes) == 1, (group, replicas)


def test_stages_lay_out_moe_layers_when_the_batch_does_not_split_over_every_device() -> None:
    """4 sequences on 8 devices: the MoE family (every device a dp rank) cannot run, but two
    stages of 4 dp ranks take one sequence each, and lay their MoE layers out over them
    (DeepSeek-V3 on 2,048 GPUs at 1,024 sequences is this case)."""
    spec = ModelSpec("hf:mixtral", {**MIXTRAL, "batch_size": 4})
    plan = planner.plan(spec, "cpu:2x4", constraints=SearchConstraints(mesh={"pp": 2}), progress=False)
    assert plan.pipeline is not None and plan.mesh == STAGES
    assert [layout.module for layout in plan.expert_layouts] == [f"model.layers.{i}.mlp" for i in range(4)]
