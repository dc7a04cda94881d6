"""Write ``model_spmd.py`` for a pipeline whose stages have different widths (the emitter part
of the ``hetero-pp`` family for plans whose section gives ``widths``; the layouts are
``planner.families.hetero_pipeline.widths``'s).

The stage modules are the pipeline family's (``codegen.pipeline_emit``), written for a
*template* of the plan: the same ops, stages and placements on a mesh of one rank per stage
(``pp`` = the number of stages) and the plan's micro-batch count, which for these plans counts
*units* (``codegen.runtime.uneven_width_pipeline``: ``micro_batches x lcm(widths)``), so the
program is traced at one unit's rows and every stage's ranks run it at those shapes. Only the
program's entry points differ from an even pipeline's: ``parallelize`` builds the stage of this
rank's place among the widths, ``shard_batch`` leaves the whole batch (the schedule takes each
rank's units' rows) and ``make_pipeline`` returns the ``UnevenWidthRunner`` (GPipe, row slices
sent between ranks of stages of different widths, gradients summed over each stage's ranks).

Not compiled (``unsupported``): a plan whose pipeline is not GPipe of one virtual stage, not in
fp32 (no bf16 parity checked yet), whose data-parallel flavour is not DDP, or whose units do
not divide the batch.
"""

from __future__ import annotations

import dataclasses
import math

from codegen.pipeline_emit import render_pipeline_program
from codegen.plan_checks import checked_plan
from codegen.source_text import number
from planner.cluster import Cluster
from planner.plans import Plan
from planner.strategy import Mesh

JSON_KEY = "hetero-pp"  # the plan section (planner.families.hetero_pipeline.section)
ENTRY_POINTS = "\n\ndef parallelize("  # where the even pipeline's entry points start in its program

__all__ = ["compile_uneven_width_plan", "template_plan", "unsupported"]


def unsupported(plan: Plan) -> str | None:
    """Why ``plan``, a pipeline of stages of different widths, cannot be compiled (one line), or
    None (also for any other plan: ``planner.api.compile_blocker`` asks every pipeline plan)."""
    section = plan.sections.get(JSON_KEY)
    widths = section.widths if section is not None else ()
    pipeline = plan.pipeline
    if not widths or pipeline is None:
        return None
    if pipeline.schedule != "gpipe" or pipeline.virtual_stages != 1:
        return (f"pipeline stages of different widths run GPipe with one virtual stage, not {pipeline.schedule} with "
                f"{pipeline.virtual_stages}; plan it again")
    if plan.precision != "fp32":
        return (f"pipeline stages of different widths are compiled in fp32, not {plan.precision}; plan it with "
                f"--precision fp32")
    if plan.dp_flavour != "ddp":
        return (f"pipeline stages of different widths replicate each stage's weights over its ranks (ddp), not "
                f"{plan.dp_flavour}; plan it with ddp")
    if pipeline.micro_batches % math.lcm(*widths) or plan.batch_size % pipeline.micro_batches:
        return (f"the pipeline's {pipeline.micro_batches} units do not fill micro-batches of lcm{tuple(widths)} units "
                f"or do not divide the batch {plan.batch_size}; plan it again")
    return None


def template_plan(plan: Plan) -> Plan:
    """``plan`` on one rank per stage (its mesh ``pp`` = the stages, a cluster of as many of
    its first node's devices, no section): what the pipeline emitter writes the stages from."""
    stages = len(plan.sections[JSON_KEY].widths)
    node = plan.cluster.nodes[0]
    cluster = Cluster(f"{plan.cluster.name}-stages"[:120], (dataclasses.replace(node, devices=stages, site=""),),
                      plan.cluster.inter_link, plan.cluster.backend)
    return dataclasses.replace(plan, cluster=cluster, mesh=Mesh((("pp", stages),)), sections={},
                               pipeline=dataclasses.replace(plan.pipeline, stages=stages))


def compile_uneven_width_plan(plan: Plan) -> str:
    """The emitter part of the ``hetero-pp`` family for stages of different widths: the plan's
    names checked against its model, the stage modules written from ``template_plan``, the
    entry points replaced by this layout's (module docstring).

    Raises:
        NotImplementedError: a plan ``unsupported`` names.
    """
    reason = unsupported(plan)
    if reason:
        raise NotImplementedError(reason)
    checked = checked_plan(plan, graph_program=True)
    template = template_plan(checked)
    source = render_pipeline_program(template)
    # The program runs on the plan's mesh (pp = every rank; launch.py checks it against
    # plan.json), not the template's one rank per stage.
    template_mesh = f"MESH_AXES = {tuple(template.mesh.axes)!r}\n"
    if source.count(template_mesh) != 1 or source.count(ENTRY_POINTS) != 1:
        raise NotImplementedError("the pipeline program's layout changed: its MESH_AXES line or entry points moved")
    stages_part, _ = source.replace(template_mesh, f"MESH_AXES = {tuple(plan.mesh.axes)!r}\n").split(ENTRY_POINTS)
    return stages_part + _entry_points(plan.sections[JSON_KEY].widths)


def _entry_points(widths: tuple[int, ...]) -> str:
    """This layout's ``parallelize``, ``shard_batch`` and ``make_pipeline``."""
    return f'''

# Stages of different widths (codegen.runtime.uneven_width_pipeline): stage s runs data parallel
# on WIDTHS[s] consecutive ranks. MICRO_BATCHES counts units of one traced micro-batch's rows;
# a micro-batch is lcm(WIDTHS) units, each rank of stage s running lcm / WIDTHS[s] of them.
from codegen.runtime.uneven_width_pipeline import UnevenWidthRunner, build_width_stage

WIDTHS = ({", ".join(number(width, "hetero-pp.widths") for width in widths)},)


def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> PipelineStageModule:
    """This rank's stage (its place among WIDTHS), whole on this rank: the stage's parameters
    become DTensors over a one-rank mesh (no communication)."""
    return build_width_stage(STAGES, model, mesh, WIDTHS, PARAMETERS, STAGE_PARAMETERS, DROPOUT_MODULES)


def shard_batch(args: tuple, kwargs: dict, mesh: DeviceMesh) -> tuple[tuple, dict]:
    """The whole batch: every rank holds it, and the schedule takes its units' rows."""
    return args, kwargs


def make_pipeline(module: PipelineStageModule, mesh: DeviceMesh) -> UnevenWidthRunner:
    """GPipe over MICRO_BATCHES units: pipeline.step(args, kwargs) runs one step's forward and
    backward, gradients summed over each stage's ranks, and returns the loss."""
    return UnevenWidthRunner(module, WIDTHS, MICRO_BATCHES, STAGE_INPUTS, INPUT_NAMES, SHARED_PARAMETERS)
'''
