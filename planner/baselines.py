"""Baseline plans, so any published or hand-written configuration can be simulated.

    >>> from planner import baselines
    >>> plan = baselines.megatron("examples/gpt.py", "dgx-a100-80g:128", tp=8, pp=8,
    ...                           micro_batch=1, schedule="1f1b", recompute="full")
    >>> plan.estimate.step_time_s, plan.estimate.mfu

``ddp`` and ``fsdp`` default to fp32 (what compiled programs run); ``megatron`` to bf16
mixed precision (what Megatron-LM runs). Every baseline is simulated on construction.
"""

from __future__ import annotations

from planner import arguments
from planner.api import prepare_model
from planner.cluster import Cluster
from planner.errors import ArgumentError
from planner.plans import PLAN_PRECISIONS, Plan
from planner.strategy import DP_FLAVOURS, PIPELINE_SCHEDULES


def ddp(model, cluster: Cluster | str, example_inputs=None, *, spec=None, precision: str = "fp32") -> Plan:
    """Data parallelism with DDP over every device."""
    return _data_parallel("ddp", model, cluster, example_inputs, spec, precision)


def fsdp(model, cluster: Cluster | str, example_inputs=None, *, spec=None, precision: str = "fp32") -> Plan:
    """Fully sharded data parallelism (ZeRO-3, one unit per repeated block) over every device."""
    return _data_parallel("fsdp", model, cluster, example_inputs, spec, precision)


def zero(model, cluster: Cluster | str, example_inputs=None, *, stage: int = 1, spec=None, precision: str = "fp32") -> Plan:
    """ZeRO stage 1 (optimizer states sharded) or 2 (also gradients) over every device."""
    if isinstance(stage, bool) or stage not in (1, 2):
        from planner.errors import PlanningError

        raise PlanningError(f"ZeRO stage must be 1 or 2 here (stage 3 is fsdp()), got {stage!r}")
    return _data_parallel(f"zero{stage}", model, cluster, example_inputs, spec, precision)


def megatron(
    model,
    cluster: Cluster | str,
    example_inputs=None,
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
    layers_per_stage=None,
    spec=None,
) -> Plan:
    """Megatron-LM's layout: column/row-parallel blocks on ``tp``, layers split over ``pp``
    stages (evenly, or ``layers_per_stage`` blocks on each (virtual) stage, e.g.
    ``(3, 4, 4, 3)``), the batch over ``dp`` with ``dp_flavour`` (``"ddp"``, ``"zero1"`` as
    Megatron's distributed optimizer, ``"zero2"`` or ``"fsdp"``); see
    ``search.megatron.megatron_plan``."""
    from search.megatron import megatron_plan

    for argument, value in (("tp", tp), ("pp", pp), ("micro_batch", micro_batch), ("virtual_stages", virtual_stages)):
        arguments.integer_at_least(value, argument, 1)
    if dp is not None:
        arguments.integer_at_least(dp, "dp", 1)
    arguments.one_of(schedule, PIPELINE_SCHEDULES, "schedule")
    arguments.one_of(precision, PLAN_PRECISIONS, "precision")
    arguments.boolean(sequence_parallel, "sequence_parallel")
    arguments.one_of(dp_flavour, DP_FLAVOURS, "dp_flavour")
    if layers_per_stage is not None and not (
        isinstance(layers_per_stage, (list, tuple))
        and all(isinstance(c, int) and not isinstance(c, bool) for c in layers_per_stage)
    ):
        raise ArgumentError(f"layers_per_stage must be a list of integers (blocks per stage), got {layers_per_stage!r}")
    graph, spec, name, cluster = prepare_model(model, cluster, example_inputs, spec)
    return megatron_plan(
        graph, cluster, spec, name, tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, schedule=schedule,
        virtual_stages=virtual_stages, recompute=recompute, sequence_parallel=sequence_parallel, precision=precision,
        dp_flavour=dp_flavour, layers_per_stage=None if layers_per_stage is None else tuple(layers_per_stage),
    )


def _data_parallel(flavour: str, model, cluster, example_inputs, spec, precision: str) -> Plan:
    from search.data_parallel import data_parallel_plan

    arguments.one_of(precision, PLAN_PRECISIONS, "precision")
    graph, spec, name, cluster = prepare_model(model, cluster, example_inputs, spec)
    return data_parallel_plan(graph, cluster, spec, name, flavour, precision=precision)
