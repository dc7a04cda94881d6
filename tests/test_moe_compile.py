"""What ``compile`` refuses of a plan with expert layouts, and what ``launch.py
--record-routing`` refuses, each with one line naming the field or flag (no process group,
no torchrun: everything here is found before any rank starts); and what gradient accumulation
means for an MoE program: each micro-batch routed on its own."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import planner
from codegen.runtime.launcher import main as launch_main
from moe_plans import moe_plan
from planner.cli import main as cli_main
from planner.errors import PlanFileError, PlanningError


@pytest.fixture(scope="module")
def plan():
    return moe_plan(2, "data_parallel")


def _with_layout(plan, index: int = 0, **changes):
    layouts = list(plan.expert_layouts)
    layouts[index] = dataclasses.replace(layouts[index], **changes)
    return dataclasses.replace(plan, expert_layouts=tuple(layouts))


@pytest.mark.parametrize(
    ("changes", "field", "fix"),
    [
        ({"module": "blocks.0.attn"}, "'expert_layouts[0].module'", "its MoE layers: blocks.0.moe, blocks.1.moe"),
        ({"module": "blocks.9.moe"}, "'expert_layouts[0].module'", "re-plan"),
        ({"experts": 8}, "'expert_layouts[0].experts' is 8 but layer 'blocks.0.moe' of the model has 4", "re-plan"),
        ({"top_k": 1}, "'expert_layouts[0].top_k' is 1 but layer 'blocks.0.moe' of the model has 2", "re-plan"),
        ({"capacity_factor": 2.0}, "'expert_layouts[0].capacity_factor' is 2.0", "build the model with that"),
    ],
)
def test_layout_that_does_not_match_the_model_is_refused(plan, tmp_path, changes, field, fix):
    with pytest.raises(PlanFileError) as refused:
        planner.compile(_with_layout(plan, **changes), tmp_path / "out")
    message = str(refused.value)
    assert field in message and fix in message and "\n" not in message, message
    assert not (tmp_path / "out").exists()


def test_every_moe_layer_needs_a_layout(plan, tmp_path):
    with pytest.raises(PlanFileError, match=r"plan field 'expert_layouts' has no layout for the model's MoE layer 'blocks.1.moe'"):
        planner.compile(dataclasses.replace(plan, expert_layouts=plan.expert_layouts[:1]), tmp_path / "out")


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"recompute": "selective"}, "recompute whole blocks or nothing, not 'selective'"),
    ],
)
def test_plan_shapes_not_written_for_moe_are_refused(plan, tmp_path, changes, expected):
    with pytest.raises(PlanningError, match=expected):
        planner.compile(dataclasses.replace(plan, **changes), tmp_path / "out")


def test_cli_refuses_a_foreign_module_with_one_line(plan, tmp_path, capsys):
    path = tmp_path / "p.json"
    _with_layout(plan, module="lm_head").save(path)
    status = cli_main(["compile", str(path), "-o", str(tmp_path / "out")])
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("importing model file")]
    assert status == 2 and len(err) == 1 and err[0].startswith("error: plan field 'expert_layouts[0].module'"), err


def test_expert_parallel_layout_compiles_with_its_placement(tmp_path):
    ep = moe_plan(2, "expert_parallel", "round-robin")
    source = (planner.compile(ep, tmp_path / "out") / "model_spmd.py").read_text()
    assert "EXPERT_PLACEMENT_1 = (((0, 1.0),), ((1, 1.0),), ((0, 1.0),), ((1, 1.0),))" in source
    assert "#   rank 1: experts 1, 3" in source


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--check", "--record-routing", "r.json"], "--record-routing records the routing of training steps; add --steps N"),
        (["--steps", "1", "--record-routing", "."], "is a folder; give a file path, e.g. output.json"),
        (["--steps", "1", "--record-routing", "no/such/folder/r.json"], "does not exist; create it first"),
    ],
)
def test_record_routing_refusals(plan, tmp_path, monkeypatch, capsys, argv, expected):
    folder = planner.compile(plan, tmp_path / "out")
    monkeypatch.chdir(tmp_path)
    assert launch_main(folder, argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("importing model file")]
    assert len(err) == 1 and expected in err[0], err


def test_record_routing_needs_expert_layouts(plan, tmp_path, monkeypatch, capsys):
    dense = planner.compile(dataclasses.replace(plan, label="", expert_layouts=()), tmp_path / "dense")
    monkeypatch.chdir(tmp_path)
    assert launch_main(dense, ["--steps", "1", "--record-routing", "r.json"]) == 2
    assert "needs a plan whose MoE layers have expert layouts" in capsys.readouterr().err


def test_sharded_expert_copies_under_zero1_step_each_ranks_shard(tmp_path):
    # ZeRO-1 splits the replicated weights' states over "dp" and steps each rank's own expert
    # shard (FSDP2 over its copy group) whole: rank-local, never split again nor gathered over
    # "dp" (parity at world 2 and 4: tests/test_moe_parity.py).
    zero1 = moe_plan(4, "expert_parallel", "grid", flavour="zero1", sharded_copies=True)
    source = (planner.compile(zero1, tmp_path / "out") / "model_spmd.py").read_text()
    assert "from codegen.runtime.expert_copies import copy_mesh, shard_over_copies\n" in source
    assert source.count("    shard_over_copies(model.get_submodule(") == 2
    assert "rank_local=rank_local_parameters(module)" in source and "plain_and_sharded_groups" not in source


def test_accumulating_programs_route_each_micro_batch(tmp_path):
    folder = planner.compile(moe_plan(2, "expert_parallel", "skewed", 0.5, accumulation_steps=2), tmp_path / "out")
    source = (folder / "model_spmd.py").read_text()
    assert "\nACCUMULATION_STEPS = 2\n" in source
    assert "# its own (over all the ranks' parts of it): capacities, drops and the balance loss are the" in source


def test_micro_batches_route_another_step_than_the_whole_batch():
    """Why launch.py --check's reference runs the plan's micro-batches: with a capacity, an
    expert's slots are an even share of the micro-batch's choices (factor 0.5: 0.5 x 128 x 2
    / 4 = 32 per micro-batch of 4 x 32 tokens, 64 for the batch of 256), and the balance loss is the mean
    over micro-batches of products of means. The step over 2 micro-batches differs from the
    whole batch's by far more than the parity tolerance (atol 1e-5), in the router's
    gradient (the balance loss) and the experts' (other tokens dropped)."""
    from codegen.runtime.accumulation import forward_backward
    from codegen.runtime.program import BUILD_SEED
    from moe_plans import MOE_EXAMPLE
    from planner.model_spec import ModelSpec

    def gradients(steps: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(BUILD_SEED)
        model, args, kwargs = ModelSpec(str(MOE_EXAMPLE), {"capacity_factor": 0.5}).build("cpu")
        forward_backward(model, args, kwargs, steps, 8, lambda a, k: (a, k))
        return {name: p.grad for name, p in model.named_parameters()}

    whole, micro = gradients(1), gradients(2)
    assert (whole["blocks.0.moe.router.weight"] - micro["blocks.0.moe.router.weight"]).abs().max() > 1e-4
    assert (whole["blocks.0.moe.experts.w_in"] - micro["blocks.0.moe.experts.w_in"]).abs().max() > 1e-4


def test_expert_parallel_ddp_is_told_of_parameters_that_get_no_gradient(tmp_path):
    # Found on hf:deepseek_v4 (benchmarks/hf_sweep.py): its compressors get no gradient at a
    # short sequence, DDP (told nothing) never all-reduced their bucket, and every non-expert
    # gradient stayed one rank's own (up to 5,604x the parity tolerance; loss and logits exact).
    from planner.api import prepare_model
    from planner.model_spec import ModelSpec
    from planner.moe_blocks import find_moe_blocks
    from planner.strategy import ExpertLayout, ExpertPlacement
    from search.data_parallel import data_parallel_plan

    spec = ModelSpec(str(Path(__file__).parent / "moe_unused_model.py"), {"ffn": 128})
    graph, spec, name, cluster = prepare_model(spec, "cpu:1x2")
    base = data_parallel_plan(graph, cluster, spec, name, "ddp", precision="fp32")
    layouts = tuple(
        ExpertLayout(module=block.module, mode="expert_parallel", experts=block.experts, top_k=block.top_k,
                     capacity_factor=block.capacity_factor, axis="dp",
                     placement=ExpertPlacement.round_robin(block.experts, 2))
        for block in find_moe_blocks(spec.build("meta")[0])
    )
    plan = dataclasses.replace(base, label="moe", expert_layouts=layouts)
    source = (planner.compile(plan, tmp_path / "out") / "model_spmd.py").read_text()
    assert "ExpertParallelMoE(" in source, source  # the expert-parallel path of the emitter
    assert "find_unused_parameters=True," in source and "unused_scale" in source, source
