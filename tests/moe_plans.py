"""Hand-built plans of ``examples/moe.py`` with expert layouts, for the compiler's tests.

The search's own MoE plans come from elsewhere; these build exactly the shape it produces:
a data-parallel DDP plan of the traced model (``search.data_parallel.data_parallel_plan``;
``planner.plan(..., search="dp")`` refuses this model, whose batch the router couples),
labelled ``moe``, with one ``ExpertLayout`` per MoE layer of the model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from planner.api import prepare_model
from planner.model_spec import ModelSpec
from planner.moe_blocks import find_moe_blocks
from planner.plans import Plan
from planner.strategy import ExpertLayout, ExpertPlacement
from search.data_parallel import data_parallel_plan

REPO = Path(__file__).resolve().parents[1]
MOE_EXAMPLE = REPO / "examples" / "moe.py"
EXPERTS = 4


def skewed_placement(experts: int, world: int) -> ExpertPlacement:
    """Expert 0 copied on ranks 0 and 1 (0.6 / 0.4 of its slots), expert e > 0 whole on rank
    (e + 1) % world: at world 4 rank 1 holds only its copy of expert 0."""
    copies = [((0, 0.6), (1, 0.4))] + [(((e + 1) % world, 1.0),) for e in range(1, experts)]
    return ExpertPlacement(world, tuple(copies), "hand-made skew")


def grid_placement(experts: int, world: int) -> ExpertPlacement:
    """Every expert on 2 consecutive ranks, ``2 x experts / world`` experts per rank
    (``ExpertPlacement.copied_grid``): at world 4, 4 experts give groups (0, 1) and (2, 3)."""
    return ExpertPlacement.copied_grid(experts, world, 2 * experts // world)


def _placement(name: str | None, experts: int, world: int) -> ExpertPlacement:
    if name == "round-robin":
        return ExpertPlacement.round_robin(experts, world)
    return grid_placement(experts, world) if name == "grid" else skewed_placement(experts, world)


def moe_plan(world: int, mode: str, placement: str | None = None, capacity_factor: float = 1.25,
             precision: str = "fp32", experts: int = EXPERTS, flavour: str = "ddp", nodes: int = 1,
             all_to_all: str = "flat", recompute: str = "none", sharded_copies: bool = False,
             accumulation_steps: int = 1) -> Plan:
    """A data-parallel plan (``flavour``: ddp, fsdp, zero2) of ``examples/moe.py`` (``n_expert=experts``, the capacity factor given) on
    ``world`` CPU ranks over ``nodes`` nodes, every MoE layer in ``mode``; ``placement``:
    ``round-robin``, ``skewed`` (``skewed_placement``) or ``grid`` (``grid_placement``) for
    expert parallelism, whose all-to-all is ``all_to_all`` (``flat`` or ``hierarchical``) and
    whose experts are sharded over their copies with ``sharded_copies``; ``recompute`` and
    ``accumulation_steps`` (micro-batches per step): the plan's."""
    # ffn 128: the sizes these plans' hand-worked costs and byte counts were written for.
    spec = ModelSpec(str(MOE_EXAMPLE), {"n_expert": experts, "capacity_factor": capacity_factor, "ffn": 128})
    graph, spec, name, cluster = prepare_model(spec, f"cpu:{nodes}x{world // nodes}")
    base = data_parallel_plan(graph, cluster, spec, name, flavour, precision=precision)
    layouts = []
    for block in find_moe_blocks(spec.build("meta")[0]):
        chosen = None
        if mode == "expert_parallel":
            chosen = _placement(placement, experts, world)
        layouts.append(ExpertLayout(
            module=block.module, mode=mode, experts=block.experts, top_k=block.top_k,
            capacity_factor=block.capacity_factor, axis="dp", placement=chosen,
            all_to_all=all_to_all if mode == "expert_parallel" else "flat", sharded_copies=sharded_copies,
        ))
    return dataclasses.replace(base, label="moe", expert_layouts=tuple(layouts), recompute=recompute,
                               accumulation_steps=accumulation_steps)


# Tiny HuggingFace MoE decoders (transformers' own blocks: router kept, stacked SwiGLU experts).
HF_TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
           "vocab_size": 64, "batch_size": 8, "seq_len": 8}
HF_MOE = {
    "mixtral": {**HF_TINY, "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {**HF_TINY, "intermediate_size": 48, "moe_intermediate_size": 40, "num_experts": 4,
                  "num_experts_per_tok": 2},
    # every layer MoE (first_k_dense_replace 0): the pipeline grid cuts repeated blocks
    "deepseek_v3": {**HF_TINY, "intermediate_size": 48, "moe_intermediate_size": 40, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1},
    # biased router, transposed biased experts, clamped SwiGLU (planner.moe_blocks); head_dim set: its default is 64
    "gpt_oss": {**HF_TINY, "intermediate_size": 40, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**HF_TINY, "intermediate_size": 48, "moe_intermediate_size": 40, "shared_expert_intermediate_size": 24,
                  "num_experts": 4, "num_experts_per_tok": 2},
}


def hf_moe_plan(world: int, model_type: str, mode: str, placement: str | None = None, flavour: str = "ddp",
                sharded_copies: bool = False, accumulation_steps: int = 1, precision: str = "fp32",
                recompute: str = "none") -> Plan:
    """As ``moe_plan``, for the tiny ``hf:<model_type>`` of ``HF_MOE`` (dropless, 4 experts)."""
    spec = ModelSpec(f"hf:{model_type}", HF_MOE[model_type])
    graph, spec, name, cluster = prepare_model(spec, f"cpu:1x{world}")
    base = data_parallel_plan(graph, cluster, spec, name, flavour, precision=precision)
    layouts = []
    for block in graph.moe_blocks:
        chosen = None
        if mode == "expert_parallel":
            chosen = _placement(placement, block.experts, world)
        layouts.append(ExpertLayout(module=block.module, mode=mode, experts=block.experts, top_k=block.top_k,
                                    capacity_factor=block.capacity_factor, axis="dp", placement=chosen,
                                    sharded_copies=sharded_copies))
    return dataclasses.replace(base, label="moe", expert_layouts=tuple(layouts), accumulation_steps=accumulation_steps,
                               recompute=recompute)


def moe_pipeline_plan(spec: ModelSpec, world: int, schedule: str = "1f1b", virtual_stages: int = 1,
                      recompute: str = "none") -> Plan:
    """The MoE pipeline grid's plan (``search.stage_experts``) of ``spec`` on ``pp=2 x
    dp=<world/2>`` (``cpu:2x<world/2>``) under ``schedule``, recomputing as ``recompute``
    says, every MoE layer expert parallel over its stage's dp ranks."""
    from search.pipeline_search import PipelineGrid, PipelineSpace
    from search.stage_experts import EXPERT_PARALLEL, stage_expert_variants

    graph, spec, name, cluster = prepare_model(spec, f"cpu:2x{world // 2}")
    space = PipelineSpace(
        flavours=("ddp",), tensor_parallel=(1,), recompute=(recompute,), per_stage_recompute=False,
        sequence_parallel=(False,), searched_layout="off",
        expert_layouts=lambda mesh, micro_batches: stage_expert_variants(graph, cluster, None, "fp32", mesh, micro_batches),
    )
    grid = PipelineGrid(graph, cluster, "fp32", space)
    config = next(c for c in grid.configurations()
                  if (c.pp, c.schedule, c.virtual_stages, c.experts) == (2, schedule, virtual_stages, EXPERT_PARALLEL))
    plan = grid.plan(grid.estimate(config), spec, name)
    assert all(layout.mode == "expert_parallel" for layout in plan.expert_layouts), plan.name
    return plan


def with_copied_expert(plan: Plan) -> Plan:
    """``plan`` with every MoE layer's expert 0 copied on (stage) ranks 0 and 1 (``skewed_placement``)."""
    layouts = tuple(dataclasses.replace(layout, placement=skewed_placement(layout.experts, layout.placement.devices))
                    for layout in plan.expert_layouts)
    return dataclasses.replace(plan, expert_layouts=layouts)


def folded_pipeline_plan(spec: ModelSpec, world: int, ep: int) -> Plan:
    """The folded plan (``search.moe_folding.folded_plan``) of ``spec`` on ``pp=2 x dp=2 x
    tp=<world/4>`` (``cpu:2x<world/2>``), 1F1B over 2 micro-batches, every MoE layer EP ``ep``
    (the rest of each stage's ranks expert copies)."""
    from planner.strategy import Mesh
    from search.moe_folding import folded_plan

    graph, spec, name, cluster = prepare_model(spec, f"cpu:2x{world // 2}")
    mesh = Mesh((("pp", 2), ("dp", 2), ("tp", world // 4)))
    return folded_plan(graph, cluster, spec, name, mesh, ep, micro_batches=2)
