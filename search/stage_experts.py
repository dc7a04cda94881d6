"""Expert layouts for the MoE layers inside pipeline stages.

A pipeline plan of an MoE model (mesh ``pp x dp``) runs each MoE layer on the ``dp`` ranks of
the stage that holds it: its experts split over them (``expert_parallel``: two all-to-alls
over the stage's dp group per micro-batch) or copied on each (``data_parallel``: the expert
gradients all-reduced over the group once per step, with the other replicated weights).
Every micro-batch is routed on its own, over the group's tokens of that micro-batch, so a
layer's capacity is a micro-batch's (``cost_model.moe_layers.price_layout`` with the step's
micro-batches).

Candidates per layer: data parallel; expert parallel round-robin when the experts divide
over the group; expert parallel with EPLB's placement from the layer's routed shares (the
fewest slots per device that hold every expert; with group-limited routing, DeepSeek-V3's,
whole routing groups packed onto the stage's nodes, so each token's all-to-all reaches at
most its chosen groups' nodes), each with a flat all-to-all (a stage's dp
group of a pipeline searched here lies inside one node or spans a few; the two-level
exchange is the MoE family's). Each is scored with the MoE family's cost functions over the
stage's group (``cost_model.moe_layers``): expert compute and all-to-alls per micro-batch
times the micro-batches, the routing all-gather, copied experts' gradient sums, and the
data-parallel mode's gradient all-reduce.

``stage_expert_variants`` gives the pipeline grid (``search.pipeline_search``) two ways to
lay out a whole model: every layer its fastest candidate (``"fastest"``), and every layer
its fastest expert-parallel candidate (``"expert-parallel"``: the fewest expert bytes per
device, what lets large MoE models fit); the stage slicing prices both (its simulated
segment profiles carry the layouts) and the step time and memory decide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from cost_model.collectives import collective_time
from cost_model.moe_layers import (
    expert_group,
    layer_tokens,
    price_layout,
    replica_sync_time,
    routing_sync_time,
)
from cost_model.parameter_bytes import bytes_per_parameter
from planner.cluster import Cluster
from planner.graph import OpGraph
from planner.moe_blocks import HF_STACKED_EXPERTS, ROUTED_GELU, MoEBlock
from planner.routing import RoutingStats
from planner.strategy import ExpertLayout, ExpertPlacement, Mesh
from search.expert_placement import eplb
from search.moe_search import routing_label

# The layouts a compiled pipeline program runs inside its stages (codegen.runtime.pipeline_moe).
STAGE_EXPERT_MODES = ("expert_parallel", "data_parallel")
FASTEST, EXPERT_PARALLEL = "fastest", "expert-parallel"
VARIANTS = (FASTEST, EXPERT_PARALLEL)
# The MoE blocks the pipeline grid lays out inside stages (``runs_in_stages``).
STAGE_RUNTIMES = (ROUTED_GELU, HF_STACKED_EXPERTS)


def runs_in_stages(graph: OpGraph) -> bool:
    """Whether the pipeline grid lays out every MoE layer of ``graph`` over its stages' dp
    ranks: ``examples/moe.py``'s routed GELU layers (compiled pipeline programs run them,
    ``codegen.runtime.pipeline_moe``) and HuggingFace's stacked-experts blocks (Mixtral,
    Qwen3-MoE, DeepSeek-V3: planned and priced alike, as DeepSeek ran V3 with 16 stages and
    64-way EP; compiled, a replicated one runs as its traced ops and an expert-parallel one
    is refused in one line, ``compiled_in_stages``)."""
    return bool(graph.moe_blocks) and all(block.runtime in STAGE_RUNTIMES for block in graph.moe_blocks)


def compiled_in_stages(block: MoEBlock) -> bool:
    """Whether compiled pipeline programs run ``block`` by its layout (the routed GELU
    runtime only: HuggingFace's blocks keep their own router, which the stage writer does
    not replace yet)."""
    return block.runtime == ROUTED_GELU


def stage_layer_candidates(block: MoEBlock, loads: tuple[float, ...], source: str, group_size: int,
                           per_node: int | None) -> list[ExpertLayout]:
    """The layouts tried for ``block`` on a stage's dp group of ``group_size`` ranks (see the
    module docstring), in a fixed order."""
    common = dict(module=block.module, experts=block.experts, top_k=block.top_k,
                  capacity_factor=block.capacity_factor, axis="dp", routing=source, expert_loads=loads)
    layouts = [ExpertLayout(mode="data_parallel", **common)]
    if group_size == 1:
        return layouts
    placements: dict[tuple, ExpertPlacement] = {}
    if block.experts % group_size == 0:
        round_robin = ExpertPlacement.round_robin(block.experts, group_size)
        placements[round_robin.replicas] = round_robin
    slots = -(-block.experts // group_size)
    # Group-limited routing (DeepSeek-V3) limits the nodes a token reaches only when its
    # groups lie on nodes: EPLB's hierarchical policy packs whole groups onto the stage's nodes.
    groups = block.routing_groups[0] if block.routing_groups else None
    balanced = eplb(loads, group_size, slots, per_node if per_node and group_size % per_node == 0 else None, groups)
    placements.setdefault(balanced.replicas, balanced)
    layouts += [ExpertLayout(mode="expert_parallel", placement=p, **common) for p in placements.values()]
    return layouts


def stage_layer_seconds(block: MoEBlock, layout: ExpertLayout, tokens: int, cluster: Cluster, precision: str,
                        group: Sequence[int], micro_batches: int) -> float:
    """One layer's seconds per step under ``layout`` on ``group`` (see the module docstring)."""
    per_micro = price_layout(block, layout, tokens, cluster, precision, micro_batches, group)
    seconds = micro_batches * (per_micro.total_s + routing_sync_time(block, cluster, group))
    seconds += replica_sync_time(block, layout, cluster, precision, group)
    if layout.mode == "data_parallel" and len(group) > 1:
        gradients = block.expert_parameters * bytes_per_parameter(precision)[1]
        seconds += collective_time("all_reduce", gradients, cluster, list(group))
    return seconds


def stage_expert_variants(graph: OpGraph, cluster: Cluster, routing: RoutingStats | None, precision: str,
                          mesh: Mesh, micro_batches: int) -> dict[str, tuple[ExpertLayout, ...]]:
    """The whole model's layouts by variant name (``VARIANTS``; identical ones once, the
    first name kept) for a pipeline on ``mesh`` running ``micro_batches`` per step; empty
    when the mesh has no ``dp`` axis (each stage then runs its MoE layers whole)."""
    if "dp" not in mesh.names:
        return {}
    routing = routing or RoutingStats()
    group = expert_group(mesh, "dp")
    per_node = cluster.devices_per_node if cluster.is_homogeneous else None
    fastest, parallel = [], []
    chosen: dict[tuple, tuple[ExpertLayout, ExpertLayout]] = {}  # by layer class: identical layers score alike
    for block in graph.moe_blocks:
        loads = tuple(routing.layer(block.module, block.experts, block.top_k).token_share)
        tokens = layer_tokens(graph, block)
        source = routing_label(routing, block.module)
        key = (dataclasses.replace(block, module=""), tokens, loads, source)
        if key not in chosen:
            scored = [
                (stage_layer_seconds(block, layout, tokens, cluster, precision, group, micro_batches), index, layout)
                for index, layout in enumerate(stage_layer_candidates(block, loads, source, len(group), per_node))
            ]
            best = min(scored)[2]
            expert_parallel = [item for item in scored if item[2].mode == "expert_parallel"]
            chosen[key] = (best, min(expert_parallel)[2] if expert_parallel else best)
        fastest.append(dataclasses.replace(chosen[key][0], module=block.module))
        parallel.append(dataclasses.replace(chosen[key][1], module=block.module))
    variants: dict[str, tuple[ExpertLayout, ...]] = {FASTEST: tuple(fastest)}
    if tuple(parallel) != variants[FASTEST]:
        variants[EXPERT_PARALLEL] = tuple(parallel)
    return variants
