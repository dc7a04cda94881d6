"""Pipeline schedules in compiled programs: which ``torch.distributed.pipelining`` schedule runs
a plan's pipeline, how many stage modules it has, and where each runs.

- ``gpipe`` (``ScheduleGPipe``) and ``1f1b`` (``Schedule1F1B``): one stage per rank of ``pp``;
  stage ``s`` runs on the ranks at pp coordinate ``s``.
- ``interleaved`` (``ScheduleInterleaved1F1B``, Narayanan et al. 2021): ``pp x v`` virtual
  stages (the plan's ``virtual_stages`` = v model chunks per rank); virtual stage ``s`` runs on
  the ranks at pp coordinate ``s % pp``, so each rank holds ``v`` non-adjacent chunks
  (``codegen.runtime.pipeline.VirtualStages``) and a micro-batch goes round the ranks ``v``
  times. The plan's strategies name the virtual stage of each op (``NodeStrategy.stage`` in
  ``0 .. pp*v - 1``), as the simulator reads them.

How torch's interleaved schedule compares with the simulator's
(``cost_model.schedules.interleaved``), for ``micro_batches % pp == 0`` (what the planner's
plans have): the same order of forward and backward steps on every rank. Both warm up with
``(v - 1) * pp + 2 * (pp - 1 - rank)`` forwards, take chunks in rounds of ``pp``
micro-batches (forward chunk ``(k // pp) % v``, backward chunks in reverse), then alternate
one forward and one backward. The differences: torch also accepts micro-batch counts that are
not a multiple of ``pp`` (rounds of ``micro_batches // (micro_batches // pp)``), which the
simulator refuses; and torch inserts its sends and receives as actions into each rank's
order (``_prepare_schedule_with_comms``), where the simulator charges each transfer as a task
on a stream of its own between the two steps (``tests/test_schedule_parity.py`` compares
the two orders).
"""

from __future__ import annotations

from planner.plans import Plan
from planner.strategy import PipelineConfig

SCHEDULES = ("gpipe", "1f1b", "interleaved")
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


def schedule_problem(pipeline: PipelineConfig) -> str | None:
    """Why the pipeline's schedule does not compile (one line), or ``None``."""
    if pipeline.schedule not in SCHEDULES:
        return f"the {pipeline.schedule} schedule is not compiled; {', '.join(SCHEDULES)} are"
    if pipeline.schedule == "interleaved" and pipeline.virtual_stages < 2:
        return f"the interleaved schedule needs 2 or more virtual stages per rank, not {pipeline.virtual_stages}"
    if pipeline.schedule != "interleaved" and pipeline.virtual_stages != 1:
        return (
            f"the {pipeline.schedule} schedule runs one stage per rank, not {pipeline.virtual_stages} virtual stages; "
            f"plan with the interleaved schedule"
        )
    return None


def stage_count(pipeline: PipelineConfig) -> int:
    """Stage modules of the program: one per rank of ``pp``, times the virtual stages."""
    return pipeline.stages * pipeline.virtual_stages


def schedule_lines(plan: Plan) -> list[str]:
    """The header's lines on the schedule (comment text)."""
    pipeline = plan.pipeline
    dp = plan.mesh.axis_size("dp") if "dp" in plan.mesh.names else 1
    micro = plan.batch_size // pipeline.micro_batches
    per_rank = f", {micro // dp} per rank of dp" if dp > 1 else ""
    lines = [
        f"Pipeline: {stage_count(pipeline)} stages over pp, schedule {pipeline.schedule} "
        f"(torch.distributed.pipelining.{TORCH_SCHEDULES[pipeline.schedule]}),",
        f"{pipeline.micro_batches} micro-batches of {micro} samples per step{per_rank}.",
    ]
    if pipeline.schedule == "interleaved":
        pp = pipeline.stages
        lines.append(
            f"Interleaved: {pipeline.virtual_stages} virtual stages per rank; stage s runs on the ranks at pp coordinate "
            f"s % {pp} (rank p holds stages {', '.join(['p'] + [f'p + {s}' for s in range(pp, stage_count(pipeline), pp)])})."
        )
    return lines


def stages_comment(pipeline: PipelineConfig) -> str:
    """The comment on the STAGES table: where each stage runs."""
    if pipeline.schedule == "interleaved":
        return f"stage s runs on the ranks at pp coordinate s % {pipeline.stages} (interleaved)"
    return "stage s runs on the ranks at pp coordinate s"
