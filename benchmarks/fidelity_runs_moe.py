"""The Megatron-Core MoE runs of ``benchmarks/fidelity.py``: Qwen3-235B-A22B in BF16 on 256
H100s, as NVIDIA's Megatron MoE model zoo and the Megatron-Core MoE technical report publish
them, and how each is built (``moe_plan``).

Sources (both BF16, both stating the model, GPUs, sequence, global batch and every degree):

  * yanring/Megatron-MoE-ModelZoo, best_practice/qwen3/readme.md, "Performance Results, H100"
    (first published 2025-05-27 in examples/qwen3/readme.md at 8017e1120; its Qwen3-235B rows
    unchanged at e8650517, 2026-05-16): "256 H100 GPUS, NVLink 4th Generation, InfiniBand
    8x50 GB/s", Qwen3-235B-A22B, BF16, sequence 4,096, global batch 2,048, and per row the
    dispatcher, TP, EP, PP, VPP, DP, FSDP, micro-batch, recomputation and the step time in
    seconds. Every Qwen3-235B row is
    here; the table's Qwen3-Next-80B-A3B row is not (its Gated DeltaNet layers trace as
    transformers' PyTorch fallback, a Python loop of chunk ops, not the fused kernels the run
    used, and the trace alone takes five minutes on this machine).
  * Yan et al. 2026, "Scalable Training of Mixture-of-Experts Models with Megatron Core"
    (arXiv 2603.07685), table 11: Qwen3-235B, H100, 256 GPUs, sequence 4,096, BF16, 320
    TFLOP/s and 2,132 tokens/s per GPU, with force-balanced routing; its layout is the model
    zoo's script for that figure (best_practice/qwen3/run_h100_235b.sh at 1ed4179f, the same at
    e8650517, "H100 config, 320 TFLOPS": TP2 PP8 VPP4 EP32, global batch 2,048, DeepEP,
    ``A2A_OVERLAP=1``, ``--recompute-modules moe_act layernorm``). The table's other H100 row (DeepSeek-V3) is
    FP8, which the simulator does not price.

What the model zoo's configuration adds (model_configs/benchmarking/Qwen3-235B-A22B.yaml and
sbatch_benchmarking.sh at 8017e1120): ``--sequence-parallel``, ``--use-distributed-optimizer``
with ``--overlap-grad-reduce`` and ``--overlap-param-gather``
(``Plan.megatron_distributed_optimizer``), ETP 1, dropout 0, ``--account-for-embedding-in-pipeline-split`` and
``--account-for-loss-in-pipeline-split`` (the split ``search.megatron_moe.account_split``
builds), ``--untie-embeddings-and-output-weights`` (Qwen3-235B's own config unties them), no
``--tp-comm-overlap`` (its sbatch adds it for BF16 only from b09773a8, 2025-12-16: the
technical report's row has it). Attention runs as Transformer Engine picks it on Hopper,
cuDNN's fused flash attention, as for Megatron-Core's dense rows.

Assumed where the sources are silent or the simulator cannot say it, and which way each bends
the rows (predicted faster unless said):
  * recomputation "norm, act" (``--recompute-modules layernorm moe_act``: the norms and the
    experts' SwiGLU recomputed in backward, their outputs discarded) runs as the plan mode
    ``norms_moe_act`` (``planner.strategy.NORMS_MOE_ACT``, priced by ``cost_model.recompute``:
    each block's two norms and the experts' activation function keep only their inputs and
    run again in backward); the TP4 row's blank recomputation column runs as none. The
    traced program is transformers' eager Qwen3-MoE, not Transformer Engine's fused kernels:
    its q/k norms keep their fp32 input and normalised values (TE's fused RMSNorm: the input)
    and its unfused SwiGLU keeps silu(gate) beside gate and up, about 0.12 GB a layer and
    micro-batch more than Megatron-Core holds (``docs/fidelity_log.md``, session 11), so the
    memory is if anything high. Its time is high too: each RMSNorm is priced as transformers'
    ten eager kernels and each rotary embedding as five, where Transformer Engine runs one
    (``benchmarks/fused_norm_whatif.py``: the norms 2.3-2.6 s a step in every row, 0.5 s as
    fused kernels: ``docs/fidelity_log.md``, sessions 13 and 14). The rows price them as the
    runs ran them (``QWEN3_FUSED_CHAINS`` below, ``Plan.fused_chains``), which takes 2.0-2.8 s
    off every row's step: the pipelined rows' errors now show all that they miss;
  * routing: the simulator routes every token uniformly (each expert its share); the model
    zoo's rows do not say they forced balance, so they ran dropless with the auxiliary loss,
    whose imbalance slows the busiest expert (faster); the report's row forced balance, as
    simulated;
  * DeepEP is priced as its exchange moves bytes (``all_to_all="deduplicated"``); its normal
    kernels' 20 SMs slow the compute beside them (``cost_model.moe_overlap``), which only the
    EP overlap's rows run: without it the experts wait for the dispatch and the next layer for
    the combine, so nothing computes during the exchange (slower where it applies);
  * the EP overlap as Megatron-Core's main branch runs it from d7bf5aaaa8 (2025-08-26: the
    interleaved pipeline's steady state only, with the experts' weight gradients delayed,
    ``cost_model.moe_overlap``), as the model zoo's ``A2A_OVERLAP=1`` asks for it from
    7f7b732 (2025-07-30: ``--delay-wgrad-compute --overlap-moe-expert-parallel-comm`` in
    sbatch_benchmarking.sh). The EP32-ov row ran an earlier development branch
    (``moe_dev(f3e6c5)`` in its table), not public; its configuration then listed, "Used for
    1F1B overlap", ``NVTE_FWD/BWD_LAYERNORM_SM_MARGIN: 20`` (norm kernels leave 20 SMs free)
    and ``CUDA_DEVICE_MAX_CONNECTIONS: 32`` (model_configs/benchmarking/Qwen3-235B-A22B.yaml
    at 8017e1120), neither priced. The margin sizes Transformer Engine's norm kernels' grid to
    the SMs less 20 (``multiprocessorCount`` in NVIDIA/TransformerEngine transformer_engine/
    common/normalization/rmsnorm/rmsnorm_fwd_cuda_kernel.cu at d0067d0d), so a norm runs on
    112 SMs beside DeepEP's 20, as the simulator already runs all compute beside an exchange;
    alone it is at most 132 / 112 - 1 = 18% slower, under 0.1 s a step on the norms as one fused kernel each (0.50 s,
    ``benchmarks/fused_norm_whatif.py``). More than one connection is what the overlap needs
    (Megatron-LM megatron/core/transformer/moe/README.md at d98e8a64: "Requirements for EP A2A
    Overlap: ... CUDA_DEVICE_MAX_CONNECTIONS > 1"), so that the two streams run at once, as
    simulated: no cost of its own;
  * Megatron-FSDP (the one row without a pipeline; ``--use-custom-fsdp
    --data-parallel-sharding-strategy optim_grads_params``, the model zoo's
    examples/qwen3/run_235b.sh at 31c5686) is priced as the simulator's FSDP with one unit per
    transformer block (``fidelity.simulate``) for the dense part, not Megatron-FSDP's flat
    per-module buffers, and its experts sharded over their EDP 32 copies
    (``ExpertLayout.sharded_copies``, set by ``search.moe_folding.folded_plan`` under FSDP),
    gathered in bf16 before each block's forward and backward and reduce-scattered in fp32
    after every micro-batch's backward, as Megatron-FSDP runs them (``docs/fidelity_log.md``,
    session 12); its fp32 main gradients are held as bf16 (about 1.7 GiB low) and the gathers
    and reduce-scatters, on their own streams, do not share the NIC (the step is compute-bound
    here; at NCCL's measured rates the NIC would be busy about as long: faster);
  * the report's row also captures the router and the dispatch preprocessing in CUDA graphs,
    which the simulator does not price (their host time is not modelled either way).

Why TP4 EP8 is ranked ahead of TP2 EP32 (session 10's search; ``benchmarks/fidelity_ops.py
--runs 'Qwen3-235B-TP4*' 'Qwen3-235B-EP32@*'``, the folded layer costs of the simulated plans):
  * the experts' FLOPs are alike per device and step (TP4: 256 micro-batches of 1,024 tokens a
    rank, 8,192 routed copies over 16 local experts, 512 rows each; EP32: 128 of 2,048, 16,384
    copies over 4 experts, 4,096 rows each), their time is not: since session 13 the experts
    run as Transformer Engine's grouped GEMM runs them (``cost_model.grouped_gemm``: one cuBLAS
    GEMM per local expert and projection, four streams, each GEMM's shape priced), 0.601 s of
    expert compute per MoE layer and step for TP4 (96 GEMMs a pass, the weight gradients
    reducing over 512 rows) against 0.372 s for EP32 (24 GEMMs a pass at large shapes); both
    0.355 s before, one roofline kernel at the best-shape fraction. Their all-to-alls differ
    too: 0.166 s per layer (EP8 inside one node, NVLink) against 0.476 s (EP32 over four
    nodes); step (session 10): TP4 14.03 s compute + 2.91 s exposed communication, EP32 13.15 s
    + 5.70 s;
  * ruled out: the row's ETP (the table states ETP 1, EDP 4 for TP4, as the row has it and
    ``tests/test_fidelity_runs_moe.py`` checks); an all-gather of the tokens over TP before the
    dispatch (Megatron-Core's dispatchers use the expert-tensor-parallel group,
    ``self.tp_group = pg_collection.expt_tp`` in megatron/core/transformer/moe/token_dispatcher.py:
    with ETP 1 nothing is gathered, and ``cost_model.moe_folding`` prices nothing); the expert
    GEMMs' shapes and launches as the whole cause: priced since session 13 (above), they move
    TP4 -42.3% -> -32.9% and PP32 -20.7% -> -16.0%, and the memory-bound kernels around them
    (the activation function and the permutations, ``cost_model.moe_layers.
    expert_memory_op_times``, a per-copy cost alike in every layout) to -30.2% and -13.7%
    (``docs/fidelity_log.md``, session 13);
  * priced since session 11, and not the cause: the per-layer host syncs of the token
    dispatchers (``cost_model.host_syncs``, from Megatron-LM's source at 0d77a93b7b). Both
    dispatchers sync once per MoE layer in forward and never in backward: DeepEP's normal
    dispatch waits on the CPU for the received counts before it launches the dispatch kernel
    (fused_a2a.py ``FusedDispatch.forward``; no CPU sync only with ``num_worst_tokens``,
    deep_ep/buffer.py), NCCL's all-to-all dispatcher at ``cuda_sync_point =
    "before_ep_alltoall"`` (``MoEAlltoAllTokenDispatcher``); with ETP 1, TP adds none (the
    dispatchers' ``tp_size`` is ETP), nor does the interleaved pipeline's P2P
    (``overlap_p2p_comm`` by default, so no ``batch_p2p_sync``). But what the host issues
    right after the sync is the exchange itself, which keeps the device busy for milliseconds
    while the host issues the permutation and the grouped GEMMs: priced with the simulator's
    launch cost (``cost_model.defaults.KERNEL_OVERHEAD_S``, 5 us an op), a sync costs the
    device about one launch, 0.01 s a step in every row (TP4's 3,072 layer passes). Closing
    TP4's 12 s would take ~3.9 ms per pass: after the sync, Megatron-Core's host issues ~45
    ops in TP4 (the dispatch, the permutation, 16 + 16 expert GEMMs, Transformer Engine's
    grouped GEMM being one cuBLAS launch per local expert, the activation, the unpermutation,
    the combine) against 0.78 ms of device work (the exchange and the experts); to fall 3.9 ms
    behind, each would have to take ~100 us, and a host that slow would stall the attention
    half of every layer, and the dense Megatron-Core rows, as much (``docs/fidelity_log.md``,
    session 11). So the per-pass cost that TP4 and PP32 (512 micro-batches, one layer per
    virtual stage, -21%) point to is still not identified; candidates not priced: the MoE
    layer's host time as Megatron-Core and Transformer Engine spend it beyond the launches
    (the traced graph's ATen ops stand in for their Python modules; the launch of each expert
    kernel is charged to the host since session 14, 35 forward and 67 backward a TP4 pass,
    0.00 s a step; no public x86 H100 measurement of the rest was found,
    ``docs/fidelity_log.md``, session 14), the routing imbalance of the dropless rows
    on the busiest EP8 rank. (DeepEP's SMs taken from the GEMMs are priced
    since session 12 where compute runs beside the exchange, under the EP overlap: not in TP4.)
    Evidence for the imbalance, not priced (``docs/fidelity_log.md``, session 13): the same
    readme's "Long Context" H100 table runs this very layout (TP4 EP8 PP8 VPP4, DeepEP, 256
    GPUs) forced-balanced and dropless at 16k-128k tokens; by Megatron's FLOP count the
    dropless runs take 169-176 GPU-microseconds more per token at every length, a per-token
    (MoE) cost: 5.7 s at the TP4 row's 8.4M tokens a step. The EP32 rows (dropless too, on
    another branch) and the FSDP row (EP8, +21.6%) leave no room for such an excess, so no
    routing statistic is set.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cost_model.simulator import simulated
from planner.cluster import Cluster
from planner.cluster_edits import with_attention_kernel
from planner.expert_kernels import TE_GROUPED_GEMM
from planner.graph import OpGraph
from planner.plans import Plan
from planner.strategy import NORMS_MOE_ACT, Mesh
from search.megatron_moe import MegatronMoEConfig, account_split, tensor_parallel_pipeline_plan
from search.moe_folding import folded_plan

try:  # imported as benchmarks.fidelity_runs_moe, or from a script in benchmarks/ (its folder on sys.path)
    from benchmarks.fidelity_flops import tokens_step
    from benchmarks.fidelity_row import DISPATCHER_ALL_TO_ALL, MoeLayout, Run
except ModuleNotFoundError:  # pragma: no cover
    from fidelity_flops import tokens_step
    from fidelity_row import DISPATCHER_ALL_TO_ALL, MoeLayout, Run

QWEN3_235B_MODEL = str(Path(__file__).with_name("qwen3_235b.py"))
MOE_MODEL_ZOO = "Megatron-MoE-ModelZoo best_practice/qwen3/readme.md (H100)"
MOE_REPORT = "Yan et al. 2026 (Megatron-Core MoE, arXiv 2603.07685), table 11"
QWEN3_GPUS, QWEN3_BATCH, QWEN3_SEQ = 256, 2048, 4096
# The kernels the runs used for the norms and rotary embeddings (``Plan.fused_chains``): the
# model zoo's configuration (yanring/Megatron-MoE-ModelZoo model_configs/benchmarking/
# Qwen3-235B-A22B.yaml at 1ed4179f) sets ``--transformer-impl transformer_engine``,
# ``--normalization RMSNorm``, ``--qk-layernorm``, ``--position-embedding-type rope`` and not
# ``--no-rope-fusion``, so Megatron-Core (NVIDIA/Megatron-LM 1e057005,
# megatron/core/models/gpt/gpt_layer_specs.py, ``get_gpt_layer_with_transformer_engine_spec``)
# runs the input norm inside ``TELayerNormColumnParallelLinear``, the q/k norms and the pre-MLP
# norm as ``TENorm``, and RoPE as TE's fused kernel (``apply_rope_fusion``, on by default:
# megatron/training/arguments.py at 1e057005): "norms_rope". Priced so from session 14: the
# traced eager ops (10 kernels a norm, 5 a rotary embedding) cost 2.0-2.8 s a step more than
# the runs spent on them and hid part of what the pipelined rows lack (docs/fidelity_log.md,
# session 14: s14norms gives every row both ways). "" prices the traced eager ops again.
QWEN3_FUSED_CHAINS = "norms_rope"


def qwen3_h100_cluster() -> Cluster:
    """The model zoo's 256 H100s ("NVLink 4th Generation, InfiniBand 8x50 GB/s": the
    dgx-h100 preset's 50 GB/s per GPU) running cuDNN's fused attention (module docstring)."""
    return with_attention_kernel(Cluster.preset("dgx-h100", nodes=QWEN3_GPUS // 8), "cudnn-fused-attention")


def megatron_core_moe_runs() -> list[Run]:
    """Qwen3-235B-A22B on 256 H100s in BF16 (module docstring): the model zoo's five
    Qwen3-235B rows, then the technical report's."""
    found = []
    overrides = {"batch_size": QWEN3_BATCH, "seq_len": QWEN3_SEQ}
    # (name, dispatcher, tp, ep, pp, vpp, micro-batch, recomputation, EP overlap, flavour, step s):
    # the table's rows in its order. "norm, act" runs as NORMS_MOE_ACT, the TP4 row's blank
    # as "none" (module docstring); EDP and ETP follow (ETP 1 throughout; EDP = dp*tp / ep).
    for tag, dispatcher, tp, ep, pp, vpp, micro, recompute, overlap, flavour, step in (
        ("EP32", "DeepEP", 2, 32, 8, 4, 1, NORMS_MOE_ACT, False, "zero1", 19.7),
        ("EP32-ov", "DeepEP", 2, 32, 8, 4, 1, NORMS_MOE_ACT, True, "zero1", 17.6),
        ("FSDP", "DeepEP", 2, 8, 1, 1, 4, "full", False, "fsdp", 17.6),
        ("PP32", "A2A", 2, 8, 32, 3, 1, NORMS_MOE_ACT, False, "zero1", 24.2),
        ("TP4", "DeepEP", 4, 8, 8, 4, 1, "none", False, "zero1", 29.0),
    ):
        dp = QWEN3_GPUS // (tp * pp)
        config = MegatronMoEConfig(tp=tp, ep=ep, etp=1, pp=pp, vpp=vpp, dp=dp, recompute=recompute,
                                   micro_batch_size=micro)
        found.append(Run(
            f"Qwen3-235B-{tag}@256xH100", QWEN3_235B_MODEL, overrides, qwen3_h100_cluster(), {},
            QWEN3_BATCH // (dp * micro) if pp == 1 else 1, step, f"{step} s/step", MOE_MODEL_ZOO,
            megatron_distributed_optimizer=flavour == "zero1", fused_chains=QWEN3_FUSED_CHAINS,
            moe=MoeLayout(config, dispatcher, a2a_overlap=overlap, flavour=flavour),
        ))
    # The report's row: 2,132 tokens/s per GPU -> 2048 x 4096 / (2132 x 256) = 15.37 s per step.
    # run_h100_235b.sh: ``--recompute-modules moe_act layernorm``.
    config = MegatronMoEConfig(tp=2, ep=32, etp=1, pp=8, vpp=4, dp=16, recompute=NORMS_MOE_ACT, micro_batch_size=1)
    found.append(Run(
        "Qwen3-235B-report@256xH100", QWEN3_235B_MODEL, overrides, qwen3_h100_cluster(), {}, 1,
        tokens_step(QWEN3_BATCH, QWEN3_SEQ, 2132, QWEN3_GPUS), "2132 tok/s/GPU", MOE_REPORT,
        megatron_distributed_optimizer=True, fused_chains=QWEN3_FUSED_CHAINS,
        moe=MoeLayout(config, "DeepEP", a2a_overlap=True),
    ))
    return found


def moe_plan(graph: OpGraph, cluster: Cluster, spec, model_name: str, layout: MoeLayout,
             precision: str = "bf16") -> Plan:
    """``layout`` on ``graph`` as a simulated plan: a pipeline by
    ``search.megatron_moe.tensor_parallel_pipeline_plan`` on Megatron-Core's split with the
    embedding and the loss each counted as a layer (``account_split``), one without by the
    folded MoE builder (``search.moe_folding.folded_plan``) accumulating the rank's
    micro-batches; sequence parallel, every MoE layer folded over ``dp x tp`` with the
    layout's EP, its all-to-alls as the dispatcher moves them, its EP overlap as stated."""
    config = layout.config
    all_to_all = DISPATCHER_ALL_TO_ALL[layout.dispatcher]
    if config.pp > 1:
        blocks = sum(graph.blocks.values())
        plan = tensor_parallel_pipeline_plan(graph, cluster, spec, model_name, config,
                                             account_split(blocks, config.pp * config.vpp),
                                             all_to_all=all_to_all, precision=precision)
    else:
        mesh = Mesh((("dp", config.dp), ("tp", config.tp)))
        plan = folded_plan(graph, cluster, spec, model_name, mesh, config.ep, config.etp, sequence_parallel=True,
                           precision=precision, dp_flavour=layout.flavour, recompute=config.recompute,
                           accumulation_steps=graph.batch_size // (config.dp * config.micro_batch_size))
    layouts = tuple(dataclasses.replace(expert, all_to_all=all_to_all) for expert in plan.expert_layouts)
    # Megatron-Core runs the experts with Transformer Engine's grouped GEMM (``cost_model.grouped_gemm``'s
    # docstring): priced so, not as the planner's own program would run them (planner.expert_kernels).
    return simulated(dataclasses.replace(plan, expert_layouts=layouts, moe_a2a_overlap=layout.a2a_overlap,
                                         expert_implementation=TE_GROUPED_GEMM), graph)
