"""Simulator fidelity: predicted step time against published large-scale training runs.

    python benchmarks/fidelity.py                 # every run (several minutes)
    python benchmarks/fidelity.py --runs MPT-7B@8xA100 BLOOM-176B@384xA100
    python benchmarks/fidelity.py --runs 'MCore-*'   # names or shell patterns
    python benchmarks/fidelity.py --roofline      # the same runs with the roofline model
    python benchmarks/fidelity.py --breakdown     # and where each predicted step goes
    python benchmarks/fidelity.py --no-engine-overhead   # without the fitted engine constant
    python benchmarks/fidelity.py --rows-only    # the runs and their sources, nothing simulated

Each row prints the signed error (predicted / published - 1: negative = predicted fast,
optimistic), and the summary the median and largest absolute error and the bias (how many
rows are predicted fast and how many slow).

Each run is simulated with the layout its source states - the mesh (tp x pp x dp), the
pipeline schedule and micro-batches, recomputation, the data-parallel flavour (FSDP, ZeRO-1,
DDP), gradient accumulation, bf16 - built by ``search.megatron.megatron_plan`` on the model
traced once on meta tensors, on the cluster preset of its GPUs (or the network its source
describes). Nothing is searched and nothing is fitted to these runs: they check the
simulator's constants, which come from kernel- and link-level measurements
(``cost_model/gpu_kernels.py``, ``planner/presets.py``), and, for BLOOM's row, one constant
of its cluster's software fitted to a separate published sweep on that cluster (below).

Published figures become a step time with the source's own definitions:
  * tokens/s per GPU (MosaicML, torchtitan): step = global batch tokens / (tokens/s/GPU x GPUs);
  * iteration time (MT-NLG): as published;
  * TFLOP/s per GPU (BLOOM, Llama 3, Megatron-Core's weak-scaling table): step = the FLOPs
    the source counts per step / (TFLOP/s x GPUs), with the formula its framework prints (see
    ``megatron_deepspeed_flops``, ``palm_model_flops`` and ``megatron_core_flops``).

Sources, each row naming its own: MosaicML llm-foundry's benchmarking README (the MPT rows
only); torchtitan's docs/performance.md (A100 of mid-2024; H100 of August 2024); Smith et
al. 2022 (MT-NLG, section 2.4, its three scales); BigScience's
BLOOM-176B pages; Dubey et al. 2024 (Llama 3), table 4; NVIDIA/Megatron-LM's README
(weak-scaling table of Megatron-Core r0.8.0 on H100).

What the simulator leaves out, and which way each bends these rows (predicted faster, unless
said):
  * the kernel ceilings are matmul throughputs measured with CUDA 12.1 (ml-engineering's MAMF
    table); MT-NLG (2021) and BLOOM (2022) ran on CUDA 11 with DeepSpeed's pipeline engine -
    older kernels are slower than the ceilings we use. Not the MPT rows: their tables came
    with llm-foundry's October 2023 sweep (commit b2a43a147, scripts/train/benchmarking/
    sweep.sh: ``IMAGE="mosaicml/pytorch:2.1.0_cu121..."``, CUDA 12.1 for A100 and H100 alike);
  * Megatron-Core's rows: the ``--bf16`` fp32 gradient buffer (4 bytes per gradient where
    the model counts 2: memory only, not time). Their micro-batch size is not stated; taken as
    1 (Megatron's GPT-3 example), so the pp1 rows run 4 micro-batches, gradients reduced once
    after the last. There MCore-GPT-32B (tp8: one GPU per node in each dp ring) comes out
    slow (+37%): its 15.8 GB of fp32 gradients per GPU take 0.39 s to reduce-scatter over
    48 nodes, behind a last backward of 0.14 s, and its bf16 weights 0.19 s to gather,
    behind a first forward of 0.07 s; with one micro-batch of 4 it is +0.1%. MCore-GPT-16B
    (tp4: two GPUs per node per ring, twice the bandwidth) is -1.0%. Either the run's
    micro-batch was larger or its data-parallel collectives ran faster than the measured
    NCCL profile (SHARP on the fabric would do it); the source does not say which.
  * slower, not faster: torch.compile's fusions (torchtitan's 405B row).

Checked and not a cause: the MPT rows' ``mixed_precision: DEFAULT`` gathers and reduces in
bf16 as the simulator does (Composer since mosaicml/composer aaa8dcc4c, 2023-03-09:
``param_dtype`` and ``buffer_dtype`` the autocast precision, ``reduce_dtype`` None, which
FSDP's ``MixedPrecision`` takes as ``param_dtype``), so ``amp_bf16`` casts no weights per
step; MPT's ``low_precision_layernorm`` runs its norms in bf16 under autocast.

torchtitan's FSDP2 reduces gradients in fp32 (``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=float32)`` in torchtitan/parallelisms/parallelize_llama.py at 1ea476e9f, the
commit of its A100 rows; ``--training.mixed_precision_reduce``, whose only choice is "float32",
by the 405B row's), which is what the planner's own bf16 FSDP2 programs run
(``cost_model.mixed_precision``): its rows are the only ones without ``Run.half_precision_weights``,
and their reduce-scatters move twice the bytes of bf16 ones. Compute-bound, the A100 rows move 0.6-0.8 points slower (Llama3-70B -9.3% ->
-8.7%, Llama2-13B -13.2% -> -12.4%, Llama2-70B -8.7% -> -8.0%); Llama3.1-405B, whose 16 dp ranks
reduce across hosts, 2.1 (-14.9% -> -12.8%: 0.4 s more exposed). 26 runs: median 8.5% -> 8.2%,
largest 23.7%, 19 fast / 7 slow.

Found and left as it is, moving the MPT rows the wrong way: llm-foundry's FSDP of October 2023 is
FSDP1 (PyTorch 2.1, flat parameters: the all-gather writes the unsharded flat parameter in
place), which has no copy-out; the simulator charges FSDP2's (``DataParallelStep.copy_out``:
1.3% of MPT-7B@8xA100's predicted step). Without it the MPT rows would be up to 1.3 points
faster still. Not priced either, and too small to explain the MPT rows: Composer's
``DecoupledAdamW`` (the yamls' ``decoupled_adamw``; composer/optim/decoupled_weight_decay.py,
``DecoupledAdamW.adamw``) steps parameter by parameter, a ``.item()`` and nine memory-bound
ops each (22 fp32 accesses per element against the fused kernel's 7): by hand, 0.6% of
MPT-7B@8xA100's step (0.84e9 elements per GPU x 15 x 4 bytes more at 0.8 x 2.04 TB/s = 31 ms
of 5.30 s), 1.6% of MPT-7B@8xH100's, 0.5% or less on 64 GPUs.

Jean Zay's per-layer cost (BLOOM only): BigScience's published layout sweep on BLOOM's cluster
and software (``benchmarks/fidelity_sweep.py``) is predicted 5-21% fast by a time that grows
with the layer executions (layers per stage x micro-batches), not their size; the fixed
``MEGATRON_DEEPSPEED_LAYER_OVERHEAD_S`` per layer per micro-batch fitted there (median 1.7%;
an earlier sweep held out, 11.6% -> 3.7%) is identified only in part (up to a third of it is
``CUDA_LAUNCH_BLOCKING=1``, which that cluster's runs needed; ``JEAN_ZAY_LAYER_OVERHEAD`` has
the sources), so it is applied to BLOOM's row alone (``PipelineConfig.block_overhead_s``),
which is therefore not independent of the fit, and not to MT-NLG, run elsewhere. What else
the engine of that time did per micro-batch is small or already priced:
``ThroughputTimer.start``'s ``torch.cuda.synchronize()`` before every forward pass
(deepspeed/runtime/pipe/engine.py ``_exec_forward_pass``, deepspeed/utils/timer.py, 0.5.x),
``PartitionedTensor.from_meta``'s ``.tolist()``, ``PartitionedTensor.full()``'s zero-fill
and clone (~0.3% of the step by hand); the attention mask is not sent between stages
(pretrain_gpt.py caches it in ``args.attn_mask``); the tied embedding's gradient all-reduce
is priced (11 ms on MT-NLG).

Modelled from the runs' stated hardware: the Grand Teton H100s' 500 W power limit lowers their
peak to the clock such a board holds (``grand_teton_h100``, ``planner.power_limit``). Every
H100 row prices tensor-core work at the clock a 700 W GH100 holds under GEMMs overlapped with
communication, 1575 of the 1830 MHz its datasheet peak is counted at (``cost_model.
gpu_kernels.SUSTAINED_CLOCK``, from deepseek-ai/DeepGEMM#120; before, the A100's 1305/1410):
each H100 row moved 4.5-6.5 points slower, the fast FSDP and Llama 3 rows closer and the
tensor-parallel Megatron-Core rows from 16B up past their published figures (26 runs: median
9.0% -> 7.9%, 20 fast / 6 slow -> 17 / 9). Megatron-Core's rows then run the attention kernel
Transformer Engine picks on Hopper, cuDNN's (below): 1.7B and 7.1B, a quarter of whose kernel
time is attention, back to 13.6% and 11.1% fast, the larger rows 1.6-3.2 points closer
(26 runs: median 8.2%, largest 23.7%, 17 fast / 9 slow). Megatron-Core's distributed
optimizer as r0.8 runs it (fp32 reduce-scatter once per step, the weights' gather hidden in
the next forward: ``Plan.megatron_distributed_optimizer``) moves the pp1 rows 1-9 points
faster (1.7B -13.6% -> -14.5%, 16B +4.9% -> -8.4%) and 70B to +10.4% (26 runs: median 8.5%,
largest 23.7%, 19 fast / 7 slow).

Modelled from the runs' stated software: collectives overlapping compute slow it
(``cost_model.nccl``'s contention); the host's time to issue ops bounds each block from below
(``cost_model.host_dispatch``; it binds on none of these runs: their kernels outlast it);
Megatron-Core's rows with tensor parallelism hide the sequence-parallel collectives behind
GEMMs as Transformer Engine's userbuffers do (``--tp-comm-overlap``:
``cost_model.tp_comm_overlap``), run Megatron-Core's distributed optimizer (fp32 gradients
reduce-scattered once per step in its buckets, weights gathered during the next forward:
``Plan.megatron_distributed_optimizer``, ``cost_model.megatron_grad_sync``), and their attention runs as Transformer Engine's
``DotProductAttention`` picks it on Hopper, cuDNN's fused flash attention
(``"cudnn-fused-attention"``: ``gpu_kernels.attention_kernel_slowdown``, from TE's own
benchmark); MPT rows run the Triton FlashAttention kernel (llm-foundry's benchmark default ``attn_impl: triton``; ``cost_model.gpu_kernels``'
``ATTENTION_KERNEL_SLOWDOWN``: the sweep installed llm-foundry v0.3.0 with its ``gpu`` extras,
whose Triton is the pre-MLIR fork ``triton_pre_mlir_sm90``; we found no published H100 figure
for it, so the FlashAttention-2 paper's A100 ratios stand there too); MT-NLG and BLOOM run DeepSpeed's pipeline engine
(``DEEPSPEED_PIPELINE``): its ``TrainSchedule`` with every send and receive a rendezvous
(``PipelineConfig.blocking_p2p``, ``cost_model.deepspeed_pipeline``) of 1/tp slices
that the receiver all-gathers (``partitioned_p2p``), gradients reduced after the schedule
(``overlap_grad_reduce`` False), and each micro-batch's gradients added into the step's as
the run's optimizer did (``gradient_accumulation``: fp16 ``param.grad`` by autograd for
MT-NLG, BF16_Optimizer's fp32 copy for BLOOM, whose gradients are then all-reduced in fp32);
both tie the embedding to the LM head, whose gradient the first and last stage all-reduce
between them before that reduction (``ReduceTiedGrads``: 0.58 s of BLOOM's step, in fp32 over
Jean Zay's 6.25 GB/s per GPU).

Not used, kept aside as an independent check of the simulator: table 1 of Narayanan et al.
(SC'21), table 5 of Korthikanti et al. (2022), the IBM/PyTorch "Maximizing training throughput
using PyTorch FSDP" blog and its fms-fsdp README, and llm-foundry's rows beyond those here.
Considered and left out: NeMo's and Megatron-Bridge's performance tables (their H100 rows are
FP8, which ``megatron_plan`` does not price, but for GPT-OSS 120B, whose attention sinks and
sliding windows no example expresses); Megatron-LM's strong-scaling figure (a log-scale plot,
no figures to quote); Megatron-Core MoE's "438 TFLOPS" for Mixtral 8x7B (no GPUs or layout
stated); DeepSeek-V3's GPU hours (FP8, H800); MegaScale's table (modified model blocks, and
its GPUs named only as Ampere); torchtitan's rows with layer- or op-level selective
checkpointing (policies the simulator's ``selective`` does not express: the Llama 3 8B and
Llama 2 13B/70B A100 rows, and the Llama 3.1 8B H100 rows, ``torchtitan_h100_runs``).

Models: MPT (MosaicML) is GPT-like (LayerNorm, GELU MLP of 4x width, vocabulary 50,368,
ALiBi in place of learned positions): ``examples/gpt.py`` with its widths. Runs from before
FlashAttention (MT-NLG 2021, BLOOM 2022) use ``gpt.py``'s explicit attention (``eager``): the
(s x s) scores exist as tensors, as in Megatron-LM's core attention.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from planner.api import prepare_model
from planner.cluster import Cluster
from planner.cluster_edits import with_attention_kernel, with_inter_node, with_memory, with_power_limit
from planner.families.hsdp.section import HsdpSection
from planner.model_spec import ModelSpec
from search.data_parallel import fsdp_units
from search.layouts import nearly_even_layers
from search.megatron import megatron_plan
from cost_model.simulator import simulated

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MPT_VOCAB = 50368  # llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml: vocab_size 50368
LLM_FOUNDRY = "llm-foundry scripts/train/benchmarking/README.md"
TORCHTITAN_A100 = "torchtitan docs/performance.md (2024, 64 A100)"
MEGATRON_WEAK_SCALING = "NVIDIA/Megatron-LM README, weak-scaling table (images/model_table.png, Megatron-Core r0.8.0, 2024-07)"


@dataclass(frozen=True)
class Run:
    """One published run: the model, its GPUs and layout, and the figure it publishes.

    Attributes:
        name: short label.
        example: model file under ``examples/``; ``overrides``: its keyword arguments
            (widths, layers, batch = the global batch of one step, sequence).
        cluster: a preset string ``PRESET:NODES`` or a ``Cluster``.
        layout: ``megatron_plan`` keyword arguments (tp, pp, schedule, micro-batch, ...).
        accumulation: gradient-accumulation steps (micro-batches without a pipeline).
        published_step_s: the published figure as seconds per step (see the module docstring).
        figure: the published figure as the source states it; ``source``: where.
        hsdp_shard: for an FSDP run that shards within groups of this many ranks and
            replicates across them (HSDP), the group size; None for every other run.
        megatron_distributed_optimizer: the run's ZeRO-1 is Megatron-Core's distributed
            optimizer (``Plan.megatron_distributed_optimizer``).
        half_precision_weights: the run's model holds 16-bit weights and gradients
            (``Plan.half_precision_weights``: Megatron-LM, DeepSpeed, Composer's FSDP with
            ``mixed_precision: DEFAULT``); False for torchtitan's FSDP2, which gathers bf16 and
            reduces in fp32 as the planner's own bf16 programs do.
    """

    name: str
    example: str
    overrides: dict
    cluster: object
    layout: dict
    accumulation: int
    published_step_s: float
    figure: str
    source: str
    hsdp_shard: int | None = None
    megatron_distributed_optimizer: bool = False
    half_precision_weights: bool = True

    def describe(self, gpus: int) -> str:
        parts = [f"tp{self.layout.get('tp', 1)}", f"pp{self.layout.get('pp', 1)}",
                 f"dp{gpus // (self.layout.get('tp', 1) * self.layout.get('pp', 1))}"]
        flavour = "mcore-distopt" if self.megatron_distributed_optimizer else self.layout.get("dp_flavour", "ddp")
        parts.append(f"hsdp{self.hsdp_shard}" if self.hsdp_shard else flavour)
        if not self.half_precision_weights:
            parts.append("rs-fp32")
        if self.layout.get("sequence_parallel"):
            parts.append("sp")
        if self.layout.get("tp_comm_overlap"):
            parts.append("tpov")
        if self.layout.get("pp", 1) > 1:
            schedule = self.layout.get("schedule", "1f1b")
            parts.append(f"{schedule}{self.layout.get('virtual_stages', '') if schedule == 'interleaved' else ''}"
                         f" mb{self.layout.get('micro_batch', 1)}")
            if self.layout.get("blocking_p2p"):
                parts.append("sync-p2p")
        if self.accumulation > 1:
            parts.append(f"acc{self.accumulation}")
        parts.append(f"rc-{self.layout.get('recompute', 'none')}")
        return " ".join(parts)


def tokens_step(batch: int, seq: int, tokens_per_gpu_s: float, gpus: int) -> float:
    """Step seconds from a published tokens/s per GPU."""
    return batch * seq / (tokens_per_gpu_s * gpus)


def megatron_deepspeed_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool) -> float:
    """FLOPs per step as Megatron-DeepSpeed prints its TFLOP/s (Narayanan et al. SC'21,
    section 5.1's formula, 72 B s l h^2 (1 + s/6h + V/16lh), with 96 in place of 72 when
    activations are recomputed: the "checkpoint_activations_factor" of its throughput log)."""
    factor = 96 if recompute else 72
    return factor * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def megatron_core_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, ffn: int,
                        heads: int, query_groups: int, swiglu: bool = False) -> float:
    """FLOPs per step as Megatron-Core prints its TFLOP/s per GPU
    (``num_floating_point_operations`` in megatron/training/training.py, r0.8.0):
    12 B s L h^2 ((1 + g/a + s/h) + f/h x (3/2 if SwiGLU) + V / (2 L h)), g the query groups,
    a the heads, f the FFN width, V the padded vocabulary (forward, backward, no recomputation;
    the attention scores counted in full, not halved for causality)."""
    gated = 1.5 if swiglu else 1.0
    return 12 * batch * seq * layers * hidden**2 * (
        (1 + query_groups / heads + seq / hidden) + ffn / hidden * gated + vocab / (2 * layers * hidden))


def palm_model_flops(params: float, layers: int, hidden: int, seq: int, tokens: float) -> float:
    """Model FLOPs per step for MFU (Chowdhery et al. 2022, PaLM, appendix B):
    6 N + 12 L H Q T per token (H x Q = the model width, T the sequence)."""
    return (6 * params + 12 * layers * hidden * seq) * tokens


def _mpt(size: str, layers: int, width: int, heads: int, batch: int, seq: int) -> dict:
    return {"n_layer": layers, "n_embd": width, "n_head": heads, "vocab_size": MPT_VOCAB, "seq_len": seq,
            "batch_size": batch}


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
# ``CUDA_LAUNCH_BLOCKING``) runs without it, and its rows show the engine as modelled.
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
        ))
    # torchtitan on 64 A100 80GB (docs/performance.md of mid-2024): FSDP2, local batch 1 or 2,
    # gradients reduce-scattered in fp32: torchtitan's FSDP2 policy was
    # MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # (torchtitan/parallelisms/parallelize_llama.py at 1ea476e9f, 2024-04-24, the commit that
    # published these rows; from 5c69c02ea, 2024-05-20, ``--training.mixed_precision_reduce``
    # whose only choice is "float32"): the planner's own policy, not ``half_precision_weights``.
    for name, shape, batch, seq, recompute, tokens in (
        ("Llama3-70B@64xA100", LLAMA3_70B, 64, 8192, "full", 331),
        ("Llama2-13B@64xA100", LLAMA2_13B, 128, 4096, "none", 2162),
        ("Llama2-70B@64xA100", LLAMA2_70B, 128, 4096, "full", 353),
    ):
        found.append(Run(
            name, "llama.py", _llama(**shape, batch=batch, seq=seq), "dgx-a100-80g:8",
            {"dp_flavour": "fsdp", "recompute": recompute}, 1, tokens_step(batch, seq, tokens, 64),
            f"{tokens} tok/s/GPU", TORCHTITAN_A100, half_precision_weights=False,
        ))
    # MT-NLG and BLOOM ran Megatron-DeepSpeed with DeepSpeed's pipeline engine
    # (DEEPSPEED_PIPELINE). MT-NLG (2021) trained in 16-bit with DeepSpeed's ZeRO-1 fp16 path:
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
    # vocabulary 50,257 (GPT-2's BPE) padded to 51,200.
    for nodes, seconds in ((280, 60.1), (350, 50.2), (420, 44.4)):
        found.append(Run(
            f"MT-NLG-530B@{nodes * 8}xA100", "gpt.py",
            {"n_layer": 105, "n_embd": 20480, "n_head": 128, "vocab_size": 51200, "seq_len": 2048,
             "batch_size": 1920, "attention": "eager", "tie_weights": True},
            f"dgx-a100-80g:{nodes}",
            {"tp": 8, "pp": 35, "micro_batch": 1, "schedule": "1f1b", "recompute": "full", "dp_flavour": "zero1",
             **DEEPSPEED_PIPELINE, "gradient_accumulation": "autograd"}, 1,
            seconds, f"{seconds} s/iteration", "Smith et al. 2022 (MT-NLG), section 2.4",
        ))
    # BLOOM-176B (Le Scao et al. 2022, section 3.4; bigscience-workshop's training README):
    # 384 A100 80GB, tp 4 x pp 12 x dp 8, ZeRO-1, micro-batch 2, global batch 2048 of 2048
    # tokens, full recomputation, "about 150 TFLOPs" per GPU as Megatron-DeepSpeed prints it.
    # 70 layers, width 14336, 112 heads, vocabulary 250,880.
    found.append(Run(
        "BLOOM-176B@384xA100", "gpt.py",
        {"n_layer": 70, "n_embd": 14336, "n_head": 112, "vocab_size": 250880, "seq_len": 2048, "batch_size": 2048,
         "attention": "eager", "tie_weights": True},
        bloom_cluster(),
        {"tp": 4, "pp": 12, "micro_batch": 2, "schedule": "1f1b", "recompute": "full", "dp_flavour": "zero1",
         "layers_per_stage": tuple(nearly_even_layers(70, 12)), **DEEPSPEED_PIPELINE, **JEAN_ZAY_LAYER_OVERHEAD,
         "gradient_accumulation": "fp32-copy"}, 1,
        megatron_deepspeed_flops(2048, 2048, 70, 14336, 250880, recompute=True) / (150e12 * 384),
        "150 TFLOP/s/GPU", "BigScience BLOOM-176B model page (bigscience.notion.site); BLOOM paper 3.4",
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
        ))
    found += megatron_core_weak_scaling_runs()
    found += torchtitan_h100_runs()
    return found


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

    Attention runs as Transformer Engine's ``DotProductAttention`` picks it on Hopper: cuDNN's
    fused flash attention (``"cudnn-fused-attention"``, ``cost_model.gpu_kernels``'
    ``attention_kernel_slowdown``), not flash-attention 2.

    The data-parallel side is Megatron-Core's distributed optimizer as r0.8 runs it
    (``Plan.megatron_distributed_optimizer``, ``cost_model.megatron_grad_sync``): fp32
    gradients (``--bf16`` sets ``accumulate_allreduce_grads_in_fp32``) reduce-scattered once per
    step in Megatron's buckets during the last backward (one bucket on a stage after the
    first), the updated weights gathered during the next forward. Without a pipeline (the pp1
    rows) each dp rank passes its 4 samples through at once: the table states no micro-batch
    size. Run as 4 micro-batches of 1 with one reduction after the last (Megatron's ``no_sync``;
    ``accumulation_steps=4`` with the distributed optimizer), the 32B row's 15.8 GB of fp32
    gradients per GPU no longer hide behind one last backward (+38.9%, against +2.5%), while
    1.7B and 7.1B move 2.5 points closer (-12.0% / -9.5%): which the run used is not known.
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
             "batch_size": batch},
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
    # train_configs/llama3_405b.toml sets compile = true, which the simulator does not model;
    # its config_manager.py: ``--training.mixed_precision_reduce`` "float32", the only choice).
    found.append(Run(
        "Llama3.1-405B@128xH100", "llama.py", _llama(**LLAMA3_405B, batch=32, seq=8192),
        grand_teton_h100(16, memory_bytes=94_000_000_000),
        {"tp": 8, "dp_flavour": "fsdp", "recompute": "full", "sequence_parallel": True}, 1,
        tokens_step(32, 8192, 109, 128), "109 tok/s/GPU", "torchtitan docs/performance.md (2024-08, 128 H100)",
        half_precision_weights=False,
    ))
    return found


def roofline_cluster(cluster: Cluster) -> Cluster:
    """``cluster`` with its devices renamed to no known GPU generation, so the simulator uses
    the roofline with the default efficiencies (the model before ``cost_model.gpu_kernels``)."""
    nodes = tuple(dataclasses.replace(node, device=dataclasses.replace(node.device, name="roofline-device"))
                  for node in cluster.nodes)
    return dataclasses.replace(cluster, nodes=nodes)


def simulate(run: Run, roofline: bool = False):
    """The simulated plan of ``run``'s stated layout (with the roofline model if asked)."""
    spec = ModelSpec(str(EXAMPLES / run.example), run.overrides).resolved()
    cluster = Cluster.parse(run.cluster) if isinstance(run.cluster, str) else run.cluster
    graph, spec, name, cluster = prepare_model(spec, roofline_cluster(cluster) if roofline else cluster)
    # Every run here is another system's program: where it splits over tp, it lays the fused
    # q|k|v (gate|up) weights out per rank as Megatron-LM does, so those splits are local.
    plan = megatron_plan(graph, cluster, spec, name, precision="bf16", fused_splits_local=True, **run.layout)
    changes = {}
    if run.accumulation > 1:
        changes["accumulation_steps"] = run.accumulation
    if plan.dp_flavour == "fsdp":
        # Every FSDP run here wraps each transformer block as its own unit, the root holding
        # the rest (llm-foundry: MPTForCausalLM.fsdp_wrap_fn wraps each MPTBlock; torchtitan:
        # apply_fsdp calls fully_shard on each TransformerBlock, then on the model), so a
        # block is gathered again for its backward and the root is not.
        changes["fsdp_units"] = fsdp_units(graph)
    if run.megatron_distributed_optimizer:
        changes["megatron_distributed_optimizer"] = True
    if run.half_precision_weights:
        changes["half_precision_weights"] = True
    if run.hsdp_shard:
        changes["sections"] = {**plan.sections, "hsdp": HsdpSection(run.hsdp_shard)}
    if changes:
        plan = simulated(dataclasses.replace(plan, **changes), graph)
    return plan, cluster


def breakdown(estimate) -> str:
    """Where a predicted step goes on its busiest device, in seconds and shares of the step."""
    step = estimate.step_time_s or 1.0
    parts = [("compute", estimate.compute_s), ("exposed communication", estimate.communication_s)]
    if estimate.host_wait_s:
        parts.append(("of compute, waiting for the host", estimate.host_wait_s))
    text = ", ".join(f"{name} {seconds:.2f}s ({seconds / step:.0%})" for name, seconds in parts)
    if estimate.bubble_fraction:
        text += f", pipeline bubble {estimate.bubble_fraction:.0%} of compute"
    return f"{text}; MFU {estimate.mfu:.1%}"


def summary(errors: list[float]) -> str:
    """The figures a reader checks the simulator by, from signed errors (predicted / published
    - 1): the median and largest absolute error, and the bias: how many rows are predicted
    fast (negative error: optimistic) and how many slow (pessimistic)."""
    absolute = [abs(error) for error in errors]
    fast = sum(error < 0 for error in errors)
    slow = sum(error > 0 for error in errors)
    return (f"{len(errors)} runs: median absolute error {statistics.median(absolute):.1%}, largest {max(absolute):.1%}; "
            f"bias: {fast} predicted fast (optimistic), {slow} slow (pessimistic), median signed error "
            f"{statistics.median(errors):+.1%} (targets: median <= 5%, none above 12%, at most two thirds on one side)")


def print_rows(chosen: list[Run]) -> None:
    """The runs as their sources state them, without simulating (``--rows-only``)."""
    for run in chosen:
        cluster = Cluster.parse(run.cluster) if isinstance(run.cluster, str) else run.cluster
        gpus = cluster.world_size
        print(f"{run.name:<24} {gpus:>5}  {run.describe(gpus):<40} {run.overrides['batch_size']:>5} "
              f"{run.overrides['seq_len']:>5}  {run.figure:>18} {run.published_step_s:>8.2f}s  {run.source}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", help="run names or shell patterns, e.g. 'MCore-*' (default: all)")
    parser.add_argument("--rows-only", action="store_true",
                        help="list the runs, their layouts, published figures and sources without simulating")
    parser.add_argument("--roofline", action="store_true",
                        help="price kernels with the roofline and default efficiencies instead (for comparison)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also print where each predicted step goes (compute, exposed communication, bubble)")
    parser.add_argument("--no-engine-overhead", action="store_true",
                        help="leave out the per-layer overhead fitted to BigScience's sweep on Jean Zay (BLOOM's row)")
    options = parser.parse_args()
    names = [run.name for run in runs()]
    unmatched = [pattern for pattern in options.runs or () if not fnmatch.filter(names, pattern)]
    if unmatched:
        parser.error(f"no run matches {', '.join(unmatched)}; --rows-only lists them")
    chosen = [run for run in runs()
              if not options.runs or any(fnmatch.fnmatchcase(run.name, pattern) for pattern in options.runs)]
    if options.rows_only:
        print_rows(chosen)
        return
    if options.no_engine_overhead:
        chosen = [dataclasses.replace(run, layout={**run.layout, "block_overhead_s": 0.0})
                  if "block_overhead_s" in run.layout else run for run in chosen]
    print(f"{'run':<24} {'GPUs':>5}  {'layout':<40} {'batch':>5} {'seq':>5}  {'published':>18} "
          f"{'step':>8} {'predicted':>9} {'error':>7}  source")
    errors = []
    for run in chosen:
        started = time.perf_counter()
        plan, cluster = simulate(run, options.roofline)
        predicted = plan.estimate.step_time_s
        error = predicted / run.published_step_s - 1
        errors.append(error)
        fits = "" if plan.estimate.fits else " (OOM in the simulator)"
        print(f"{run.name:<24} {cluster.world_size:>5}  {run.describe(cluster.world_size):<40} "
              f"{run.overrides['batch_size']:>5} {run.overrides['seq_len']:>5}  {run.figure:>18} "
              f"{run.published_step_s:>7.2f}s {predicted:>8.2f}s {error:>+7.1%}  {run.source}{fits} "
              f"[{time.perf_counter() - started:.0f}s]", flush=True)
        if options.breakdown:
            print(f"{'':<24} {breakdown(plan.estimate)}", flush=True)
    if errors:
        print(f"\n{summary(errors)}")


if __name__ == "__main__":
    main()
