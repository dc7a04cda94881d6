"""Uneven tensor parallelism's candidates (search layer): ACCPAR's per-layer partition type
and per-rank ratios on a cluster of two or more kinds of device.

The plan runs on a ``tp`` mesh over every rank with every op replicated, and splits each
linear layer (``regions.split_dimensions``) by ``ratios.best_layer_split``: the kind
(batch, column, row) and integer shares of least modelled seconds, each rank's share capped
by its memory. The caps: what the replicated plan holds apart from the linear layers'
weights, gradients and optimizer states stays on every rank; the room left on rank r is a
fraction ``f_r`` of those layers' states, so rank r may take at most ``floor(f_r * D)`` of
each column or row split (a sufficient condition: every layer within that fraction keeps
the rank within its memory); a batch split holds the whole weight, so it is allowed only
where every rank holds all of them (``f_r >= 1``). Layers of the same shapes are solved once.
Then, over the chain of linear layers (``ratios.best_chain``): each fusable group
(``regions.py``: a column split kept split into a row split, no gather between) fused or
not, and a layer left whole (no collective, the slowest device's time) where every rank
holds it and that is cheaper than any split.

``uneven_tp_plan(..., even=True)`` is the same space with even shares (the kind, fusion and
whole layers still chosen): what an even-split system would run, for the comparison.
"""

from __future__ import annotations

import dataclasses
import math

from cost_model.compute import op_times
from cost_model.mixed_precision import reduced_gradient_bytes
from cost_model.parameter_bytes import PARAM_BYTES
from cost_model.simulator import simulated
from planner.cluster import Cluster
from planner.device_groups import device_groups, rank_devices
from planner.families.uneven_tp.costs import (fused_terms, layer_terms, plan_rank_memories, rank_seconds,
                                              split_dimension, split_ops, whole_op_seconds)
from planner.families.uneven_tp.ratios import KindTerms, LayerChoice, best_chain, best_layer_split, layer_objective
from planner.families.uneven_tp.regions import fusable_groups, split_dimensions
from planner.families.uneven_tp.section import JSON_KEY, KINDS, LayerSplit, UnevenTpSection
from planner.graph import OpGraph
from planner.model_spec import ModelSpec
from planner.plans import Plan
from planner.strategy import Mesh
from search.context import SearchContext
from search.layouts import data_parallel_layout
from search.plan_builder import unsimulated_plan

FAMILY = JSON_KEY


def replicated_plan(graph: OpGraph, cluster: Cluster, spec: ModelSpec | None, model_name: str, precision: str,
                    warnings: tuple[str, ...] = ()) -> Plan:
    """Every op whole on every rank of a ``tp`` mesh over the cluster: what the splits start from."""
    mesh = Mesh((("tp", cluster.world_size),))
    strategies, inputs = data_parallel_layout(graph, mesh)
    return unsimulated_plan(graph, cluster, spec, model_name, mesh, strategies, inputs, precision=precision,
                            warnings=warnings, label="accpar")


def linear_nodes(graph: OpGraph) -> dict[str, object]:
    """The linear op of each splittable layer, by module path."""
    dims = split_dimensions(graph)
    return {node.module: node for node in graph.nodes if node.op == "aten.linear.default" and node.module in dims}


def memory_fractions(plan: Plan, graph: OpGraph) -> tuple[float, ...]:
    """Per rank, the fraction (at most 1) of the splittable layers' weights, gradients and
    optimizer states its memory holds beside everything else of the simulated ``plan``."""
    per_element = sum(PARAM_BYTES[plan.precision])
    layers = linear_nodes(graph)
    states = sum(math.prod(graph.parameters[param].shape) for node in layers.values() for param in node.params)
    states *= per_element
    rest = plan.estimate.memory.total - states
    return tuple(1.0 if states <= 0 else max(0.0, min(1.0, (device.memory_bytes - rest) / states))
                 for device in rank_devices(plan.cluster))


def _even_shares(dim: int, ranks: int) -> tuple[int, ...]:
    return tuple(dim // ranks + (1 if r < dim % ranks else 0) for r in range(ranks))


def choose_splits(plan: Plan, graph: OpGraph, even: bool = False, allow_whole: bool = True) -> tuple[LayerSplit, ...]:
    """Each splittable layer's kind and shares, fused groups, or whole (module docstring),
    chosen over the chain of linear layers by ``ratios.best_chain``; empty when none is split.
    ``allow_whole=False``: a layer stays whole only where no split fits."""
    fractions = memory_fractions(plan, graph)
    nodes = linear_nodes(graph)
    modules = list(nodes)
    cluster, precision = plan.cluster, plan.precision
    gradient_bytes = reduced_gradient_bytes(plan)  # fp32 gradients in a bf16 program
    solved: dict[tuple, LayerChoice | None] = {}
    singles, whole = [], []
    for module, node in nodes.items():
        key = (tuple(meta.shape for meta in node.input_meta), len(node.params))
        if key not in solved:
            options = [layer_terms(node, kind, cluster, precision, _caps(fractions, node, kind), gradient_bytes)
                       for kind in KINDS]
            solved[key] = _even_split(options, len(fractions)) if even else best_layer_split(options)
        singles.append(solved[key])
        # Whole on every rank: where every rank holds the layer, or where no split fits.
        whole.append(sum(whole_op_seconds(node, cluster, precision))
                     if (allow_whole and min(fractions) >= 1.0) or solved[key] is None else None)
    groups = {}
    by_name = {node.name: node for node in graph.nodes}
    for group in fusable_groups(graph):
        start, stop = modules.index(group.columns[0]), modules.index(group.row) + 1
        if tuple(modules[start:stop]) != group.modules:
            continue  # not consecutive in the chain: each layer alone
        terms = fused_terms([nodes[m] for m in group.columns], nodes[group.row],
                            [by_name[name] for name in group.between], cluster, precision,
                            _caps(fractions, nodes[group.row], "row"))
        choice = _even_split([terms], len(fractions)) if even else best_layer_split([terms])
        if choice is not None:
            # The elementwise ops between would run whole if the group were not fused: the
            # group saves them, so they count against the unfused layers' choice too.
            between = sum(sum(whole_op_seconds(by_name[name], cluster, precision)) for name in group.between)
            groups[(start, stop)] = dataclasses.replace(choice, seconds=choice.seconds - between)
    chain = best_chain(whole, singles, groups)
    splits = []
    for step in chain[0] if chain is not None else ():
        if step.choice is None:
            continue
        if step.choice.kind != "fused":
            splits.append(LayerSplit(modules[step.start], step.choice.kind, step.choice.shares))
            continue
        for module in modules[step.start:step.stop]:
            kind = "row" if module == modules[step.stop - 1] else "column"
            splits.append(LayerSplit(module, kind, step.choice.shares, fused=True))
    return tuple(splits)


def _caps(fractions: tuple[float, ...], node, kind: str) -> tuple[int, ...]:
    """Each rank's largest share of ``node`` split ``kind`` (module docstring)."""
    dim = split_dimension(node, kind)
    if kind == "batch":
        return tuple(dim if f >= 1.0 else 0 for f in fractions)
    return tuple(int(math.floor(f * dim)) for f in fractions)


def _even_split(options: list[KindTerms], ranks: int) -> LayerChoice | None:
    """The kind of least modelled seconds with even shares (within the caps), or None."""
    fitting = []
    for index, terms in enumerate(options):
        shares = _even_shares(terms.dim, ranks)
        if terms.dim >= ranks and all(share <= cap for share, cap in zip(shares, terms.caps)):
            fitting.append((layer_objective(terms, shares), index, LayerChoice(terms.kind, shares,
                                                                              layer_objective(terms, shares))))
    return min(fitting)[2] if fitting else None


def busy_seconds(plan: Plan, graph: OpGraph, splits: tuple[LayerSplit, ...]) -> tuple[float, ...]:
    """Each rank's forward and backward compute seconds: its share of each split layer and of
    the elementwise ops between fused layers on its device, every other op whole."""
    devices = rank_devices(plan.cluster)
    by_module = {split.module: split for split in splits}
    between = split_ops(graph, UnevenTpSection(splits))
    busy = [0.0] * len(devices)
    whole: dict = {}
    for node in graph.nodes:
        split = by_module.get(node.module) if node.op == "aten.linear.default" else None
        if split is not None or node.name in between:
            if split is not None:
                times = rank_seconds(node, split.kind, split.shares, devices, plan.precision)
            else:
                shares, dim = between[node.name]
                times = [op_times(node, share / dim, device, plan.precision) for share, device in zip(shares, devices)]
            for rank, (forward, backward) in enumerate(times):
                busy[rank] += forward + backward
            continue
        for rank, device in enumerate(devices):
            if (node.name, device) not in whole:
                whole[(node.name, device)] = sum(op_times(node, 1.0, device, plan.precision))
            busy[rank] += whole[(node.name, device)]
    return tuple(busy)


def uneven_tp_plan(graph: OpGraph, cluster: Cluster, spec: ModelSpec | None, model_name: str, precision: str,
                   warnings: tuple[str, ...] = (), even: bool = False, allow_whole: bool = True) -> Plan | None:
    """The simulated uneven tensor-parallel plan of ``graph`` on ``cluster`` (module
    docstring), or None when no layer can be split."""
    base = simulated(replicated_plan(graph, cluster, spec, model_name, precision, warnings), graph)
    splits = choose_splits(base, graph, even, allow_whole)
    if not splits:
        return None
    section = UnevenTpSection(splits, busy_s=busy_seconds(base, graph, splits))
    plan = simulated(dataclasses.replace(base, sections={FAMILY: section}), graph)
    # Every rank's bytes, for the report (the estimate holds the rank nearest its capacity);
    # they change no op's cost, so the estimate stands.
    memory = tuple(breakdown.total for breakdown in plan_rank_memories(plan, graph))
    return dataclasses.replace(plan, sections={FAMILY: dataclasses.replace(section, memory_bytes=memory)})


def uneven_tp_candidates(context: SearchContext) -> list[Plan]:
    """The candidates part of the ``uneven-tp`` family (``planner.families``): on a cluster of
    two or more kinds of device, the uneven tensor-parallel plan, when ``--family`` names
    the family or no plan found so far shares every device by its speed (uneven data
    parallelism's, which a batch of fewer samples than twice the devices cannot give);
    none on one kind of device, with ``--tp-layouts summa``, for a model whose samples mix,
    or when the constraints leave the family out or fix a mesh it does not have."""
    if (context.whole_batch_only or context.summa_only or not context.constraints.allows_family(FAMILY)
            or len(device_groups(context.cluster)) < 2
            or not context.constraints.allows_sizes({"tp": context.cluster.world_size})):
        return []
    asked = context.constraints.families is not None
    if not asked and any(plan.estimate.fits and plan.world_size == context.cluster.world_size
                         and "uneven" in plan.sections and len(set(plan.sections["uneven"].shares)) > 1
                         for plan in context.found):
        # Uneven data parallelism already uses every device by its speed: splitting layers is
        # the user's call (--family uneven-tp), not worth a search's time (a 16-GPU model's
        # splits take tens of seconds to choose). A plan whose batch shares are even (its
        # optimizer states split by memory alone) does not.
        return []
    plan = uneven_tp_plan(context.graph, context.cluster, context.spec, context.model_name, context.precision,
                          context.warnings)
    return [] if plan is None else [plan]

