"""MoE layers inside pipeline stages: searched, priced over the stage's dp ranks, written as
one call of the MoE runtime per layer, refused in one line where they cannot run.

The parity of the compiled program (2 stages x 4 dp ranks, experts split over the 4, two
micro-batches each routed on its own) is in ``test_pipeline_parity.py``'s world-8 launch.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import planner
from codegen.pipeline_emit import unsupported
from codegen.runtime.pipeline_parity import micro_batch_loss
from cost_model.collectives import collective_time
from cost_model.moe import MoELayer, moe_layer_cost
from cost_model.moe_layers import expert_group, laid_out_layers
from planner.api import prepare_model
from planner.cli import main
from planner.constraints import SearchConstraints
from planner.model_spec import ModelSpec
from planner.plans import Plan
from planner.strategy import ExpertLayout, Mesh
from search.stage_experts import EXPERT_PARALLEL, FASTEST, stage_expert_variants
from test_parity import REPO

# Eight experts over a stage's four dp ranks: two each under round-robin.
OVERRIDES = {"batch_size": 16, "n_expert": 8, "ffn": 512, "capacity_factor": 1.0}
SPEC = ModelSpec(str(REPO / "examples" / "moe.py"), OVERRIDES)


@pytest.fixture(scope="module")
def moe_pipeline() -> Plan:
    """What ``planner plan examples/moe.py --cluster cpu:2x4 --mesh pp=2`` chooses."""
    return planner.plan(SPEC, "cpu:2x4", constraints=SearchConstraints(mesh={"pp": 2}), progress=False)


def test_mesh_pp2_gives_pipeline_stages_with_moe_layouts_over_their_dp_ranks(moe_pipeline: Plan) -> None:
    plan = moe_pipeline
    assert plan.pipeline is not None and plan.pipeline.stages == 2
    assert plan.mesh == Mesh((("pp", 2), ("dp", 4)))
    assert [layout.module for layout in plan.expert_layouts] == ["blocks.0.moe", "blocks.1.moe"]
    for layout in plan.expert_layouts:
        assert layout.axis == "dp" and layout.mode in ("expert_parallel", "data_parallel")
        if layout.placement is not None:
            assert layout.placement.devices == 4
    # One block per stage: each MoE layer's ops on its own stage.
    graph = prepare_model(SPEC, "cpu:2x4")[0]
    stage_of = {s.node: s.stage for s in plan.strategies}
    assert [{stage_of[n.name] for n in graph.moe_nodes(layout.module)} for layout in plan.expert_layouts] == [{0}, {1}]
    assert plan.estimate.fits


def test_plan_json_round_trips(moe_pipeline: Plan) -> None:
    again = Plan.from_dict(json.loads(json.dumps(moe_pipeline.to_dict())))
    assert again.pipeline == moe_pipeline.pipeline
    assert again.expert_layouts == moe_pipeline.expert_layouts


def test_expert_group_is_the_first_group_along_the_axis() -> None:
    assert expert_group(Mesh((("pp", 2), ("dp", 4))), "dp") == (0, 1, 2, 3)
    assert expert_group(Mesh((("dp", 8),)), "dp") == tuple(range(8))
    assert expert_group(Mesh((("pp", 2), ("dp", 2), ("tp", 2))), "dp") == (0, 2)  # dp strides over tp


def test_moe_layer_in_a_stage_is_priced_per_micro_batch_over_its_stage_dp_group(moe_pipeline: Plan) -> None:
    plan = moe_pipeline
    graph, _, _, cluster = prepare_model(SPEC, "cpu:2x4")
    micro_batches = plan.pipeline.micro_batches
    layer = laid_out_layers(plan, graph, micro_batches)["blocks.0.moe"]
    group = [0, 1, 2, 3]  # stage 0's dp ranks on pp=2 x dp=4 (rank = pp x 4 + dp)
    # The routing all-gather: each of the 4 ranks' (top_k=2 x 8 experts) int64 counts.
    assert layer.routing_sync_s == collective_time("all_gather", 4 * 2 * 8 * 8, cluster, group)
    # 16 samples x 32 tokens = 512 tokens per step, 512 / m per micro-batch, over the 4 ranks.
    layout = plan.expert_layouts[0]
    expected = moe_layer_cost(
        MoELayer(tokens=512 // micro_batches, hidden=64, ffn=512, experts=8, top_k=2, matmuls=2), layout.mode, cluster,
        group, token_share=layout.expert_loads, placement=layout.placement, capacity_factor=1.0, precision=plan.precision,
    )
    assert layer.cost == expected


def test_stage_variants_split_the_experts_over_the_stage() -> None:
    graph, _, _, cluster = prepare_model(SPEC, "cpu:2x4")
    variants = stage_expert_variants(graph, cluster, None, "fp32", Mesh((("pp", 2), ("dp", 4))), 2)
    assert FASTEST in variants
    parallel = variants.get(EXPERT_PARALLEL, variants[FASTEST])
    for layout in parallel:
        assert layout.mode == "expert_parallel"
        assert layout.placement.devices == 4 and layout.placement.most_experts_per_device == 2
    assert stage_expert_variants(graph, cluster, None, "fp32", Mesh((("pp", 8),)), 2) == {}


def test_layouts_the_stages_do_not_run_are_refused_in_one_line(moe_pipeline: Plan) -> None:
    assert unsupported(moe_pipeline) is None
    first = moe_pipeline.expert_layouts[0]
    sliced = ExpertLayout(first.module, "expert_sliced", first.experts, first.top_k, first.capacity_factor)
    plan = dataclasses.replace(moe_pipeline, expert_layouts=(sliced, *moe_pipeline.expert_layouts[1:]))
    reason = unsupported(plan)
    assert reason is not None and "expert_sliced" in reason and "\n" not in reason


@pytest.mark.parametrize(("edit", "named"), [
    (lambda layout: layout.update(module="blocks.0.moe'); import os #"), "'expert_layouts[0].module'"),
    (lambda layout: layout.update(axis="tp"), "runs over axis"),
])
def test_hostile_expert_layouts_of_a_pipeline_plan_are_refused(moe_pipeline: Plan, tmp_path, capsys, edit,
                                                               named) -> None:
    data = moe_pipeline.to_dict()
    edit(data["expert_layouts"][0])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    status = main(["compile", str(path), "-o", str(tmp_path / "out")])
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("importing model file /")]
    assert status == 2 and len(err) == 1 and err[0].startswith("error: ") and named in err[0], err
    assert not (tmp_path / "out" / "model_spmd.py").exists()


def test_single_device_reference_runs_the_pipeline_micro_batches() -> None:
    """Micro-batch i holds, for each dp rank in order, the i-th part of that rank's share.
    Batch 0..7, dp=2 (shares 0-3 and 4-7), 2 micro-batches of 2 per rank: micro-batch 0 is
    samples (0, 1, 4, 5), micro-batch 1 is (2, 3, 6, 7). A loss that is the micro-batch's
    first sample gives (0 + 2) / 2 = 1."""
    seen = []

    def first_sample(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.tolist())
        return x[0].float()

    loss = micro_batch_loss(first_sample, (torch.arange(8),), {}, dp=2, micro_batches=2)
    assert seen == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert loss.item() == 1.0


def test_report_lists_each_stage_moe_layers(moe_pipeline: Plan) -> None:
    """Eight experts with uniform routing, round-robin over a stage's 4 dp ranks: each rank
    holds 2 experts, so the busiest takes 2 x 1/8 = 25.0% of the layer's expert work."""
    from rich.console import Console

    from planner.pipeline_moe_report import stage_moe_table

    console = Console(width=200, record=True)
    console.print(stage_moe_table(moe_pipeline))
    rows = [line for line in console.export_text().splitlines() if "blocks." in line]
    assert [row.split("│")[1].strip() for row in rows] == ["0", "1"]
    assert [row.split("│")[2].strip() for row in rows] == ["blocks.0.moe", "blocks.1.moe"]
    assert all(layout.placement.method == "round-robin" for layout in moe_pipeline.expert_layouts)
    assert all("25.0% of expert work" in row for row in rows)


def test_ops_between_blocks_stay_with_the_block_before_them() -> None:
    """examples/moe.py sums each layer's balance loss at the top level, between the blocks:
    with 4 layers on 4 stages each sum runs on its layer's stage, so the stages follow each
    other in graph order (the compiled pipeline needs that)."""
    from search.layouts import uneven_stages

    graph = prepare_model(ModelSpec(str(REPO / "examples" / "moe.py"), {"n_layer": 4}), "cpu:1x4")[0]
    stage_of = uneven_stages(graph, (1, 1, 1, 1))
    order = [stage_of[node.name] for node in graph.nodes]
    assert order == sorted(order) and set(order) == {0, 1, 2, 3}
    between = [node for node in graph.nodes[:-1] if node.block is None and stage_of[node.name] not in (0, 3)]
    assert between, "the balance sums between blocks"


def test_programs_refuse_recording_routing_of_moe_stages_in_one_line(moe_pipeline: Plan, tmp_path) -> None:
    """Compiled: --record-routing (rank 0 would write only stage 0's layers) is refused before
    any process starts (--clip-grad-norm and checkpoints run: test_pipeline_hf_moe_training.py)."""
    import subprocess
    import sys

    folder = planner.compile(moe_pipeline, tmp_path / "out")
    flags = ["--steps", "1", "--record-routing", str(tmp_path / "r.json")]
    done = subprocess.run([sys.executable, str(folder / "launch.py"), *flags], capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2 and len(lines) == 1 and "inside pipeline stages" in lines[0], done.stderr[-2000:]


def test_a_stage_without_moe_layers_recomputes_full_not_keeping_exchanges() -> None:
    """Each stage of an MoE pipeline chooses among ``MOE_RECOMPUTE_ORDER``; where a stage
    holds no MoE op, ``full_keep_a2a`` has nothing to keep and prices as ``full``, so the
    plan names it ``full`` (``PipelineGrid.unsimulated``): a tiny DeepSeek-V3 of 2 dense
    layers then 2 MoE ones, the dense ones on stage 0."""
    from moe_plans import HF_MOE
    from planner.strategy import KEEP_A2A
    from search.pipeline_configs import MOE_RECOMPUTE_ORDER, PER_STAGE, Configuration, Estimate
    from search.pipeline_search import PipelineGrid, PipelineSpace

    spec = ModelSpec("hf:deepseek_v3", {**HF_MOE["deepseek_v3"], "num_hidden_layers": 4, "first_k_dense_replace": 2})
    graph, spec, name, cluster = prepare_model(spec, "cpu:2x4")
    space = PipelineSpace(flavours=("ddp",), tensor_parallel=(1,), sequence_parallel=(False,), searched_layout="off",
                          recompute=MOE_RECOMPUTE_ORDER, virtual_stages=(),
                          expert_layouts=lambda mesh, micro_batches: stage_expert_variants(graph, cluster, None, "fp32",
                                                                                           mesh, micro_batches))
    grid = PipelineGrid(graph, cluster, "fp32", space)
    assert grid.stage_modes == MOE_RECOMPUTE_ORDER
    # pp=2 x dp=4, one sample per micro-batch, every layer expert parallel; the stages' blocks
    # and modes as the slicing would give them.
    config = Configuration(1, 2, 4, 1, 2, "1f1b", 1, "ddp", PER_STAGE, experts=EXPERT_PARALLEL)
    estimate = Estimate(0.0, config, layers_per_stage=(2, 2), memory_bytes=0.0, stage_recompute=(KEEP_A2A, KEEP_A2A))
    plan = grid.unsimulated(estimate, spec, name)
    # The plan's mode is the heaviest of its stages' (full recomputes more than keeping).
    assert plan.pipeline.stage_recompute == ("full", KEEP_A2A) and plan.recompute == "full"
