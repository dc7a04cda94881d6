"""Pieces of generated source that every emitter shares: the plan named in comments, the
mixed-precision lines, the batch-norm test, the recomputed blocks and a data-parallel
``shard_batch``.

Below the emitters (``codegen.emit`` dispatches to them; ``codegen.moe_emit``,
``codegen.spmd_sections`` and ``codegen.pipeline_sections`` build programs with these), so
none of them imports the dispatcher. Plan text enters the source only through
``codegen.source_text`` (comments, ``repr``).
"""

from __future__ import annotations

from codegen.source_text import comment, one_line
from planner.errors import PlanningError
from planner.plans import Plan
from planner.program_shape import wraps_bf16_fsdp_units
from planner.strategy import placements_str


def has_batch_norm(plan: Plan) -> bool:
    """Whether the plan's model normalises with batch statistics (a BatchNorm layer)."""
    return any("batch_norm" in strategy.op for strategy in plan.strategies)


def precision_imports(plan: Plan) -> list[str]:
    """The import lines ``autocast_lines`` and ``fsdp_policy_option`` need (none for an fp32 plan)."""
    if plan.precision == "fp32":
        return []
    if wraps_bf16_fsdp_units(plan):
        return ["from codegen.runtime.precision import BF16_FSDP_POLICY, run_in_autocast"]
    return ["from codegen.runtime.precision import run_in_autocast"]


def fsdp_policy_option(plan: Plan) -> str:
    """The ``mp_policy`` argument of ``fully_shard`` in ``plan``'s program: bf16 gathers and
    fp32 reductions in a bf16 plan (``codegen.runtime.precision.BF16_FSDP_POLICY``, which the
    simulator prices: ``cost_model.mixed_precision``), none otherwise."""
    return ", mp_policy=BF16_FSDP_POLICY" if wraps_bf16_fsdp_units(plan) else ""


def autocast_lines(plan: Plan, module: str, device_type: str) -> str:
    """Lines that run ``module``'s forward in the plan's mixed precision (bf16 autocast);
    none for an fp32 plan."""
    if plan.precision == "fp32":
        return ""
    if plan.precision != "bf16":
        raise PlanningError(f"compiled programs run fp32 or bf16, not {one_line(plan.precision)!r}; plan with --precision bf16")
    units = (
        "    # Inside FSDP2's units the gathered weights are bf16 already (BF16_FSDP_POLICY below);\n"
        "    # their fp32 shards are what the optimizer steps, their gradients reduced in fp32.\n"
    ) if wraps_bf16_fsdp_units(plan) else ""
    return (
        "    # Mixed precision (bf16): forward under torch.autocast, matmuls in bf16; weights,\n"
        "    # gradients and optimizer states stay fp32.\n"
        f"{units}"
        f"    run_in_autocast({module}, {device_type}, torch.bfloat16)\n"
    )


def recomputed_blocks(plan: Plan) -> tuple[str, ...]:
    """Module paths of the repeated blocks (what ``recompute='full'`` checkpoints), from the
    plan's traced graph, or by tracing its model on meta tensors."""
    graph = plan.graph
    if graph is None:
        from codegen.graph_facts import build_meta_model, trace_model

        graph = trace_model(*build_meta_model(plan))
    blocks = graph.block_paths()
    if not blocks:
        raise PlanningError(
            "this plan recomputes activations, but the model has no repeated blocks to checkpoint; plan it again "
            "(recomputation only applies to repeated blocks)"
        )
    return blocks


def about_plan(plan: Plan) -> str:
    """Comment lines naming the plan, its model and its cluster, for the top of a generated
    file. This is text from plan.json, so it goes in comments (one inert line each), never
    in a docstring."""
    source = plan.model.describe() if plan.model else plan.summary.name
    lines = [
        f"Plan: {plan.name}",
        f"Model: {source}",
        f"Mesh: {plan.mesh} over {plan.world_size} ranks of cluster {plan.cluster.name}; global batch {plan.batch_size}.",
    ]
    return "".join(comment(line) + "\n" for line in lines)


def shard_batch_source(plan: Plan, dp: int) -> str:
    """``shard_batch`` of a data-parallel program: inputs placed ``S(0)`` over "dp" split by
    rows, the others whole (with a comment line per input)."""
    comments = []
    for name, placements in plan.inputs.items():
        if placements is None:
            comments.append(comment(f"  {name}: not a tensor, passed unchanged"))
        elif placements_str(placements) == "(S(0))":
            comments.append(comment(f"  {name}: {placements_str(placements)}, batch {plan.batch_size} -> {plan.batch_size // dp} per rank"))
        else:
            comments.append(comment(f"  {name}: {placements_str(placements)}, the same on every rank"))
    sharded = tuple(name for name, p in plan.inputs.items() if p is not None and placements_str(p) == "(S(0))")
    return f'''
# Inputs of one step (placements over "dp"):
{chr(10).join(comments)}
BATCH_SHARDED_INPUTS = {sharded!r}
INPUT_NAMES = {tuple(plan.inputs)!r}


def shard_batch(args: tuple, kwargs: dict, mesh: DeviceMesh) -> tuple[tuple, dict]:
    """This rank's slice of one global batch: inputs sharded on dim 0 over "dp" keep rows
    [rank * B/{dp}, (rank + 1) * B/{dp}); the others are passed whole."""
    rank, size = mesh.get_local_rank("dp"), mesh.size(mesh.mesh_dim_names.index("dp"))

    def local(name, value):
        if name in BATCH_SHARDED_INPUTS:
            return value.chunk(size, dim=0)[rank]
        return value

    names = iter(INPUT_NAMES)
    local_args = tuple(local(next(names), value) for value in args)
    local_kwargs = {{key: local(key, value) for key, value in kwargs.items()}}
    return local_args, local_kwargs
'''
