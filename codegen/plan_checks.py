"""What ``compile`` checks of a plan against the model its spec builds, before writing code.

A plan file is data someone else may have written. Every name in it that the generated
program uses must name something real, or the program is refused with one line naming the
plan field (``codegen.source_text`` then decides how the name is written):

- mesh axis names are among the axes programs know (``dp``, ``tp``, ``pp``, and SUMMA's ``row``, ``col``, ``dep``);
- ``fsdp_units`` are modules of the model built from the spec (``named_modules``);
- ``inputs`` names the traced model's user inputs, in its order (``shard_batch`` maps
  positional arguments to them);
- each strategy's ``node`` is an op of the traced graph and its ``params`` are what that op
  reads;
- the numbers the program writes (batch, micro-batches, stages, parameter bytes) are ints;
- each of ``expert_layouts`` names an MoE layer of the model (``planner.moe_blocks``) with
  its experts, top-k and capacity factor, every MoE layer has one, and the layer holds no
  parameter besides its router and experts (the program replaces the whole module), and
  its all-to-all is one a program runs (not ``deduplicated``, which plans only price), and
  where the plan names the experts' kernels (``expert_implementation``) it is the one the
  program runs for that layer (``planner.expert_kernels.emitted_expert_kernel``).

And one check of meaning: a graph or pipeline program replays the traced ATen graph, so it
cannot run a backward the model defines itself (a custom ``torch.autograd.Function``, a
backward hook); the tracer records those (``OpGraph.opaque_backward``) and such a plan is
refused here, naming the module and the Function (data-parallel programs run the model's own
modules, so their backward runs as written).
"""

from __future__ import annotations

import dataclasses

import torch

from codegen.source_text import one_line
from planner.errors import PlanFileError, PlanningError
from planner.expert_kernels import COMPILED_EXPERT_KERNELS, TE_GROUPED_GEMM, emitted_expert_kernel
from planner.expert_layouts import COMPILED_ALL_TO_ALLS, FOLDED_DP_TP
from planner.families.moe_folding.section import folding_of
from planner.graph import OpGraph
from planner.moe_blocks import HF_STACKED_EXPERTS, find_moe_blocks
from planner.opaque_backward import describe
from planner.plan_checks import check_plan_against_graph
from planner.plans import Plan

KNOWN_AXES = ("dp", "tp", "pp", "row", "col", "dep")
PRECISIONS = ("fp32", "bf16", "fp16")  # what plans simulate; compile refuses fp16 with its own message


def checked_plan(plan: Plan, graph_program: bool) -> Plan:
    """``plan`` with its traced graph attached, once every name in it is checked against the
    model built from its spec (on the meta device) and that model's traced graph.

    Args:
        plan: a plan with a model spec.
        graph_program: whether the program replays the traced graph (graph and pipeline
            programs) rather than running the model's modules (data-parallel programs).

    Raises:
        PlanFileError: a field names something the model does not have (the message names
            the field).
        PlanningError: a graph program of a model whose backward it cannot reproduce.
    """
    from codegen.graph_facts import build_meta_model, trace_model

    check_fields(plan)
    model, args, kwargs = build_meta_model(plan)
    graph = plan.graph if plan.graph is not None and plan.graph.graph_module is not None else trace_model(model, args, kwargs)
    check_names(plan, model, graph)
    if plan.expert_layouts:
        check_expert_layouts(plan, model)
    if graph_program:
        check_backward_replayable(plan, graph)
    return dataclasses.replace(plan, graph=graph)


def check_fields(plan: Plan) -> None:
    """What can be checked from the plan alone: mesh axes, the precision and optimizer a
    program runs, and the numbers it writes. ``planner.compile`` runs this first, so a bad
    field is named before any other message quotes it."""
    from codegen.runtime.optimizers import OPTIMIZERS

    for index, name in enumerate(plan.mesh.names):
        if name not in KNOWN_AXES:
            raise PlanFileError(
                f"plan field 'mesh[{index}]' names axis {_shown(name)}; compiled programs know the axes "
                f"{', '.join(KNOWN_AXES)}: re-plan"
            )
    for field, value, known in (("precision", plan.precision, PRECISIONS), ("optimizer", plan.optimizer, tuple(OPTIMIZERS))):
        if value not in known:
            raise PlanFileError(f"plan field '{field}' is {_shown(value)}, not one of {', '.join(known)}; re-plan")
    if plan.fused_splits_local:
        raise PlanFileError(
            "plan field 'fused_splits_local' is true: it lays fused q|k|v and gate|up weights out per rank, as "
            "Megatron-LM does, which compiled programs do not (such plans simulate other systems' runs); re-plan "
            "with `planner plan` for a program"
        )
    if plan.tp_comm_overlap:
        raise PlanFileError(
            "plan field 'tp_comm_overlap' is true: it prices the sequence-parallel collectives as hidden behind "
            "GEMMs by Transformer Engine's userbuffers, which compiled programs do not run (such plans simulate "
            "other systems' runs); re-plan with `planner plan` for a program"
        )
    if plan.megatron_distributed_optimizer:
        raise PlanFileError(
            "plan field 'megatron_distributed_optimizer' is true: it prices gradients reduced once per step in fp32 "
            "and weights gathered during the next forward, as Megatron-Core does, which compiled programs do not "
            "run (such plans simulate other systems' runs); re-plan with `planner plan` for a program"
        )
    if plan.pipeline is not None and plan.pipeline.deepspeed_checkpointing:
        raise PlanFileError(
            f"plan field 'pipeline.deepspeed_checkpointing' lists {', '.join(plan.pipeline.deepspeed_checkpointing)}: "
            "it prices DeepSpeed's activation-checkpointing options, which compiled programs do not run (such plans "
            "simulate other systems' runs); re-plan with `planner plan` for a program"
        )
    if plan.half_precision_weights:
        raise PlanFileError(
            "plan field 'half_precision_weights' is true: it prices a model holding 16-bit weights and gradients, as "
            "Megatron-LM and DeepSpeed run them, where compiled programs keep fp32 weights under autocast (such "
            "plans simulate other systems' runs); re-plan with `planner plan` for a program"
        )
    if plan.optimizer_implementation:
        raise PlanFileError(
            f"plan field 'optimizer_implementation' is {_shown(plan.optimizer_implementation)}: it prices another "
            "system's AdamW, which compiled programs do not run (they step torch.optim's default AdamW, foreach on GPUs; such "
            "plans simulate other systems' runs); re-plan with `planner plan` for a program"
        )
    if plan.gradient_clipping:
        raise PlanFileError(
            f"plan field 'gradient_clipping' is {_shown(plan.gradient_clipping)}: it prices another system's gradient "
            "clipping, which compiled programs do not run as priced (they clip only when launched with "
            "--clip-grad-norm; such plans simulate other systems' runs); re-plan with `planner plan` for a program"
        )
    if plan.loss_implementation or plan.metric_cross_entropies:
        raise PlanFileError(
            f"plan field 'loss_implementation' is {_shown(plan.loss_implementation)} and 'metric_cross_entropies' "
            f"{plan.metric_cross_entropies}: they price another system's loss and training metrics, which compiled "
            "programs do not run (they compute one eager cross entropy; such plans simulate other systems' runs); "
            "re-plan with `planner plan` for a program"
        )
    if plan.expert_implementation == TE_GROUPED_GEMM:
        raise PlanFileError(
            f"plan field 'expert_implementation' is {_shown(plan.expert_implementation)}: it prices the experts' GEMMs as "
            "Transformer Engine's grouped GEMM runs them for Megatron-Core, which compiled programs do not run (such "
            "plans simulate other systems' runs); leave the field empty (the program's own kernels) or re-plan with "
            "`planner plan` for a program"
        )
    if plan.fused_chains:
        raise PlanFileError(
            f"plan field 'fused_chains' is {_shown(plan.fused_chains)}: it prices another system's fused norm "
            "and rotary kernels, which compiled programs do not run (they run the traced eager ops; such plans "
            "simulate other systems' runs); re-plan with `planner plan` for a program"
        )
    if plan.moe_a2a_overlap:
        raise PlanFileError(
            "plan field 'moe_a2a_overlap' is true: it prices each MoE layer's all-to-alls as hidden under another "
            "micro-batch's compute, as Megatron-Core's EP overlap and DualPipe run them, which compiled programs do "
            "not (such plans are simulated only); re-plan without --moe-dispatch overlapped to compile"
        )
    numbers = {"batch_size": plan.batch_size, "summary.parameter_bytes": plan.summary.parameter_bytes}
    if plan.pipeline is not None:
        for key in ("stages", "micro_batches", "virtual_stages"):
            numbers[f"pipeline.{key}"] = getattr(plan.pipeline, key)
    for field, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanFileError(f"plan field '{field}' must be an integer, got {type(value).__name__} {_shown(value)}; re-plan")


def check_names(plan: Plan, model: torch.nn.Module, graph: OpGraph) -> None:
    """Every module path, input name and parameter name of ``plan`` against ``model`` (built
    from the spec) and ``graph`` (traced from it)."""
    modules = dict(model.named_modules())
    for index, unit in enumerate(plan.fsdp_units):
        if not isinstance(unit, str) or not unit or unit not in modules:
            raise PlanFileError(
                f"plan field 'fsdp_units[{index}]' ({_shown(unit)}) is not a module of the model built from the spec "
                f"(the root is always a unit of its own); re-plan"
            )
    expected = [graph_input.name for graph_input in graph.inputs]
    for name in plan.inputs:
        if name not in expected:
            raise PlanFileError(
                f"plan field 'inputs' names {_shown(name)}, which is not an input of the model traced from the spec "
                f"(its inputs: {', '.join(expected)}); re-plan"
            )
    if list(plan.inputs) != expected:
        raise PlanFileError(
            f"plan field 'inputs' lists {', '.join(map(_shown, plan.inputs))} but the model traced from the spec takes "
            f"{', '.join(expected)}, in that order; re-plan"
        )
    if plan.recompute != "none":
        for path in graph.block_paths():  # what a recomputing program checkpoints, by path
            if path not in modules:
                raise PlanningError(f"repeated block '{one_line(path)}' of the traced model is not a module of the model")
    # Ops, their names and the parameters they read: the same checks compile runs first.
    check_plan_against_graph(plan, graph)


def check_expert_layouts(plan: Plan, model: torch.nn.Module) -> None:
    """Each expert layout against the MoE layers of ``model`` (see the module docstring)."""
    blocks = {block.module: block for block in find_moe_blocks(model)}
    known = ", ".join(blocks) or "none"
    modules = dict(model.named_modules())
    for index, layout in enumerate(plan.expert_layouts):
        field = f"expert_layouts[{index}]"
        block = blocks.get(layout.module)
        if block is None:
            raise PlanFileError(
                f"plan field '{field}.module' ({_shown(layout.module)}) is not an MoE layer of the model built from the "
                f"spec (its MoE layers: {known}); re-plan"
            )
        for name, planned, actual in (
            ("experts", layout.experts, block.experts),
            ("top_k", layout.top_k, block.top_k),
            ("capacity_factor", layout.capacity_factor, block.capacity_factor),
        ):
            if planned != actual:
                raise PlanFileError(
                    f"plan field '{field}.{name}' is {_shown(planned)} but layer {block.module!r} of the model has "
                    f"{actual}; re-plan for this model (or build the model with that {name})"
                )
        if layout.axis != (FOLDED_DP_TP if folding_of(plan) is not None else "dp"):
            raise PlanFileError(
                f"plan field '{field}.axis' is {_shown(layout.axis)}; compiled MoE layers run over the 'dp' axis; re-plan"
            )
        if layout.all_to_all not in COMPILED_ALL_TO_ALLS:
            raise PlanFileError(
                f"plan field '{field}.all_to_all' is {_shown(layout.all_to_all)} (DeepEP's deduplicated dispatch), which "
                f"plans price but compiled programs do not run; set it to 'flat' or 'hierarchical', or re-plan without "
                f"--moe-dispatch deduplicated"
            )
        emitted = emitted_expert_kernel(block.runtime, layout.mode)
        if plan.expert_implementation in COMPILED_EXPERT_KERNELS and plan.expert_implementation != emitted:
            raise PlanFileError(
                f"plan field 'expert_implementation' is {_shown(plan.expert_implementation)} but the compiled program "
                f"runs the experts of layer {block.module!r} ({layout.mode.replace('_', ' ')}) as {emitted!r}; leave "
                f"the field empty (each layer's own kernels) and simulate the plan again"
            )
        if block.runtime == HF_STACKED_EXPERTS:
            continue  # only its experts are replaced: its router and shared experts run as written
        owned = {block.router, *block.expert_weights}
        extra = [name for name, _ in modules[block.module].named_parameters() if name not in owned]
        if extra:
            raise PlanningError(
                f"MoE layer {block.module!r} has parameters besides its router and experts ({', '.join(extra[:3])}), "
                f"which the compiled layer would not run; plan it without expert layouts"
            )
    planned = {layout.module for layout in plan.expert_layouts}
    missing = [module for module in blocks if module not in planned]
    if missing:
        raise PlanFileError(
            f"plan field 'expert_layouts' has no layout for the model's MoE layer {missing[0]!r} (each MoE layer needs "
            f"one: its routing couples the whole batch); re-plan"
        )


def check_backward_replayable(plan: Plan, graph: OpGraph) -> None:
    """Refuse a graph or pipeline program of a model with a backward of its own (see the
    module docstring)."""
    found = list(getattr(graph, "opaque_backward", ()) or ())
    if found:
        raise PlanningError(
            f"{plan.name} cannot be compiled: {describe(found)}, whose backward a graph program cannot reproduce (it "
            f"replays the traced ATen ops, so gradients would be wrong); plan it with --search dp: data-parallel "
            f"programs run the model as written"
        )


def _shown(value: object) -> str:
    """A plan value for an error message: its repr, one line, at most 80 characters."""
    text = one_line(repr(value))
    return text if len(text) <= 80 else text[:77] + "..."
