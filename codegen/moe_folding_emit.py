"""``model_spmd.py`` of a folded MoE plan: the dense layers tensor parallel on ``tp``, every
MoE layer's experts over all ``dp x tp`` ranks (``planner.families.moe_folding``).

``parallelize(model, mesh)`` replaces, by the plan's parameter placements on ``tp``:

- each causal self-attention whose fused ``c_attn`` is column parallel and ``c_proj`` row
  parallel with ``codegen.runtime.tensor_parallel_layers.HeadParallelSelfAttention`` (each tp
  rank its heads);
- each other linear split on ``tp`` with a column- or row-parallel one (a column-parallel
  linear followed by a row-parallel one in the same ``nn.Sequential`` hands it its slice of
  the features; any other gathers its output, as the head before the loss does);
- each HuggingFace attention whose q/k/v projections are split by columns and ``o_proj`` by
  rows with column- and row-parallel linears (the attention reshapes to -1 heads, so each tp
  rank runs its heads; a per-head norm inside, Qwen3's ``q_norm``/``k_norm``, has its gradients
  summed over tp), and likewise a HuggingFace SwiGLU MLP (``gate_proj``/``up_proj`` feeding
  ``down_proj``);
- each embedding split on ``tp`` with a vocabulary-parallel one;
- each MoE layer with ``codegen.runtime.moe_folding.FoldedMoE``: each tp rank takes 1/tp of
  its dp rank's tokens, the experts run expert parallel over every rank of ``dp x tp`` by the
  plan's placement (with EDP > 1, the EP x EDP ranks hold each expert's EDP copies, each copy
  taking its share of the expert's slots), the outputs are all-gathered over tp;
- each HuggingFace MoE block (``planner.moe_blocks.HF_STACKED_EXPERTS``) is kept, its own
  router included: only its stacked experts become
  ``codegen.runtime.moe_folding.FoldedStackedExperts`` (expert parallel over every rank of
  ``dp x tp``), and ``fold_block_tokens`` makes the block run on 1/tp of the tokens and
  all-gather its output over tp;

and wraps the model in DDP over "dp" (each tp rank's own "dp" group), the experts kept out.

A pipeline plan (``pp x dp x tp``) is written by the pipeline writer (``codegen.pipeline_emit``):
its stages replay the traced graph on DTensors, tensor parallel by the plan's placements, and
each MoE layer runs folded over its stage's ``dp x tp`` ranks (``codegen.runtime.pipeline_moe``).

What this compiler does not write is refused in one line naming the combination and the fix
(``check_foldable``): sequence parallelism, expert tensor parallelism (ETP > 1) in a pipeline
or beside expert copies (EDP > 1), experts sharded over their copies (``sharded_copies``,
priced as Megatron-FSDP runs them), and without a pipeline data-parallel flavours other than
DDP and recomputation. Without a pipeline, also HuggingFace blocks with split experts (ETP >
1, ``render_folded_program``) and, in ``tensor_parallel_replacements``, attention whose heads
do not split over tp or that has parameters of its own (gpt-oss's sinks). With ETP > 1 each
expert's ETP consecutive ranks hold a slice of its width each
(``codegen.runtime.moe_folding.SlicedExperts``).

Module paths reach the source only as ``repr()`` of paths checked against the model
(``codegen.plan_checks``); other plan text only in comments.
"""

from __future__ import annotations

from torch import nn

from codegen.moe_folding_placement import folded_replicas
from codegen.plan_checks import checked_plan
from codegen.program_parts import about_plan
from codegen.source_text import comment, literal, number
from planner import __version__
from planner.errors import PlanningError
from planner.moe_blocks import HF_STACKED_EXPERTS, ROUTED_GELU, find_moe_blocks
from planner.plans import Plan
from planner.families.moe_folding.section import JSON_KEY as SECTION
from planner.strategy import placement_to_str


def check_foldable(plan: Plan) -> None:
    """Raise ``PlanningError`` (one line naming the combination and the fix) for a folded
    plan this compiler does not write (module docstring)."""
    section = plan.sections[SECTION]
    if section.sequence_parallel:
        raise PlanningError(
            "compiled folded MoE programs keep the tokens whole on every tp rank between blocks; this plan is sequence "
            "parallel; re-plan with sequence_parallel false in its moe_folding section"
        )
    ranks = plan.mesh.axis_size("dp") * plan.mesh.axis_size("tp")
    for layout in plan.expert_layouts:
        ep, etp = layout.placement.devices, layout.tensor_parallel
        if etp != 1 and (plan.pipeline is not None or ep * etp != ranks):
            raise PlanningError(
                f"compiled folded MoE programs split experts (ETP={etp}) only without a pipeline and with EP x ETP "
                f"= dp x tp = {ranks} (no expert copies); layer {layout.module!r} has EP={ep}"
                f"{' in a pipeline' if plan.pipeline is not None else ''}; re-plan with ETP 1"
            )
    sharded = [layout.module for layout in plan.expert_layouts if layout.sharded_copies]
    if sharded:
        raise PlanningError(
            f"compiled folded MoE programs keep every expert copy whole; layer {sharded[0]!r} shards its experts over "
            f"their expert-data-parallel copies (Megatron-FSDP's way, priced only); re-plan with sharded_copies false"
        )
    if plan.pipeline is not None:
        return  # the pipeline writer's own checks follow (codegen.pipeline_emit.unsupported)
    if plan.dp_flavour != "ddp":
        raise PlanningError(
            f"compiled folded MoE programs wrap the dense part in DDP over dp; dp flavour {plan.dp_flavour!r} is not "
            f"written for them; plan with --dp ddp"
        )
    if plan.recompute != "none":
        raise PlanningError(
            f"compiled folded MoE programs keep every activation; recomputation {plan.recompute!r} is not written for "
            f"them; plan with --recompute none"
        )


def render_folded_program(plan: Plan) -> str:
    """Source of ``model_spmd.py`` for ``plan`` (see the module docstring).

    Raises:
        PlanFileError: a layout or placement names what the model does not have.
        PlanningError: a folded plan this compiler does not write (``check_foldable``), or a
            layer split on tp that it has no tensor-parallel module for.
    """
    check_foldable(plan)
    from codegen.graph_facts import build_meta_model

    model = build_meta_model(plan)[0]
    blocks = {block.module: block for block in find_moe_blocks(model)}
    for layout in plan.expert_layouts:
        block = blocks.get(layout.module)
        if plan.pipeline is not None or block is None:
            continue  # the pipeline writer's checks, or check_expert_layouts' below, name it
        if block.runtime not in (ROUTED_GELU, HF_STACKED_EXPERTS):
            raise PlanningError(
                f"compiled folded MoE programs without a pipeline run examples/moe.py's routed GELU layers and "
                f"HuggingFace stacked experts; {layout.module!r} is {block.kind}; plan it with pipeline stages "
                f"(--mesh pp=2) or without --mesh tp"
            )
        if block.runtime == HF_STACKED_EXPERTS and layout.tensor_parallel != 1:
            raise PlanningError(
                f"compiled folded programs run HuggingFace MoE block {layout.module!r} with whole experts; this plan "
                f"splits them (ETP={layout.tensor_parallel}); re-plan with ETP 1"
            )
    if plan.pipeline is not None:
        # Stages replay the traced graph on DTensors over each stage's dp x tp (attention and
        # dense ops tensor parallel by their placements); each MoE layer runs as one call over
        # the stage's dp x tp ranks (codegen.runtime.pipeline_moe, folded).
        from codegen.pipeline_emit import compile_pipeline_plan

        return compile_pipeline_plan(plan)
    plan = checked_plan(plan, graph_program=False)
    replacements = tensor_parallel_replacements(plan, model, set(blocks))
    return (_header(plan, blocks, replacements) + _constants(plan) + _parallelize(plan, replacements, blocks) + _shard_batch(plan))


# Not a replacement: a module inside a head-split attention whose replicated parameters'
# gradients are summed over tp (``codegen.runtime.moe_folding.sum_gradients_over``).
HEAD_LOCAL = "sum_gradients_over"


def tensor_parallel_replacements(plan: Plan, model: nn.Module, moe_paths: set[str]) -> list[tuple[str, str, str]]:
    """(module path, runtime class, extra arguments) for every dense module the plan splits
    on ``tp``, in the model's order.

    Raises:
        PlanningError: a parameter split on ``tp`` in a way no tensor-parallel module here runs.
    """
    tp_index = plan.mesh.names.index("tp")
    on_tp = {name: placement_to_str(placements[tp_index])
             for strategy in plan.strategies for name, placements in strategy.params.items()}
    split = {name: where for name, where in on_tp.items() if where != "R"}
    inside_moe = [name for name in split if any(name.startswith(path + ".") for path in moe_paths)]
    if inside_moe:
        raise PlanningError(
            f"parameter {inside_moe[0]!r} of an MoE layer is split on tp ({split[inside_moe[0]]}); a folded program "
            f"keeps the router replicated on tp; re-plan"
        )
    found, handled = [], set()
    modules = dict(model.named_modules())
    for path, module in modules.items():
        prefix = f"{path}." if path else ""
        if _is_fused_attention(module) and split.get(f"{prefix}c_attn.weight") == "S(0)" \
                and split.get(f"{prefix}c_proj.weight") == "S(1)":
            found.append((path, "HeadParallelSelfAttention", ""))
            handled |= {f"{prefix}c_attn.weight", f"{prefix}c_attn.bias", f"{prefix}c_proj.weight"}
            continue
        where = split.get(f"{prefix}weight")
        if where is None or any(path.startswith(done + ".") for done, _, _ in found):
            continue
        if isinstance(module, nn.Linear) and where in ("S(0)", "S(1)"):
            if where == "S(1)":
                found.append((path, "RowParallelLinear", ""))
            else:
                found.append((path, "ColumnParallelLinear", "" if _feeds_row_parallel(path, modules, split)
                              else ", gather_output=True"))
            handled |= {f"{prefix}weight", f"{prefix}bias"}
        elif isinstance(module, nn.Embedding) and where == "S(0)":
            found.append((path, "VocabParallelEmbedding", ""))
            handled.add(f"{prefix}weight")
    for path, module in modules.items():
        if not path or not _is_split_hf_attention(path, modules, split):
            continue
        tp = plan.mesh.axis_size("tp")
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if own:
            raise PlanningError(
                f"attention {path!r} has parameters of its own ({', '.join(own[:3])}), which compiled folded programs "
                f"do not split over its heads on tp; plan it without --mesh tp"
            )
        config = getattr(module, "config", None)
        heads = [getattr(config, name, None) for name in ("num_attention_heads", "num_key_value_heads")]
        if any(not isinstance(count, int) or count % tp for count in heads):
            raise PlanningError(
                f"attention {path!r} has {heads[0]} query and {heads[1]} key/value heads, which do not split over "
                f"tp={tp}; re-plan with a tp that divides both"
            )
        for child, sub in module.named_children():
            if child not in ("q_proj", "k_proj", "v_proj", "o_proj") and any(True for _ in sub.parameters()):
                # A per-head norm (Qwen3's q_norm, k_norm) replicated on tp sees this rank's heads only.
                found.append((f"{path}.{child}", HEAD_LOCAL, ""))
    left = [name for name in split if name not in handled]
    if left:
        raise PlanningError(
            f"parameter {left[0]!r} is split on tp ({split[left[0]]}) in a way compiled folded MoE programs do not run "
            f"(they split linears, embeddings and fused-q|k|v causal attention); re-plan without --mesh tp"
        )
    return found


def _is_split_hf_attention(path: str, modules: dict, split: dict) -> bool:
    """Whether the module at ``path`` is a HuggingFace attention whose q/k/v projections are
    column parallel and ``o_proj`` row parallel (each tp rank its heads)."""
    module = modules[path]
    return isinstance(getattr(module, "o_proj", None), nn.Linear) and split.get(f"{path}.o_proj.weight") == "S(1)" \
        and all(split.get(f"{path}.{name}.weight") == "S(0)" for name in ("q_proj", "k_proj", "v_proj"))


def _is_fused_attention(module: nn.Module) -> bool:
    """``examples/gpt.py``'s causal self-attention: a fused q|k|v ``c_attn``, ``c_proj``, ``n_head``."""
    return (type(module).__name__ == "CausalSelfAttention" and isinstance(getattr(module, "c_attn", None), nn.Linear)
            and isinstance(getattr(module, "c_proj", None), nn.Linear) and isinstance(getattr(module, "n_head", None), int))


# HuggingFace projections (Llama, Mixtral, Qwen3-MoE, ...: attention reshapes with -1 heads of
# ``head_dim``, so each rank runs its heads) and the row-parallel sibling each feeds.
_FEEDS = {"q_proj": "o_proj", "k_proj": "o_proj", "v_proj": "o_proj", "gate_proj": "down_proj", "up_proj": "down_proj"}


def _feeds_row_parallel(path: str, modules: dict, split: dict) -> bool:
    """Whether the column-parallel linear at ``path`` sits in an ``nn.Sequential`` whose next
    linear is row parallel (an MLP: the features stay split between the two), or is a
    HuggingFace projection whose sibling (``_FEEDS``) is row parallel."""
    parent, _, name = path.rpartition(".")
    container = modules.get(parent)
    if name in _FEEDS and isinstance(getattr(container, _FEEDS[name], None), nn.Linear):
        # HuggingFace attention and SwiGLU MLPs: q/k/v (gate/up) column parallel feed o_proj
        # (down_proj) through per-head (element-wise) ops, which run on this rank's slice.
        return split.get(f"{parent}.{_FEEDS[name]}.weight") == "S(1)"
    if not isinstance(container, nn.Sequential) or not name.isdigit():
        return False
    for child in list(container._modules)[list(container._modules).index(name) + 1:]:
        if isinstance(container._modules[child], nn.Linear):
            return split.get(f"{parent}.{child}.weight") == "S(1)"
    return False


def _header(plan: Plan, blocks: dict, replacements: list[tuple[str, str, str]]) -> str:
    dp, tp = plan.mesh.axis_size("dp"), plan.mesh.axis_size("tp")
    used = {blocks[layout.module].runtime for layout in plan.expert_layouts}
    imported = [*(("FoldedExpertParallelMoE", "FoldedMoE") if ROUTED_GELU in used else ()),
               *(("FoldedStackedExperts",) if HF_STACKED_EXPERTS in used else ()), "expert_tensor_groups",
               *(("fold_block_tokens",) if HF_STACKED_EXPERTS in used else ()),
               *((HEAD_LOCAL,) if any(kind == HEAD_LOCAL for _, kind, _ in replacements) else ())]
    return f'''"""Per-rank program of a folded Mixture-of-Experts plan (which plan, model and cluster: the comments below).

Generated by soap-planner {__version__} from plan.json; it is plain PyTorch, review it freely.
parallelize() makes the attention and dense layers tensor parallel over the {tp} ranks of "tp"
(Megatron-style: column/row-parallel linears, each rank its heads, vocabulary-parallel
embedding), puts each MoE layer's experts over all {dp * tp} ranks of dp x tp (expert parallel,
folded as Megatron-Core folds it), and wraps the model in DDP over the {dp} ranks of "dp".
Every MoE layer routes in the order of the whole (micro-)batch, so each expert's capacity, the
dropped tokens and the balance loss are those of one device running the same batch.
"""

{about_plan(plan)}
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from codegen.runtime.moe_folding import {", ".join(imported)}
from codegen.runtime.tensor_parallel_layers import (
    ColumnParallelLinear,
    HeadParallelSelfAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
)

'''


def _constants(plan: Plan) -> str:
    ranks = plan.mesh.axis_size("dp") * plan.mesh.axis_size("tp")
    text = (
        f"MESH_AXES = {tuple(plan.mesh.axes)!r}\n"
        f"GLOBAL_BATCH = {number(plan.batch_size, 'batch_size')}\n"
        + comment("Gradient accumulation: each micro-batch is routed on its own (capacity, drops, balance loss).") + "\n"
        + f"ACCUMULATION_STEPS = {number(plan.accumulation_steps, 'accumulation_steps')}\n"
    )
    for index, layout in enumerate(plan.expert_layouts):
        ep = layout.placement.devices
        copies = ranks // ep
        text += "\n" + comment(
            f"Experts of {layout.module} over the {ranks} ranks of dp x tp (EP={ep}, EDP={copies}; placement "
            f"method: {layout.placement.method or 'not given'}): for each expert, the ranks holding a copy and the "
            f"share of its slots each copy takes."
        ) + "\n"
        text += f"EXPERT_PLACEMENT_{index} = {literal(folded_replicas(layout, ranks))}\n"
    return text + "\n\n"


def _parallelize(plan: Plan, replacements: list[tuple[str, str, str]], blocks: dict) -> str:
    dp, tp = plan.mesh.axis_size("dp"), plan.mesh.axis_size("tp")
    lines = [
        "def replace_layer(model: torch.nn.Module, path: str, layer: torch.nn.Module) -> None:",
        '    """Put ``layer`` where the module at ``path`` was."""',
        '    parent, _, name = path.rpartition(".")',
        "    setattr(model.get_submodule(parent) if parent else model, name, layer)",
        "",
        "",
        "def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:",
        f'    """This rank\'s module: dense layers tensor parallel over "tp" ({tp} ranks), MoE layers\' experts over',
        f'    all {dp * tp} ranks, the rest replicated and averaged over "dp" ({dp} ranks) by DDP."""',
        '    dp_mesh, tp_group = mesh["dp"], mesh["tp"].get_group()',
        "    folded_group = dist.group.WORLD  # every rank of dp x tp, in mesh order (tp innermost)",
        *_etp_group_lines(plan),
        "",
        "    # Tensor parallel over \"tp\", as the plan splits their weights.",
    ]
    for path, runtime, extra in replacements:  # paths checked against the model
        if runtime == HEAD_LOCAL:
            lines.append("    " + comment(f"{path} sees this rank's heads only: its gradients are summed over tp."))
            lines.append(f"    sum_gradients_over(model.get_submodule({path!r}), tp_group)")
            continue
        lines.append(f"    replace_layer(model, {path!r}, {runtime}(model.get_submodule({path!r}), tp_group{extra}))")
    ignored = []
    for index, layout in enumerate(plan.expert_layouts):
        block = blocks[layout.module]
        path = block.module  # checked against the model: a module path, written with repr()
        if block.runtime == HF_STACKED_EXPERTS:
            layer_lines, rank_local = _stacked_experts_lines(index, block, dp, tp)
            lines += layer_lines
            ignored += rank_local
            continue
        lines += [
            "",
            "    " + comment(
                f"{path}: {block.experts} experts, top-{block.top_k}; each tp rank takes 1/{tp} of its dp rank's "
                f"tokens, they travel to their experts over all {dp * tp} ranks and back, and the outputs are "
                f"all-gathered over tp."
            ),
            f"    layer = model.get_submodule({path!r})",
            f"    replace_layer(model, {path!r}, FoldedMoE(FoldedExpertParallelMoE(",
            f"        layer.get_parameter({block.router!r}),",
            f"        layer.get_parameter({block.expert_weights[0]!r}),",
            f"        layer.get_parameter({block.expert_weights[1]!r}),",
            f"        EXPERT_PLACEMENT_{index},",
            f"        top_k={block.top_k!r},",
            f"        capacity_factor={block.capacity_factor!r},",
            "        group=folded_group,",
            "        rank_losses_averaged=True,",
            f"        names={(block.router, *block.expert_weights)!r},",
            f"        tensor_parallel={tp!r},",
            *([f"        etp_group=etp_groups[{layout.tensor_parallel!r}],"] if layout.tensor_parallel > 1 else []),
            "    ), tp_group))",
        ]
        owner = f"{path}.layer.sharded_experts" if layout.tensor_parallel > 1 else f"{path}.layer"
        ignored += [f"{owner}.w_in", f"{owner}.w_out"]
    lines += [
        "",
        "    # Each rank's own experts: DDP neither broadcasts nor averages them (their gradients arrive",
        "    # from every rank's tokens through the all-to-all's backward).",
        f"    EXPERT_WEIGHTS_OUTSIDE_DDP = {literal(tuple(ignored))}",
        "    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, EXPERT_WEIGHTS_OUTSIDE_DDP)",
        '    device_ids = [torch.cuda.current_device()] if dp_mesh.device_type == "cuda" else None',
        "    # Everything else, whole or this tp rank's slice, is the same on the ranks of this rank's \"dp\"",
        "    # group: DDP averages its gradients there with bucketed all-reduces during backward.",
        "    return DistributedDataParallel(model, device_ids=device_ids, process_group=dp_mesh.get_group(),",
        "                                   gradient_as_bucket_view=True)",
        "",
    ]
    return "\n".join(lines) + "\n"


def _stacked_experts_lines(index: int, block, dp: int, tp: int) -> tuple[list[str], list[str]]:
    """Lines of ``parallelize`` folding a HuggingFace MoE block (its router and shared experts
    kept as written, its stacked experts over every rank), and its rank-local parameters."""
    path = block.module  # checked against the model: a module path, written with repr()
    owner = block.expert_weights[0].rpartition(".")[0]  # "experts"
    target = f"{path}.{owner}"
    lines = [
        "",
        "    " + comment(
            f"{path}: {block.experts} SwiGLU experts, top-{block.top_k}, dropless; the block's own router runs on "
            f"this tp rank's 1/{tp} of its dp rank's tokens, each choice travels to its expert over all {dp * tp} "
            f"ranks and back (two all-to-alls), and the block's output is all-gathered over tp. Its router's (and "
            f"shared experts') gradients are summed over tp."
        ),
        f"    replace_layer(model, {target!r}, FoldedStackedExperts(",
        f"        model.get_submodule({target!r}),",
        f"        EXPERT_PLACEMENT_{index},",
        f"        top_k={block.top_k!r},",
        "        group=folded_group,",
        f"        tensor_parallel={tp!r},",
        "    ))",
        f"    fold_block_tokens(model.get_submodule({path!r}), tp_group, model.get_submodule({target!r}))",
    ]
    return lines, [f"{path}.{name}" for name in block.expert_weights]


def _etp_group_lines(plan: Plan) -> list[str]:
    """Lines making the expert-tensor-parallel groups, once per ETP degree the layers use."""
    degrees = sorted({layout.tensor_parallel for layout in plan.expert_layouts if layout.tensor_parallel > 1})
    if not degrees:
        return []
    return [
        "    # Expert tensor parallelism: each expert split over ETP consecutive ranks (made once, by every rank).",
        f"    etp_groups = {{size: expert_tensor_groups(size) for size in {literal(tuple(degrees))}}}",
    ]


def _shard_batch(plan: Plan) -> str:
    dp_index = plan.mesh.names.index("dp")
    sharded = tuple(name for name, placements in plan.inputs.items()
                    if placements is not None and placement_to_str(placements[dp_index]) == "S(0)")
    return f'''
# Inputs split on dim 0 over "dp" (the same on every tp rank); the others whole.
BATCH_SHARDED_INPUTS = {literal(sharded)}
INPUT_NAMES = {literal(tuple(plan.inputs))}


def shard_batch(args: tuple, kwargs: dict, mesh: DeviceMesh) -> tuple[tuple, dict]:
    """This rank's part of one (micro-)batch: its dp rank's rows of the batch-split inputs."""
    rank, size = mesh.get_local_rank("dp"), mesh.size(mesh.mesh_dim_names.index("dp"))

    def local(name, value):
        return value.chunk(size, dim=0)[rank] if name in BATCH_SHARDED_INPUTS else value

    names = iter(INPUT_NAMES)
    local_args = tuple(local(next(names), value) for value in args)
    local_kwargs = {{key: local(key, value) for key, value in kwargs.items()}}
    return local_args, local_kwargs
'''
