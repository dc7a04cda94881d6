"""The public API: ``plan``, ``compile``, ``load_plan``.

This module (with ``planner.cli``) is the only part of ``planner`` that imports the layers
below it (``search``, ``cost_model``, ``codegen``); the vocabulary modules import none of them.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from planner.cluster import Cluster
from planner.errors import PlanningError, SpecError
from planner.model_spec import ModelSpec
from planner.plans import Plan, load_plan
from planner.strategy import SimResult
from planner.trace import trace

__all__ = ["plan", "simulate", "compile", "load_plan"]

# Seed used whenever the planner builds a model from its spec, so every rank of a compiled
# program and the single-device reference start from the same weights.
BUILD_SEED = 0


def plan(
    model: torch.nn.Module | ModelSpec | str,
    cluster: Cluster | str,
    example_inputs: tuple | dict | None = None,
    *,
    spec: ModelSpec | str | None = None,
    dp_flavour: str | None = None,
    precision: str = "fp32",
    search: str = "auto",
    time_budget_s: float = 30.0,
    seed: int = 0,
    progress: bool = True,
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
            (which need loss scaling) are simulated only.
        search: ``"auto"`` (CP-SAT per mesh, then MCMC refinement), ``"ilp"`` (CP-SAT),
            ``"mcmc"`` (Metropolis-Hastings over the simulator), or ``"dp"`` (data
            parallelism only: DDP, ZeRO-1, ZeRO-2 or FSDP). ``dp_flavour`` implies ``"dp"``.
        time_budget_s: wall-clock budget of the search; the best plan found so far is
            returned when it runs out.
        seed: seed of the MCMC search (deterministic for a seed and iteration count).
        progress: show a progress bar on stderr (a terminal only) for searches over a second.

    Returns:
        The chosen ``Plan``; ``plan.report()`` explains it.

    Raises:
        PlannerError: a subclass naming the problem (trace, cluster, spec, planning).
    """
    from search.data_parallel import plan_data_parallel

    if precision not in ("fp32", "bf16", "fp16"):
        raise PlanningError(f"precision must be fp32, bf16 or fp16, got '{precision}'")
    with _progress_bar(enabled=progress) as on_progress:
        if on_progress:
            on_progress("tracing the model on meta tensors", 0.0)
        graph, spec, name, cluster = prepare_model(model, cluster, example_inputs, spec)
        if search == "dp" or dp_flavour is not None:
            return plan_data_parallel(
                graph, cluster, spec, model_name=name, dp_flavour=dp_flavour, warnings=graph_warnings(graph),
                precision=precision,
            )
        from search.auto import search_plan

        return search_plan(
            graph, cluster, spec, name, search=search, time_budget_s=time_budget_s, seed=seed,
            warnings=graph_warnings(graph), precision=precision, on_progress=on_progress,
        )


def simulate(plan: Plan) -> SimResult:
    """Simulate one training step of ``plan`` (see ``cost_model.simulator``).

    A plan made in this process reuses its traced graph; a plan loaded from JSON re-traces
    its model spec on meta tensors first.
    """
    from cost_model.simulator import simulate_plan

    graph = plan.graph
    if graph is None:
        if plan.model is None:
            raise PlanningError("this plan has no model spec, so its model cannot be traced again to simulate it")
        graph, _, _, _ = prepare_model(plan.model, plan.cluster, None, None)
    return simulate_plan(plan, graph)


def prepare_model(model, cluster, example_inputs=None, spec=None):
    """Trace a module or spec on meta tensors: returns ``(graph, spec, model name, cluster)``."""
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    if isinstance(model, (str, ModelSpec)):
        spec = ModelSpec(model, {}) if isinstance(model, str) else model
        spec = spec.resolved()
        torch.manual_seed(BUILD_SEED)
        model, args, kwargs = spec.build("meta")
    else:
        if not isinstance(model, torch.nn.Module):
            raise SpecError(f"expected an nn.Module or a model spec string, got {type(model).__name__}")
        if example_inputs is None:
            raise SpecError("example_inputs (one global batch) are needed when planning an nn.Module")
        args, kwargs = _split_inputs(example_inputs)
        if isinstance(spec, str):
            spec = ModelSpec(spec, {})
        spec = spec.resolved() if spec is not None else None
    graph = trace(model, args, kwargs)
    graph.warnings = _model_warnings(model)
    return graph, spec, type(model).__name__, cluster


def graph_warnings(graph) -> tuple[str, ...]:
    return tuple(getattr(graph, "warnings", ()))


def compile(plan: Plan, out_dir: str | Path) -> Path:  # noqa: A001 - the verb users expect
    """Write the per-rank program of ``plan`` to ``out_dir``.

    Writes ``model_spmd.py`` (the readable per-rank module), ``plan.json`` and
    ``launch.py`` (run it with ``torchrun --nproc_per_node N out/launch.py --check``).

    Returns:
        The output folder.
    """
    from codegen.emit import write_program

    if plan.model is None:
        raise PlanningError(
            "this plan has no model spec, so torchrun cannot rebuild the model; plan from a spec "
            "(planner.plan('file.py:build', ...)) or pass spec= to planner.plan"
        )
    if plan.pipeline is not None:
        from codegen.pipeline_emit import unsupported

        reason = unsupported(plan)
        if reason:
            raise PlanningError(f"{plan.name} cannot be compiled: {reason} (planner simulate still prices it)")
    from codegen.emit import is_data_parallel

    dp = plan.mesh.axis_size("dp") if "dp" in plan.mesh.names else 1
    if not is_data_parallel(plan) and plan.dp_flavour != "ddp" and dp > 1:
        raise PlanningError(
            f"{plan.name} shards weights over dp ({plan.dp_flavour}) beside other parallelism; compiled programs of "
            f"such meshes keep weights whole over dp (DDP-style), so it is not compiled yet; use dp_flavour 'ddp' on "
            f"this mesh (as the search's plans do), or a data-parallel-only plan"
        )
    if plan.recompute not in ("none", "full"):
        raise PlanningError(
            f"this plan recomputes activations ({plan.recompute}), which is simulated but not compiled yet "
            f"(compiled programs recompute whole blocks); plan again, or use recompute='full'"
        )
    if plan.precision not in ("fp32", "bf16"):
        raise PlanningError(
            f"this plan simulates {plan.precision} mixed precision, which needs loss scaling and is not compiled; "
            f"plan with --precision bf16 (or fp32) to compile it"
        )
    return write_program(plan, Path(out_dir))


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


def _split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _model_warnings(model: torch.nn.Module) -> list[str]:
    notes = []
    batch_norms = [name for name, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if batch_norms:
        notes.append(
            f"{len(batch_norms)} BatchNorm layer(s) (first: '{batch_norms[0]}'): compiled data-parallel programs "
            f"all-reduce their batch statistics over dp to match one device (two small all-reduces per layer and "
            f"pass, not in the simulated step time)"
        )
    return notes
