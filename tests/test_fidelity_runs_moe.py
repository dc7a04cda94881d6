"""benchmarks/fidelity.py's Megatron-Core MoE rows (``benchmarks/fidelity_runs_moe.py``): each
states the layout its table states, its figure converts to a step by hand, and the builder
behind them (``search.megatron_moe.tensor_parallel_pipeline_plan``, ``account_split``) lays out
what Megatron-Core runs, on a tiny MoE (``examples/moe.py`` over ``cpu:2x4``)."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.fidelity import simulate
from benchmarks.fidelity_row import MoeLayout, Run
from benchmarks.fidelity_runs import runs
from benchmarks.fidelity_runs_moe import megatron_core_moe_runs
from planner.api import prepare_model
from planner.errors import PlanningError
from planner.families.moe_folding.section import JSON_KEY as FOLDING_KEY
from planner.model_spec import ModelSpec
from planner.strategy import NORMS_MOE_ACT
from search.megatron_moe import (
    INTERLEAVED_TP_MISSING, MegatronGrid, MegatronMoEConfig, account_split, tensor_parallel_pipeline_plan,
)
from test_parity import REPO

TINY = {"batch_size": 16, "n_expert": 8, "ffn": 512, "n_layer": 6}


def test_the_moe_rows_take_the_model_zoos_table_as_it_states_them():
    rows = {run.name: run for run in megatron_core_moe_runs()}
    assert set(rows) <= {run.name for run in runs()}  # fidelity.py prints them with the others
    # best_practice/qwen3/readme.md, H100, its Qwen3-235B rows in order:
    # (dispatcher, TP, EP, PP, EDP, VPP, DP, FSDP, MBS, GA, step s).
    table = {
        "Qwen3-235B-EP32@256xH100": ("DeepEP", 2, 32, 8, 1, 4, 16, False, 1, 128, 19.7),
        "Qwen3-235B-EP32-ov@256xH100": ("DeepEP", 2, 32, 8, 1, 4, 16, False, 1, 128, 17.6),
        "Qwen3-235B-FSDP@256xH100": ("DeepEP", 2, 8, 1, 32, 1, 128, True, 4, 4, 17.6),
        "Qwen3-235B-PP32@256xH100": ("A2A", 2, 8, 32, 1, 3, 4, False, 1, 512, 24.2),
        "Qwen3-235B-TP4@256xH100": ("DeepEP", 4, 8, 8, 4, 4, 8, False, 1, 256, 29.0),
    }
    for name, (dispatcher, tp, ep, pp, edp, vpp, dp, fsdp, micro, accumulated, step) in table.items():
        run = rows[name]
        config = run.moe.config
        assert (run.moe.dispatcher, config.tp, config.ep, config.pp, config.vpp, config.dp) == (
            dispatcher, tp, ep, pp, vpp, dp), name
        assert config.tp * config.pp * config.dp == 256 and config.etp == 1
        # The table's EDP and GA columns follow from the degrees: EDP = DP x TP / EP (the
        # copies of each expert), GA = 2048 / (DP x MBS) micro-batches per step.
        assert config.dp * config.tp // config.ep == edp and 2048 // (config.dp * micro) == accumulated
        assert config.micro_batch_size == micro and (run.moe.flavour == "fsdp") == fsdp
        assert run.megatron_distributed_optimizer == (not fsdp)
        assert run.published_step_s == step and run.overrides == {"batch_size": 2048, "seq_len": 4096}
        assert run.accumulation == (accumulated if pp == 1 else 1)
    assert rows["Qwen3-235B-EP32-ov@256xH100"].moe.a2a_overlap
    assert rows["Qwen3-235B-FSDP@256xH100"].moe.config.recompute == "full"
    # The table's recompute column: "norm, act" (--recompute-modules layernorm moe_act) for
    # EP32, EP32-ov and PP32, blank for TP4; the report's script (run_h100_235b.sh) the same.
    for name in ("Qwen3-235B-EP32@256xH100", "Qwen3-235B-EP32-ov@256xH100", "Qwen3-235B-PP32@256xH100",
                 "Qwen3-235B-report@256xH100"):
        assert rows[name].moe.config.recompute == NORMS_MOE_ACT, name
    assert rows["Qwen3-235B-TP4@256xH100"].moe.config.recompute == "none"
    assert not any(rows[name].moe.a2a_overlap for name in table if name != "Qwen3-235B-EP32-ov@256xH100")


def test_the_reports_row_is_its_tokens_per_gpu_as_a_step():
    (run,) = [run for run in megatron_core_moe_runs() if run.name == "Qwen3-235B-report@256xH100"]
    # 2,048 x 4,096 = 8,388,608 tokens per step over 2,132 tok/s/GPU x 256 GPUs = 545,792
    # tok/s: 15.37 s.
    assert run.published_step_s == pytest.approx(15.3697, abs=1e-4)
    config = run.moe.config
    assert (config.tp, config.ep, config.pp, config.vpp, config.dp) == (2, 32, 8, 4, 16)  # run_h100_235b.sh
    assert run.moe.dispatcher == "DeepEP" and run.moe.a2a_overlap


def test_account_split_counts_the_embedding_and_the_loss_as_layers():
    # Qwen3-235B on PP8 x VPP4: 94 layers + 2 = 96 slots, 3 per virtual stage; the first
    # gives one to the embedding, the last one to the loss.
    assert account_split(94, 32) == (2, *([3] * 30), 2)
    # PP32 x VPP3: one slot each, so the end stages hold no layer at all.
    assert account_split(94, 96) == (0, *([1] * 94), 0)
    with pytest.raises(PlanningError, match="do not split evenly over 30"):
        account_split(94, 30)


@pytest.fixture(scope="module")
def tiny():
    return prepare_model(ModelSpec(str(REPO / "examples" / "moe.py"), TINY), "cpu:2x4")


def test_tp_inside_an_interleaved_pipeline_builds_what_the_grid_refuses(tiny):
    graph, spec, name, cluster = tiny
    config = MegatronMoEConfig(tp=2, ep=4, etp=1, pp=2, vpp=2, dp=2, recompute="none", micro_batch_size=1)
    assert MegatronGrid(graph, cluster, spec, name).build(config).missing == INTERLEAVED_TP_MISSING
    split = account_split(6, 4)  # 8 slots over 4 virtual stages: (1, 2, 2, 1)
    assert split == (1, 2, 2, 1)
    plan = tensor_parallel_pipeline_plan(graph, cluster, spec, name, config, split, all_to_all="deduplicated")
    assert dict(zip(plan.mesh.names, plan.mesh.shape)) == {"pp": 2, "dp": 2, "tp": 2}
    assert plan.pipeline.schedule == "interleaved" and plan.pipeline.virtual_stages == 2
    assert plan.pipeline.micro_batches == 8  # 16 samples / (2 dp ranks x 1 per micro-batch)
    assert plan.dp_flavour == "zero1" and plan.sections[FOLDING_KEY].sequence_parallel
    assert plan.expert_layouts and all(
        layout.axis == "dp*tp" and layout.all_to_all == "deduplicated" and layout.tensor_parallel == 1
        and layout.placement.most_experts_per_device == 2  # 8 experts over EP 4
        for layout in plan.expert_layouts)
    assert plan.estimate.step_time_s > 0
    with pytest.raises(PlanningError, match="TP and PP of at least 2"):
        tensor_parallel_pipeline_plan(graph, cluster, spec, name, dataclasses.replace(config, tp=1, dp=4), split)


@pytest.mark.parametrize("config, flavour, overlap", [
    (MegatronMoEConfig(tp=2, ep=4, etp=1, pp=2, vpp=2, dp=2, recompute="none", micro_batch_size=1), "zero1", True),
    (MegatronMoEConfig(tp=2, ep=4, etp=1, pp=1, vpp=1, dp=4, recompute="full", micro_batch_size=2), "fsdp", False),
])
def test_fidelity_simulates_an_moe_row_as_its_layout_says(config, flavour, overlap):
    run = Run("tiny-moe", "moe.py", TINY, "cpu:2x4", {}, 2 if config.pp == 1 else 1, 1.0, "1 s", "test",
              megatron_distributed_optimizer=flavour == "zero1",
              moe=MoeLayout(config, "A2A", a2a_overlap=overlap, flavour=flavour))
    plan, cluster = simulate(run)
    assert cluster.world_size == 8 and plan.dp_flavour == flavour
    assert plan.moe_a2a_overlap == overlap and plan.megatron_distributed_optimizer == (flavour == "zero1")
    assert all(layout.all_to_all == "flat" for layout in plan.expert_layouts)
    if config.pp == 1:
        assert plan.accumulation_steps == 2 and plan.recompute == "full"  # 16 / (4 ranks x 2 samples)
        # Megatron-FSDP shards the experts over their EDP = 8 / 4 = 2 copies (search.moe_folding.folded_plan).
        assert all(layout.sharded_copies for layout in plan.expert_layouts)
    else:
        assert plan.pipeline.virtual_stages == 2
    assert plan.estimate.step_time_s > 0
    assert run.describe(8).startswith(f"tp2 ep4 pp{config.pp}")


def test_megatrons_distributed_optimizer_shards_expert_states_over_their_copies():
    """Megatron-Core steps expert weights in their own distributed optimizer over the expert
    data-parallel group (``cost_model.step_memory.expert_state_shards``). The tiny MoE's 8
    experts on tp2 x dp2 = 4 folded ranks: EP 2 gives each rank 4 experts held by EDP = 4 / 2 =
    2 ranks, so it steps the states of 4 / 2 = 2 experts; EP 4 gives it 2 experts, EDP 1: the
    same 2 experts' states. The dense weights are laid out alike in both, so the optimizer
    states on a device are equal (before: EP 2 held 4 experts' states, twice EP 4's), while
    EP 2 holds twice EP 4's expert weights."""
    states, weights = {}, {}
    for ep in (2, 4):
        config = MegatronMoEConfig(tp=2, ep=ep, etp=1, pp=2, vpp=2, dp=2, recompute="none", micro_batch_size=1)
        run = Run(f"tiny-ep{ep}", "moe.py", TINY, "cpu:2x4", {}, 1, 1.0, "1 s", "test",
                  megatron_distributed_optimizer=True, moe=MoeLayout(config, "A2A"))
        plan, _ = simulate(run)
        memory = plan.estimate.memory
        states[ep], weights[ep] = memory.optimizer_states, memory.weights
    assert states[2] == pytest.approx(states[4], rel=1e-9)
    assert weights[2] > weights[4]
