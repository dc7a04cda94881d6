"""The data-parallel part of every program, written once: how the weights that every rank of
"dp" holds alike are wrapped, and ZeRO-1's ``make_optimizer``.

By the plan's flavour (``Plan.dp_flavour``) the end of a program's ``parallelize`` is:

- ``ddp``: ``DistributedDataParallel`` around the model; gradients averaged over "dp" by
  bucketed all-reduces during backward;
- ``zero1``: the same DDP, plus a ``make_optimizer`` whose optimizer keeps states for this
  rank's share of the weights only (below);
- ``zero2``: FSDP2 units (``fully_shard``) that keep their gathered weights from forward to
  backward (``reshard_after_forward=False``, FSDP1's SHARD_GRAD_OP);
- ``fsdp``: FSDP2 units, weights gathered for forward and again for backward.

The plain data-parallel program (``codegen.emit``) and the MoE program
(``codegen.moe_emit``, which also keeps each rank's own experts out of the wrapper) end
their ``parallelize`` with ``wrap_lines``; graph and pipeline programs (whose weights are
DTensors, their gradients reduced by the program's hooks) take only ZeRO-1's optimizer.

ZeRO-1 is ``codegen.runtime.sharded_states.ShardedStatesOptimizer`` for every program
(``sharded_states_optimizer``): each rank steps its 1/dp slice of every weight and
all-gathers the updated slices. It works for every caller: on plain tensors under DDP (the
data-parallel program), on DTensors beside tp or pp (graph and pipeline programs), and
beside an MoE layer's rank-local experts, which it steps whole (``rank_local``) since no
other rank has them. The simulator prices the same slices and gathers
(``cost_model.data_parallel_step``).

Module paths reach the source only as ``repr()`` of paths checked against the model
(``codegen.plan_checks``); plan figures only as numbers in comments.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from codegen.program_parts import fsdp_policy_option
from codegen.source_text import comment, literal
from planner.plans import Plan
from planner.units import format_bytes

DDP_FLAVOURS = ("ddp", "zero1")  # the replicated weights wrapped in DDP
FSDP_FLAVOURS = ("zero2", "fsdp")  # ... in FSDP2 units
SHARDED_STATES_IMPORT = "from codegen.runtime.sharded_states import ShardedStatesOptimizer"


def uses_ddp(plan: Plan) -> bool:
    """Whether the plan's replicated weights are wrapped in DDP (``ddp``, ``zero1``) rather
    than FSDP2 units (``zero2``, ``fsdp``)."""
    return plan.dp_flavour in DDP_FLAVOURS


def wrapper_name(plan: Plan) -> str:
    """The wrapper as a program's comments name it: ``DDP`` or ``FSDP2``."""
    return "DDP" if uses_ddp(plan) else "FSDP2"


def wrapper_import(plan: Plan) -> str:
    """The import line of the wrapper ``wrap_lines`` calls."""
    return "from torch.nn.parallel import DistributedDataParallel" if uses_ddp(plan) else "from torch.distributed.fsdp import fully_shard"


def wrap_lines(plan: Plan, dp: int, *, held: str, ignored: Sequence[str] = (), unused: Sequence[str] = ()) -> list[str]:
    """The last lines of ``parallelize``: the model (``dp_mesh`` is its "dp" sub-mesh) wrapped
    by the plan's flavour and returned.

    Args:
        held: what the wrapper holds, for the comment (``"The weights"``, ``"Everything
            else (...)"``).
        ignored: qualified names of parameters that differ from rank to rank (an MoE
            layer's own experts): kept out of the wrapper, never averaged nor sharded.
        unused: parameters with no path to the output (``unused_parameters``): DDP is told
            to look for them, or their bucket would never be all-reduced.
    """
    if uses_ddp(plan):
        return _ddp_lines(plan, held, ignored, unused)
    return _fsdp_lines(plan, dp, held, ignored)


def unused_parameters(plan: Plan) -> list[str]:
    """Parameters of the traced model whose ops do not lead to the model's output (e.g. a
    pooler that a classification head computes and drops), so backward never gives them a
    gradient; in the model's order, empty without a traced graph."""
    graph = plan.graph
    if graph is None or graph.graph_module is None:
        return []
    output = next(node for node in graph.graph_module.graph.nodes if node.op == "output")
    reached, stack = set(), [output]
    while stack:
        node = stack.pop()
        for source in node.all_input_nodes:
            if source.name not in reached:
                reached.add(source.name)
                stack.append(source)
    read = {param for node in graph.nodes if node.name in reached for param in node.params}
    return [name for name in graph.parameters if name not in read]


def _comment_lines(text: str) -> list[str]:
    """``text`` as comment lines of ``parallelize``'s body, wrapped at 100 columns."""
    return [f"    # {line}" for line in textwrap.wrap(text, width=94, break_on_hyphens=False)]


def _ddp_lines(plan: Plan, held: str, ignored: Sequence[str], unused: Sequence[str]) -> list[str]:
    lines = []
    if ignored:
        lines += _comment_lines(
            "Expert weights that differ from rank to rank (each rank's own experts or slices): DDP must neither "
            "broadcast nor average them. Their gradients arrive whole from every rank's tokens through the "
            "all-to-all's backward, divided by the group size in the layer."
        ) + [
            f"    EXPERT_WEIGHTS_OUTSIDE_DDP = {literal(tuple(ignored))}",
            "    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, EXPERT_WEIGHTS_OUTSIDE_DDP)",
        ]
    step = (
        "then make_optimizer's optimizer (below) steps this rank's share of them (ZeRO-1)"
        if plan.dp_flavour == "zero1" else "every rank then takes the same optimizer step"
    )
    lines.append('    device_ids = [torch.cuda.current_device()] if dp_mesh.device_type == "cuda" else None')
    lines += _comment_lines(
        f"{held}: replicated. During backward DDP averages their gradients over \"dp\" with bucketed all-reduces "
        f"({_bucket_note(plan, ignored)}) that overlap with the rest of backward; {step}."
    )
    return lines + [
        "    return DistributedDataParallel(",
        "        model,",
        "        device_ids=device_ids,",
        "        process_group=dp_mesh.get_group(),",
        "        gradient_as_bucket_view=True,  # gradients live in the buckets: no second copy",
        *_unused_parameters_lines(unused),
        "    )",
    ]


def _bucket_note(plan: Plan, ignored: Sequence[str]) -> str:
    """DDP's buckets, and the bytes they all-reduce when every weight is in them."""
    total = "" if ignored else f", all-reduce of {format_bytes(plan.summary.parameter_bytes)} in total"
    return f"25 MiB buckets{total}"


def _unused_parameters_lines(unused: Sequence[str]) -> list[str]:
    """DDP's argument for parameters forward never reads: without it their bucket is never
    all-reduced, and the gradients in it (also those of parameters that are used) stay
    this rank's own, silently (found on CLIP's image classifier, whose pooler is unused)."""
    if not unused:
        return []
    shown = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
    return [
        "        " + comment(f"{len(unused)} parameter(s) with no path to the output ({shown}) get no gradient: without this DDP"),
        "        " + comment("never all-reduces their bucket, and every gradient in it stays this rank's own"),
        "        find_unused_parameters=True,",
    ]


def _fsdp_lines(plan: Plan, dp: int, held: str, ignored: Sequence[str]) -> list[str]:
    keep = plan.dp_flavour == "zero2"
    gathered = (
        "and, with reshard_after_forward=False, keeps them gathered until its backward is done (no second "
        f"all-gather in backward, at the cost of holding the whole model's weights, "
        f"{format_bytes(plan.summary.parameter_bytes)}, during the step)"
        if keep else "and again before its backward"
    )
    lines = _comment_lines(
        f"{held}: sharded on dim 0 over the {dp} ranks of \"dp\" by FSDP2 units"
        + (" (ZeRO-2, FSDP1's SHARD_GRAD_OP)" if keep else "")
        + f". Each unit keeps 1/{dp} of its weights (gathered only while it runs), gradients and optimizer states. "
        f"A unit all-gathers its weights over \"dp\" before its forward (the next unit's gather is prefetched) "
        f"{gathered}; after its backward it reduce-scatters its gradients over \"dp\" (averaged) and frees the "
        "gathered weights."
    )
    options = "mesh=dp_mesh" + (", reshard_after_forward=False" if keep else "") + fsdp_policy_option(plan)
    if fsdp_policy_option(plan):
        lines += _comment_lines(
            "Mixed precision as torchtitan shards it (BF16_FSDP_POLICY): each unit casts its fp32 shard to bf16 and "
            "all-gathers bf16, computes with bf16 weights, and reduce-scatters its gradients in fp32 into the fp32 "
            "shards the optimizer steps."
        )
    if ignored:
        options += ", ignored_params=expert_weights"
        lines += _comment_lines(
            "Expert weights that differ from rank to rank (each rank's own experts or slices) stay whole and "
            "unsynchronised: their gradients arrive whole from every rank's tokens through the all-to-all's "
            "backward, divided by the group size in the layer."
        ) + [
            f"    EXPERT_WEIGHTS_OUTSIDE_FSDP = {literal(tuple(ignored))}",
            "    expert_weights = {model.get_parameter(name) for name in EXPERT_WEIGHTS_OUTSIDE_FSDP}",
        ]
    for unit in plan.fsdp_units:  # module paths checked against the model (codegen.plan_checks)
        lines.append(f"    fully_shard(model.get_submodule({unit!r}), {options})")
    return lines + [
        "    # The root unit: every parameter outside the units above.",
        f"    fully_shard(model, {options})",
        "    return model",
    ]


def shards_optimizer_states(plan: Plan) -> bool:
    """Whether ``plan``'s program splits its optimizer states over ``dp`` (ZeRO-1 on a real
    ``dp`` axis)."""
    mesh = plan.mesh
    return plan.dp_flavour == "zero1" and "dp" in mesh.names and mesh.axis_size("dp") > 1


def sharded_states_optimizer(plan: Plan, *, rank_local: bool = False) -> str:
    """``make_optimizer`` building a ``ShardedStatesOptimizer`` over "dp" ("" unless
    ``shards_optimizer_states``); with ``rank_local`` the parameters that
    ``codegen.runtime.moe.rank_local_parameters`` names are stepped whole on their rank."""
    if not shards_optimizer_states(plan):
        return ""
    dp = plan.mesh.axis_size("dp")
    if rank_local:
        return f'''

def make_optimizer(module: torch.nn.Module, mesh: DeviceMesh, optimizer_class: type, **kwargs):
    """optimizer_class(**kwargs) over module's parameters, the states of the replicated ones
    split over the {dp} ranks of "dp" (ZeRO-1)."""
    # Each rank steps its 1/{dp} of every replicated weight (with the gradient DDP averaged)
    # and keeps optimizer states for that piece only; the updated pieces are then all-gathered
    # over "dp" so every replica holds the same weights again. Each rank's own experts (or
    # expert slices) are stepped whole on it, with their own states: no other rank has them.
    return ShardedStatesOptimizer(
        module.parameters(), mesh, "dp", optimizer_class, rank_local=rank_local_parameters(module), **kwargs
    )
'''
    return '''

def make_optimizer(module: torch.nn.Module, mesh: DeviceMesh, optimizer_class, **kwargs):
    """ZeRO-1 over "dp" (Megatron-LM's distributed optimizer): weights and their gradients
    stay whole over dp (gradients all-reduced in backward); each rank steps 1/dp of every
    weight, so the optimizer states take 1/dp of the memory, then the updated pieces are
    all-gathered over dp."""
    return ShardedStatesOptimizer(module.parameters(), mesh, "dp", optimizer_class, **kwargs)
'''
