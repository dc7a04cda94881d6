"""The public API: ``plan``, ``compile``, ``load_plan``.

This module, with ``planner.cli``, ``planner.compare`` and ``planner.baselines`` (the API of
``compare``/``calibrate`` and of the baseline layouts), is the part of ``planner`` that imports
the layers below it (``search``, ``cost_model``, ``codegen``); the vocabulary modules import
none of them (``tests/test_import_layering.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from planner import arguments
from planner.cluster import Cluster
from planner.constraints import ConstraintError, SearchConstraints
from planner.errors import ArgumentError, ClusterError, PlanningError, SpecError
from planner.expert_layouts import COMPILED_ALL_TO_ALLS, MOE_DISPATCHES
from planner.fingerprint import example_batch_size
from planner.model_checks import (
    check_no_empty_inputs,
    check_trainable,
    model_warnings,
    split_inputs,
    uncounted_op_warnings,
    unknown_op_warnings,
)
from planner.model_spec import ModelSpec, announce_import
from planner.opaque_backward import describe as describe_opaque_backward
from planner.outputs import check_program_folder
from planner.plan_checks import check_model_matches, check_plan_against_graph, check_plan_against_inputs
from planner.plans import Plan, load_plan
from planner.routing import read_routing_option, routing_for_layers
from planner.shared_cluster import check_same_cluster, load_co_runner
from planner.strategy import DP_FLAVOURS, DUALPIPE, KEEP_A2A, SimResult
from planner.trace import trace

__all__ = ["plan", "simulate", "compile", "load_plan"]

# Seed used whenever the planner builds a model from its spec, so every rank of a compiled
# program and the single-device reference start from the same weights.
BUILD_SEED = 0
SEARCHES = ("auto", "ilp", "mcmc", "dp")


def plan(
    model: torch.nn.Module | ModelSpec | str,
    cluster: Cluster | str,
    example_inputs: tuple | dict | None = None,
    *,
    spec: ModelSpec | str | None = None,
    dp_flavour: str | None = None,
    precision: str = "auto",
    search: str = "auto",
    effort: float = 1.0,
    time_budget_s: float | None = 600.0,
    seed: int = 0,
    progress: bool = True,
    routing: Any = None,
    tp_layouts: str = "auto",
    constraints: Any = None,
    moe_dispatch: str = "compiled",
    co_runner: Plan | str | os.PathLike | None = None,
) -> Plan:
    """Find how to train ``model`` on ``cluster``.

    Args:
        model: an ``nn.Module`` (with ``example_inputs``), or a model spec such as
            ``"examples/gpt.py:build"`` or ``"hf:gpt2"`` (built on the meta device: no
            weights are allocated).
        cluster: a ``Cluster``, a preset string (``"dgx-a100-80g:4"``, ``"cpu:1x4"``) or a
            cluster file path.
        example_inputs: one step's global batch for a module: a tuple of positional
            inputs, or a dict of keyword inputs. Dim 0 of each tensor is the batch.
        spec: for a module, the spec it can be rebuilt from inside torchrun; without one
            the plan can be reported and simulated but not compiled.
        dp_flavour: force a data-parallel flavour: ``"ddp"``, ``"zero1"`` (optimizer states
            sharded), ``"zero2"`` (and gradients) or ``"fsdp"`` (and weights); by default the
            fastest that fits.
        precision: ``"fp32"``, or mixed ``"bf16"``/``"fp16"`` (fp32 master weights); bf16
            plans compile to programs that run forward under bf16 autocast, fp16 plans
            (which need loss scaling) are simulated only. ``"auto"`` (the default) is bf16
            on a GPU cluster whose devices have bf16 tensor cores (A100, H100), else fp32.
        search: ``"auto"`` (CP-SAT per mesh, then MCMC refinement), ``"ilp"`` (CP-SAT),
            ``"mcmc"`` (Metropolis-Hastings over the simulator), or ``"dp"`` (data
            parallelism only: DDP, ZeRO-1, ZeRO-2 or FSDP). ``dp_flavour`` implies ``"dp"``.
            A model whose backward is its own (a custom ``torch.autograd.Function``, a
            backward hook: ``OpGraph.opaque_backward``) is always planned with ``"dp"``, and
            the plan's warnings say which module and why.
        effort: how much work the search does, a positive number (1 is the default; 0.25
            is quick, 4 thorough). Budgets count work (CP-SAT's deterministic time, MCMC
            proposals), not seconds, so the same model, cluster, seed and effort give the
            same plan on any machine.
        time_budget_s: a wall-clock safety cap on the whole call, tracing included, a
            positive finite number of seconds (``None``: no cap). It does not decide the
            plan unless it cuts the search short, and then the plan's warnings say so.
        seed: seed of the MCMC search, an int >= 0.
        progress: show a progress bar on stderr (a terminal only) for searches over a second.
        routing: routing statistics of the model's Mixture-of-Experts layers, from which
            each layer's layout (expert parallel, data parallel, expert-sliced; placement;
            all-to-all) is chosen: None (uniform), ``"uniform"``, ``"zipf:ALPHA"`` (a few
            hot experts, e.g. ``"zipf:1.2"``), the path of a statistics file
            (``planner.routing``; layers it does not cover are uniform) or a
            ``RoutingStats``. The plan records the source and each layer's loads.
        tp_layouts: the tensor-parallel layouts of matmul-like ops: ``"auto"`` (1-D and
            2-D/2.5-D/3-D SUMMA layouts compete, SUMMA meshes only where they can matter),
            ``"summa"`` (SUMMA layouts wherever the mesh allows them, SUMMA meshes only) or
            ``"1d"`` (Megatron-style 1-D splits only); see ``search.summa_meshes``.
        constraints: what the search may choose (``planner.constraints``): None, a
            ``SearchConstraints`` or a dict such as ``{"mesh": {"tp": 8}, "max": {"pp": 4},
            "families": ["fsdp", "tp", "pipeline"]}`` (axis sizes fixed, axis sizes bounded,
            the families that may compete: ``planner.families``). Impossible constraints
            raise ``ConstraintError`` naming the constraint; the report says which applied.
        moe_dispatch: the all-to-alls expert-parallel MoE layers may use: ``"compiled"``
            (flat or two-level, what compiled programs run) or ``"deduplicated"`` (DeepEP's
            too, each token across nodes once per destination node: for a trainer that runs
            it; such plans are simulated, not compiled). See ``cost_model.all_to_all``.
            ``"overlapped"``: DeepEP's too, and each MoE layer's all-to-alls run under
            another micro-batch's compute where that is faster and fits
            (``Plan.moe_a2a_overlap``, ``cost_model.moe_overlap``; simulated, not compiled).
        co_runner: a job that will share the devices (a ``Plan`` or a saved plan's path,
            for the same cluster): the plan chosen is the one with the shortest round
            co-located with it (``search.beside``), among those fitting beside it on every
            device, and the search summary compares it with the plan fastest alone.

    Returns:
        The chosen ``Plan``; ``plan.report()`` explains it.

    Raises:
        PlannerError: a subclass naming the problem (argument, trace, cluster, spec,
            planning), raised before any tracing when an argument is wrong.
    """
    from search.budget import SearchBudget
    from search.data_parallel import plan_data_parallel

    precision = arguments.one_of(precision, PRECISIONS, "precision")
    search = arguments.one_of(search, SEARCHES, "search")
    dp_flavour = arguments.one_of(dp_flavour, DP_FLAVOURS, "dp_flavour", optional=True)
    if dp_flavour is not None and search not in ("auto", "dp"):
        raise ArgumentError(
            f"dp_flavour={dp_flavour!r} forces a data-parallel plan, which search={search!r} does not make; "
            f"drop one of them (dp_flavour implies search='dp')"
        )
    effort = arguments.positive_finite(effort, "effort")
    if time_budget_s is not None:
        time_budget_s = arguments.positive_finite(time_budget_s, "time_budget_s", "seconds")
    seed = arguments.integer_at_least(seed, "seed", 0)
    tp_layouts = arguments.one_of(tp_layouts, ("auto", "summa", "1d"), "tp_layouts")
    moe_dispatch = arguments.one_of(moe_dispatch, MOE_DISPATCHES, "moe_dispatch")
    if tp_layouts == "summa" and (search == "dp" or dp_flavour is not None):
        raise ArgumentError(
            "tp_layouts='summa' asks for tensor-parallel layouts, which a data-parallel plan (search='dp' or a "
            "dp_flavour) does not have; drop one of them"
        )
    arguments.boolean(progress, "progress")
    constraints = SearchConstraints.coerce(constraints)
    if isinstance(cluster, Cluster):
        constraints.check_cluster(cluster)
    routing_option = read_routing_option(routing)
    beside = load_co_runner(co_runner) if co_runner is not None else None
    budget = SearchBudget(effort=effort, wall_clock_cap_s=time_budget_s)
    with _progress_bar(enabled=progress) as on_progress:
        tracing = None
        if on_progress:
            on_progress("tracing the model on meta tensors", 0.0)
            tracing = lambda what, fraction: on_progress(what, TRACE_SHARE * fraction)  # noqa: E731
        graph, spec, name, cluster = prepare_model(model, cluster, example_inputs, spec, on_progress=tracing)
        traced_s = time.perf_counter() - budget.started
        precision = default_precision(cluster) if precision == "auto" else precision
        warnings = graph_warnings(graph)
        routing_stats = routing_for_layers(routing_option, {b.module: (b.experts, b.top_k) for b in graph.moe_blocks})
        if routing is not None and not graph.moe_blocks:
            warnings += ("routing statistics were given but the model has no Mixture-of-Experts layer this planner "
                         "recognises (planner.moe_blocks): they were not used",)
        if search != "dp" and dp_flavour is None and graph.opaque_backward:
            # Only programs that run the model's own modules keep a backward the model defines.
            warnings += (
                f"{describe_opaque_backward(graph.opaque_backward)}, whose backward is not the autograd of its "
                f"forward: tensor- and pipeline-parallel programs replay the traced ops and would lose it, so this "
                f"model is planned with data parallelism only (DDP, ZeRO and FSDP run the model as written)",
            )
            search = "dp"
        constraints.check_cluster(cluster)
        if beside is not None:  # the search's context (cost_model.colocation), named by its file if given one
            from cost_model.colocation import co_runner_context

            name = beside.name if isinstance(co_runner, Plan) else str(co_runner)
            check_same_cluster([name, f"the job being planned ({cluster.name})"], [beside.cluster, cluster])
            beside = co_runner_context(name, beside, simulate(beside), cluster)
        if search == "dp" or dp_flavour is not None:
            _refuse_slices_of_a_coupled_batch(graph)
            chosen = plan_data_parallel(
                graph, cluster, spec, model_name=name, dp_flavour=dp_flavour, warnings=warnings,
                precision=precision, flavours=data_parallel_flavours(constraints, cluster, dp_flavour),
                co_runner=beside,
            )
            if constraints.any:
                chosen = dataclasses.replace(chosen, search_summary=f"constrained by {constraints.describe()}; "
                                             f"{chosen.search_summary}")
        else:
            from search.auto import search_plan

            searching = None
            if on_progress:
                searching = lambda what, fraction: on_progress(what, TRACE_SHARE + (1 - TRACE_SHARE) * fraction)  # noqa: E731
            chosen = search_plan(
                graph, cluster, spec, name, search=search, budget=budget, seed=seed,
                warnings=warnings, precision=precision, on_progress=searching, routing=routing_stats,
                tp_layouts=tp_layouts, constraints=constraints, moe_dispatch=moe_dispatch, co_runner=beside,
            )
    chosen = _with_host_bound_warning(chosen)
    total_s = time.perf_counter() - budget.started
    return dataclasses.replace(chosen, timings={"trace_s": traced_s, "search_s": total_s - traced_s, "total_s": total_s})


# Share of the step waiting for the host above which the plan says so.
HOST_BOUND_SHARE = 0.1


def _with_host_bound_warning(chosen: Plan) -> Plan:
    """``chosen`` with a warning when its GPUs would wait for the host much of the step
    (``SimResult.host_wait_s``): a model too small for its GPUs, where no layout helps much."""
    estimate = chosen.estimate
    if estimate.step_time_s <= 0 or estimate.host_wait_s <= HOST_BOUND_SHARE * estimate.step_time_s:
        return chosen
    share = estimate.host_wait_s / estimate.step_time_s
    return dataclasses.replace(chosen, warnings=tuple(chosen.warnings) + (
        f"the GPUs wait for the host {share:.0%} of the step: this model's kernels are shorter than the time PyTorch "
        f"takes to issue them; larger micro-batches, fewer devices, or compiled kernels (torch.compile, CUDA graphs) "
        f"would keep them busier",
    ))


def data_parallel_flavours(constraints: SearchConstraints, cluster: Cluster, forced: str | None) -> tuple[str, ...]:
    """The flavours a data-parallel plan (``search="dp"``, ``dp_flavour``) may use under
    ``constraints``; ``ConstraintError`` when they allow none, or refuse the all-``dp`` mesh."""
    world = cluster.world_size
    if not constraints.allows_sizes({"dp": world}):
        raise ConstraintError(
            f"a data-parallel plan (search='dp' or dp_flavour) makes every one of the {world} devices a dp rank, which "
            f"{constraints.describe()} does not allow; drop one of them"
        )
    allowed = tuple(f for f in DP_FLAVOURS if constraints.allows_family(f) and (forced is None or f == forced))
    if world > 1 and not allowed:
        raise ConstraintError(
            f"{'dp_flavour ' + repr(forced) if forced else 'a data-parallel plan'} is not among the families "
            f"{constraints.describe()} allows; drop one of them"
        )
    return allowed or DP_FLAVOURS


def _refuse_slices_of_a_coupled_batch(graph) -> None:
    """Data-parallel wrappers run the model on each rank's slice of the batch: refuse them,
    in one line, for a model whose samples mix (``search.batch_coupling``)."""
    from search.batch_coupling import batch_coupled_ops, coupled_modules

    coupled = batch_coupled_ops(graph)
    if not coupled:
        return
    modules = ", ".join(coupled_modules(coupled))
    why = "its backward is the model's own, which only data parallelism keeps, but " if graph.opaque_backward else ""
    raise PlanningError(
        f"{why}the model mixes the samples of its batch in {modules}, so data parallelism (each rank running the "
        f"model on its slice of the batch) would compute a different step; plan it without --dp / search='dp' "
        f"(the search then keeps to programs over the whole batch)"
    )


PRECISIONS = ("auto", "fp32", "bf16", "fp16")
# The progress bar's share of a plan() call that tracing takes (the search takes the rest).
TRACE_SHARE = 0.15


def default_precision(cluster: Cluster) -> str:
    """What ``precision="auto"`` means on ``cluster``: bf16 mixed precision on GPUs that have
    bf16 tensor cores (how such clusters train), else fp32 (CPU processes, V100s)."""
    devices = {cluster.device_of(rank).name: cluster.device_of(rank) for rank in range(cluster.world_size)}
    if cluster.backend == "nccl" and all("bfloat16" in device.peak_flops for device in devices.values()):
        return "bf16"
    return "fp32"


def simulate(plan: Plan | str | os.PathLike) -> SimResult:
    """Simulate one training step of ``plan`` (see ``cost_model.simulator``).

    Args:
        plan: a ``Plan``, or the path of a plan saved by ``Plan.save`` / ``planner plan -o``.

    A plan made in this process reuses its traced graph; a plan loaded from JSON rebuilds
    its model from its spec on meta tensors, checks that it is still the planned model
    (``planner.plan_checks``), and traces it.

    Raises:
        PlannerError: the plan file is bad, its spec now builds another model, or its
            strategies do not fit the traced model (the message names the field).
    """
    from cost_model.simulator import simulate_plan

    plan = _plan_argument(plan, "simulate")
    graph = plan.graph
    if graph is None:
        if plan.model is None:
            raise PlanningError("this plan has no model spec, so its model cannot be traced again to simulate it")
        announce_import(plan.model, "model.source of the plan being simulated")
        graph = trace(*build_planned_model(plan))
    check_plan_against_graph(plan, graph)
    return simulate_plan(plan, graph)


def build_planned_model(plan: Plan) -> tuple[torch.nn.Module, tuple, dict]:
    """Build ``plan``'s model on meta tensors from its spec (with the seed every rank uses)
    and check it is the model that was planned.

    Raises:
        PlanFileError: the spec now builds a different model (``check_model_matches``).
        SpecError: the spec cannot be built (model file gone, bad overrides).
    """
    torch.manual_seed(BUILD_SEED)
    model, args, kwargs = plan.model.build("meta")
    check_model_matches(plan, model, args, kwargs)
    return model, args, kwargs


def prepare_model(model, cluster, example_inputs=None, spec=None, on_progress=None):
    """Trace a module or spec on meta tensors: returns ``(graph, spec, model name, cluster)``.
    ``on_progress(what, fraction)`` follows the tracing (see ``planner.trace.trace``).

    Raises:
        PlannerError: a wrong argument type, a spec that cannot be built, a model with
            nothing to train, or a model that cannot be traced.
    """
    cluster = _cluster_argument(cluster)
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if isinstance(model, (str, ModelSpec)):
        if example_inputs is not None or spec is not None:
            raise ArgumentError(
                f"{'example_inputs' if example_inputs is not None else 'spec'} is only for a model passed as an "
                f"nn.Module; a spec such as {str(model)!r} builds its own model and example batch, drop it"
            )
        spec = ModelSpec(model, {}) if isinstance(model, str) else model
        spec = spec.resolved()
        torch.manual_seed(BUILD_SEED)
        model, args, kwargs = spec.build("meta")
    else:
        if not isinstance(model, torch.nn.Module):
            raise SpecError(
                f"expected an nn.Module, a model spec string ('file.py:build', 'hf:gpt2') or a ModelSpec, "
                f"got {type(model).__name__}"
            )
        if example_inputs is None:
            raise SpecError("example_inputs (one global batch) are needed when planning an nn.Module")
        args, kwargs = split_inputs(example_inputs)
        if isinstance(spec, os.PathLike):
            spec = os.fspath(spec)
        if isinstance(spec, str):
            spec = ModelSpec(spec, {})
        if spec is not None and not isinstance(spec, ModelSpec):
            raise ArgumentError(
                f"spec must be a model spec string ('file.py:build') or a ModelSpec, got {type(spec).__name__}"
            )
        spec = spec.resolved() if spec is not None else None
    check_trainable(model)
    batch = example_batch_size(args, kwargs)
    if batch is None:
        shown = ", ".join(type(value).__name__ for value in (*args, *kwargs.values())) or "nothing"
        raise SpecError(
            f"the example inputs ({shown}) hold no tensor with a batch dimension; pass one global batch: a tuple or "
            f"dict of tensors whose dim 0 is the batch, e.g. example_inputs=(x, y)"
        )
    if batch == 0:
        raise PlanningError(
            "the example batch is empty (dim 0 of the first tensor input is 0); give one global batch of at least "
            "one sample per device, e.g. --set batch_size=8"
        )
    check_no_empty_inputs(args, kwargs)
    graph = trace(model, args, kwargs, on_progress=on_progress)
    from search.rules import unknown_ops  # imported where used, as plan() imports search

    graph.warnings = model_warnings(model) + unknown_op_warnings(unknown_ops(graph)) + uncounted_op_warnings(graph)
    return graph, spec, type(model).__name__, cluster


def graph_warnings(graph) -> tuple[str, ...]:
    return tuple(getattr(graph, "warnings", ()))


def compile(plan: Plan | str | os.PathLike, out_dir: str | os.PathLike, *, force: bool = False) -> Path:  # noqa: A001
    """Write the per-rank program of ``plan`` to ``out_dir``.

    Writes ``model_spmd.py`` (the readable per-rank module), ``plan.json`` and
    ``launch.py`` (run it with ``torchrun --nproc_per_node N out/launch.py --check``), all
    at once: they are staged in a temporary folder and moved into ``out_dir`` only when
    every one was written (``planner.outputs``). Compiling builds the model from the plan's
    spec, so it imports the model file the plan names: its absolute path is printed on
    stderr first. Every name in the plan is checked against that model, and plan text
    enters the program only as data (``codegen.source_text``).

    Args:
        plan: a ``Plan``, or the path of a plan saved by ``Plan.save`` / ``planner plan -o``.
        out_dir: the program folder, created if missing. A folder that ``compile`` wrote
            before is replaced; a non-empty folder it did not write is refused.
        force: write the program's files into a non-empty folder ``compile`` did not
            write (its other files are kept).

    Returns:
        The output folder.

    Raises:
        PlannerError: a bad argument or output folder (checked before any work), a plan
            that cannot be compiled, or a plan that does not fit the model its spec builds.
    """
    from codegen.emit import write_program
    from codegen.plan_checks import check_fields

    plan = _plan_argument(plan, "compile")
    out_dir = check_program_folder(out_dir, force=arguments.boolean(force, "force"))
    if plan.model is not None:
        check_fields(plan)  # axes, precision, optimizer, numbers: named before any message below quotes them
    blocker = compile_blocker(plan)
    if blocker:
        raise PlanningError(blocker)
    announce_import(plan.model, "model.source of the plan being compiled")
    model, args, kwargs = build_planned_model(plan)
    check_plan_against_inputs(plan, args, kwargs)
    # Trace once here, check every strategy against the graph, and let codegen reuse it
    # (its name checks, graph and pipeline programs, recomputed blocks all read it).
    graph = plan.graph if plan.graph is not None and plan.graph.graph_module is not None else trace(model, args, kwargs)
    check_plan_against_graph(plan, graph)
    return write_program(dataclasses.replace(plan, graph=graph), out_dir, force=force)


def compile_colocated(plans, out_dir: str | os.PathLike, *, force: bool = False) -> Path:
    """Write the co-located program of two data-parallel plans (``ddp`` or ``zero1``, the same
    world size) to ``out_dir``: each job's own program in ``job_a/`` and ``job_b/`` (as
    ``compile`` writes it) and a ``launch.py`` that trains both in each process, one job's
    gradient all-reduces under the other's compute (``codegen.colocate``).

    Raises:
        PlannerError: a bad argument or output folder, or plans that cannot share a program.
    """
    from codegen.colocate import write_colocated_program

    if isinstance(plans, (str, os.PathLike, Plan)):
        raise ArgumentError("compile_colocated takes a list of two plans (or plan files), one per job")
    out_dir = check_program_folder(out_dir, force=arguments.boolean(force, "force"))
    loaded = [_plan_argument(plan, "compile_colocated") for plan in plans]
    return write_colocated_program(loaded, out_dir, compile, force=force)


def composed_flavour_blocker(plan: Plan) -> str | None:
    """Why a plan with ``dp`` beside other axes cannot compile its data-parallel flavour, or
    None. ZeRO-1 steps each rank's 1/dp of the weights (``codegen.runtime.sharded_states``).
    ZeRO-2 and FSDP hold weights split over ``dp`` between uses and gather them where they
    are read: every micro-batch gathers its own copy, which autograd keeps until backward, so
    ZeRO-2 does not compose with pipelines; FSDP frees them after forward only where backward
    re-runs the forward (recomputed blocks), so FSDP needs ``recompute='full'`` there."""
    if plan.dp_flavour == "zero2" and plan.pipeline is not None:
        return (
            "ZeRO-2 beside pipeline parallelism would keep a gathered copy of the stage's weights for every "
            "micro-batch in flight; plan with dp_flavour zero1, or fsdp with recompute full"
        )
    stages = plan.pipeline.stages * plan.pipeline.virtual_stages if plan.pipeline is not None else 1
    if plan.dp_flavour == "fsdp" and any(plan.recompute_at(stage) != "full" for stage in range(stages)):
        return (
            "FSDP beside tensor or pipeline parallelism frees gathered weights after forward only in recomputed "
            "blocks, so it compiles with recompute 'full'; plan with recompute full, or use dp_flavour zero2"
        )
    return None


def compile_blocker(plan: Plan) -> str | None:
    """Why ``compile`` would refuse ``plan`` (one line naming the fix), or None when it compiles."""
    if plan.model is None:
        return (
            "this plan has no model spec, so torchrun cannot rebuild the model; plan from a spec "
            "(planner.plan('file.py:build', ...)) or pass spec= to planner.plan"
        )
    if plan.pipeline is not None and plan.pipeline.schedule == DUALPIPE:
        return (f"{plan.name} cannot be compiled: its pipeline runs DeepSeek-V3's DualPipe schedule, which is "
                f"simulated only (planner simulate prices it); plan with --max pp=1 to compile")
    if plan.pipeline is not None:
        from codegen.pipeline_emit import unsupported
        from codegen.uneven_width_emit import unsupported as uneven_width_unsupported  # stages of different widths

        reason = unsupported(plan)
        if reason:
            return f"{plan.name} cannot be compiled: {reason} (planner simulate still prices it)"
        reason = uneven_width_unsupported(plan)
        if reason:
            return f"{plan.name} cannot be compiled: {reason}"
    from planner.program_shape import is_data_parallel

    dp = plan.mesh.axis_size("dp") if "dp" in plan.mesh.names else 1
    if not is_data_parallel(plan) and dp > 1:
        reason = composed_flavour_blocker(plan)
        if reason:
            return f"{plan.name} cannot be compiled: {reason}"
    if plan.recompute == KEEP_A2A and not plan.expert_layouts:
        return (
            f"this plan recomputes blocks keeping their MoE layers' exchanges ({KEEP_A2A}) but has no MoE layer; "
            f"plan again, or use recompute='full'"
        )
    if plan.recompute not in ("none", "full", "selective", KEEP_A2A):
        return (
            f"this plan recomputes activations ({plan.recompute}), which is not compiled (compiled programs recompute "
            f"whole blocks or attention cores); plan again, or use recompute='full' or 'selective'"
        )
    if plan.precision not in ("fp32", "bf16"):
        return (
            f"this plan simulates {plan.precision} mixed precision, which needs loss scaling and is not compiled; "
            f"plan with --precision bf16 (or fp32) to compile it"
        )
    priced_only = [layout.module for layout in plan.expert_layouts if layout.all_to_all not in COMPILED_ALL_TO_ALLS]
    if priced_only:
        return (
            f"MoE layer {priced_only[0]!r} uses DeepEP's deduplicated all-to-all, which compiled programs do not run "
            f"(planner simulate still prices it); plan without --moe-dispatch deduplicated to compile"
        )
    if plan.moe_a2a_overlap:
        return ("this plan runs each MoE layer's all-to-alls under another micro-batch's compute (Megatron-Core's EP "
                "overlap), which compiled programs do not (planner simulate still prices it); plan without "
                "--moe-dispatch overlapped to compile")
    return None


@contextlib.contextmanager
def _progress_bar(enabled: bool):
    """A transient rich progress bar on stderr (terminals only) for tracing and search."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), transient=True, console=Console(stderr=True)
    ) as bar:
        task = bar.add_task("planning", total=1.0)
        yield lambda what, fraction: bar.update(task, description=what, completed=fraction)


def _plan_argument(plan: Any, verb: str) -> Plan:
    """A ``Plan``, or one loaded from the path of a saved plan."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return load_plan(plan)
    raise ArgumentError(
        f"{verb} takes a Plan or the path of a saved plan (str or pathlib.Path), got {type(plan).__name__}"
    )


def _cluster_argument(cluster: Any) -> Cluster:
    """A ``Cluster``, or one parsed from a preset string or cluster file path."""
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, (str, os.PathLike)):
        return Cluster.parse(cluster)
    raise ClusterError(
        f"cluster must be a Cluster, a preset such as 'cpu:1x2' or 'dgx-a100-80g:2', or the path of a cluster "
        f"file, got {type(cluster).__name__}"
    )
