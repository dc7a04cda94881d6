"""``model_spmd.py`` of a plan with expert layouts: MoE layers in their planned mode, the rest
data parallel.

``parallelize(model, mesh)`` replaces each MoE layer of the model (a module found by
``planner.moe_blocks``) with the runtime layer of its ``ExpertLayout`` mode, built from the
layer's own weights:

- ``expert_parallel``: ``codegen.runtime.moe.ExpertParallelMoE``, the experts split over
  "dp" by the plan's placement (a repr'd literal in the program), tokens moved to their
  experts and back by two all-to-alls;
- ``data_parallel``: ``codegen.runtime.moe_modes.DataParallelMoE``, every expert on every
  rank, tokens stay;
- ``expert_sliced``: ``codegen.runtime.moe_modes.ExpertSlicedMoE``, each expert's hidden
  width sliced over "dp", tokens gathered and partial outputs reduce-scattered back.

An expert-parallel layout with ``sharded_copies`` (a grid placement: groups of ranks holding
the same experts) also shards each rank's experts over the ranks of its group with FSDP2
(``codegen.runtime.expert_copies``): gathered for forward and backward, gradients
reduce-scattered (summed over the copies), states for the shard only.

Every mode routes in the global order of the whole batch (one all-gather of per-expert
counts), so capacity, drops and the balance loss are one device's. A plan that accumulates
gradients routes each micro-batch so, on its own (``codegen.runtime.accumulation`` cuts the
global batch into consecutive micro-batches and each rank takes its part of each): the
capacity, drops and balance loss are the micro-batch's, as MoE trainers run them. The rest of
the model (and the router, and the experts of data-parallel layers) is data parallel by the plan's
flavour: DDP (``ddp``; ``zero1`` adds an optimizer splitting the replicated weights'
states over "dp") or FSDP2 units (``fsdp``; ``zero2`` keeps gathered weights from forward to
backward). The expert weights that differ from rank to rank are kept out of DDP, of every
FSDP2 unit and of ZeRO-1's split (each rank steps its own whole): their gradients arrive complete through the all-to-all's backward, divided by
the group size in the layer (each rank's loss is a mean over its own tokens). Under ZeRO-1
with experts sharded over their copies, each rank's own part is its FSDP2 shard: ZeRO-1's
optimizer steps that shard (with the gradient FSDP2 reduce-scattered into it) and states for
it alone, as Megatron-Core's distributed optimizer shards expert states over the
expert-data-parallel group.

Module paths reach the source only as ``repr()`` of a path checked against the model
(``codegen.plan_checks.check_expert_layouts``); other plan text only in comments.
"""

from __future__ import annotations

from codegen.program_parts import (
    about_plan,
    autocast_lines,
    has_batch_norm,
    precision_imports,
    recomputed_blocks,
    shard_batch_source,
)
from codegen.data_parallel_emit import (
    SHARDED_STATES_IMPORT,
    sharded_states_optimizer,
    unused_parameters,
    uses_ddp,
    wrap_lines,
    wrapper_import,
    wrapper_name,
)
from codegen.plan_checks import checked_plan
from codegen.source_text import comment, literal, number
from planner import __version__
from planner.errors import PlannerError, PlanningError
from planner.expert_kernels import BATCHED_MATMUL, MODEL_EXPERTS, PER_EXPERT_LOOP, emitted_expert_kernel
from planner.moe_blocks import MoEBlock, find_moe_blocks
from planner.plans import Plan
from planner.program_shape import shards_expert_copies_in_bf16
from planner.strategy import KEEP_A2A, WHOLE_BLOCK_RECOMPUTE, ExpertLayout, placements_str

# How the rest of the model is data parallel, by the plan's dp flavour: DDP (replicated),
# FSDP2 units (``fsdp``: sharded, gathered for forward and again for backward) or FSDP2 units
# that keep their gathered weights from forward to backward (``zero2``).
# ``zero1`` is DDP with the optimizer states of the replicated weights split over "dp".
_DENSE_WRAPPERS = ("ddp", "zero1", "fsdp", "zero2")
_RUNTIME_CLASSES = {
    "expert_parallel": "ExpertParallelMoE",
    "data_parallel": "DataParallelMoE",
    "expert_sliced": "ExpertSlicedMoE",
}


def render_moe_program(plan: Plan) -> str:
    """Source of ``model_spmd.py`` for ``plan`` (see the module docstring).

    Raises:
        PlanFileError: an expert layout does not match the model's MoE layers (the field named).
        PlanningError: a plan shape this compiler does not write for MoE models yet.
    """
    _check_supported(plan)
    plan = checked_plan(plan, graph_program=False)
    from codegen.graph_facts import build_meta_model

    blocks = {block.module: block for block in find_moe_blocks(build_meta_model(plan)[0])}
    dp = plan.mesh.axis_size("dp")
    layouts = [(index, layout, blocks[layout.module]) for index, layout in enumerate(plan.expert_layouts)]
    return (
        _header(plan, dp)
        + _imports(plan, layouts)
        + _constants(plan, layouts)
        + _parallelize(plan, dp, layouts)
        + shard_batch_source(plan, dp)
    )


def _check_supported(plan: Plan) -> None:
    """MoE programs are data parallel (DDP or FSDP2) around the MoE layers, one step in one piece."""
    if plan.mesh.names != ("dp",) or plan.pipeline is not None:
        raise PlanningError(
            f"compiled MoE programs run on a 'dp' mesh without a pipeline, not mesh {plan.mesh}; re-plan with the "
            f"experts over 'dp'"
        )
    if plan.dp_flavour not in _DENSE_WRAPPERS:
        raise PlanningError(
            f"compiled MoE programs wrap the dense part in DDP or FSDP2; dp flavour {plan.dp_flavour!r} is not written "
            f"for MoE layers yet; plan with --dp ddp, zero1, zero2 or fsdp"
        )
    if plan.recompute not in ("none", *WHOLE_BLOCK_RECOMPUTE):
        raise PlanningError(
            f"compiled MoE programs recompute whole blocks or nothing, not {plan.recompute!r}; re-plan with --recompute "
            f"full, {KEEP_A2A} or none"
        )
    for strategy in plan.strategies:
        for placements in strategy.params.values():
            if placements_str(placements) != "(R)":
                raise PlanningError(
                    "compiled MoE programs run every op outside the MoE layers data parallel over 'dp'; this plan "
                    "shards some parameters another way; re-plan"
                )


_FULL_NOTE = (
    "# Activation recomputation: these blocks keep only their inputs for backward and run their\n"
    "# forward again when backward reaches it (less memory, one more forward each; MoE layers route\n"
    "# again, with the same result, and move their tokens again).\n"
)
_KEPT_EXCHANGES_NOTE = (
    "# Activation recomputation keeping the exchanges: these blocks keep their inputs and their MoE\n"
    "# layers' exchanged rows (dispatch and combine outputs, routing counts) for backward and run\n"
    "# their forward again when backward reaches it, every collective of the MoE layers handing back\n"
    "# what it received in forward instead of communicating again (codegen.runtime.kept_exchanges).\n"
)


def _header(plan: Plan, dp: int) -> str:
    wrapper = wrapper_name(plan) + ("" if uses_ddp(plan) else f" units ({plan.dp_flavour})")
    return f'''"""Per-rank program of a Mixture-of-Experts plan (which plan, model and cluster: the comments below).

Generated by soap-planner {__version__} from plan.json; it is plain PyTorch, review it freely.
parallelize() replaces each MoE layer with the runtime layer of its planned mode (below),
built from the layer's own weights, and wraps the model in {wrapper} over the {dp} ranks of "dp".
Every MoE layer routes in the order of the whole global batch, or of each micro-batch when
the step accumulates (ACCUMULATION_STEPS; one all-gather of per-expert counts), so each
expert's capacity, the dropped tokens and the balance loss are those of one device running
the same (micro-)batch. Use it in your own training loop:

    from codegen.runtime import load_program
    program = load_program("<this folder>")
    mesh = program.build_mesh()
    module = program.parallelize(model, mesh)           # model built identically on every rank
    optimizer = program.make_optimizer(module, mesh, torch.optim.AdamW, lr=1e-3)
    loss, output = program.forward_backward(module, args, kwargs, mesh)  # global batch in, sharded here
    optimizer.step()
"""

{about_plan(plan)}
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
{wrapper_import(plan)}
'''


def _imports(plan: Plan, layouts: list[tuple[int, ExpertLayout, MoEBlock]]) -> str:
    lines = []
    # Which layers run which kernels: one decision (planner.expert_kernels), which the
    # simulator prices too.
    kernels = [emitted_expert_kernel(block.runtime, layout.mode) for _, layout, block in layouts]
    routed = {layout.mode for (_, layout, _), kernel in zip(layouts, kernels) if kernel == BATCHED_MATMUL}
    if PER_EXPERT_LOOP in kernels:
        lines.append("from codegen.runtime.expert_dispatch import ExpertParallelExperts")
    if "expert_parallel" in routed:
        lines.append("from codegen.runtime.moe import ExpertParallelMoE")
    if _ranks_per_node(plan, layouts):
        lines.append("from codegen.runtime.moe_exchange import TwoLevelExchange")
    if _copy_groups(layouts):
        # ZeRO-1's optimizer steps plain views of every parameter's local tensor: no mixed groups to split.
        split = uses_ddp(plan) and plan.dp_flavour != "zero1"
        names = "copy_mesh, plain_and_sharded_groups, shard_over_copies" if split else "copy_mesh, shard_over_copies"
        lines.append(f"from codegen.runtime.expert_copies import {names}")
        if shards_expert_copies_in_bf16(plan.precision):
            lines.append("from codegen.runtime.precision import BF16_FSDP_POLICY")
    others = [_RUNTIME_CLASSES[mode] for mode in ("data_parallel", "expert_sliced") if mode in routed]
    if others:
        lines.append(f"from codegen.runtime.moe_modes import {', '.join(others)}")
    if plan.recompute in WHOLE_BLOCK_RECOMPUTE:
        lines.append("from codegen.runtime.moe import recompute_in_backward_counting_once")
    if plan.dp_flavour == "zero1":
        lines.append("from codegen.runtime.moe import rank_local_parameters")
        lines.append(SHARDED_STATES_IMPORT)
    if has_batch_norm(plan):
        lines.append("from codegen.runtime.batch_norm import synchronise_batch_norm")
    lines += precision_imports(plan)
    return "\n" + "\n".join(lines) + "\n\n"


def _constants(plan: Plan, layouts: list[tuple[int, ExpertLayout, MoEBlock]]) -> str:
    text = (
        f"MESH_AXES = {tuple(plan.mesh.axes)!r}\n"
        f"GLOBAL_BATCH = {number(plan.batch_size, 'batch_size')}\n"
    ) + _accumulation_lines(plan)
    if plan.recompute in WHOLE_BLOCK_RECOMPUTE:
        rows = "".join(f"    {path!r},\n" for path in recomputed_blocks(plan))  # the traced model's block paths
        text += "\n" + (_KEPT_EXCHANGES_NOTE if plan.recompute == KEEP_A2A else _FULL_NOTE) + (
            f"RECOMPUTED_BLOCKS = (\n{rows})\n"
        )
    for index, layout, block in layouts:
        if layout.placement is None:
            continue
        placement = layout.placement
        text += "\n" + comment(
            f"Placement of the experts of {block.module} over the ranks of \"dp\" (method: {placement.method or 'not given'}):"
        ) + "\n"
        text += comment("for each expert, the ranks holding a copy and the share of its slots each copy takes.") + "\n"
        for device in range(placement.devices):
            held = placement.experts_on(device)
            text += comment(f"  rank {device}: experts {', '.join(map(str, held)) or 'none'}") + "\n"
        replicas = tuple(tuple((int(d), float(s)) for d, s in copies) for copies in placement.replicas)
        text += f"EXPERT_PLACEMENT_{index} = {literal(replicas)}\n"
    for position, (groups, indices) in enumerate(_copy_groups(layouts).items()):
        text += "\n" + comment(
            f"Ranks of \"dp\" holding the same experts (layers {', '.join(layouts[i][2].module for i in indices)}): "
            f"each expert's weights, gradients and optimizer states are sharded over its {len(groups[0])} copies."
        ) + "\n"
        text += f"EXPERT_COPY_GROUPS_{position} = {literal(groups)}\n"
    return text + "\n\n"


def _accumulation_lines(plan: Plan) -> str:
    """The constant saying how many micro-batches a step accumulates over, and what that
    means for routing: each micro-batch is routed on its own, as MoE trainers route them."""
    steps = number(plan.accumulation_steps, "accumulation_steps")
    if plan.accumulation_steps == 1:
        return "# Gradient accumulation: none (the whole global batch is routed at once).\nACCUMULATION_STEPS = 1\n"
    return (
        "# Gradient accumulation: the global batch runs forward and backward in this many consecutive\n"
        "# micro-batches, each rank taking its part of each. Every MoE layer routes each micro-batch on\n"
        "# its own (over all the ranks' parts of it): capacities, drops and the balance loss are the\n"
        "# micro-batch's, and the step's loss is the mean of the micro-batches' (launch.py --check runs\n"
        "# the same micro-batches on one device).\n"
        f"ACCUMULATION_STEPS = {steps}\n"
    )


def _parallelize(plan: Plan, dp: int, layouts: list[tuple[int, ExpertLayout, MoEBlock]]) -> str:
    rest = "replicated" if uses_ddp(plan) else "sharded"
    lines = [
        "def replace_layer(model: torch.nn.Module, path: str, layer: torch.nn.Module) -> None:",
        '    """Put ``layer`` where the module at ``path`` was."""',
        '    parent, _, name = path.rpartition(".")',
        "    setattr(model.get_submodule(parent), name, layer)",
        "",
        "",
        "def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:",
        f'    """This rank\'s module: the MoE layers in their planned modes, the rest {rest} over the {dp}',
        f'    ranks of "dp" ({wrapper_name(plan)})."""',
        '    dp_mesh = mesh["dp"]',
        "    group = dp_mesh.get_group()",
    ]
    per_node = _ranks_per_node(plan, layouts)
    if per_node:
        lines += [
            f"    # The two-level all-to-all the plan chose: rows move inside each node of {per_node} ranks first, then",
            f"    # across the {dp // per_node} nodes between ranks of the same local index (fewer, larger inter-node",
            "    # messages than one flat all-to-all). Its node and cross-node groups are made once, here.",
            f"    two_level = TwoLevelExchange(group, ranks_per_node={per_node})",
        ]
    copy_meshes = {}
    for position, (groups, indices) in enumerate(_copy_groups(layouts).items()):
        lines += [
            f"    # This rank's group of {len(groups[0])} ranks holding the same experts: a (groups x copies) mesh over",
            "    # \"dp\", built once (every rank makes every group's process group).",
            f"    copies_mesh_{position} = copy_mesh(dp_mesh, EXPERT_COPY_GROUPS_{position})",
        ]
        copy_meshes.update({index: f"copies_mesh_{position}" for index in indices})
    ignored = []
    for index, layout, block in layouts:
        if emitted_expert_kernel(block.runtime, layout.mode) != BATCHED_MATMUL:  # its experts kept or looped
            layer_lines, rank_local = _stacked_experts_lines(index, layout, block, dp, copy_meshes.get(index),
                                                             plan.precision)
            lines += layer_lines
            ignored += rank_local
            continue
        lines += [""] + [f"    {line}" for line in _layer_comment(index, layout, block, dp, bool(per_node), plan)]
        path = block.module  # checked against the model: a module path, written with repr()
        names = (block.router, *block.expert_weights)
        arguments = [
            f"layer.get_parameter({block.router!r})",
            f"layer.get_parameter({block.expert_weights[0]!r})",
            f"layer.get_parameter({block.expert_weights[1]!r})",
        ]
        if layout.mode == "expert_parallel":
            arguments.append(f"EXPERT_PLACEMENT_{index}")
        arguments += [f"top_k={block.top_k!r}", f"capacity_factor={block.capacity_factor!r}", "group=group"]
        owner = f"{path}.sharded_experts" if layout.sharded_copies else path  # where the runtime layer keeps them
        if layout.mode != "data_parallel":
            arguments.append("rank_losses_averaged=True")
            ignored += [f"{owner}.w_in", f"{owner}.w_out"]
        arguments.append(f"names={names!r}")
        if layout.mode == "expert_parallel" and per_node and layout.all_to_all == "hierarchical":
            arguments.append("exchange=two_level")
        if layout.sharded_copies:
            arguments.append("sharded_copies=True")
        lines.append(f"    layer = model.get_submodule({path!r})")
        lines.append(f"    replace_layer(model, {path!r}, {_RUNTIME_CLASSES[layout.mode]}(")
        lines += [f"        {argument}," for argument in arguments]
        lines.append("    ))")
        if layout.sharded_copies:
            lines += _shard_copies_lines(owner, copy_meshes[index], plan.precision)
    lines.append("")
    if plan.recompute in WHOLE_BLOCK_RECOMPUTE:
        keep = ", keep_exchanges=True" if plan.recompute == KEEP_A2A else ""
        lines += [
            "    # After the MoE layers are in place, before wrapping: the wrapper's hooks stay outside.",
            "    for path in RECOMPUTED_BLOCKS:",
            f"        recompute_in_backward_counting_once(model.get_submodule(path){keep})",
        ]
    if has_batch_norm(plan):
        lines += [
            "    # Batch norm normalises with the statistics of the whole global batch (every rank of \"dp\").",
            "    synchronise_batch_norm(model, dp_mesh.get_group())",
        ]
    lines += autocast_lines(plan, "model", "dp_mesh.device_type").splitlines()
    held = "Everything else (embeddings, attention, norms, head, every router, the experts of data-parallel layers)"
    # Parameters no op leads to the output from (DeepSeek-V4's compressors, unused at a short
    # sequence) get no gradient: DDP must be told, or it never all-reduces their bucket and
    # every gradient in it stays this rank's own (found by benchmarks/hf_sweep.py).
    unused = [name for name in unused_parameters(plan) if name not in ignored]
    lines += wrap_lines(plan, dp, held=held, ignored=ignored, unused=unused) + [""]
    text = "\n".join(lines) + "\n"
    if plan.dp_flavour == "zero1":
        text += sharded_states_optimizer(plan, rank_local=True)
    elif uses_ddp(plan) and _copy_groups(layouts):
        text += _split_groups_optimizer()
    return text


def _split_groups_optimizer() -> str:
    """``make_optimizer`` of a DDP program whose experts are sharded over their copies."""
    return '''

def make_optimizer(module: torch.nn.Module, mesh: DeviceMesh, optimizer_class: type, **kwargs):
    """optimizer_class(**kwargs) over module's parameters in two groups: DDP's replicated
    weights (plain tensors) and the expert shards (DTensors), which a multi-tensor step
    cannot take in one list."""
    return optimizer_class(plain_and_sharded_groups(module.parameters()), **kwargs)
'''


def _stacked_experts_lines(index: int, layout: ExpertLayout, block: MoEBlock, dp: int,
                           copies_mesh: str | None, precision: str) -> tuple[list[str], list[str]]:
    """Lines of ``parallelize`` for a HuggingFace MoE block (its own router kept, only its
    stacked experts run by the layout), and the parameters that become rank-local."""
    path = block.module  # checked against the model: a module path, written with repr()
    owner = block.expert_weights[0].rpartition(".")[0]  # "experts"
    head = comment(
        f"{block.module}: {block.experts} SwiGLU experts, top-{block.top_k}, dropless; "
        f"{layout.mode.replace('_', ' ')} over \"dp\". The block's router and shared experts run as the model wrote them."
    )
    if emitted_expert_kernel(block.runtime, layout.mode) == MODEL_EXPERTS:
        body = [
            "Every rank holds every expert and runs its own tokens' choices: no token moves, nothing is replaced.",
            "The experts are replicated weights like the rest: the wrapper averages their gradients.",
        ]
        return [""] + [f"    {line}" for line in [head, *map(comment, body)]], []
    if layout.mode != "expert_parallel":
        raise PlanningError(
            f"compiled programs run HuggingFace MoE block {block.module!r} expert parallel or replicated, not "
            f"{layout.mode.replace('_', ' ')}; re-plan"
        )
    body = [
        f"Only the block's experts are replaced: each rank keeps those EXPERT_PLACEMENT_{index} gives it (a copied",
        "expert's choices are split among its copies by their shares). Each token's choices travel to a rank holding",
        "their expert with one flat all-to-all over \"dp\" (uneven splits), the experts run there, and the outputs come",
        "back with a second all-to-all to be weighted by the router and summed. In backward each expert's gradient is",
        "divided by the group size (each rank's loss is a mean over its own tokens) and copies are summed.",
    ]
    lines = [""] + [f"    {line}" for line in [head, *map(comment, body)]]
    target = f"{path}.{owner}"
    lines += [
        f"    replace_layer(model, {target!r}, ExpertParallelExperts(",
        f"        model.get_submodule({target!r}),",
        f"        EXPERT_PLACEMENT_{index},",
        f"        top_k={block.top_k!r},",
        "        group=group,",
    ]
    lines += ["        sharded_copies=True,", "    ))"] if layout.sharded_copies else ["    ))"]
    if layout.sharded_copies:
        lines += _shard_copies_lines(target, copies_mesh, precision)
    return lines, [f"{path}.{name}" for name in block.expert_weights]


def _shard_copies_lines(owner: str, copies_mesh: str, precision: str) -> list[str]:
    """Lines sharding the module at ``owner`` (this rank's experts) over its copy group; in
    bf16 plans under ``BF16_FSDP_POLICY`` (``planner.program_shape.shards_expert_copies_in_bf16``)."""
    bf16 = shards_expert_copies_in_bf16(precision)
    return [
        "    # Each of this rank's experts sharded over the ranks holding its copies (FSDP2 on the copy mesh):",
        "    # all-gathered before the experts' forward and again before their backward, gradients",
        "    # reduce-scattered there (summed over the copies), optimizer states for the shard only."
        + (" bf16 gathers, fp32 reductions." if bf16 else ""),
        f"    shard_over_copies(model.get_submodule({owner!r}), {copies_mesh}"
        + (", mp_policy=BF16_FSDP_POLICY)" if bf16 else ")"),
    ]


def _copy_groups(layouts: list[tuple[int, ExpertLayout, MoEBlock]]) -> dict[tuple, list[int]]:
    """The distinct copy groups of the layouts with sharded copies (as ``literal``-ready
    tuples of "dp" positions), each with the indices of the layouts using it, in order."""
    found: dict[tuple, list[int]] = {}
    for index, layout, _ in layouts:
        if layout.sharded_copies:
            groups = tuple(tuple(int(rank) for rank in group) for group in layout.placement.copy_groups)
            found.setdefault(groups, []).append(index)
    return found


def _ranks_per_node(plan: Plan, layouts: list[tuple[int, ExpertLayout, MoEBlock]]) -> int:
    """Ranks per node of the two-level all-to-all when an expert-parallel layer plans one and
    the cluster has several equal nodes covering "dp"; 0 when every exchange is flat (on one
    node the two levels are one)."""
    wanted = any(layout.mode == "expert_parallel" and layout.all_to_all == "hierarchical" for _, layout, _ in layouts)
    if not wanted or plan.cluster.num_nodes < 2:
        return 0
    try:
        per_node = plan.cluster.devices_per_node
    except PlannerError:  # nodes of different sizes: no even two-level split
        return 0
    dp = plan.mesh.axis_size("dp")
    return per_node if 1 <= per_node < dp and dp % per_node == 0 else 0


def _exchange_words(layout: ExpertLayout, two_level: bool) -> str:
    """How the layer's all-to-all runs, for its comment."""
    if layout.all_to_all != "hierarchical":
        return "one flat all-to-all"
    return "two-level: inside the node, then across nodes" if two_level else "planned two-level, flat on one node"


def _layer_comment(index: int, layout: ExpertLayout, block: MoEBlock, dp: int, two_level: bool, plan: Plan) -> list[str]:
    """Comment lines saying how one MoE layer runs: what moves and why (``plan``'s flavour
    says what synchronises replicated experts)."""
    capacity = "dropless (every expert takes every token)" if block.capacity_factor == 0 else (
        f"capacity factor {block.capacity_factor:g}"
    )
    head = f"{block.module}: {block.experts} experts, top-{block.top_k}, {capacity}; {layout.mode.replace('_', ' ')} over \"dp\"."
    if layout.mode == "expert_parallel":
        body = [
            f"Each rank keeps the experts EXPERT_PLACEMENT_{index} gives it (a copied expert's slots are split among",
            "its copies by their shares). Each kept token choice travels to a rank holding its expert with one",
            f"all-to-all over \"dp\" (uneven splits; {_exchange_words(layout, two_level)}),",
            "the experts run as one batched matmul, and the outputs come back with a second all-to-all.",
            "Copies of an expert have their gradients summed over their holders in backward"
            + (" (reduce-scattered: each copy keeps a shard of the expert)." if layout.sharded_copies else "."),
        ]
    elif layout.mode == "data_parallel":
        body = [
            "Every rank holds every expert and runs its own tokens' kept choices: no token moves.",
            "The experts are replicated weights like the rest: "
            + (f"{wrapper_name(plan)} averages their gradients." if uses_ddp(plan) else
               f"{wrapper_name(plan)} shards them and reduce-scatters their gradients (averaged)."),
        ]
    else:
        body = [
            f"Each rank keeps 1/{dp} of every expert's hidden width ({block.ffn} units in all). Every rank's kept",
            "choices go to every rank (an all-to-all), each rank runs its slice of every expert on the whole",
            "batch's buffer, and the partial outputs go back to their tokens' ranks, summed over the slices",
            "(a reduce-scatter as an all-to-all).",
        ]
    return [comment(head)] + [comment(line) for line in body]
