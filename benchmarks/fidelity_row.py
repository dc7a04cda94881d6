"""One published run of ``benchmarks/fidelity.py`` (``Run``) and, for a Megatron-Core MoE run,
its layout (``MoeLayout``): the rows ``benchmarks/fidelity_runs.py`` and
``benchmarks/fidelity_runs_moe.py`` list."""

from __future__ import annotations

from dataclasses import dataclass

from search.megatron_moe import MegatronMoEConfig

# The token dispatchers Megatron-Core MoE runs name, as the simulator prices their exchanges
# (``planner.expert_layouts.ExpertLayout.all_to_all``): ``alltoall`` is NCCL's all-to-all
# ("flat"); DeepEP (``--moe-token-dispatcher-type flex --moe-enable-deepep``) sends each token
# across the network once per destination node and forwards it inside the node ("deduplicated").
DISPATCHER_ALL_TO_ALL = {"A2A": "flat", "DeepEP": "deduplicated"}


@dataclass(frozen=True)
class MoeLayout:
    """A Megatron-Core MoE run's layout as its source states it.

    Attributes:
        config: the degrees (TP, EP, ETP, PP, VPP, DP), recomputation and samples per
            micro-batch (``search.megatron_moe.MegatronMoEConfig``).
        dispatcher: the token dispatcher, a key of ``DISPATCHER_ALL_TO_ALL``.
        a2a_overlap: the run hides each micro-batch's expert all-to-alls under another's
            compute (Megatron-Core's ``--overlap-moe-expert-parallel-comm``, the source's
            "1f1b overlap": ``Plan.moe_a2a_overlap``).
        flavour: the data-parallel side: ``"zero1"`` (the distributed optimizer) or ``"fsdp"``
            (Megatron-FSDP, without a pipeline only).
    """

    config: MegatronMoEConfig
    dispatcher: str
    a2a_overlap: bool = False
    flavour: str = "zero1"

    def describe(self) -> str:
        config = self.config
        parts = [f"tp{config.tp} ep{config.ep} pp{config.pp}"]
        if config.vpp > 1:
            parts.append(f"vpp{config.vpp}")
        parts.append(f"dp{config.dp} {'mcore-distopt' if self.flavour == 'zero1' else self.flavour}")
        parts.append(self.dispatcher + ("+ov" if self.a2a_overlap else ""))
        parts.append(f"mb{config.micro_batch_size} rc-{config.recompute}")
        return " ".join(parts)


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
        moe: for a Megatron-Core MoE run, its layout (``MoeLayout``), built by
            ``benchmarks.fidelity_runs_moe.moe_plan`` instead of ``megatron_plan`` (``layout``
            is then empty); None for every dense run.
        optimizer_implementation: how the run's AdamW steps (``Plan.optimizer_implementation``):
            "fused" (Megatron-LM's and DeepSpeed's FusedAdam: the default), "foreach" (torch.optim's
            default on CUDA, torchtitan's until its PR #881 of 2025-02 made fused the default),
            "per_parameter" (Composer's DecoupledAdamW).
        loss_implementation: how the run computes its cross entropy (``Plan.loss_implementation``):
            "" (eager ``F.cross_entropy``, the default) or "fused_xentropy" (FlashAttention's
            fused kernel, llm-foundry's default loss).
        gradient_clipping: how the run clips its gradients to a global norm once per step
            (``Plan.gradient_clipping``; ``cost_model.gradient_clipping``): "multi_tensor"
            (Megatron-LM's and Megatron-Core's ``clip_grad_norm_fp32``, ``--clip-grad`` 1.0 by
            default: the default here), "foreach" (``torch.nn.utils.clip_grad_norm_``,
            torchtitan's ``max_norm``), "per_tensor" (FSDP1's ``clip_grad_norm_``, Composer's
            ``gradient_clipping``), or "" where the run's clipping is priced elsewhere
            (DeepSpeed's fp16 ZeRO-1 step) or its software is not public.
        fused_chains: which chains of eager kernels in the traced model the run computes as
            one fused kernel each (``Plan.fused_chains``: "norms", "norms_rope"); "" (the
            default) prices every traced op, as the row has always been priced.
        metric_cross_entropies: forward-only cross entropies the run's trainer computes per
            micro-batch for its training metrics (``Plan.metric_cross_entropies``: Composer's
            two for llm-foundry's MPT).
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
    optimizer_implementation: str = "fused"
    loss_implementation: str = ""
    metric_cross_entropies: int = 0
    gradient_clipping: str = "multi_tensor"
    fused_chains: str = ""
    moe: MoeLayout | None = None

    def describe(self, gpus: int) -> str:
        if self.moe is not None:
            return self.moe.describe()
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
