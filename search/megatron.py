"""Megatron-LM plans: tensor, pipeline and data parallelism as Megatron lays them out.

The layout (column/row-parallel matmuls, vocabulary-parallel embedding, sequence
parallelism, even pipeline split) is ``search.layouts.megatron_layout``; this module checks
the configuration, builds the mesh ``(pp, dp, tp)`` with ``tp`` innermost (inside a node)
and simulates the plan.
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_model.simulator import simulated
from planner.cluster import Cluster
from planner.errors import PlanningError
from planner.graph import OpGraph
from planner.model_spec import ModelSpec
from planner.plans import Plan
from planner.strategy import PIPELINE_SCHEDULES, RECOMPUTE_MODES, Mesh, PipelineConfig
from search.layouts import check_layers_per_stage, megatron_layout
from search.plan_builder import unsimulated_plan


def megatron_plan(
    graph: OpGraph,
    cluster: Cluster,
    spec: ModelSpec | None,
    model_name: str,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    micro_batch: int = 1,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    recompute: str | None = None,
    sequence_parallel: bool = False,
    precision: str = "bf16",
    dp_flavour: str = "ddp",
    layers_per_stage: Sequence[int] | None = None,
    blocking_p2p: bool = False,
    partitioned_p2p: bool = False,
    gradient_accumulation: str = "in-gemm",
    overlap_grad_reduce: bool = True,
    block_overhead_s: float = 0.0,
    deepspeed_checkpointing: Sequence[str] = (),
    fused_splits_local: bool = False,
    tp_comm_overlap: bool = False,
) -> Plan:
    """A simulated Megatron-LM plan (see the module docstring).

    Args:
        tp, pp, dp: degrees of tensor, pipeline and data parallelism; ``dp`` defaults to
            the devices left over, and ``tp * pp * dp`` must equal the device count.
        micro_batch: samples per micro-batch per data-parallel rank; the number of
            micro-batches is ``batch / (dp * micro_batch)``.
        schedule: ``"1f1b"``, ``"interleaved"`` (with ``virtual_stages`` > 1) or ``"gpipe"``.
        recompute: ``None``/``"none"``, ``"selective"`` or ``"full"``.
        precision: ``"bf16"`` (Megatron's usual mixed precision), ``"fp16"`` or ``"fp32"``.
        dp_flavour: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"fsdp"`` on the ``dp`` axis.
        blocking_p2p: pipeline sends hold the sender's compute stream (DeepSpeed's pipeline
            engine, ``PipelineConfig.blocking_p2p``) instead of overlapping it.
        partitioned_p2p: pipeline sends carry 1/tp of each boundary tensor, all-gathered by
            the receiver (DeepSpeed's pipeline engine, ``PipelineConfig.partitioned_p2p``).
        gradient_accumulation: how micro-batches' weight gradients are summed
            (``PipelineConfig.gradient_accumulation``: ``"in-gemm"``, ``"autograd"``,
            ``"fp32-copy"``).
        overlap_grad_reduce: False to reduce gradients over ``dp`` only after the last
            backward (``PipelineConfig.overlap_grad_reduce``).
        block_overhead_s: the engine's fixed seconds per layer per micro-batch beyond its
            kernels (``PipelineConfig.block_overhead_s``); pipelines only.
        deepspeed_checkpointing: the options of DeepSpeed's activation checkpointing the run
            turned on (``PipelineConfig.deepspeed_checkpointing``); pipelines only.
        fused_splits_local: the fused q|k|v and gate|up weights laid out per rank, as
            Megatron-LM lays them out (``Plan.fused_splits_local``): for simulating Megatron-LM's
            own runs; compiled programs gather at those splits instead.
        layers_per_stage: blocks on each (virtual) stage in order, e.g. ``(3, 4, 4, 3)``
            (``search.layouts.uneven_stages``); the default splits them evenly.

    Raises:
        PlanningError: the degrees do not match the cluster or the model, or the batch does
            not split into micro-batches.
    """
    world = cluster.world_size
    recompute = recompute or "none"
    if recompute not in RECOMPUTE_MODES:
        raise PlanningError(f"recompute must be None, 'selective' or 'full', got '{recompute}'")
    if schedule not in PIPELINE_SCHEDULES:
        raise PlanningError(f"schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got '{schedule}'")
    if dp is None:
        if world % (tp * pp):
            raise PlanningError(f"tp={tp} x pp={pp} does not divide the {world} devices; choose degrees whose product divides it")
        dp = world // (tp * pp)
    if tp * pp * dp != world:
        raise PlanningError(f"tp={tp} x pp={pp} x dp={dp} = {tp * pp * dp} but the cluster has {world} devices")
    if tp_comm_overlap and not (sequence_parallel and tp > 1):
        raise PlanningError("tp_comm_overlap overlaps the sequence-parallel collectives: it needs tp > 1 and "
                            "sequence_parallel=True")
    if graph.batch_size % (dp * micro_batch):
        raise PlanningError(
            f"the global batch {graph.batch_size} does not split into micro-batches of {micro_batch} over dp={dp}; "
            f"use a batch that is a multiple of {dp * micro_batch}"
        )
    micro_batches = graph.batch_size // (dp * micro_batch)
    if schedule == "interleaved" and (virtual_stages < 2 or micro_batches % pp):
        raise PlanningError(
            f"the interleaved schedule needs virtual_stages >= 2 and micro-batches ({micro_batches}) divisible by pp={pp}"
        )
    chunks = virtual_stages if schedule == "interleaved" else 1
    if layers_per_stage is not None:
        check_layers_per_stage(layers_per_stage, sum(graph.blocks.values()), pp * chunks)
    warnings = []
    if cluster.is_homogeneous and tp > cluster.devices_per_node:
        warnings.append(f"tp={tp} spans nodes ({cluster.devices_per_node} devices each): its all-reduces cross the network")
    axes = tuple((name, size) for name, size in (("pp", pp), ("dp", dp), ("tp", tp)) if size > 1) or (("dp", 1),)
    mesh = Mesh(axes)
    strategies, inputs = megatron_layout(
        graph, mesh, sequence_parallel=sequence_parallel, virtual_stages=chunks, layers_per_stage=layers_per_stage
    )
    pipeline = PipelineConfig(stages=pp, schedule=schedule, micro_batches=micro_batches, virtual_stages=chunks,
                              blocking_p2p=blocking_p2p, partitioned_p2p=partitioned_p2p,
                              gradient_accumulation=gradient_accumulation,
                              overlap_grad_reduce=overlap_grad_reduce,
                              block_overhead_s=block_overhead_s,
                              deepspeed_checkpointing=tuple(deepspeed_checkpointing)) if pp > 1 else None
    plan = unsimulated_plan(
        graph, cluster, spec, model_name, mesh, strategies, inputs,
        dp_flavour=dp_flavour, recompute=recompute, pipeline=pipeline, precision=precision,
        warnings=tuple(warnings), label="megatron", fused_splits_local=fused_splits_local,
        tp_comm_overlap=tp_comm_overlap,
    )
    return simulated(plan, graph)


def megatron_baseline(graph, cluster, spec, model_name, precision, sequence_parallel: bool = False) -> Plan | None:
    """Megatron-LM on the widest tensor-parallel degree inside a node that the model's
    heads and widths split over (tp = devices per node, halved until it builds), with or
    without sequence parallelism, or None when Megatron's layout does not apply."""
    if not cluster.is_homogeneous:
        return None
    tp = cluster.devices_per_node
    while tp > 1:
        try:
            return megatron_plan(graph, cluster, spec, model_name, tp=tp, precision=precision, sequence_parallel=sequence_parallel)
        except PlanningError:
            tp //= 2
    return None
