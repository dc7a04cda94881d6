"""Write a plan's per-rank program: ``model_spmd.py``, ``plan.json`` and ``launch.py``.

``model_spmd.py`` is meant to be read: it names the model's own modules, says on each
collective why it is there, and gives shapes global -> local. It defines two functions the
runtime (and a user's own training loop) calls: ``parallelize(model, mesh)`` and
``shard_batch(args, kwargs, mesh)``, and, when the plan's optimizer is not the plain one,
a third, ``make_optimizer(module, mesh, optimizer_class, **kwargs)`` (ZeRO-1 defines it;
``codegen.runtime.Program.make_optimizer`` uses it when present). A data-parallel plan
becomes (below): DDP (``ddp``); DDP plus ``ShardedStatesOptimizer`` over ``dp``
(``zero1``); FSDP2 units that keep their gathered weights from forward to backward
(``zero2``, FSDP1's SHARD_GRAD_OP); FSDP2 units (``fsdp``). Any other plan on a
``dp``/``tp`` mesh replays the traced graph on DTensors (``codegen.spmd_emit``).

Data-parallel programs run the user's model itself, so its attention runs the kernel the model
chooses (transformers takes the causal kernel when there is no padding); graph programs call
the causal kernel where the trace proved the mask causal (``codegen.causal_attention``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from codegen.data_parallel_emit import (
    DDP_FLAVOURS,
    FSDP_FLAVOURS,
    SHARDED_STATES_IMPORT,
    sharded_states_optimizer,
    shards_optimizer_states,
    unused_parameters,
    uses_ddp,
    wrap_lines,
    wrapper_import,
)
from codegen.index_inputs import index_inputs_source
from codegen.plan_checks import checked_plan
from codegen.program_parts import (
    about_plan,
    autocast_lines,
    has_batch_norm,
    precision_imports,
    recomputed_blocks,
    shard_batch_source,
)
from codegen.source_text import number
from planner import __version__
from planner.launch_command import check_fits_one_device, torchrun_parts
from planner.outputs import program_folder
from planner.plans import Plan
from planner.families import emitting_family

_DP_AXIS = "dp"


def write_program(plan: Plan, out_dir: Path, *, force: bool = False) -> Path:
    """Write the three files of ``plan``'s program into ``out_dir`` (created if needed).

    The files are written into a temporary folder beside ``out_dir`` and moved into place
    only when all of them were written (``planner.outputs.program_folder``): a failure
    leaves ``out_dir`` as it was. A non-empty folder that ``planner compile`` did not write is
    refused unless ``force`` (then the program's files are written into it, the user's
    other files kept); a folder it wrote before is replaced.

    Raises:
        OutputError: ``out_dir`` is a file, not writable, or a user's non-empty folder.
    """
    with program_folder(out_dir, force=force, version=__version__) as staging:
        plan.save(staging / "plan.json")
        (staging / "model_spmd.py").write_text(render_model_spmd(plan) + index_inputs_source(plan.graph))
        (staging / "launch.py").write_text(render_launch(plan))
    return out_dir


def render_model_spmd(plan: Plan) -> str:
    """Source of ``model_spmd.py``: written by the emitter of the family that claims the plan
    (``planner.families.emitting_family``: MoE layouts, pipelines, hybrid sharding, graph
    programs on DTensors, then the plain data-parallel flavours, in that order).

    Every name the plan gives is first checked against the model built from its spec
    (``codegen.plan_checks``), and plan text reaches the source only as ``repr()`` literals or
    inert comments (``codegen.source_text``).
    """
    family = emitting_family(plan)
    if family is None:
        raise NotImplementedError(f"codegen for plan {plan.name} is not written yet: no parallelism family compiles it")
    return family.part("emitter")(plan)


def render_data_parallel_program(plan: Plan, parallelize: Callable[[Plan, int], str] | None = None,
                                 shard_batch: Callable[[Plan, int], str] | None = None) -> str:
    """The emitter part of the data-parallel families (``planner.families``): a plain
    data-parallel plan (a ``dp`` mesh, every parameter replicated) becomes, by flavour, a
    DDP module (``ddp``), a DDP module with a ``ShardedStatesOptimizer`` from
    ``make_optimizer`` (``zero1``), or FSDP2 units with (``fsdp``) or without (``zero2``)
    resharding after forward.

    Args:
        parallelize: ``(plan, dp) -> source`` of the program's ``parallelize`` (and what it
            imports), for a family whose program is this one with the model wrapped another
            way (HSDP); it starts from ``preparation_lines``. Default: the flavour's.
        shard_batch: ``(plan, dp) -> source`` of the program's ``shard_batch``, for a family
            that slices the batch another way (uneven shares). Default: even rows.
    """
    plan = checked_plan(plan, graph_program=False)
    dp = plan.mesh.axis_size(_DP_AXIS)
    header = _header(plan)
    if plan.dp_flavour not in (*DDP_FLAVOURS, *FSDP_FLAVOURS):
        raise NotImplementedError(f"codegen for dp flavour '{plan.dp_flavour}' is not written yet")
    body = (parallelize or _data_parallel_body)(plan, dp)
    batch_norm = ["from codegen.runtime.batch_norm import synchronise_batch_norm"] if has_batch_norm(plan) else []
    imports = "".join(line + "\n\n" for line in precision_imports(plan) + batch_norm)
    return header + _recompute_table(plan) + imports + body + (shard_batch or shard_batch_source)(plan, dp)


def _recompute_table(plan: Plan) -> str:
    """The modules a recomputing plan checkpoints (whole blocks for ``"full"``, attention
    cores for ``"selective"``, ``codegen.attention_core``), and the helper that does it."""
    if plan.recompute == "none":
        return ""
    if plan.recompute == "selective":  # each block's attention core, when it is a module of its own
        from codegen.attention_core import selective_table

        return selective_table(plan)
    if plan.recompute != "full":
        raise NotImplementedError(f"codegen recomputes whole blocks or attention cores, not '{plan.recompute}'")
    blocks = recomputed_blocks(plan)
    rows = "".join(f"    {path!r},\n" for path in blocks)
    return (
        "from codegen.runtime.recompute import recompute_in_backward\n\n"
        "# Activation recomputation: these blocks keep only their inputs for backward and run\n"
        "# their forward again when backward reaches them (less memory, one more forward each).\n"
        f"RECOMPUTED_BLOCKS = (\n{rows})\n\n"
    )


def preparation_lines(plan: Plan) -> str:
    """Lines of ``parallelize`` that synchronise batch norm, checkpoint the blocks and set
    mixed precision, before DDP/FSDP2 wrap the model (so their hooks stay outside the
    recomputed forward)."""
    lines = ""
    if has_batch_norm(plan):
        lines += (
            "    # Batch norm normalises with the statistics of the whole global batch (every rank of \"dp\"),\n"
            "    # as on one device: two all-reduces of per-channel sums per layer in forward and backward.\n"
            "    synchronise_batch_norm(model, dp_mesh.get_group())\n"
        )
    if plan.recompute != "none":
        lines += (
            "    for path in RECOMPUTED_BLOCKS:  # before wrapping: the wrapper's hooks stay outside\n"
            "        recompute_in_backward(model.get_submodule(path))\n"
        )
    return lines + autocast_lines(plan, "model", "dp_mesh.device_type")


def render_launch(plan: Plan) -> str:
    """Source of ``launch.py``, the torchrun entry point (it names no plan text: plan.json
    beside it says which plan it runs)."""
    run = " ".join(torchrun_parts(plan, "launch.py"))
    run_note = (f"on each of the {number(plan.cluster.num_nodes, 'nodes')} nodes, MASTER_ADDR = the first node's address:\n\n"
                if plan.cluster.num_nodes > 1 else "")
    too_big = "" if check_fits_one_device(plan) else " (this model is too big for one: use --steps)"
    return f'''"""torchrun entry point of the compiled plan in this folder (plan.json; model_spmd.py says which).

{run_note}    {run} --check      # one step sharded vs one device{too_big}
    {run} --steps 10   # train on synthetic data, print step times

Generated by soap-planner {__version__}. Needs the soap-planner package installed.
"""

import sys
from pathlib import Path

from codegen.runtime.launcher import exit_now, main

if __name__ == "__main__":
    exit_now(main(Path(__file__).resolve().parent, sys.argv[1:]))
'''


def _header(plan: Plan) -> str:
    return f'''"""Per-rank program of a data-parallel plan (which plan, model and cluster: the comments below).

Generated by soap-planner {__version__} from plan.json; it is plain PyTorch, review it freely.
Use it in your own training loop:

    from codegen.runtime import load_program
    program = load_program("{'<this folder>'}")
    mesh = program.build_mesh()
    module = program.parallelize(model, mesh)           # model built identically on every rank
    optimizer = program.make_optimizer(module, mesh, torch.optim.AdamW, lr=1e-3)
    loss, output = program.forward_backward(module, args, kwargs, mesh)  # global batch in, sharded here,
    optimizer.step()                                                   # in ACCUMULATION_STEPS micro-batches

{_optimizer_note(plan)}
"""

{about_plan(plan)}
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

MESH_AXES = {tuple(plan.mesh.axes)!r}
GLOBAL_BATCH = {number(plan.batch_size, "batch_size")}
{_accumulation_line(plan)}
'''


def _accumulation_line(plan: Plan) -> str:
    """The constant saying how many micro-batches a step accumulates gradients over."""
    steps = number(plan.accumulation_steps, "accumulation_steps")
    why = (
        "each rank's part of the batch runs forward and backward in this many\n"
        "# micro-batches, one after another (one micro-batch's activations at a time; DDP reduces\n"
        "# gradients after the last)"
        if plan.accumulation_steps > 1
        else "none (each rank's part of the batch runs forward and backward at once)"
    )
    return f"# Gradient accumulation: {why}.\nACCUMULATION_STEPS = {steps}\n"


def _optimizer_note(plan: Plan) -> str:
    """The header's line on ``program.make_optimizer``: what builds this program's optimizer."""
    if shards_optimizer_states(plan):
        return (
            "program.make_optimizer builds the optimizer through make_optimizer below, which shards\n"
            'its states over "dp" (ZeRO-1); call make_optimizer(module, mesh, optimizer_class, **kwargs)\n'
            "directly in a loop of your own."
        )
    return (
        "program.make_optimizer builds optimizer_class(module.parameters(), **kwargs) (a program that\n"
        "shards optimizer states defines make_optimizer(module, mesh, optimizer_class, **kwargs) instead)."
    )


def _data_parallel_body(plan: Plan, dp: int) -> str:
    """``parallelize`` (and ZeRO-1's ``make_optimizer``) of a data-parallel plan: the model
    prepared (batch norm, recomputation, mixed precision), then wrapped by its flavour
    (``codegen.data_parallel_emit``)."""
    sharded = "" if uses_ddp(plan) else (
        f"every parameter sharded on dim 0 over the {dp} ranks of \"dp\" (FSDP2 units"
        + (", ZeRO-2)" if plan.dp_flavour == "zero2" else ")")
    )
    what = sharded or f'the whole model, replicated over the {dp} ranks of "dp"'
    imports = [wrapper_import(plan)] + ([SHARDED_STATES_IMPORT] if shards_optimizer_states(plan) else [])
    lines = [
        *imports,
        "",
        "",
        "def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:",
        f'    """This rank\'s module: {what}."""',
        '    dp_mesh = mesh["dp"]',
        *preparation_lines(plan).splitlines(),
        *wrap_lines(plan, dp, held="The weights", unused=unused_parameters(plan)),
    ]
    text = "\n".join(lines) + "\n\n"
    return text + sharded_states_optimizer(plan)
