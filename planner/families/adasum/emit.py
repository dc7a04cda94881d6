"""Adasum's program: the ddp program of the plan with Adasum as DDP's communication hook.

The compiled ``model_spmd.py`` of an Adasum plan is its ddp program (header, precision and
batch-norm imports, ``shard_batch``: ``codegen.emit.render_data_parallel_program``) whose
``parallelize`` (written here) registers ``planner.families.adasum.runtime.adasum_hook`` on
the DDP module: each gradient bucket is averaged inside a node, then combined across nodes
by Adasum instead of averaged.

Codegen layer: imports the planner's vocabulary and ``codegen``, never search or cost_model.
Plan figures reach the source only through ``codegen.source_text.number``.
"""

from __future__ import annotations

import dataclasses
import textwrap

from codegen.emit import preparation_lines, render_data_parallel_program
from codegen.source_text import number
from planner.errors import PlanningError
from planner.families.adasum.section import AdasumSection
from planner.plans import Plan


def compile_adasum_plan(plan: Plan) -> str:
    """The emitter part of the ``adasum`` family (``planner.families``): the program of a
    plan with an ``"adasum"`` section.

    Raises:
        PlanningError: the section does not fit the plan (``AdasumSection.check``'s line).
    """
    section = plan.sections["adasum"]
    try:
        plan = dataclasses.replace(plan, sections={**plan.sections, "adasum": section})
    except ValueError as error:
        raise PlanningError(str(error)) from None
    return render_data_parallel_program(plan, lambda plan, dp: _parallelize_source(plan, section))


def _parallelize_source(plan: Plan, section: AdasumSection) -> str:
    """``parallelize``: the model prepared as the ddp program prepares it, wrapped in DDP,
    Adasum registered as its communication hook."""
    dp = plan.mesh.axis_size("dp")
    local = section.local
    copies = section.copies(plan)
    inside = f"averaged over the {local} ranks of this rank's node (an all-reduce), then " if local > 1 else ""
    why = textwrap.wrap(
        f"Every gradient bucket, once backward has filled it, is {inside}combined across the {copies} copies by "
        f"Adasum, tensor by tensor: log2({copies}) swaps of the whole bucket with the rank at distance 1, 2, 4, "
        f"... copies, and (1 - g1.g2/(2|g1|^2)) g1 + (1 - g1.g2/(2|g2|^2)) g2 on each pair.", width=94)
    comment = "".join(f"    # {line}\n" for line in why)
    return f'''from torch.nn.parallel import DistributedDataParallel

from planner.families.adasum.runtime import adasum_hook, adasum_state

# Ranks averaged inside a node before Adasum combines the {copies} node gradients.
LOCAL_RANKS = {number(local, "adasum.local")}


def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """This rank's module: the whole model, replicated over the {dp} ranks of "dp", its
    gradients combined by Adasum instead of averaged."""
    dp_mesh = mesh["dp"]
{preparation_lines(plan)}    device_ids = [torch.cuda.current_device()] if dp_mesh.device_type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=dp_mesh.get_group())
{comment}    state = adasum_state(dp_mesh.mesh.flatten().tolist(), LOCAL_RANKS, torch.distributed.get_rank())
    ddp.register_comm_hook(state, adasum_hook)
    return ddp
'''
