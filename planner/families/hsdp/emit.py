"""HSDP's program: the fsdp program of the plan, its ``parallelize`` on a 2-D mesh.

The compiled ``model_spmd.py`` of a HSDP plan is its fsdp program (header, recomputation
table, precision and batch-norm imports, ``shard_batch``: ``codegen.emit``) with one
function written here: ``parallelize`` builds the ``replicate x shard`` mesh over the ``dp``
ranks (``planner.families.hsdp.runtime.hybrid_mesh``) and calls FSDP2's ``fully_shard`` on
every FSDP unit and the root with that mesh, which shards each parameter over ``"shard"``
and replicates it over ``"replicate"``.

Codegen layer: imports the planner's vocabulary and ``codegen``, never search or cost_model.
Plan text reaches the source only as ``repr()`` literals and inert comments
(``codegen.source_text``).
"""

from __future__ import annotations

import dataclasses

from codegen.emit import render_data_parallel_program
from codegen.source_text import number
from planner.errors import PlanningError
from planner.families.hsdp.section import HsdpSection
from planner.plans import Plan

# Where the fsdp program's parallelize starts and ends, and where its lines that prepare the
# model (batch norm, recomputation, mixed precision) end: the FSDP2 comment block.
_FSDP_START = "from torch.distributed.fsdp import fully_shard\n"
_MESH_LINE = '    dp_mesh = mesh["dp"]\n'
_FSDP_COMMENT = "    # Each unit keeps 1/"
_FSDP_END = "\n    return model\n"
_PLAN_LINE = "# Plan: "


def compile_hsdp_plan(plan: Plan) -> str:
    """The emitter part of the ``hsdp`` family (``planner.families``): the program of a plan
    with a ``"hsdp"`` section."""
    return render_hsdp_program(plan, plan.sections["hsdp"])


def render_hsdp_program(plan: Plan, section: HsdpSection) -> str:
    """Source of the ``model_spmd.py`` of ``plan`` (an fsdp plan on a ``dp`` mesh) with
    ``section``'s hybrid sharding: the fsdp program whose ``parallelize`` shards every FSDP
    unit over a shard group of ``section.shard`` ranks and replicates it over the groups.

    Raises:
        PlanningError: ``section`` does not fit ``plan`` (``HsdpSection.check``'s line).
    """
    try:
        section.check(plan)
    except ValueError as error:
        raise PlanningError(str(error)) from None
    fsdp = dataclasses.replace(plan, sections={name: s for name, s in plan.sections.items() if name != "hsdp"})
    before, prologue, after = _around_parallelize(render_data_parallel_program(fsdp))
    return _named(before, plan, section) + _parallelize_source(plan, section, prologue) + after


def _around_parallelize(program: str) -> tuple[str, str, str]:
    """The fsdp ``program`` cut around its ``parallelize`` (with its ``fully_shard`` import):
    the source before it, the lines of ``parallelize`` that prepare the model before FSDP2
    wraps it, and the source after it.

    A stand-in until ``codegen.emit`` shares the pieces it builds the fsdp program from; a
    change there that moves a mark fails here at once, never silently."""
    start = program.find(_FSDP_START)
    mesh_line = program.find(_MESH_LINE, start)
    fsdp_comment = program.find(_FSDP_COMMENT, mesh_line)
    end = program.find(_FSDP_END, fsdp_comment)
    if min(start, mesh_line, fsdp_comment, end) < 0 or program.count(_FSDP_START) != 1:
        raise AssertionError("the fsdp program's parallelize no longer has the marks HSDP's emitter cuts it at")
    end += len(_FSDP_END)
    return program[:start], program[mesh_line + len(_MESH_LINE):fsdp_comment], program[end:]


def _named(source: str, plan: Plan, section: HsdpSection) -> str:
    """``source`` with its ``# Plan: ...`` comment naming the hybrid sharding too."""
    lines = source.split("\n")
    index = next((i for i, line in enumerate(lines) if line.startswith(_PLAN_LINE)), None)
    if index is None:
        raise AssertionError("the fsdp program no longer names its plan in a '# Plan: ' comment")
    # The line is inert already (codegen.source_text); the words added are numbers.
    lines[index] = f"{lines[index].removesuffix(')')}; {section.describe(plan)})"
    return "\n".join(lines)


def _parallelize_source(plan: Plan, section: HsdpSection, prologue: str) -> str:
    """``parallelize`` of the HSDP program: ``prologue`` (the fsdp program's lines that
    prepare the model, which use ``dp_mesh``), the 2-D mesh, then ``fully_shard`` on every
    unit and the root over it."""
    dp = plan.mesh.axis_size("dp")
    shard = section.shard
    replicate = section.replicate(plan)
    units = "".join(  # module paths checked against the model by render_data_parallel_program (codegen.plan_checks)
        f"    fully_shard(model.get_submodule({unit!r}), mesh=hsdp_mesh)\n" for unit in plan.fsdp_units
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
    fully_shard(model, mesh=hsdp_mesh)
    return model
'''
