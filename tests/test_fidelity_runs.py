"""benchmarks/fidelity.py's published runs: each states its source, figure and layout, and
the layouts build simulated plans; the FLOP counts and the summary line are right by hand."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.fidelity import as_hsdp, simulate, summary
from benchmarks.fidelity_flops import megatron_core_flops, megatron_deepspeed_flops
from benchmarks.fidelity_runs import Run, bloom_cluster, llama3_405b_layout, runs
from planner.families.hsdp.section import HsdpSection


def example(file: str):
    """The module ``examples/<file>``, loaded from its path."""
    spec = importlib.util.spec_from_file_location(f"fidelity_example_{Path(file).stem}",
                                                  Path(__file__).resolve().parents[1] / "examples" / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def by_name() -> dict[str, Run]:
    return {run.name: run for run in runs()}


def test_every_run_names_its_source_figure_and_layout():
    found = runs()
    assert len(found) >= 25
    assert len({run.name for run in found}) == len(found), "run names must be unique (--runs picks by name)"
    for run in found:
        assert run.source.strip() and run.figure.strip(), run.name
        assert run.published_step_s > 0, run.name
        assert {"batch_size", "seq_len"} <= set(run.overrides), run.name
        if run.moe is not None:  # a Megatron-Core MoE row states its layout in MoeLayout
            assert run.moe.flavour in ("zero1", "fsdp") and not run.layout, run.name
        else:
            assert "dp_flavour" in run.layout, f"{run.name}: the data-parallel flavour must be stated"


def shrunk(run: Run, layers: int) -> Run:
    """``run`` with fewer layers (its layout, cluster and batch kept), so its plan builds fast."""
    overrides = dict(run.overrides, n_layer=layers)
    return dataclasses.replace(run, overrides=overrides)


@pytest.mark.parametrize("name, layers", [
    ("MCore-GPT-1.7B@48xH100", 2),  # ZeRO-1, one device per model copy
    ("MCore-GPT-70B@768xH100", 4),  # tp 8 x pp 2 with sequence parallelism
    ("MPT-7B@8xA100", 2),  # FSDP with gradient accumulation
    ("Llama3.1-405B@128xH100", 2),  # FSDP x tensor parallelism 8
])
def test_run_layouts_build_the_plans_they_state(name, layers):
    run = shrunk(by_name()[name], layers)
    plan, cluster = simulate(run)
    tp, pp = run.layout.get("tp", 1), run.layout.get("pp", 1)
    sizes = dict(zip(plan.mesh.names, plan.mesh.shape))
    assert sizes.get("tp", 1) == tp and sizes.get("pp", 1) == pp
    assert sizes["dp"] == cluster.world_size // (tp * pp)
    assert plan.dp_flavour == run.layout["dp_flavour"]
    assert plan.estimate.step_time_s > 0
    # Megatron-Core's rows ran --tp-comm-overlap, which needs sequence parallelism; no other did.
    assert plan.tp_comm_overlap == (name.startswith("MCore-") and tp > 1)
    # Megatron-Core's rows ran its distributed optimizer (--use-distributed-optimizer with
    # --overlap-grad-reduce --overlap-param-gather); without a pipeline each rank's samples pass
    # at once (the table states no micro-batch size: docs/fidelity_log.md).
    assert plan.megatron_distributed_optimizer == name.startswith("MCore-")
    if name.startswith("MCore-") and pp == 1:
        assert plan.accumulation_steps == 1
    # torchtitan's FSDP2 gathers bf16 and reduces in fp32 (MixedPrecisionPolicy), as the
    # planner's own bf16 programs do; every other row's model holds 16-bit weights and
    # gradients (Megatron-LM, DeepSpeed, Composer's DEFAULT mixed precision).
    assert plan.half_precision_weights == (not name.startswith("Llama3.1-405B"))
    # llm-foundry's yamls step Composer's DecoupledAdamW, parameter by parameter; torchtitan
    # of 2024 torch.optim.AdamW(foreach=True); every other row's framework a fused AdamW
    # (Megatron's, DeepSpeed's).
    expected = "per_parameter" if name.startswith("MPT-") else "foreach" if name.startswith("Llama3.1-405B") else "fused"
    assert plan.optimizer_implementation == expected
    # llm-foundry's MPT computes its loss with FlashAttention's fused cross entropy and Composer
    # updates two train metrics (cross entropies over the logits) after every micro-batch; every
    # other row's framework runs one cross entropy of its own (priced as eager PyTorch's).
    mpt = name.startswith("MPT-")
    assert (plan.loss_implementation, plan.metric_cross_entropies) == (("fused_xentropy", 2) if mpt else ("", 0))


def test_the_jean_zay_constant_applies_only_to_the_run_on_the_cluster_it_was_fitted_on():
    # MEGATRON_DEEPSPEED_LAYER_OVERHEAD_S was fitted to BigScience's sweep on Jean Zay (BLOOM's
    # cluster and software, CUDA_LAUNCH_BLOCKING=1); its cause is identified only in part, so
    # no run elsewhere (MT-NLG on Selene in particular) may carry it.
    for run in runs():
        fitted_here = isinstance(run.cluster, type(bloom_cluster())) and run.cluster == bloom_cluster()
        assert (run.layout.get("block_overhead_s", 0.0) > 0) == fitted_here, run.name
    assert [run.name for run in runs() if run.layout.get("block_overhead_s")] == ["BLOOM-176B@384xA100"]


def test_deepspeed_checkpointing_options_are_set_only_where_a_source_states_them():
    # BLOOM's script passes none of DeepSpeed's activation-checkpointing options (stated: an
    # empty tuple); MT-NLG's are stated nowhere, so its rows leave the setting out (DeepSpeed's
    # defaults, off) and ``fidelity.py --deepspeed-checkpointing`` turns them on as a what-if.
    # No other row runs DeepSpeed.
    stated = {run.name: run.layout["deepspeed_checkpointing"] for run in runs() if "deepspeed_checkpointing" in run.layout}
    assert stated == {"BLOOM-176B@384xA100": ()}
    unstated = [run.name for run in runs() if run.layout.get("blocking_p2p") and "deepspeed_checkpointing" not in run.layout]
    assert unstated == [f"MT-NLG-530B@{gpus}xA100" for gpus in (2240, 2800, 3360)]


def test_llama3_405b_rows_take_the_pipeline_section_3_3_2_states():
    layout = llama3_405b_layout()
    # 126 layers plus an embedding-only and a head-only chunk fill 16 ranks x 8 chunks of one.
    assert (layout["pp"], layout["virtual_stages"], layout["tp"]) == (16, 8, 8)
    assert layout["layers_per_stage"] == (0, *([1] * 126), 0)
    # Interleaved: chunk c of rank r is virtual stage c x 16 + r, so the first and last rank
    # hold one transformer layer fewer (7) than the other fourteen (8).
    per_rank = [sum(layout["layers_per_stage"][chunk * 16 + rank] for chunk in range(8)) for rank in range(16)]
    assert per_rank == [7, *([8] * 14), 7]
    # Asynchronous sends (no blocking_p2p) and no activation checkpointing at 8K tokens.
    assert not layout.get("blocking_p2p") and layout["recompute"] == "none"
    rows = [run for run in runs() if run.name.startswith("Llama3-405B@")]
    assert [run.layout for run in rows] == [layout, layout]
    with pytest.raises(ValueError, match="do not fill 16 pipeline ranks"):
        llama3_405b_layout(layers=125)


def test_llama3_405b_layout_simulates_with_empty_end_chunks():
    # 6 layers + 2 end chunks over 2 ranks: 4 chunks of one layer per rank, 8 virtual stages.
    run = by_name()["Llama3-405B@8192xH100"]
    small = dataclasses.replace(shrunk(run, 6), layout=llama3_405b_layout(layers=6, pipeline_ranks=2))
    plan, cluster = simulate(small)
    assert plan.pipeline.virtual_stages == 4 and plan.pipeline.stages == 2
    # 2048 sequences over dp = 8192 / (8 x 2) = 512 groups: 4 micro-batches of one.
    assert plan.pipeline.micro_batches == 2048 // (cluster.world_size // 16)
    assert {strategy.stage for strategy in plan.strategies} == set(range(8))
    assert plan.estimate.step_time_s > 0


def test_a_run_with_a_hsdp_shard_simulates_as_hsdp():
    fsdp_run = shrunk(by_name()["MPT-13B@64xH100"], 2)
    fsdp, _ = simulate(fsdp_run)
    hsdp, _ = simulate(dataclasses.replace(fsdp_run, hsdp_shard=8))
    assert "hsdp" not in fsdp.sections
    assert hsdp.sections["hsdp"] == HsdpSection(8)
    assert "hsdp8" in dataclasses.replace(fsdp_run, hsdp_shard=8).describe(64)
    # Gradients cross nodes as 1/8 shards: a different step from FSDP over all 64 ranks.
    assert hsdp.estimate.step_time_s != fsdp.estimate.step_time_s


def test_the_hsdp_what_if_takes_the_fsdp_rows_on_dp_alone_that_whole_node_groups_divide():
    """``fidelity.py --hsdp-shard``: groups of 8 (one 8-GPU node) fit the six 64-GPU FSDP rows
    without tp (64 / 8 = 8 groups); not the 8-GPU FSDP rows (one group of all 8 ranks is plain
    FSDP), the 405B row (FSDP x tp 8: HSDP is on a mesh of dp alone), nor the ZeRO-1 or MoE
    rows. Groups of 4 take the 8-GPU rows too (8 / 4 = 2 groups); groups of 16 fit none (a
    group would span two 8-GPU nodes), nor does 1."""
    sixty_four = {"MPT-70B@64xA100", "MPT-13B@64xH100", "MPT-70B@64xH100", "Llama3-70B@64xA100",
                  "Llama2-13B@64xA100", "Llama2-70B@64xA100"}
    eight = {"MPT-7B@8xA100", "MPT-13B@8xA100", "MPT-30B@8xA100", "MPT-7B@8xH100"}
    by_eight = {run.name: run.hsdp_shard for run in as_hsdp(runs(), 8)}
    assert {name for name, shard in by_eight.items() if shard} == sixty_four
    assert set(by_eight.values()) == {None, 8}
    assert {run.name for run in as_hsdp(runs(), 4) if run.hsdp_shard == 4} == sixty_four | eight
    for shard, message in ((16, "fits none of the chosen runs"), (1, "2 or more")):
        with pytest.raises(ValueError, match=message):
            as_hsdp(runs(), shard)


def test_megatron_core_flops_counts_the_logit_gemm_as_6_b_s_h_v():
    """Megatron-Core's count equals Narayanan et al.'s (72 B s l h^2 (1 + s/6h + V/16lh),
    no recomputation) but for the output layer, which it counts as forward and backward of
    one (B s, h) x (h, V) GEMM: 6 B s h V."""
    batch, seq, layers, hidden, vocab = 8, 2048, 24, 2048, 131072
    without_vocab = megatron_core_flops(batch, seq, layers, hidden, 0, 4 * hidden, 16, 16)
    assert without_vocab == pytest.approx(megatron_deepspeed_flops(batch, seq, layers, hidden, 0, recompute=False))
    logit = megatron_core_flops(batch, seq, layers, hidden, vocab, 4 * hidden, 16, 16) - without_vocab
    assert logit == pytest.approx(6 * batch * seq * hidden * vocab)


def test_megatron_core_flops_with_gqa_and_swiglu():
    """Llama-like layer by hand: q and o projections 2 h^2, k and v 2 h^2 g/a, scores and
    values 2 s h, SwiGLU 3 h f; times 2 FLOPs per multiply-add and 3 for forward + backward."""
    batch, seq, layers, hidden, ffn, heads, groups = 1, 1024, 1, 4096, 14336, 32, 8
    per_token = 6 * (2 * hidden**2 + 2 * hidden**2 * groups / heads + 2 * seq * hidden + 3 * hidden * ffn)
    counted = megatron_core_flops(batch, seq, layers, hidden, 0, ffn, heads, groups, swiglu=True)
    assert counted == pytest.approx(per_token * batch * seq * layers)


def test_summary_gives_median_largest_and_bias():
    line = summary([-0.10, 0.05, 0.02])
    assert "median absolute error 5.0%" in line
    assert "largest 10.0%" in line
    assert "1 predicted fast (optimistic), 2 slow (pessimistic)" in line
    assert "median signed error +2.0%" in line


def test_megatron_core_rows_have_the_parameter_counts_their_table_names():
    """The weak-scaling table names each model by its size (1.7B ... 462B); gpt.py with the
    row's widths, untied embeddings and a 4x GELU MLP must come within 5% of it (tied
    embeddings would leave the 1.7B and 7.1B rows 13% and 7% short)."""
    gpt = example("gpt.py")
    rows = [run for run in runs() if run.name.startswith("MCore-GPT-")]
    assert len(rows) == 9
    for run in rows:
        named = float(run.name.split("-")[2].split("B@")[0]) * 1e9
        with torch.device("meta"):
            model, _ = gpt.build(**run.overrides)
        counted = sum(parameter.numel() for parameter in model.parameters())
        assert abs(counted / named - 1) < 0.05, (run.name, counted)


def test_runs_picks_a_subset_by_name_or_pattern_and_rows_only_simulates_nothing():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "fidelity.py"
    listed = subprocess.run([sys.executable, str(script), "--rows-only", "--runs", "MCore-*", "BLOOM-176B@384xA100"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert [line.split()[0] for line in listed] == [
        "BLOOM-176B@384xA100", *(run.name for run in runs() if run.name.startswith("MCore-"))]
    assert all("NVIDIA/Megatron-LM README" in line for line in listed[1:])
    unmatched = subprocess.run([sys.executable, str(script), "--rows-only", "--runs", "Nope*"],
                               capture_output=True, text=True)
    assert unmatched.returncode != 0 and "no run matches Nope*" in unmatched.stderr


def test_the_transfer_check_takes_the_engine_runs_not_fitted_on_and_closes_each_gap_by_hand():
    """``fidelity_sweep.py --elsewhere`` checks Jean Zay's per-layer constant on the engine's
    other runs without applying it: those are MT-NLG's three (blocking sends, no fitted
    overhead), and a row's closing overhead is its gap over its sensitivity."""
    from benchmarks.fidelity_sweep import engine_runs_elsewhere, fitted_overhead

    assert [run.name for run in engine_runs_elsewhere()] == [
        "MT-NLG-530B@2240xA100", "MT-NLG-530B@2800xA100", "MT-NLG-530B@3360xA100"]
    # 47.9 s predicted, 60.1 s published, 822 s of step per second of per-layer overhead
    # (3 layers per stage x 274 micro-batch slots): (60.1 - 47.9) / 822 = 14.84 ms.
    assert fitted_overhead([47.9], [822.0], [60.1]) == pytest.approx(12.2 / 822)
    # Two rows, least squares on relative error: weights k/q = 10 and 10, gaps 0.1 and 0.3:
    # c = (10 x 0.1 + 10 x 0.3) / (100 + 100) = 0.02.
    assert fitted_overhead([9.0, 7.0], [100.0, 100.0], [10.0, 10.0]) == pytest.approx(0.02)
    # Never negative: a row predicted slow gets none.
    assert fitted_overhead([11.0], [100.0], [10.0]) == 0.0


def test_the_slot_fit_splits_mt_nlg_published_steps_by_hand():
    """``fidelity_slots.py``: MT-NLG's runs at dp 8, 10 and 12 (batch 1920, pp 35) have
    1920 / (dp x micro-batch) + 34 slots, and a least-squares line through the published
    steps gives seconds per slot and per step."""
    from benchmarks.fidelity_slots import mt_nlg_runs, pipeline_slots, slot_fit

    chosen = mt_nlg_runs()
    assert [pipeline_slots(run, 1) for run in chosen] == [240 + 34, 192 + 34, 160 + 34]
    assert [pipeline_slots(run, 2) for run in chosen] == [120 + 34, 96 + 34, 80 + 34]
    with pytest.raises(ValueError, match="does not split into micro-batches of 7"):
        pipeline_slots(chosen[0], 7)
    published = [60.1, 50.2, 44.4]
    # Micro-batch 1: mean slots 231.333, mean step 51.567; deviations (42.667, -5.333, -37.333)
    # and (8.533, -1.367, -7.167): Sxy = 364.09 + 7.29 + 267.56 = 638.93, Sxx = 1820.44 +
    # 28.44 + 1393.78 = 3242.67; 0.19704 s per slot, 51.567 - 0.19704 x 231.333 = 5.98 s per step.
    per_slot, per_step = slot_fit([274, 226, 194], published)
    assert per_slot == pytest.approx(638.93 / 3242.67, rel=1e-4)
    assert per_step == pytest.approx(5.98, abs=0.01)
    # Micro-batch 2: mean 132.667; deviations (21.333, -2.667, -18.667): Sxy = 182.04 + 3.64 +
    # 133.78 = 319.47, Sxx = 455.11 + 7.11 + 348.44 = 810.67; 0.39408 s per slot, -0.72 s per step.
    per_slot, per_step = slot_fit([154, 130, 114], published)
    assert per_slot == pytest.approx(319.47 / 810.67, rel=1e-4)
    assert per_step == pytest.approx(-0.72, abs=0.01)
    with pytest.raises(ValueError, match="at least two runs"):
        slot_fit([274, 274], [60.1, 60.0])


def test_the_slot_fits_errors_and_the_micro_batch_free_split_by_hand():
    """``fidelity_slots.py``: the three runs cannot tell a per-step cost from a larger bubble
    (the micro-batch-2 line is the micro-batch-1 line in other units, with the same
    residuals), and the fits' standard errors come from those residuals; the split into
    seconds per sequence and seconds that do not shrink with dp is the same either way."""
    from benchmarks.fidelity_slots import mt_nlg_runs, sequence_fit, sequences_per_pipeline, slot_fit_errors

    published = [60.1, 50.2, 44.4]
    # Micro-batch 1 (above: 0.19704 s per slot, 5.985 s per step): fitted 53.988 + 5.985 =
    # 59.974, 44.531 + 5.985 = 50.516, 38.226 + 5.985 = 44.211; residuals +0.126, -0.316,
    # +0.189; RSS = 0.01596 + 0.09972 + 0.03590 = 0.15158 over 3 - 2 = 1 degree of freedom;
    # se(per slot) = sqrt(0.15158 / 3242.67) = 0.006837; se(per step) = sqrt(0.15158 x
    # (1/3 + 231.333^2 / 3242.67)) = sqrt(0.15158 x 16.8367) = 1.5975 s.
    slot_error, step_error = slot_fit_errors([274, 226, 194], published)
    assert slot_error == pytest.approx(0.006837, rel=1e-3)
    assert step_error == pytest.approx(1.5975, rel=1e-3)
    # Micro-batch 2: the same residuals (slots2 = (slots1 + 34) / 2); Sxx = 810.67, mean
    # 132.667: se(per slot) = sqrt(0.15158 / 810.67) = 0.013674 (twice, as the slope is);
    # se(per step) = sqrt(0.15158 x (1/3 + 17600.4 / 810.67)) = sqrt(0.15158 x 22.044) = 1.8280 s.
    slot_error, step_error = slot_fit_errors([154, 130, 114], published)
    assert slot_error == pytest.approx(0.013674, rel=1e-3)
    assert step_error == pytest.approx(1.8280, rel=1e-3)
    with pytest.raises(ValueError, match="at least three runs"):
        slot_fit_errors([274, 226], [60.1, 50.2])
    # Sequences per pipeline 1920 / dp = 240, 192, 160: deviations from 197.333 are the
    # micro-batch-1 slots' (Sxy 638.93, Sxx 3242.67): 0.19704 s per sequence, and 51.567 -
    # 0.19704 x 197.333 = 12.684 s that do not shrink with dp. The same from either slot fit:
    # 5.985 + 34 x 0.19704 = 12.684 (micro-batch 1), -0.714 + 34 x 0.39408 = 12.684 (2).
    chosen = mt_nlg_runs()
    assert [sequences_per_pipeline(run) for run in chosen] == [240, 192, 160]
    per_sequence, fixed = sequence_fit(chosen, published)
    assert per_sequence == pytest.approx(638.93 / 3242.67, rel=1e-4)
    assert fixed == pytest.approx(12.684, abs=0.002)
