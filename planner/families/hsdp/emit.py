"""HSDP's program: the fsdp program of the plan, its ``parallelize`` on a 2-D mesh.

The compiled ``model_spmd.py`` of a HSDP plan is its fsdp program (header, recomputation
table, precision and batch-norm imports, ``shard_batch``:
``codegen.emit.render_data_parallel_program``) with one function written here: ``parallelize`` builds the ``replicate x shard`` mesh over the ``dp``
ranks (``planner.families.hsdp.runtime.hybrid_mesh``) and calls FSDP2's ``fully_shard`` on
every FSDP unit and the root with that mesh, which shards each parameter over ``"shard"``
and replicates it over ``"replicate"``.

Codegen layer: imports the planner's vocabulary and ``codegen``, never search or cost_model.
Plan text reaches the source only as ``repr()`` literals and inert comments
(``codegen.source_text``).
"""

from __future__ import annotations

import dataclasses

from codegen.emit import preparation_lines, render_data_parallel_program
from codegen.program_parts import fsdp_policy_option
from codegen.source_text import number
from planner.errors import PlanningError
from planner.families.hsdp.section import HsdpSection
from planner.plans import Plan



def compile_hsdp_plan(plan: Plan) -> str:
    """The emitter part of the ``hsdp`` family (``planner.families``): the program of a plan
    with a ``"hsdp"`` section."""
    return render_hsdp_program(plan, plan.sections["hsdp"])


def render_hsdp_program(plan: Plan, section: HsdpSection) -> str:
    """Source of the ``model_spmd.py`` of ``plan`` (an fsdp plan on a ``dp`` mesh) with
    ``section``'s hybrid sharding: the data-parallel program
    (``codegen.emit.render_data_parallel_program``) whose ``parallelize`` shards every FSDP
    unit over a shard group of ``section.shard`` ranks and replicates it over the groups.

    Raises:
        PlanningError: ``section`` does not fit ``plan`` (``HsdpSection.check``'s line).
    """
    try:
        # The plan with its section: the program's header names it (Plan.name).
        plan = dataclasses.replace(plan, sections={**plan.sections, "hsdp": section})
    except ValueError as error:
        raise PlanningError(str(error)) from None
    return render_data_parallel_program(plan, lambda plan, dp: _parallelize_source(plan, section))


def _parallelize_source(plan: Plan, section: HsdpSection) -> str:
    """``parallelize`` of the HSDP program: the lines that prepare the model as the fsdp
    program does (``codegen.emit.preparation_lines``: batch norm, recomputation, mixed
    precision, which use ``dp_mesh``), the 2-D mesh, then ``fully_shard`` on every unit and
    the root over it."""
    prologue = preparation_lines(plan)
    dp = plan.mesh.axis_size("dp")
    shard = section.shard
    replicate = section.replicate(plan)
    policy = fsdp_policy_option(plan)  # bf16 gathers, fp32 reductions in a bf16 plan
    units = "".join(  # module paths checked against the model by render_data_parallel_program (codegen.plan_checks)
        f"    fully_shard(model.get_submodule({unit!r}), mesh=hsdp_mesh{policy})\n" for unit in plan.fsdp_units
    )
    return f'''from torch.distributed.fsdp import fully_shard

from planner.families.hsdp.runtime import hybrid_mesh

# Ranks of one shard group: consecutive ranks of "dp", inside one node.
SHARD_GROUP = {number(shard, "hsdp.shard")}


def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """This rank's module: every parameter sharded on dim 0 over the {shard} ranks of its shard
    group and replicated over the {replicate} groups (HSDP: FSDP2 on a 2-D replicate x shard mesh)."""
    dp_mesh = mesh["dp"]
{prologue}    # The {dp} ranks of "dp" as a {replicate} x {shard} mesh ("replicate", "shard"): each row, a shard
    # group, is {shard} consecutive ranks; the ranks of a column hold the same shard.
    hsdp_mesh = hybrid_mesh(dp_mesh, SHARD_GROUP)
    # Each unit keeps 1/{shard} of its weights, gradients and optimizer states on this rank.
    # Before a unit's forward, and again before its backward, it all-gathers its weights over
    # "shard" (the next unit's gather is prefetched); after its backward it reduce-scatters its
    # gradients over "shard", all-reduces that shard over "replicate" (averaged over all {dp}
    # ranks) and frees the gathered weights. Only 1/{shard} of the gradients crosses "replicate".
{units}    # The root unit: every parameter outside the units above (embeddings, head, norms).
    fully_shard(model, mesh=hsdp_mesh{policy})
    return model
'''
