"""A plan checked against the model it is applied to.

``Plan.from_dict`` checks what a plan file says on its own (types, ranges, one placement
per mesh axis). What it says about a model can only be checked against that model:

* ``check_model_matches``: the plan's spec still builds the model that was planned (the
  structural fingerprint of ``planner.fingerprint``, cheap: the model is built on meta, not
  traced). ``compile``, ``simulate`` and ``launch.py`` run it.
* ``check_plan_against_graph``: where the traced graph is at hand (``simulate``, and
  ``compile`` of graph and pipeline programs), every op has one strategy, with as many
  placements as the op has tensors, each ``Shard(d)`` on a dimension the tensor has; the
  batch is the graph's batch; the inputs are the graph's inputs.
* ``check_plan_against_inputs``: without a trace (data-parallel programs), the batch and the
  inputs' placements against the example batch the spec builds.

Every failure is a ``PlanFileError`` naming the field and saying to re-plan.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed.tensor import Shard

from planner.errors import PlanFileError, one_line
from planner.fingerprint import describe_model, example_batch_size, model_fingerprint
from planner.graph import OpGraph, TensorMeta
from planner.plans import Plan
from planner.strategy import Placements, placements_str

_REPLAN = "re-plan it with `planner plan`"


def check_model_matches(plan: Plan, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Fail when ``model(*args, **kwargs)``, built from ``plan.model``, is not the planned model.

    Raises:
        PlanFileError: the plan has no fingerprint, or the fingerprints differ (the message
            shows the model now built and the one planned).
    """
    spec = plan.model.describe() if plan.model is not None else "the model"
    if not plan.model_fingerprint:
        raise PlanFileError(f"the plan records no model fingerprint, so {spec} cannot be checked against it; {_REPLAN}")
    if model_fingerprint(model, args, kwargs) == plan.model_fingerprint:
        return
    now = describe_model(model, args, kwargs)
    planned = f"{plan.summary.name}, {plan.summary.parameters:,} parameters, batch {plan.batch_size}"
    detail = f"now {now}; planned {planned}" if now != planned else f"{now}, but parameter or input shapes or dtypes differ"
    raise PlanFileError(
        f"the spec {spec} now builds a different model than the one planned ({detail}); {_REPLAN}"
    )


def check_plan_against_inputs(plan: Plan, args: tuple, kwargs: dict) -> None:
    """The batch and the input placements against one example batch (no trace needed).

    Inputs are matched by keyword name, positional inputs by position, as a program's
    ``shard_batch`` matches them.
    """
    batch = example_batch_size(args, kwargs)
    if batch is not None and plan.batch_size != batch:
        raise PlanFileError(
            f"the plan's batch_size is {plan.batch_size} but the model's example batch is {batch}; {_REPLAN}"
        )
    flat = all(not isinstance(value, (tuple, list, dict)) for value in args)
    values = dict(zip(plan.inputs, args)) if flat else {}  # nested inputs: matched by the traced graph only
    values.update(kwargs)
    for name, placements in plan.inputs.items():
        value = values.get(name)
        if placements is None or not isinstance(value, torch.Tensor):
            continue
        _check_shards(f"inputs.{name}", placements, value.dim(), f"input '{name}'")


def check_plan_against_graph(plan: Plan, graph: OpGraph) -> None:
    """Every op's strategy against the traced ``graph`` (see the module docstring).

    Raises:
        PlanFileError: naming the first field that does not fit the graph.
    """
    if plan.batch_size != graph.batch_size:
        raise PlanFileError(
            f"the plan's batch_size is {plan.batch_size} but the traced model's global batch is {graph.batch_size}; "
            f"{_REPLAN}"
        )
    graph_inputs = {item.name: item for item in graph.inputs}
    for name, placements in plan.inputs.items():
        if name not in graph_inputs:
            raise PlanFileError(
                f"field 'inputs' places input {_shown(name)} but the traced model's inputs are "
                f"{', '.join(graph_inputs) or 'none'}; {_REPLAN}"
            )
        meta = graph_inputs[name].meta
        if placements is not None and meta is not None:
            _check_shards(f"inputs.{name}", placements, len(meta.shape), f"input '{name}' {meta}")
    by_node: dict[str, int] = {}
    for index, strategy in enumerate(plan.strategies):
        if strategy.node in by_node:
            raise PlanFileError(
                f"field 'strategies[{index}].node' is a second strategy for op {_shown(strategy.node)} "
                f"(the first is strategies[{by_node[strategy.node]}]); {_REPLAN}"
            )
        if not graph.has_node(strategy.node):
            raise PlanFileError(
                f"field 'strategies[{index}].node' names op {_shown(strategy.node)}, which the traced model does not "
                f"have; the plan was made for another version of the model or of the tracer, or the model's forward "
                f"computes other ops in each process (random choices, values read from the environment): {_REPLAN}"
            )
        by_node[strategy.node] = index
    missing = [node.name for node in graph.nodes if node.name not in by_node]
    if missing:
        raise PlanFileError(
            f"the plan has no strategy for {len(missing)} op(s) of the traced model (first: '{missing[0]}'); "
            f"the plan was made for another version of the model or of the tracer: {_REPLAN}"
        )
    tensors = {**graph.parameters, **graph.buffers}
    for index, strategy in enumerate(plan.strategies):
        node = graph.node(strategy.node)
        where = f"strategies[{index}]"
        if strategy.op != node.op:
            raise PlanFileError(
                f"field '{where}.op' is {_shown(strategy.op)} but the traced op '{node.name}' is {node.op}; {_REPLAN}"
            )
        _check_tensors(f"{where}.inputs", strategy.inputs, node.input_meta, node.name, "input")
        _check_tensors(f"{where}.outputs", strategy.outputs, node.output_meta, node.name, "output")
        if strategy.produced is not None:
            _check_tensors(f"{where}.produced", strategy.produced, node.output_meta, node.name, "output")
        for name, placements in strategy.params.items():
            if name not in node.params:
                raise PlanFileError(
                    f"field '{where}.params' places {_shown(name)}, which op '{node.name}' of the traced model does not "
                    f"read; {_REPLAN}"
                )
            if name not in tensors:
                continue  # a tensor constant the forward makes (graph.constants): whole on every rank
            _check_shards(f"{where}.params.{name}", placements, len(tensors[name].shape), f"parameter '{name}' {tensors[name]}")
    _check_expert_layouts(plan, graph)


def _check_expert_layouts(plan: Plan, graph: OpGraph) -> None:
    """Each expert layout names an MoE layer of the traced model with its expert count and
    top-k (``OpGraph.moe_blocks``)."""
    blocks = {block.module: block for block in graph.moe_blocks}
    for index, layout in enumerate(plan.expert_layouts):
        where = f"expert_layouts[{index}]"
        block = blocks.get(layout.module)
        if block is None:
            known = ", ".join(list(blocks)[:4]) or "none"
            raise PlanFileError(
                f"plan field '{where}.module' ({_shown(layout.module)}) is not an MoE layer of the traced model (its MoE "
                f"layers: {known}); {_REPLAN}"
            )
        for name, planned, actual in (("experts", layout.experts, block.experts), ("top_k", layout.top_k, block.top_k)):
            if planned != actual:
                raise PlanFileError(
                    f"plan field '{where}.{name}' is {planned} but layer {block.module!r} of the model has {actual}; "
                    f"{_REPLAN}"
                )


def _shown(text: object) -> str:
    """Untrusted plan text quoted on one line (plan files are shared)."""
    return f"'{one_line(text)}'"


def _check_tensors(where: str, placements: Iterable[Placements], metas: tuple[TensorMeta, ...], node: str, kind: str) -> None:
    placements = tuple(placements)
    if len(placements) != len(metas):
        raise PlanFileError(
            f"field '{where}' places {len(placements)} tensor(s) but op '{node}' has {len(metas)} tensor {kind}(s); "
            f"{_REPLAN}"
        )
    for position, (tensor, meta) in enumerate(zip(placements, metas)):
        _check_shards(f"{where}[{position}]", tensor, len(meta.shape), f"{kind} {position} of op '{node}' {meta}")


def _check_shards(where: str, placements: Placements, ndim: int, tensor: str) -> None:
    for placement in placements:
        if isinstance(placement, Shard) and placement.dim >= ndim:
            raise PlanFileError(
                f"field '{where}' is {placements_str(placements)}: S({placement.dim}) splits dimension {placement.dim} "
                f"but {tensor} has {ndim} dimension(s); use S(0)..S({ndim - 1}) or R"
                if ndim else
                f"field '{where}' is {placements_str(placements)}: S({placement.dim}) splits a 0-dim tensor ({tensor}); "
                f"use R"
            )

