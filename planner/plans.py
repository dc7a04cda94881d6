"""The ``Plan``: everything needed to explain, simulate and compile one parallelization.

A plan is saved as versioned JSON (never pickle) and validated on load: a corrupt file, a
file of another version or a bad field raises ``PlanFileError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from planner.cluster import Cluster
from planner.graph import OpGraph
from planner.errors import ClusterError, PlanFileError, SpecError, one_line
from planner.families import section_families
from planner.fingerprint import FINGERPRINT_LENGTH
from planner.json_files import peek_json, read_json
from planner.left_out_devices import LeftOutDevices
from planner.outputs import check_output_file, write_text_atomically
from planner.plan_part_checks import check_expert_layouts, check_pipeline_size, check_summa_layouts
from planner.run_settings import check_run_settings
from planner.plan_fields import (
    FieldReader,
    check_placement_counts,
    estimate_from,
    expert_layout_from_dict,
    expert_layout_to_dict,
    mesh_from_json,
    pipeline_from_dict,
    pipeline_to_dict,
    strategy_from_dict,
    strategy_to_dict,
    timings_from,
)
from planner.model_spec import ModelSpec
from planner.strategy import (
    DP_FLAVOURS,
    RECOMPUTE_MODES,
    Alternative,
    ExpertLayout,
    expert_modes_summary,
    Mesh,
    NodeStrategy,
    PipelineConfig,
    SimResult,
    Placements,
    placements_from_json,
    placements_to_json,
)

PLAN_FORMAT = "soap-planner-plan"
# Version 3 added model_fingerprint (planner/fingerprint.py).
PLAN_VERSION = 9  # 4: accumulation_steps; 5: pipeline.stage_recompute; 6: expert_layouts; 7: SUMMA layouts, row/col/dep axes;
# 8: ops named by a digest of what they compute (planner.node_names), not by trace order, so a
# version-7 plan names ops a re-trace no longer has: it is refused in one line (re-plan it).
# 9: family sections (planner.families), each under its family's key; a version-8 plan has none
# and is read as it is (READABLE_VERSIONS).
# Precisions a plan is made in (the API also takes "auto", resolved before planning).
READABLE_VERSIONS = (8, PLAN_VERSION)
PLAN_PRECISIONS = ("fp32", "bf16", "fp16")
# The fields of a plan's JSON; any other key is a family's section (Plan.sections).
_PLAN_KEYS = frozenset((
    "format", "version", "model", "cluster", "mesh", "dp_flavour", "recompute", "pipeline", "accumulation_steps",
    "precision", "optimizer", "optimizer_implementation", "loss_implementation", "metric_cross_entropies",
    "expert_implementation",
    "gradient_clipping", "fused_chains",
    "batch_size", "inputs", "fsdp_units", "expert_layouts",
    "summary", "estimate",
    "runners_up", "warnings", "search_summary", "label", "timings", "fused_splits_local", "tp_comm_overlap",
    "megatron_distributed_optimizer", "moe_a2a_overlap", "model_fingerprint", "strategies", "half_precision_weights",
    "left_out",
    "fsdp_fp32_reduce",  # retired: read and ignored (every bf16 FSDP2 program reduces in fp32 now)
))

@dataclass(frozen=True)
class ModelSummary:
    """What the report says about the model without re-tracing it."""

    name: str
    parameters: int
    parameter_bytes: int
    forward_flops: int
    ops: int
    tracer: str
    blocks: dict[str, int] = field(default_factory=dict)
    tokens_per_sample: int = 0
    # The blocks' runs in words (``OpGraph.block_runs_text``: DeepSeek-V3's "model.layers x61:
    # 3 dense (0-2) + 58 MoE (3-60)"); empty in plans written before it, whose report words ``blocks``.
    block_runs: str = ""


@dataclass(frozen=True)
class Plan:
    """A parallelization of one model's training step on one cluster.

    Attributes:
        model: the spec the model is rebuilt from inside torchrun (``None`` for a model
            passed as an object without a spec; such a plan can be reported, not compiled).
        cluster: the cluster it was planned for.
        mesh: the device mesh over the cluster's ranks.
        dp_flavour: how the ``dp`` axis keeps weights: ``ddp``, ``zero1``, ``zero2``, ``fsdp``.
        batch_size: the global batch of one step.
        inputs: placements of each user input by name (``None`` for non-tensor inputs).
        strategies: one ``NodeStrategy`` per traced op, in graph order.
        estimate: predicted step time and memory.
        recompute: activation recomputation: ``none``, ``selective`` or ``full``. A pipeline
            may give its stages modes of their own (``PipelineConfig.stage_recompute``);
            then ``recompute`` is the heaviest of them (``recompute_at`` gives a stage's).
        pipeline: pipeline stages and schedule, or ``None``.
        accumulation_steps: without a pipeline, the micro-batches each rank's part of the
            batch is cut into, each run forward and backward in turn with their gradients
            summed before the one data-parallel reduction and optimizer step (gradient
            accumulation: the activations of one micro-batch at a time). 1 for none; a
            pipeline has its own micro-batches.
        fsdp_units: module paths sharded as separate FSDP units (the root is always one).
        expert_layouts: how each MoE layer runs (``ExpertLayout``: mode, placement of its
            experts, capacity factor, all-to-all), by module path; empty for a dense model
            or a plan that runs MoE layers as traced ops.
        precision: ``fp32`` (mixed precision comes with the simulator).
        optimizer: the optimizer the step uses (``adamw``).
        summary: a summary of the traced model, for the report.
        runners_up: the next best plans, for the report.
        warnings: things the planner noticed that the user should know.
        search_summary: how the strategy was found (searches, meshes, optimality); the
            same for the same inputs on any machine.
        left_out: the devices of the planned cluster this plan leaves idle and the best plan
            the search found on every device (``planner.left_out_devices``); None when it
            uses every device or was not searched.
        timings: wall-clock seconds the planning took (``trace_s``, ``search_s``,
            ``total_s``): the only fields that differ between two runs of the same plan.
        label: the strategy family for names and reports (``"soap"`` for searched plans,
            ``"megatron"``); empty for data-parallel plans, named by their flavour.
        fused_splits_local: the fused projections (q|k|v, gate|up) have their weights laid out
            per rank, each rank's rows holding its part of every piece, so splitting their
            output is local (Megatron-LM's layout). For simulating other systems' runs
            (``benchmarks/fidelity.py``): compiled programs hold the weights as the model
            built them and gather at the split (``cost_model.split_gather``), so
            ``planner compile`` refuses such a plan.
        tp_comm_overlap: the sequence-parallel all-gathers and reduce-scatters inside the
            blocks are overlapped with the GEMMs next to them as Transformer Engine's
            userbuffers do (Megatron-LM's ``--tp-comm-overlap``; ``cost_model.tp_comm_overlap``).
            For simulating other systems' runs (``benchmarks/fidelity.py``): compiled programs
            run each collective before or after its GEMM, so the search never sets it and
            ``planner compile`` refuses a plan that does. Needs sequence parallelism.
        megatron_distributed_optimizer: ZeRO-1 as Megatron-Core r0.8 runs it
            (``--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather``
            under ``--bf16``; ``cost_model.megatron_grad_sync``): gradients accumulate in an fp32
            buffer over all the step's micro-batches and are reduce-scattered once, in fp32,
            bucket by bucket during the last backward; the updated weights are all-gathered
            bucket by bucket during the next step's forward. For simulating other systems'
            runs (``benchmarks/fidelity.py``): compiled programs reduce after every
            micro-batch and gather after the optimizer step, so the search never sets it and
            ``planner compile`` refuses a plan that does. Needs ``dp_flavour`` zero1.
        optimizer_implementation: how the run's AdamW steps, where it is another system's
            (``benchmarks/fidelity.py``): ``"fused"`` (one kernel), ``"foreach"``
            (torch.optim's multi-tensor kernels) or ``"per_parameter"`` (Composer's
            ``DecoupledAdamW``: ops and a host sync per parameter tensor); priced by
            ``cost_model.compute.optimizer_step_time``. Empty (the default): the compiled
            program's own (torch.optim's default: foreach on GPUs, single-tensor on gloo). The search never sets it,
            and ``planner compile`` refuses a plan that does (its program steps its own).
        loss_implementation: how the run computes its cross entropy, where it is another
            system's (``benchmarks/fidelity.py``): ``"fused_xentropy"`` (FlashAttention's fused
            kernel over the 16-bit logits, llm-foundry's default loss). Empty (the default):
            the compiled program's own eager ``F.cross_entropy``. Priced by
            ``cost_model.loss_kernels``; the search never sets it and ``planner compile``
            refuses a plan that does.
        expert_implementation: the kernels that run the MoE layers' expert GEMMs
            (``planner.expert_kernels``): ``"te_grouped_gemm"`` (Transformer Engine's grouped
            GEMM, as Megatron-Core runs them: for simulating its runs, ``planner compile``
            refuses it), ``"torch_bmm"``, ``"per_expert_loop"`` or ``"model_experts"`` (the
            compiled programs' kernels; ``planner compile`` refuses one a layer's program
            does not run). Empty (the default): each layer's compiled kernel. Priced by
            ``cost_model.grouped_gemm``.
        gradient_clipping: how another system's run clips its gradients to a global norm
            (``planner.run_settings.GRADIENT_CLIPPINGS``, priced by ``cost_model.gradient_clipping``). Empty (the
            default): none priced; the search never sets it and ``planner compile`` refuses a
            plan that does (compiled programs clip only when launched with ``--clip-grad-norm``).
        fused_chains: which chains of eager kernels in the traced program another system's run
            computes as one fused kernel each (``planner.run_settings.FUSED_CHAINS``):
            ``"norms"`` (each normalisation module, as Transformer Engine's ``TENorm`` and
            ``TELayerNormColumnParallelLinear`` run it in Megatron-Core) or ``"norms_rope"``
            (also each rotary embedding of q and of k, TE's fused RoPE). Priced by
            ``cost_model.fused_chains`` (recomputation recomputes the fused kernels; saved
            activations stay as traced). Empty (the default): every traced op priced as it
            runs in the compiled program. The search never sets it and ``planner compile``
            refuses a plan that does.
        metric_cross_entropies: forward-only cross entropies the run's trainer computes over
            each micro-batch's logits for its training metrics (Composer's, two for
            llm-foundry's MPT; ``cost_model.loss_kernels``). 0 (the default) for compiled
            programs, which compute none; ``planner compile`` refuses a plan that sets it.
        half_precision_weights: the run's model holds 16-bit weights and gradients, the fp32
            master weights living in its optimizer (Megatron-LM's ``Float16Module``,
            DeepSpeed's 16-bit engines, Composer's FSDP with ``mixed_precision: DEFAULT``):
            its gathers and gradient reductions move 2 bytes per element unless another field
            says fp32, and nothing is cast per op. Compiled bf16 programs keep fp32 weights
            and gradients under autocast instead (FSDP2 units under a bf16 gather / fp32
            reduce policy; ``cost_model.mixed_precision``). For simulating other systems'
            runs (``benchmarks/fidelity.py``); the search never sets it and ``planner
            compile`` refuses it. Needs a 16-bit precision. (It replaces
            ``fsdp_fp32_reduce``, which is what every bf16 FSDP2 program now does: plan files
            naming it load, and it is ignored.)
        moe_a2a_overlap: each expert-parallel MoE layer's all-to-alls run under another
            micro-batch's compute of the same layer (Megatron-Core's
            ``--overlap-moe-expert-parallel-comm``, DualPipe's overlapped chunk;
            ``cost_model.moe_overlap``: in a pipeline, its steady state only; the compute
            beside an exchange slowed by the SMs the exchange takes), one more
            micro-batch's activations held for it.
            Searched only with ``--moe-dispatch overlapped``; compiled programs run each
            micro-batch's passes one after the other, so ``planner compile`` refuses it.
        model_fingerprint: the structural fingerprint of the planned model and its example
            batch (``planner.fingerprint``); taken from ``graph`` when left empty.
            ``compile``, ``simulate`` and ``launch.py`` compare it with what the spec builds.
        sections: the plan sections of families that have one (``planner.families``), by
            family name: e.g. ``{"hsdp": HsdpSection(shard=2)}``. Each is saved under its
            family's own key of the plan JSON, checks itself against the plan and adds its
            words to the plan's name.
        graph: the traced model, kept in memory for simulation (not saved; a loaded plan
            re-traces its model spec on meta tensors when it needs it).
    """

    model: ModelSpec | None
    cluster: Cluster
    mesh: Mesh
    dp_flavour: str
    batch_size: int
    inputs: dict[str, Placements | None]
    strategies: tuple[NodeStrategy, ...]
    estimate: SimResult
    summary: ModelSummary
    recompute: str = "none"
    pipeline: PipelineConfig | None = None
    accumulation_steps: int = 1
    fsdp_units: tuple[str, ...] = ()
    expert_layouts: tuple[ExpertLayout, ...] = ()
    precision: str = "fp32"
    optimizer: str = "adamw"
    optimizer_implementation: str = ""
    loss_implementation: str = ""
    expert_implementation: str = ""
    gradient_clipping: str = ""
    fused_chains: str = ""
    metric_cross_entropies: int = 0
    runners_up: tuple[Alternative, ...] = ()
    warnings: tuple[str, ...] = ()
    search_summary: str = ""
    left_out: LeftOutDevices | None = None
    label: str = ""
    timings: Mapping[str, float] = field(default_factory=dict)
    fused_splits_local: bool = False
    tp_comm_overlap: bool = False
    megatron_distributed_optimizer: bool = False
    moe_a2a_overlap: bool = False
    half_precision_weights: bool = False
    model_fingerprint: str = ""
    sections: Mapping[str, Any] = field(default_factory=dict)
    graph: OpGraph | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.model_fingerprint and self.graph is not None:
            object.__setattr__(self, "model_fingerprint", self.graph.model_fingerprint)
        if self.dp_flavour not in DP_FLAVOURS:
            raise ValueError(f"field 'dp_flavour' must be one of {DP_FLAVOURS}, got '{one_line(self.dp_flavour)}'")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"field 'recompute' must be one of {RECOMPUTE_MODES}, got '{one_line(self.recompute)}'")
        if self.precision not in PLAN_PRECISIONS:
            raise ValueError(f"field 'precision' must be one of {PLAN_PRECISIONS}, got '{one_line(self.precision)}'")
        check_run_settings(self)
        if self.left_out is not None and (not isinstance(self.left_out, LeftOutDevices) or self.left_out.cluster_ranks
                                          - sum(count for _, count in self.left_out.devices) != self.cluster.world_size):
            raise ValueError(f"field 'left_out' must say which ranks of a larger cluster this plan's {self.cluster.world_size} "
                             f"leave idle; drop the field or plan again")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size (the global batch) must be a positive integer, got {self.batch_size!r}")
        steps = self.accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"field 'accumulation_steps' must be a positive integer, got {steps!r}")
        if steps > 1 and self.pipeline is not None:
            raise ValueError(
                f"field 'accumulation_steps' is {steps} but the plan has a pipeline, whose micro-batches accumulate "
                f"gradients already; set it to 1 and use pipeline.micro_batches"
            )
        dp = self.mesh.axis_size("dp") if "dp" in self.mesh.names else 1
        # A section that cuts each rank's own share into micro-batches (uneven data-parallel
        # shares) checks its own split.
        cuts_itself = any(getattr(section, "cuts_micro_batches", False) for section in self.sections.values())
        if steps > 1 and self.batch_size % (dp * steps) and not cuts_itself:
            raise ValueError(
                f"the global batch {self.batch_size} does not split into {steps} micro-batches on each of the dp={dp} "
                f"ranks; choose accumulation_steps so that dp x accumulation_steps divides the batch"
            )
        if (self.pipeline is not None) != ("pp" in self.mesh.names):
            raise ValueError(
                f"a pipeline needs a 'pp' mesh axis and a 'pp' axis needs a pipeline; the mesh is {self.mesh} and "
                f"the pipeline {'is missing' if self.pipeline is None else 'is set'}"
            )
        if self.pipeline is not None and self.pipeline.stages != self.mesh.axis_size("pp"):
            raise ValueError(
                f"the pipeline has {self.pipeline.stages} stages but the mesh axis pp has {self.mesh.axis_size('pp')} ranks"
            )
        if self.pipeline is not None:
            check_pipeline_size(self.pipeline, self.batch_size, len(self.strategies))
        if self.tp_comm_overlap and not self.sequence_parallel:
            # Transformer Engine overlaps the sequence-parallel collectives only (Megatron-LM
            # asserts --tp-comm-overlap needs --sequence-parallel).
            raise ValueError("field 'tp_comm_overlap' is true but the plan has no sequence parallelism; set it to false")
        stages = self.pipeline.stages * self.pipeline.virtual_stages if self.pipeline is not None else 1
        per_stage = self.pipeline.stage_recompute if self.pipeline is not None else ()
        if per_stage and self.recompute != max(per_stage, key=RECOMPUTE_MODES.index):
            raise ValueError(
                f"field 'recompute' is '{self.recompute}' but the heaviest of the pipeline's stage_recompute "
                f"{list(per_stage)} is '{max(per_stage, key=RECOMPUTE_MODES.index)}'; the plan's mode is the heaviest "
                f"any stage uses"
            )
        for strategy in self.strategies:
            if not 0 <= strategy.stage < stages:
                raise ValueError(
                    f"op '{strategy.node}' runs on pipeline stage {strategy.stage} but the plan has {stages} stage(s) "
                    f"(0..{stages - 1})"
                )
        if self.mesh.size != self.cluster.world_size:
            raise ValueError(
                f"mesh {self.mesh} has {self.mesh.size} ranks but the cluster has {self.cluster.world_size} devices"
            )
        check_expert_layouts(self.expert_layouts, self.mesh, self.sections)
        check_summa_layouts(self.strategies, self.mesh)
        object.__setattr__(self, "sections", dict(self.sections))
        for name, section in self.sections.items():
            owner = next((f for f in section_families() if f.name == name), None)
            if owner is None:
                raise ValueError(
                    f"plan section '{one_line(str(name))[:40]}' belongs to no parallelism family with a section; "
                    f"those are {', '.join(f.name for f in section_families()) or 'none'}"
                )
            if not isinstance(section, owner.section):
                raise ValueError(f"plan section '{name}' must be a {owner.section.__name__}, got {type(section).__name__}")
            section.check(self)

    @property
    def world_size(self) -> int:
        return self.mesh.size

    def recompute_at(self, stage: int) -> str:
        """The recomputation mode of pipeline stage module ``stage`` (``NodeStrategy.stage``):
        its own when the pipeline gives stages modes of their own, else the plan's."""
        per_stage = self.pipeline.stage_recompute if self.pipeline is not None else ()
        return per_stage[stage] if per_stage else self.recompute

    @property
    def sequence_parallel(self) -> bool:
        """Whether this is a Megatron plan whose residual stream between blocks is split on
        the sequence (Megatron's layout reshards an op's output only for that)."""
        return self.label == "megatron" and any(s.produced is not None for s in self.strategies)

    @property
    def name(self) -> str:
        """Short name of the strategy, e.g. ``"fsdp (dp=4)"``, ``"soap (dp=2 x tp=4)"``,
        ``"megatron (pp=4 x dp=2 x tp=8; 1f1b, 16 micro-batches; zero1)"`` or, with gradient
        accumulation, ``"zero2 (dp=16; 2 micro-batches)"``; one line, whatever a plan file's
        label holds."""
        details = [str(self.mesh)]
        if self.pipeline is not None:
            pipeline = self.pipeline
            interleaving = f" x{pipeline.virtual_stages}" if pipeline.schedule == "interleaved" else ""
            details.append(f"{pipeline.schedule}{interleaving}, {pipeline.micro_batches} micro-batches")
        if self.accumulation_steps > 1:
            details.append(f"{self.accumulation_steps} micro-batches")
        if self.label and self.dp_flavour != "ddp" and "dp" in self.mesh.names:
            details.append(self.dp_flavour)  # a labelled plan's dp flavour is not in its label
        if self.sequence_parallel:
            details.append("sequence parallel")
        if self.tp_comm_overlap:
            details.append("tp collectives overlapped as Transformer Engine does")
        if self.megatron_distributed_optimizer:
            details.append("Megatron's distributed optimizer")
        if self.half_precision_weights:
            details.append("16-bit weights and gradients")
        if self.moe_a2a_overlap:
            details.append("all-to-alls under another micro-batch's compute")
        if self.expert_layouts:
            details.append(expert_modes_summary(self.expert_layouts))
        details += [section.describe(self) for section in self.sections.values()]
        return one_line(f"{self.label or self.dp_flavour} ({'; '.join(details)})")

    def report(self, width: int | None = None) -> str:
        """A readable text report: cluster, mesh, strategy per layer, memory and time, laid
        out in ``width`` columns (default ``planner.report.REPORT_WIDTH``, 100)."""
        from planner.report import REPORT_WIDTH, render_report

        return render_report(self, REPORT_WIDTH if width is None else width)

    def save(self, path: str | Path, *, force: bool = False) -> None:
        """Write the plan as versioned JSON, atomically (a reader never sees half a file).

        Args:
            path: where to write it; its folder must exist.
            force: overwrite a file at ``path`` that is not a soap-planner plan (by default
                only a plan file is replaced, so a user's own file is never lost).

        Raises:
            OutputError: the folder is missing or not writable, ``path`` is a folder, or it
                holds a file that is not a plan and ``force`` is not set.
        """
        path = check_output_file(path, what="soap-planner plan", is_ours=is_plan_file, force=force)
        write_text_atomically(path, json.dumps(self.to_dict(), indent=1) + "\n")

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``PLAN_FORMAT`` version ``PLAN_VERSION``)."""
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "model": self.model.to_dict() if self.model else None,
            "cluster": self.cluster.to_dict(),
            "mesh": [[name, size] for name, size in self.mesh.axes],
            "dp_flavour": self.dp_flavour,
            "recompute": self.recompute,
            "pipeline": pipeline_to_dict(self.pipeline),
            "accumulation_steps": self.accumulation_steps,
            "precision": self.precision,
            "optimizer": self.optimizer,
            # Written only when set, so plans that do not use it read as before.
            **({"optimizer_implementation": self.optimizer_implementation} if self.optimizer_implementation else {}),
            **({"loss_implementation": self.loss_implementation} if self.loss_implementation else {}),
            **({"expert_implementation": self.expert_implementation} if self.expert_implementation else {}),
            **({"gradient_clipping": self.gradient_clipping} if self.gradient_clipping else {}),
            **({"fused_chains": self.fused_chains} if self.fused_chains else {}),
            **({"metric_cross_entropies": self.metric_cross_entropies} if self.metric_cross_entropies else {}),
            "batch_size": self.batch_size,
            "inputs": {name: placements_to_json(p) if p is not None else None for name, p in self.inputs.items()},
            "fsdp_units": list(self.fsdp_units),
            "expert_layouts": [expert_layout_to_dict(layout) for layout in self.expert_layouts],
            "summary": vars(self.summary),
            "estimate": self.estimate.to_dict(),
            "runners_up": [vars(alt) for alt in self.runners_up],
            "warnings": list(self.warnings),
            "search_summary": self.search_summary,
            # Written only when set, so plans that use every device read as before.
            **({"left_out": self.left_out.to_json()} if self.left_out is not None else {}),
            "label": self.label,
            "timings": dict(self.timings),
            "fused_splits_local": self.fused_splits_local,
            "tp_comm_overlap": self.tp_comm_overlap,
            "megatron_distributed_optimizer": self.megatron_distributed_optimizer,
            "moe_a2a_overlap": self.moe_a2a_overlap,
            # Written only when set, so plans that do not use it read as before.
            **({"half_precision_weights": True} if self.half_precision_weights else {}),
            "model_fingerprint": self.model_fingerprint,
            **{name: section.to_json() for name, section in self.sections.items()},
            "strategies": [strategy_to_dict(s) for s in self.strategies],
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> "Plan":
        """Validate and rebuild a plan from its JSON form; ``PlanFileError`` names the bad field."""
        reader = FieldReader(data, source)
        fmt = reader.get("format", str)
        if fmt != PLAN_FORMAT:
            raise PlanFileError(f"{source}: field 'format' is '{fmt}', not a soap-planner plan ('{PLAN_FORMAT}')")
        version = reader.get("version", int)
        if version not in READABLE_VERSIONS:
            raise PlanFileError(
                f"{source}: field 'version' is {version} but this soap-planner reads version {PLAN_VERSION}; "
                f"re-run `planner plan` with this version to regenerate the plan"
            )
        model = reader.convert("model", lambda d: None if d is None else ModelSpec.from_dict(d), SpecError, ValueError)
        cluster = reader.convert("cluster", Cluster.from_dict, ClusterError)
        mesh = reader.convert("mesh", mesh_from_json, ValueError, TypeError)
        if mesh.size != cluster.world_size:
            raise PlanFileError(
                f"{source}: mesh {mesh} has {mesh.size} ranks but the cluster has {cluster.world_size} devices; "
                f"the mesh must cover every device once"
            )
        estimate = estimate_from(reader.child("estimate"))
        summary = reader.record("summary", ModelSummary)
        inputs = {
            name: None if value is None else placements_from_json(value, f"{source}: field 'inputs.{name}'")
            for name, value in reader.get("inputs", dict).items()
        }
        strategies = tuple(
            strategy_from_dict(FieldReader(item, source, f"strategies[{index}]"))
            for index, item in enumerate(reader.get("strategies", list))
        )
        check_placement_counts(mesh, inputs, strategies, source)
        fingerprint = reader.get("model_fingerprint", str)
        if fingerprint and not re.fullmatch(f"[0-9a-f]{{{FINGERPRINT_LENGTH}}}", fingerprint):
            raise PlanFileError(
                f"{source}: field 'model_fingerprint' must be {FINGERPRINT_LENGTH} hex digits (a sha256), "
                f"got {fingerprint[:80]!r}; re-plan to regenerate the plan"
            )
        try:
            return cls(
                model=model,
                cluster=cluster,
                mesh=mesh,
                dp_flavour=reader.get("dp_flavour", str),
                batch_size=reader.get("batch_size", int),
                inputs=inputs,
                strategies=strategies,
                estimate=estimate,
                summary=summary,
                recompute=reader.get("recompute", str),
                pipeline=reader.convert("pipeline", pipeline_from_dict, TypeError, ValueError),
                accumulation_steps=reader.get("accumulation_steps", int),
                fsdp_units=tuple(reader.strings("fsdp_units")),
                expert_layouts=tuple(
                    expert_layout_from_dict(FieldReader(item, source, f"expert_layouts[{index}]"))
                    for index, item in enumerate(reader.get("expert_layouts", list))
                ),
                precision=reader.get("precision", str),
                optimizer=reader.get("optimizer", str),
                optimizer_implementation=(reader.get("optimizer_implementation", str)
                                          if "optimizer_implementation" in data else ""),
                loss_implementation=reader.get("loss_implementation", str) if "loss_implementation" in data else "",
                expert_implementation=(reader.get("expert_implementation", str)
                                       if "expert_implementation" in data else ""),
                gradient_clipping=reader.get("gradient_clipping", str) if "gradient_clipping" in data else "",
                fused_chains=reader.get("fused_chains", str) if "fused_chains" in data else "",
                metric_cross_entropies=(reader.get("metric_cross_entropies", int)
                                        if "metric_cross_entropies" in data else 0),
                runners_up=tuple(_runners_up_from(reader)),
                warnings=tuple(reader.strings("warnings")),
                search_summary=reader.get("search_summary", str),
                left_out=LeftOutDevices.from_json(data["left_out"], source) if "left_out" in data else None,
                label=reader.get("label", str),
                timings=timings_from(reader),
                # Absent from plans written before the field: their programs gather at splits.
                fused_splits_local=reader.get("fused_splits_local", bool) if "fused_splits_local" in data else False,
                # Absent from plans written before the field: none overlapped.
                tp_comm_overlap=reader.get("tp_comm_overlap", bool) if "tp_comm_overlap" in data else False,
                # Absent from plans written before the field: the planner's own ZeRO-1.
                megatron_distributed_optimizer=(reader.get("megatron_distributed_optimizer", bool)
                                                if "megatron_distributed_optimizer" in data else False),
                moe_a2a_overlap=reader.get("moe_a2a_overlap", bool) if "moe_a2a_overlap" in data else False,
                # Absent from plans written before the field: the planner's own fp32 weights.
                half_precision_weights=(reader.get("half_precision_weights", bool)
                                        if "half_precision_weights" in data else False),
                model_fingerprint=fingerprint,
                sections=_sections_from(data, source),
            )
        except ValueError as error:
            raise PlanFileError(f"{source}: {one_line(error)}") from None


def load_plan(path: str | Path) -> Plan:
    """Read a plan written by ``Plan.save``. A relative ``model.source`` (a plan written by
    hand) is taken relative to the plan file's folder.

    Raises:
        PlanFileError: ``path`` is not a path, the file is missing, is not JSON, is of
            another version, or a field is invalid (the message names it).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise PlanFileError(
            f"load_plan takes the path of a plan file (str or pathlib.Path), got {type(path).__name__}; "
            f"e.g. load_plan('plan.json')"
        )
    path = Path(path)
    if os.path.isdir(path):  # os.path's, which is False for names too long to exist
        raise PlanFileError(f"plan file '{path}' is a folder; pass the plan's JSON file, e.g. {path / 'plan.json'}")
    data = read_json(
        path, f"plan file '{path}'", "regenerate it with `planner plan`", PlanFileError,
        missing=f"does not exist; create one with `planner plan SPEC -o {path}`",
    )
    plan = Plan.from_dict(data, source=f"plan file '{path}'")
    if plan.model is not None and not plan.model.is_hf:
        # A relative model.source is relative to the plan file's folder, never to wherever
        # the user happens to run from (Plan.save writes absolute paths).
        plan = dataclasses.replace(plan, model=plan.model.resolved(path.resolve().parent))
    return plan


# ------------------------------------------------------------------------------ helpers


def _runners_up_from(reader: FieldReader) -> list[Alternative]:
    """The runners-up; a plan saved before ``Alternative.route`` was renamed from ``family``
    (the word ``planner.families`` now means) has the older key, read as the route."""
    items = reader.get("runners_up", list)
    renamed = [
        {("route" if key == "family" and "route" not in item else key): value for key, value in item.items()}
        if isinstance(item, dict) else item
        for item in items
    ]
    return FieldReader({"runners_up": renamed}, reader.source).records("runners_up", Alternative)


def _sections_from(data: dict, source: str) -> dict[str, Any]:
    """The family sections of a plan's JSON, each read by its family's section class; a
    key no field and no family has is refused (a plan written by a newer soap-planner with a
    family this one does not know would otherwise run as another plan)."""
    known = {family.name: family for family in section_families()}
    unknown = sorted(str(key)[:40] for key in data if key not in _PLAN_KEYS and key not in known)
    if unknown:
        raise PlanFileError(
            f"{source}: field '{unknown[0]}' is not a plan field or the section of a parallelism family this "
            f"soap-planner knows ({', '.join(known) or 'none'}); re-plan with this version or upgrade soap-planner"
        )
    return {name: family.section.from_json(data[name], source) for name, family in known.items() if name in data}


def is_plan_file(path: Path) -> bool:
    """Whether ``path`` holds a soap-planner plan (of any version): the files ``plan -o``
    may overwrite without ``--force``."""
    data = peek_json(path)
    return isinstance(data, dict) and data.get("format") == PLAN_FORMAT
