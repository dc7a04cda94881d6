"""The published runs ``benchmarks/fidelity.py`` checks the simulator against: each run's
model, GPUs, layout as its source states it, the figure it publishes and the source.

Sources, each row naming its own: MosaicML llm-foundry's benchmarking README (the MPT rows
only); torchtitan's docs/performance.md (A100 of mid-2024; H100 of August 2024); Smith et
al. 2022 (MT-NLG, section 2.4, its three scales); BigScience's BLOOM-176B pages; Dubey et
al. 2024 (Llama 3), table 4; NVIDIA/Megatron-LM's README (weak-scaling table of
Megatron-Core r0.8.0 on H100); the Megatron-Core MoE rows (Qwen3-235B-A22B on 256 H100s) are
``benchmarks/fidelity_runs_moe.py``'s. Published figures become step times with the source's own
definitions (``benchmarks/fidelity_flops.py``). ``Run`` is ``benchmarks/fidelity_row.py``'s.

Models: MPT (MosaicML) as llm-foundry's benchmark sweep built it is GPT-like: ``examples/gpt.py``
with its widths and its output layer tied to the token embedding (below, ``_mpt``). Runs from before
FlashAttention (MT-NLG 2021, BLOOM 2022) use ``gpt.py``'s explicit attention (``eager``): the
(s x s) scores exist as tensors, as in Megatron-LM's core attention.
"""

from __future__ import annotations

import argparse
import fnmatch

from planner.cluster import Cluster
from planner.cluster_edits import with_attention_kernel, with_inter_node, with_memory, with_power_limit
from search.layouts import nearly_even_layers

try:  # imported as benchmarks.fidelity_runs, or from a script in benchmarks/ (its folder on sys.path)
    from benchmarks.fidelity_flops import megatron_core_flops, megatron_deepspeed_flops, palm_model_flops, tokens_step
    from benchmarks.fidelity_row import Run
    from benchmarks.fidelity_runs_moe import megatron_core_moe_runs
except ModuleNotFoundError:  # pragma: no cover
    from fidelity_flops import megatron_core_flops, megatron_deepspeed_flops, palm_model_flops, tokens_step
    from fidelity_row import Run
    from fidelity_runs_moe import megatron_core_moe_runs

MPT_VOCAB = 50368  # llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml: vocab_size 50368
# ComposerMPTCausalLM's train metrics (llmfoundry/models/mpt/modeling_mpt.py at v0.3.0:
# ``train_metrics = [LanguageCrossEntropy(), LanguagePerplexity()]``), each updated by Composer
# with a cross entropy over the logits after every micro-batch.
COMPOSER_MPT_TRAIN_METRICS = 2
LLM_FOUNDRY = "llm-foundry scripts/train/benchmarking/README.md"
TORCHTITAN_A100 = "torchtitan docs/performance.md (2024, 64 A100)"
# torchtitan's AdamW in 2024: ``torch.optim.AdamW(..., weight_decay=0.1, foreach=True)`` in its
# build_optimizer (train.py); ``fused`` became an option in PR #355 (2024-06) and the default
# in PR #881 (2025-02), after every row here was published.
TORCHTITAN_2024_ADAMW = "foreach"
# torchtitan's train.py of 2024 clips with ``torch.nn.utils.clip_grad_norm_(model.parameters(),
# job_config.training.max_norm, foreach=True)`` before the optimizer step (``max_norm`` 1.0 by
# default): cost_model.gradient_clipping's "foreach".
TORCHTITAN_CLIPPING = "foreach"
# Megatron-LM's --hidden-dropout and --attention-dropout default to 0.1 (megatron/training/
# arguments.py; Megatron-DeepSpeed's arguments.py the same); MT-NLG's paper and the weak-scaling
# table state none, so their runs dropped out at 0.1 (a dropout of p = 0 launches no kernel:
# cost_model.compute.runs_no_kernel). BLOOM states 0 (its config's hidden_dropout and
# attention_dropout), examples/gpt.py's default.
MEGATRON_DEFAULT_DROPOUT = 0.1
MEGATRON_WEAK_SCALING = "NVIDIA/Megatron-LM README, weak-scaling table (images/model_table.png, Megatron-Core r0.8.0, 2024-07)"


def _mpt(size: str, layers: int, width: int, heads: int, batch: int, seq: int) -> dict:
    """``examples/gpt.py``'s overrides for MPT as llm-foundry v0.3.0 (the sweep's ``git_branch``,
    scripts/train/benchmarking/submit_benchmarks.py at b2a43a147) built it from the benchmark
    yamls (scripts/train/yamls/pretrain/mpt-*.yaml, which set only ``attn_impl`` in
    ``attn_config``), with MPTConfig's defaults (llmfoundry/models/mpt/configuration_mpt.py):
    learned positions (``learned_pos_emb: True``, ``alibi: False``), biases in every linear and
    norm (``no_bias: False``), LayerNorm, an MLP of 4x width with GELU, vocabulary 50,368, and the
    output layer the token embedding's weight: ``MPTForCausalLM`` refuses untied embeddings and
    computes its logits as ``F.linear(x, wte.weight)`` (``SharedEmbedding(..., unembed=True)``,
    llmfoundry/models/layers/custom_embedding.py)."""
    return {"n_layer": layers, "n_embd": width, "n_head": heads, "vocab_size": MPT_VOCAB, "seq_len": seq,
            "batch_size": batch, "tie_weights": True}


def _llama(layers: int, dim: int, heads: int, kv_heads: int, ffn: int, vocab: int, batch: int, seq: int) -> dict:
    return {"size": "8b", "n_layer": layers, "dim": dim, "n_heads": heads, "n_kv_heads": kv_heads, "ffn_dim": ffn,
            "vocab_size": vocab, "batch_size": batch, "seq_len": seq}


def bloom_cluster() -> Cluster:
    """Jean Zay's A100 partition as BLOOM ran on it (Le Scao et al. 2022, "BLOOM", section
    3.4.1): 48 nodes of 8 A100-80GB with NVLink, each node on 4 Omni-Path 100 Gb/s links:
    400 Gb/s per node = 6.25e9 B/s per GPU (the DGX preset's NVLink and latency otherwise)."""
    return with_inter_node(Cluster.preset("dgx-a100-80g", nodes=48), bandwidth=4 * 100e9 / 8 / 8)


# DeepSpeed's pipeline engine as MT-NLG (2021) and BLOOM (2022) ran it
# (deepspeed/runtime/pipe/engine.py and p2p.py of those years):
#   * sends are synchronous (p2p.py: ``send`` asserts ``async_op == False``) and ordered by
#     its TrainSchedule (schedule.py): blocking_p2p;
#   * with tensor parallelism, each rank sends its 1/tp slice of a boundary activation or
#     gradient and the receiver rebuilds the whole with an all-gather over the tensor-parallel
#     group (engine.py: ``is_pipe_partitioned = is_grad_partitioned = is_model_parallel``,
#     ``PartitionedTensor(...).full()``; the sender also restores its own output that way
#     before the backward): partitioned_p2p.
#   * gradients are reduced over data parallelism after the schedule's last step, not during
#     the last backward (schedule.py: ``ReduceGrads`` comes with ``OptimizerStep`` at
#     ``step_id == total_steps - 1``): overlap_grad_reduce False.
DEEPSPEED_PIPELINE = {"blocking_p2p": True, "partitioned_p2p": True, "overlap_grad_reduce": False}

# BigScience's software on Jean Zay (the sweep of ``benchmarks/fidelity_sweep.py`` and BLOOM's
# training) costs each transformer layer a further 10.75 ms per micro-batch (forward,
# recomputation and backward together), whatever the layer's size: fitted, by closed-form
# least squares on relative error, to BigScience's published layout sweep on that cluster (17
# configurations of 176-206B models on 384 A100s varying tp, pp, micro-batch, width and heads:
# ``python benchmarks/fidelity_sweep.py`` prints the fit, 10.75 ms, and its leave-one-out
# errors; 14.9 ms when first fitted, before the kernel prices of today's
# ``cost_model.gpu_kernels``). Without it the sweep is predicted 7.4% fast at the median and up
# to 21% where a rank's work per micro-batch is small; with it, 1.7% (1.8% with each row left
# out); on the same document's earlier fp16 sweep, held out, 11.6% -> 3.7% (Spearman
# 0.29 -> 0.76).
#
# What it is, as far as the sources show (``JEAN_ZAY_LAYER_OVERHEAD``):
#   * Not DeepSpeed's activation-checkpointing options. BLOOM's script
#     (bigscience-workshop/bigscience train/tr11-176B-ml/tr11-176B-ml.slurm) passes
#     ``--deepspeed-activation-checkpointing`` and none of ``--partition-activations``,
#     ``--contigious-checkpointing``, ``--checkpoint-in-cpu``, ``--synchronize-each-layer``
#     (Megatron-DeepSpeed megatron/initialize.py ``setup_deepspeed_random_and_activation_
#     checkpointing`` hands those flags, default off, to ``deepspeed.checkpointing.configure``).
#     With them off, ``CheckpointFunction`` (deepspeed/runtime/activation_checkpointing/
#     checkpointing.py, v0.5.10 and the 2021 big-science branch alike: every partition, copy
#     and ``torch.cuda.synchronize`` there sits under those flags) keeps the layer's input as
#     is (no partition, no all-gather over tp in backward, no copies), does not synchronize,
#     and per layer only copies RNG states on the host (``torch.cuda.get_rng_state``;
#     ``_set_cuda_rng_state`` through ``_lazy_call``: no device sync);
#     ``PipelineModule.forward`` (pipe/module.py) reseeds per layer only with ``seed_layers``,
#     which Megatron-DeepSpeed's ``GPTModelPipe`` leaves off.
#     What those options would cost is priced now (``PipelineConfig.deepspeed_checkpointing``,
#     ``cost_model.deepspeed_checkpointing``): on BLOOM's layer at micro-batch 2 all of
#     partitioning, contiguous buffers and synchronization together would add 0.63 ms per
#     micro-batch (0.40 ms of it the all-gather over tp), a seventeenth of 10.75 ms, had the
#     run set them; it set none, so its row sets ``deepspeed_checkpointing`` empty.
#   * Part of it is synchronous launching. Both the sweep and BLOOM's training ran with
#     ``CUDA_LAUNCH_BLOCKING=1`` (tr11-176B-ml.slurm: ``export CUDA_LAUNCH_BLOCKING=1``;
#     chronicles-prequel.md, "dealing with JZ hanging on the large model" and "Hanging
#     Issue": without it models of 100B and more hung on 20 nodes or more and 320 GPUs
#     "always hangs", so the 48-node sweep needed it): every kernel and collective waits for
#     the previous one, so the host's time per op (Python, dispatch, autograd) adds to the
#     GPU's instead of hiding under it. BigScience's own A/B of that setting (the same
#     section: 200B, tp 8 x pp 10, micro-batch 1, 512 micro-batches) measured 97.20 -> 91.04
#     TFLOP/s on 80 GPUs: by Megatron-DeepSpeed's FLOP count (``megatron_deepspeed_flops``:
#     batch 512, 80 layers of width 14400, vocabulary 250,880), 222.8 -> 237.8 s, 15.1 s over
#     8 layers x 512 micro-batches = 3.7 ms per layer per micro-batch; on 160 GPUs it measured
#     no difference (84.59 vs 84.44 and 90.29 vs 90.25 TFLOP/s). So synchronous launching
#     explains at most a third of the 10.75 ms; the rest is not identified, and the simulator
#     does not model synchronous launching on its own (its host time per op,
#     ``cost_model.host_dispatch``, is the 5 us launch gap, not PyTorch 1.11's
#     eager dispatch).
# The constant is therefore a property of that cluster's software, measured there and applied
# only to BLOOM, which ran on it; MT-NLG (Selene, DeepSpeed of 2021, fp16, no stated
# ``CUDA_LAUNCH_BLOCKING``) runs without it, and its rows show the engine as modelled. Their
# gaps would need 14.8-18.0 ms per layer per micro-batch (``fidelity_sweep.py --elsewhere``):
# the same order on another cluster, so probably not Jean Zay's alone, but growing with dp,
# which a per-layer cost does not; not applied (``docs/fidelity_log.md`` has the checks).
# ``--no-engine-overhead`` shows BLOOM without it too.
MEGATRON_DEEPSPEED_LAYER_OVERHEAD_S = 10.75e-3
JEAN_ZAY_LAYER_OVERHEAD = {"block_overhead_s": MEGATRON_DEEPSPEED_LAYER_OVERHEAD_S}


LLAMA3_405B = dict(layers=126, dim=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256)
LLAMA3_70B = dict(layers=80, dim=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)
LLAMA2_70B = dict(layers=80, dim=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000)
LLAMA2_13B = dict(layers=40, dim=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000)


def llama3_405b_layout(layers: int = LLAMA3_405B["layers"], pipeline_ranks: int = 16) -> dict:
    """Llama 3 405B's 4D layout without context parallelism (Dubey et al. 2024, section
    3.3.2; see ``runs``): tp 8, interleaved pipeline of one layer per model chunk, the first
    rank's first chunk holding only the embedding and the last rank's last chunk only the
    output projection and loss (``layers`` and ``pipeline_ranks`` other than the paper's for
    smaller checks)."""
    chunks_per_rank = (layers + 2) // pipeline_ranks
    if chunks_per_rank * pipeline_ranks != layers + 2:
        raise ValueError(f"{layers} layers + 2 end chunks do not fill {pipeline_ranks} pipeline ranks evenly")
    return {"tp": 8, "pp": pipeline_ranks, "micro_batch": 1, "schedule": "interleaved",
            "virtual_stages": chunks_per_rank, "recompute": "none", "sequence_parallel": True,
            "dp_flavour": "zero1", "layers_per_stage": (0, *([1] * layers), 0)}


def runs() -> list[Run]:
    """The published runs (each figure with its source)."""
    found = []
    # MosaicML llm-foundry benchmark tables (MPT, FSDP FULL_SHARD, bf16, seq 2048). A100 80GB
    # nodes with 1600 Gb/s per node (= dgx-a100 preset); H100 nodes as the dgx-h100 preset.
    # Attention: the Triton FlashAttention kernel (the benchmark script,
    # scripts/train/benchmarking/submit_benchmarks.py, sets model.attn_impl from
    # ``--attn_impl``, default 'triton').
    for name, size, gpus, preset, mb, acc, ac, tokens in (
        ("MPT-7B@8xA100", (32, 4096, 32), 8, "dgx-a100-80g", 6, 2, False, 4641),
        ("MPT-13B@8xA100", (40, 5120, 40), 8, "dgx-a100-80g", 2, 3, False, 2262),
        ("MPT-30B@8xA100", (48, 7168, 64), 8, "dgx-a100-80g", 3, 21, True, 916),
        ("MPT-70B@64xA100", (80, 8192, 64), 64, "dgx-a100-80g", 8, 4, True, 410),
        ("MPT-7B@8xH100", (32, 4096, 32), 8, "dgx-h100", 6, 1, False, 10643),
        ("MPT-13B@64xH100", (40, 5120, 40), 64, "dgx-h100", 2, 1, False, 4800),
        ("MPT-70B@64xH100", (80, 8192, 64), 64, "dgx-h100", 8, 4, True, 1039),
    ):
        batch = gpus * mb * acc
        found.append(Run(
            name, "gpt.py", _mpt(name, *size, batch=batch, seq=2048),
            with_attention_kernel(Cluster.preset(preset, nodes=gpus // 8), "flash-attention-triton"),
            {"dp_flavour": "fsdp", "recompute": "full" if ac else "none"}, acc,
            tokens_step(batch, 2048, tokens, gpus), f"{tokens} tok/s/GPU",
            f"{LLM_FOUNDRY} ({'H100' if 'h100' in preset else 'A100 80GB'} table)",
            optimizer_implementation="per_parameter",  # the yamls' decoupled_adamw (Composer's loop)
            # llm-foundry v0.3.0's default loss (ComposerMPTCausalLM: ``loss_fn`` defaults to
            # ``fused_crossentropy``, FlashAttention's xentropy, installed by the sweep's
            # ``pip install -e .[gpu]``), and Composer's two train metrics over every
            # micro-batch's logits (LanguageCrossEntropy, LanguagePerplexity;
            # Trainer._train_microbatch -> _eval_train_metrics at 18f2d3c33): cost_model.loss_kernels.
            loss_implementation="fused_xentropy", metric_cross_entropies=COMPOSER_MPT_TRAIN_METRICS,
            # The yamls' ``algorithms: gradient_clipping`` (norm, threshold 1.0; docs/fidelity_log.md,
            # session 12 s12mpt): Composer calls FSDP1's clip_grad_norm_ on the root module.
            gradient_clipping="per_tensor",
        ))
    # torchtitan on 64 A100 80GB (docs/performance.md of mid-2024): FSDP2, local batch 1 or 2,
    # gradients reduce-scattered in fp32: torchtitan's FSDP2 policy was
    # MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # (torchtitan/parallelisms/parallelize_llama.py at 1ea476e9f, 2024-04-24, the commit that
    # published these rows; from 5c69c02ea, 2024-05-20, ``--training.mixed_precision_reduce``
    # whose only choice is "float32"): the planner's own policy, not ``half_precision_weights``.
    # The norms as that commit's train_configs ran them (``Plan.fused_chains``): llama2_13b.toml
    # sets ``norm_type = "fused_rmsnorm"`` (torchtitan/models/norms.py: one Triton kernel each
    # way), llama2_70b.toml and llama3_70b.toml ``"rmsnorm"`` (eager, as traced); all three
    # ``compile = false``, so the rotary embeddings run eager, as traced.
    for name, shape, batch, seq, recompute, tokens, norms in (
        ("Llama3-70B@64xA100", LLAMA3_70B, 64, 8192, "full", 331, ""),
        ("Llama2-13B@64xA100", LLAMA2_13B, 128, 4096, "none", 2162, "norms"),
        ("Llama2-70B@64xA100", LLAMA2_70B, 128, 4096, "full", 353, ""),
    ):
        found.append(Run(
            name, "llama.py", _llama(**shape, batch=batch, seq=seq), "dgx-a100-80g:8",
            {"dp_flavour": "fsdp", "recompute": recompute}, 1, tokens_step(batch, seq, tokens, 64),
            f"{tokens} tok/s/GPU", TORCHTITAN_A100, half_precision_weights=False,
            optimizer_implementation=TORCHTITAN_2024_ADAMW, gradient_clipping=TORCHTITAN_CLIPPING,
            fused_chains=norms,
        ))
    # MT-NLG and BLOOM ran Megatron-DeepSpeed with DeepSpeed's pipeline engine
    # (DEEPSPEED_PIPELINE). MT-NLG (2021) trained in 16-bit, taken as DeepSpeed's ZeRO-1 fp16 path
    # (BigScience's notes, bigscience-workshop/bigscience train/tr8-104B-wide/chronicles.md at
    # 82fe642f, "Megatron-Turing NLG 530B", report from Microsoft's blog that it was bf16; the
    # public DeepSpeed of the run had no bf16 ZeRO path; the one 648f7bfa5 added on 2021-11-01
    # is the same stage2.py step, overflow check and norm included, so the rows would not move:
    # docs/fidelity_log.md, session 13 s13mtnlg):
    # gradients accumulate in param.grad by autograd (the pipeline engine turns DeepSpeed's
    # own backward all-reduce off; for ZeRO stage 1 engine.py's _configure_zero_optimizer
    # forces overlap_comm off, and zero/stage2.py registers gradient hooks only for stage 2 or
    # overlap_comm: DeepSpeed of October 2021). BLOOM (2022) trained in bf16 with
    # DeepSpeed's BF16_Optimizer, written for it (BLOOM paper section 3.4.3; DeepSpeed PR
    # #1801), which adds each micro-batch's bf16 gradients into fp32 ones: "fp32-copy".
    # Both tie the token embedding to the LM head (tie_weights): Megatron-DeepSpeed's
    # GPTModelPipe builds its first and last layers from TiedLayerSpec('embed', ...)
    # (megatron/model/gpt_model.py, microsoft/Megatron-DeepSpeed of 2021 and the bigscience
    # fork; BLOOM's tr11 README: "the tied embedding layers"), so the first and last stage each
    # hold the weight and all-reduce its gradient between them after the schedule
    # (ReduceTiedGrads; cost_model.deepspeed_pipeline).
    # MT-NLG 530B (Smith et al. 2022, arXiv:2201.11990, section 2.4): tp 8 x pp 35, batch 1920
    # of 2048 tokens on 280, 350 and 420 DGX A100 nodes (dp 8, 10, 12): 60.1, 50.2 and 44.4 s
    # per iteration (126, 121 and 113 TFLOP/s per GPU). 105 layers, width 20480, 128 heads;
    # vocabulary 50,257 (GPT-2's BPE) padded to 51,200. No source here states the micro-batch size:
    # taken as 1 (the least bubble, m = 1920 / dp micro-batches); at 2 the bubble doubles
    # (``benchmarks/fidelity_slots.py`` prints both; docs/fidelity_log.md has the figures).
    # Nor does a source here state its DeepSpeed activation-checkpointing options: the examples
    # of its time differ (microsoft/Megatron-DeepSpeed at 54884b5f, 2021-10-29, passes none in
    # examples/; its curriculum-learning script of db97cd2a passed ``--partition-activations``;
    # DeepSpeed's own 3D-parallelism example, microsoft/DeepSpeedExamples
    # Megatron-LM-v1.1.5-3D_parallelism/examples/ds_pretrain_gpt2_pipe.sh at ce00e423, turns on
    # partitioning, contiguous buffers and synchronization). The layout leaves
    # ``deepspeed_checkpointing`` out (DeepSpeed's defaults, all off);
    # ``fidelity.py --deepspeed-checkpointing ...`` shows the rows with options on.
    for nodes, seconds in ((280, 60.1), (350, 50.2), (420, 44.4)):
        found.append(Run(
            f"MT-NLG-530B@{nodes * 8}xA100", "gpt.py",
            {"n_layer": 105, "n_embd": 20480, "n_head": 128, "vocab_size": 51200, "seq_len": 2048,
             "batch_size": 1920, "attention": "eager", "tie_weights": True, "dropout": MEGATRON_DEFAULT_DROPOUT},
            f"dgx-a100-80g:{nodes}",
            {"tp": 8, "pp": 35, "micro_batch": 1, "schedule": "1f1b", "recompute": "full", "dp_flavour": "zero1",
             **DEEPSPEED_PIPELINE, "gradient_accumulation": "autograd"}, 1,
            seconds, f"{seconds} s/iteration", "Smith et al. 2022 (MT-NLG), section 2.4",
            gradient_clipping="",  # clipped inside the fp16 ZeRO-1 step's unscale (fp16_zero_step_checks_time)
        ))
    # BLOOM-176B (Le Scao et al. 2022, section 3.4; bigscience-workshop's training README):
    # 384 A100 80GB, tp 4 x pp 12 x dp 8, ZeRO-1, micro-batch 2, global batch 2048 of 2048
    # tokens, full recomputation, "about 150 TFLOPs" per GPU as Megatron-DeepSpeed prints it.
    # 70 layers, width 14336, 112 heads, vocabulary 250,880. DeepSpeed's activation
    # checkpointing with none of its options (``deepspeed_checkpointing`` empty, stated: the
    # script passes ``--checkpoint-activations`` and ``--deepspeed-activation-checkpointing``
    # and none of ``--partition-activations``, ``--contigious-checkpointing``,
    # ``--synchronize-each-layer``, ``--profile-backward``; see JEAN_ZAY_LAYER_OVERHEAD).
    found.append(Run(
        "BLOOM-176B@384xA100", "gpt.py",
        {"n_layer": 70, "n_embd": 14336, "n_head": 112, "vocab_size": 250880, "seq_len": 2048, "batch_size": 2048,
         "attention": "eager", "tie_weights": True},
        bloom_cluster(),
        {"tp": 4, "pp": 12, "micro_batch": 2, "schedule": "1f1b", "recompute": "full", "dp_flavour": "zero1",
         "layers_per_stage": tuple(nearly_even_layers(70, 12)), **DEEPSPEED_PIPELINE, **JEAN_ZAY_LAYER_OVERHEAD,
         "gradient_accumulation": "fp32-copy", "deepspeed_checkpointing": ()}, 1,
        megatron_deepspeed_flops(2048, 2048, 70, 14336, 250880, recompute=True) / (150e12 * 384),
        "150 TFLOP/s/GPU", "BigScience BLOOM-176B model page (bigscience.notion.site); BLOOM paper 3.4",
        # BF16_Optimizer clips too (its ``clip_grad``), per tensor with a host sync each in
        # DeepSpeed of 2022, over fp32 gradients not yet checked here: not priced.
        gradient_clipping="",
    ))
    # Llama 3 405B (Dubey et al. 2024, "The Llama 3 Herd of Models"), its rows of table 4
    # without context parallelism: 8,192 H100s, tp 8 x cp 1 x pp 16 x dp 64, 430 TFLOP/s per
    # GPU (BF16 MFU 43%); 16,384 H100s, dp 128, 400 TFLOP/s (41%). Both: sequence 8,192, 16M
    # tokens per batch, 32 and 16 sequences per dp group ("batch size per DP"). The layout as
    # section 3.3.2 states it ("Pipeline parallelism improvements"; ``llama3_405b_layout``):
    #   * the interleaved schedule with V model chunks per pipeline rank, bubble (PP-1)/(V M);
    #   * one transformer layer fewer on the first and on the last stage, so that "the first
    #     model chunk on the first stage has only the embedding, and the last model chunk on the
    #     last stage has only output projection and loss calculation": 126 layers + those two
    #     chunks fill 16 ranks x 8 slots, so each chunk holds one slot: V = 8 (inferred: the
    #     paper names no V; only one layer per chunk makes a first chunk hold the embedding
    #     alone when its rank holds one layer fewer);
    #   * asynchronous point-to-point sends (the simulator's default: blocking_p2p False);
    #   * no activation checkpointing at 8K tokens ("we could pretrain Llama 3 on 8K tokens
    #     without activation checkpointing");
    #   * FSDP sharding optimizer states and gradients, weights not resharded after forward
    #     (section 3.3.2, on FSDP): weights gathered and gradients reduce-scattered
    #     once per step, which ``zero1`` (the distributed optimizer) prices with the same bytes.
    # Where the paper is silent, assumed: micro-batches of one sequence (M = 32 and 16 per
    # step; the paper says N is tunable, not what it was), sequence-parallel norms with tensor
    # parallelism.
    for gpus, tflops in ((8192, 430), (16384, 400)):
        found.append(Run(
            f"Llama3-405B@{gpus}xH100", "llama.py", _llama(**LLAMA3_405B, batch=2048, seq=8192),
            f"dgx-h100:{gpus // 8}", llama3_405b_layout(), 1,
            palm_model_flops(405e9, 126, 16384, 8192, 2048 * 8192) / (tflops * 1e12 * gpus),
            f"{tflops} TFLOP/s/GPU", "Dubey et al. 2024 (Llama 3), section 3.3.2 and table 4",
            gradient_clipping="",  # Meta's training software is not public: how it clips is not known
        ))
    found += megatron_core_weak_scaling_runs()
    found += torchtitan_h100_runs()
    found += megatron_core_moe_runs()
    return found


def chosen_runs(parser: argparse.ArgumentParser, patterns: list[str]) -> list[Run]:
    """The runs whose names match any of ``patterns`` (shell patterns), in the table's order;
    none matching ends the script through ``parser.error`` (one line, exit status 2)."""
    chosen = [run for run in runs() if any(fnmatch.fnmatchcase(run.name, pattern) for pattern in patterns)]
    if not chosen:
        parser.error(f"no run matches {', '.join(patterns)}; python benchmarks/fidelity.py --rows-only lists them")
    return chosen


def megatron_core_weak_scaling_runs() -> list[Run]:
    """Megatron-Core's weak-scaling table on H100 (the NVIDIA/Megatron-LM README: GPT models
    of 1.7B to 462B parameters on 48 to 6,144 H100s, data-parallel size 48 throughout).

    What the table states: heads, width, layers, tp, pp, dp, GPUs, global batch and per-GPU
    TFLOP/s; the README adds vocabulary 131,072, sequence 4,096 and the overlaps used
    (``--overlap-grad-reduce``, ``--overlap-param-gather``, ``--tp-comm-overlap``). What
    follows from those flags: ``--overlap-param-gather`` needs the distributed optimizer
    (ZeRO-1: ``zero1``), ``--tp-comm-overlap`` needs sequence parallelism. What it does not
    state, taken as Megatron-LM's defaults and its GPT-3 example
    (examples/gpt3/train_gpt3_175b_distributed.sh): micro-batch 1, the non-interleaved 1F1B
    schedule, no recomputation, a GELU MLP of 4x the width, learned positions. The parameter
    counts the table names (7.1B at width 4096 and 30 layers) need the input embedding and the
    output layer untied (``--untie-embeddings-and-output-weights``), as here.

    ``--tp-comm-overlap``: Transformer Engine's userbuffers hide the sequence-parallel
    all-gathers and reduce-scatters inside each layer behind the GEMMs beside them, and
    Megatron-Core gathers a column-parallel layer's input again in backward
    (``Plan.tp_comm_overlap``, priced by ``cost_model.tp_comm_overlap`` with TE's default
    methods; the head's and the embedding's collectives stay exposed). The published TFLOP/s
    become a step time with Megatron-Core's own count (``megatron_core_flops``).

    Norms: the GPT example's blocks normalise with ``nn.LayerNorm``, which traces as one
    ``aten.layer_norm`` each, priced as one fused norm kernel (``cost_model.memory_kernels``
    "fused norm"), as Megatron-Core runs them with Transformer Engine (its LayerNorm fused
    into ``TELayerNormColumnParallelLinear`` / ``TELayerNormMLP``'s modules); with learned
    positions there is no rotary embedding, so ``Plan.fused_chains`` has nothing to fuse here
    (``cost_model.fused_chains`` leaves a norm traced as one op as it is; the rows print the
    same with ``fidelity.py --fused-chains norms_rope``: docs/fidelity_log.md, session 14 s14norms).

    Attention runs as Transformer Engine's ``DotProductAttention`` picks it on Hopper: cuDNN's
    fused flash attention (``"cudnn-fused-attention"``, ``cost_model.gpu_kernels``'
    ``attention_kernel_slowdown``), not flash-attention 2, dropping attention weights at
    Megatron's default 0.1 inside the kernel (``attention_dropout_slowdown``).

    The data-parallel side is Megatron-Core's distributed optimizer as r0.8 runs it
    (``Plan.megatron_distributed_optimizer``, ``cost_model.megatron_grad_sync``): fp32
    gradients (``--bf16`` sets ``accumulate_allreduce_grads_in_fp32``) reduce-scattered once per
    step in Megatron's buckets during the last backward (one bucket on a stage after the
    first), each bucket's NaN-check norm and 1/dp scaling on the compute stream before its
    reduce-scatter and the whole fp32 buffer zeroed every step (Megatron-LM's defaults:
    ``check_for_nan_in_loss_and_grad`` on, ``--ddp-average-in-collective`` off), every
    gradient the GEMMs do not accumulate themselves (embeddings, norms, biases) added into that
    buffer by the DDP hook on each micro-batch, the updated weights gathered during the next
    forward. Without a pipeline (the pp1
    rows) each dp rank passes its 4 samples through at once: the table states no micro-batch
    size. Run as 4 micro-batches of 1 with one reduction after the last (Megatron's ``no_sync``;
    ``accumulation_steps=4`` with the distributed optimizer), the 32B row's 15.8 GB of fp32
    gradients per GPU no longer hide behind one last backward (+38.9%, against +2.5%), while
    1.7B and 7.1B move 2.5 points closer (-12.0% / -9.5%; figures from before session 11 priced
    the buckets' NaN checks, 1/dp scaling and the buffer's fill): which the run used is not known.
    """
    found = []
    for size, heads, width, layers, tp, pp, gpus, batch, tflops in (
        ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
        ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
        ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
        ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
        ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
        ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
        ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
        ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
        ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
    ):
        vocab, seq = 131072, 4096
        found.append(Run(
            f"MCore-GPT-{size}@{gpus}xH100", "gpt.py",
            {"n_layer": layers, "n_embd": width, "n_head": heads, "vocab_size": vocab, "seq_len": seq,
             "batch_size": batch, "dropout": MEGATRON_DEFAULT_DROPOUT},
            with_attention_kernel(Cluster.preset("dgx-h100", nodes=gpus // 8), "cudnn-fused-attention"),
            {"tp": tp, "pp": pp, "micro_batch": 1, "schedule": "1f1b", "recompute": "none",
             "sequence_parallel": tp > 1, "tp_comm_overlap": tp > 1, "dp_flavour": "zero1"},
            1,  # pp1 rows: each dp rank's samples in one pass (the source states no micro-batch size)
            megatron_core_flops(batch, seq, layers, width, vocab, 4 * width, heads, heads) / (tflops * 1e12 * gpus),
            f"{tflops} TFLOP/s/GPU", MEGATRON_WEAK_SCALING, megatron_distributed_optimizer=True,
        ))
    return found


# torchtitan's H100 benchmarks: "We used the default 500W power limit, although tuning it up to
# 700W TDP can potentially provide further speedups" (benchmarks/llama3_h100_202412_torchtitan.md,
# "Hardware").
GRAND_TETON_POWER_LIMIT_W = 500.0


def grand_teton_h100(nodes: int, memory_bytes: int = 96_000_000_000) -> Cluster:
    """The H100 hosts torchtitan's H100 benchmarks ran on (the benchmark's "Hardware"
    section): Grand Teton, 8 H100s per host with NVLink, each with 96 GB of HBM2e at 2.4 TB/s
    (the August 2024 performance.md says 94 GB), 400 Gb/s RDMA per GPU between hosts (the
    dgx-h100 preset's 50 GB/s), at the default 500 W power limit. The source does not know
    their peak FLOP/s ("between SXM and NVL", footnote 2 of
    benchmarks/llama3_h100_202412_torchtitan.md); the peak is the SXM's at the clock a 500 W
    board holds (``planner.power_limit``: 894 of 989 TFLOP/s, between the two datasheet
    figures the source names), an estimate from the datasheets, not a measurement."""
    cluster = with_memory(Cluster.preset("dgx-h100", nodes=nodes), memory_bytes=memory_bytes, memory_bandwidth=2.4e12)
    return with_power_limit(cluster, GRAND_TETON_POWER_LIMIT_W)


def torchtitan_h100_runs() -> list[Run]:
    """torchtitan on H100 in bf16 (the Grand Teton hosts, ``grand_teton_h100``).

    Left out: the Llama 3.1 8B FSDP rows of benchmarks/llama3_h100_202412_torchtitan.md
    (tables 1 and 3, 5,762 and 5,605 tok/s/GPU): they ran torchtitan's per-op selective
    checkpointing (``selective_ac_option = 'op'``: every second matmul and all pointwise ops
    recomputed), which the simulator's ``selective`` (the attention core alone) does not
    express; simulated with it they come out 35% fast and out of memory."""
    found = []
    # Llama 3.1 405B on 128 of the same H100s (94 GB), 2-D: FSDP2 over 16 x tensor parallelism
    # 8 with sequence-parallel norms (torchtitan's TP plan), full activation checkpointing,
    # local batch 2 (global 32) of 8,192 tokens, bf16: 109 tok/s/GPU, the row without Float8 or
    # async TP (docs/performance.md at torchtitan 3faaa1a0d, 2024-08-23; its
    # train_configs/llama3_405b.toml sets compile = true: each TransformerBlock compiled
    # (parallelize_llama.py ``apply_compile``), so Inductor runs each RMSNorm as one fused
    # kernel (priced so: ``Plan.fused_chains`` "norms"); the rest of what Inductor fuses is not
    # modelled, nor is the rotary embedding, whose traced form ``cost_model.fused_chains`` does
    # not recognise; its config_manager.py: ``--training.mixed_precision_reduce`` "float32",
    # the only choice).
    found.append(Run(
        "Llama3.1-405B@128xH100", "llama.py", _llama(**LLAMA3_405B, batch=32, seq=8192),
        grand_teton_h100(16, memory_bytes=94_000_000_000),
        {"tp": 8, "dp_flavour": "fsdp", "recompute": "full", "sequence_parallel": True}, 1,
        tokens_step(32, 8192, 109, 128), "109 tok/s/GPU", "torchtitan docs/performance.md (2024-08, 128 H100)",
        half_precision_weights=False, optimizer_implementation=TORCHTITAN_2024_ADAMW,
        gradient_clipping=TORCHTITAN_CLIPPING, fused_chains="norms",
    ))
    return found
