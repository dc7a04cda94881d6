"""Write a co-located program: two jobs' compiled programs in one folder, and the
``launch.py`` that trains both in each process, interleaved in crossover order.

    out/
      job_a/  model_spmd.py, plan.json, launch.py   job A's own program, as `planner compile` writes it
      job_b/  ...                                    job B's
      launch.py                                      both jobs, one process per rank

Each job folder is the job's own program, unchanged (it also runs alone:
``torchrun ... out/job_a/launch.py --steps 5``). The top ``launch.py`` loads both
(``codegen.runtime.colocate``): every rank holds both jobs' modules and optimizers, each job
on a process group of its own, and one job's gradient all-reduces run while the other job
computes (``codegen.runtime.colocate_jobs``).

Co-located programs run data-parallel plans whose gradients DDP reduces (``ddp`` and
``zero1``): their reduction is what can be deferred under the other job's compute, without
changing a bit of either job's arithmetic. Every other plan is refused with one line
(``colocation_refusal``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from codegen.data_parallel_emit import DDP_FLAVOURS
from planner import __version__
from planner.errors import PlanningError
from planner.launch_command import torchrun_parts
from planner.outputs import program_folder
from planner.plans import Plan
from planner.program_shape import is_data_parallel
from codegen.runtime.colocate import JOB_FOLDERS, JOB_LABELS  # the jobs' folders, in crossover order (A computes first)


def colocation_refusal(plan: Plan, label: str) -> str | None:
    """Why job ``label``'s ``plan`` cannot run co-located (one line naming the fix), or None."""
    if not is_data_parallel(plan) or plan.sections or plan.expert_layouts:
        kinds = ", ".join(sorted(plan.sections)) or (
            "pipeline" if plan.pipeline is not None else f"mesh {plan.mesh}" if plan.mesh.names != ("dp",)
            else "MoE expert layouts" if plan.expert_layouts else "a searched graph program")
        return (f"job {label} ({plan.name}) is not a plain data-parallel plan ({kinds}); co-located programs run "
                f"ddp and zero1 plans: re-plan it with `planner plan MODEL --dp ddp` (or --dp zero1)")
    if plan.dp_flavour not in DDP_FLAVOURS:
        return (f"job {label} ({plan.name}) shards its weights with {plan.dp_flavour}, whose gathers and "
                f"reduce-scatters run inside forward and backward; co-located programs defer DDP's gradient "
                f"all-reduces only: re-plan it with `planner plan MODEL --dp ddp` (or --dp zero1)")
    return None


def check_colocatable(plans: Sequence[Plan]) -> None:
    """Refuse, with one line, jobs that cannot share one co-located program: not exactly two,
    for different world sizes, or of a kind ``colocation_refusal`` names.

    Raises:
        PlanningError: naming the job and the fix.
    """
    if len(plans) != len(JOB_LABELS):
        raise PlanningError(f"a co-located program runs two jobs, got {len(plans)} plans; "
                            f"give two: planner compile --colocate A.json B.json -o DIR")
    worlds = [plan.world_size for plan in plans]
    if worlds[0] != worlds[1]:
        raise PlanningError(f"job A is planned for {worlds[0]} devices and job B for {worlds[1]}: co-located jobs "
                            f"share every device; re-plan one for the other's cluster")
    for label, plan in zip(JOB_LABELS, plans):
        refusal = colocation_refusal(plan, label)
        if refusal:
            raise PlanningError(refusal)


def write_colocated_program(plans: Sequence[Plan], out_dir: Path, compile_job: Callable[[Plan, Path], Path], *,
                            force: bool = False) -> Path:
    """Write the co-located program of two data-parallel plans into ``out_dir``.

    ``compile_job(plan, folder)`` writes one job's own program (``planner.compile``), so each
    job's module is exactly what compiling it alone gives. All files are staged and moved
    into place together (``planner.outputs.program_folder``).

    Raises:
        PlanningError: the plans cannot share a program (``check_colocatable``).
        OutputError: ``out_dir`` is a file, not writable, or a user's non-empty folder.
    """
    check_colocatable(plans)
    with program_folder(out_dir, force=force, version=__version__) as staging:
        for folder, plan in zip(JOB_FOLDERS, plans):
            compile_job(plan, staging / folder)
        (staging / "launch.py").write_text(render_colocated_launch(plans))
    return out_dir


def render_colocated_launch(plans: Sequence[Plan]) -> str:
    """Source of the co-located ``launch.py`` (it names no plan text: the job folders'
    plan.json files say which plans it runs)."""
    run = " ".join(torchrun_parts(plans[0], "launch.py"))
    return f'''"""torchrun entry point of two co-located jobs: job_a/ and job_b/ (each folder is the job's own program).

Every rank holds both jobs' modules and optimizers; each job's gradient all-reduces run on its
own process group while the other job computes (crossover order).

    {run} --steps 10          # train both, interleaved; print each round's time
    {run} --steps 5 --check   # then train each job alone and compare every updated parameter

Generated by soap-planner {__version__}. Needs the soap-planner package installed.
"""

import sys
from pathlib import Path

from codegen.runtime.colocate import main
from codegen.runtime.launcher import exit_now

if __name__ == "__main__":
    exit_now(main(Path(__file__).resolve().parent, sys.argv[1:]))
'''
