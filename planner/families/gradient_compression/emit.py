"""The compressed programs: the ddp program of the plan, its DDP module given a
communication hook (``planner.families.gradient_compression.runtime.register_compression``).

The compiled ``model_spmd.py`` is the data-parallel program (``codegen.emit``) whose
``parallelize`` ends by registering the hook on the DDP module, and which names why
``launch.py --check`` cannot compare it with one device (``CHECK_REFUSAL``).

Codegen layer: imports the planner's vocabulary and ``codegen``, never search or cost_model.
Plan values reach the source only as ``repr()`` literals of checked numbers and bools.
"""

from __future__ import annotations

from codegen.data_parallel_emit import unused_parameters, wrap_lines
from codegen.emit import preparation_lines, render_data_parallel_program
from codegen.source_text import comment, literal
from planner.families.gradient_compression.section import HALF_REDUCE, POWERSGD, TOP_K, compression_of
from planner.plans import Plan

CHECK_REFUSAL = (
    "--check compares with one device, which a compressed plan cannot match (its gradients are lossy); run "
    "benchmarks/compression_convergence.py to compare its training loss with uncompressed training, or "
    "--steps N to train"
)
_DDP_RETURN = "    return DistributedDataParallel("


def compile_compressed_plan(plan: Plan) -> str:
    """The emitter part of the ``powersgd`` and ``top-k`` families (``planner.families``)."""
    return render_data_parallel_program(plan, _parallelize_source)


def _hook_arguments(plan: Plan) -> str:
    """``register_compression``'s arguments after the module, from the plan's section."""
    section = compression_of(plan)
    if POWERSGD in plan.sections:
        return (f"{literal(POWERSGD)}, rank={literal(section.rank)}, error_feedback={literal(section.error_feedback)}, "
                f"warm_start={literal(section.warm_start)}, start_iter=START_COMPRESSION_STEP")
    if HALF_REDUCE in plan.sections:
        return f"{literal(HALF_REDUCE)}, dtype={literal(section.dtype)}"
    return (f"{literal(TOP_K)}, fraction={literal(section.fraction)}, error_feedback={literal(section.error_feedback)}, "
            f"start_iter=START_COMPRESSION_STEP")


def _parallelize_source(plan: Plan, dp: int) -> str:
    """``parallelize``: the ddp program's, its DDP module kept to register the hook on."""
    wrapped = wrap_lines(plan, dp, held="The weights", unused=unused_parameters(plan))
    start = wrapped.index(_DDP_RETURN)  # the ddp flavour's wrap ends by returning the DDP module
    wrapped[start] = "    ddp_model = DistributedDataParallel("
    section = compression_of(plan)
    what = section.strategy_text(plan)
    lines = [
        "from torch.nn.parallel import DistributedDataParallel",
        "",
        "from planner.families.gradient_compression.runtime import register_compression",
        "",
        "# Why launch.py --check refuses this program (codegen.runtime.launcher reads it).",
        f"CHECK_REFUSAL = {literal(CHECK_REFUSAL)}",
        "# PowerSGD and top-k all-reduce uncompressed for their first steps (start_powerSGD_iter; 2 is the least",
        "# that keeps error feedback sound across DDP's bucket rebuild after step 1). PyTorch's docs suggest",
        "# ~10% of training for PowerSGD.",
        "START_COMPRESSION_STEP = 2",
        "",
        "",
        "def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:",
        f'    """This rank\'s module: the whole model, replicated over the {dp} ranks of "dp", its gradient',
        '    buckets compressed by a DDP communication hook."""',
        '    dp_mesh = mesh["dp"]',
        *preparation_lines(plan).splitlines(),
        *wrapped,
        "    " + comment(f"The hook registered here replaces DDP's all-reduce of each bucket. {what}."),
        f"    register_compression(ddp_model, {_hook_arguments(plan)})",
        "    return ddp_model",
    ]
    return "\n".join(lines) + "\n\n"
