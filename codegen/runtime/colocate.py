"""The body of a co-located program's ``launch.py`` (``codegen.colocate``): two jobs trained in
one process per rank, interleaved in crossover order (``codegen.runtime.colocate_jobs``).

Flags: ``--steps N`` trains both jobs N steps; ``--check`` then trains each job alone from
the same seeds with the single-job training loop and compares every updated parameter
exactly (exit 1 on any difference); ``--one-after-the-other`` runs each job's step whole
(no overlap), the baseline the crossover order is measured against; ``--lr-a``/``--lr-b``
set one job's learning rate; ``--checkpoint-dir DIR``
saves each job under ``DIR/job_a`` and ``DIR/job_b`` (``--save-every``, ``--keep``,
``--resume`` as for one job). A job that fails stops both, with one line naming it.

Each job runs on a process group of its own (``dist.new_group``, wrapped as a one-axis
``DeviceMesh``), so the two jobs' collectives never meet, also while one job's all-reduces
are in flight during the other's compute. Errors a user can act on are found before the
process group starts, as ``codegen.runtime.launcher`` does.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from codegen.runtime.checkpoint_runs import RESUME_AUTO, prepare_checkpoints
from codegen.runtime.colocate_jobs import Job, JobFailed, run_rounds
from codegen.runtime.exit_status import DONE, INTERNAL_ERROR, PARITY_FAILED, USER_ERROR, report_failure
from codegen.runtime.launcher import check_checkpoint_options, failure_status, tear_down
from codegen.runtime.program import Program, check_world_size, load_program
from codegen.runtime.training_loop import LoopOptions, train
from planner.arguments import OneLineParser, flag_type, integer_at_least, positive_finite
from planner.errors import LaunchError

JOB_FOLDERS = ("job_a", "job_b")  # each job's own program folder (codegen.colocate), in crossover order
JOB_LABELS = ("A", "B")  # A computes first


def build_parser() -> argparse.ArgumentParser:
    """The flags of a co-located ``launch.py``; a bad value raises ``ArgumentError`` (one line)."""
    rate = flag_type(float, positive_finite, "a positive finite number")
    at_least_one = flag_type(int, lambda value, name: integer_at_least(value, name, 1), "an integer >= 1")
    parser = OneLineParser(prog="launch.py", description="Train two co-located soap-planner jobs under torchrun.")
    parser.add_argument("--steps", type=flag_type(int, lambda value, name: integer_at_least(value, name, 0),
                                                  "an integer >= 0"), default=0, help="train both jobs N steps")
    parser.add_argument("--check", action="store_true",
                        help="after --steps N, train each job alone and compare every updated parameter (exit 1 on a difference)")
    parser.add_argument("--one-after-the-other", action="store_true", dest="sequential",
                        help="run each job's step whole, its all-reduces not hidden under the other job (the baseline)")
    parser.add_argument("--lr", type=rate, default=1e-3, help="learning rate of both jobs (default 1e-3)")
    parser.add_argument("--lr-a", type=rate, default=None, help="job A's learning rate (default --lr)")
    parser.add_argument("--lr-b", type=rate, default=None, help="job B's learning rate (default --lr)")
    parser.add_argument("--warmup-steps", type=flag_type(int, lambda value, name: integer_at_least(value, name, 0),
                                                         "an integer >= 0"), default=0, help="linear warm-up steps of both jobs")
    parser.add_argument("--clip-grad-norm", type=rate, default=None, metavar="MAX",
                        help="clip each job's gradients to this global L2 norm")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default=None, help="default: each plan's optimizer")
    parser.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                        help="save each job's checkpoints under DIR/job_a and DIR/job_b")
    parser.add_argument("--save-every", metavar="N", type=at_least_one, default=0, help="with --checkpoint-dir: every N steps")
    parser.add_argument("--keep", metavar="N", type=at_least_one, default=0, help="keep each job's N newest checkpoints")
    parser.add_argument("--resume", nargs="?", const=True, default=False, metavar="auto", type=_resume_mode,
                        help="continue both jobs from their latest complete checkpoints in --checkpoint-dir")
    parser.add_argument("--debug", action="store_true", help="on an internal error, print the traceback on every rank")
    return parser


def _resume_mode(value: str) -> str:
    if value != RESUME_AUTO:
        raise argparse.ArgumentTypeError(f"--resume takes no value or 'auto', got {value[:40]!r}")
    return value


def main(folder: Path, argv: list[str]) -> int:
    """Run the co-located ``launch.py`` in ``folder``; returns the exit status
    (``codegen.runtime.exit_status``)."""
    try:
        options = build_parser().parse_args(argv)
        if options.steps == 0:
            raise LaunchError("say how many steps both jobs train: --steps N (with --check to compare each job with "
                              "itself alone); see launch.py --help")
        if options.check and options.resume:
            raise LaunchError("--check compares N steps from step 0 with each job alone; leave out --resume")
        options.init_from, options.data = None, None  # what check_checkpoint_options also asks about
        check_checkpoint_options(options)
        programs = [load_program(folder / name) for name in JOB_FOLDERS]
        loops = [_loop_options(program, options, label, name)
                 for program, label, name in zip(programs, JOB_LABELS, JOB_FOLDERS)]
        starts = [loop.resume_from.step if loop.resume_from is not None else 0 for loop in loops]
        if len(set(starts)) > 1:  # a round is one step of each job: both continue from the same step
            shown = ", ".join(f"{label} {step}" for label, step in zip(JOB_LABELS, starts))
            raise LaunchError(f"--resume: the two jobs' latest checkpoints are of different steps ({shown}); delete "
                              "the newer one's extra checkpoint folders, or resume each job alone from its own folder")
        meshes = _job_meshes(programs)
        jobs = [Job(label, program, mesh, loop) for label, program, mesh, loop in zip(JOB_LABELS, programs, meshes, loops)]
        for job in jobs:
            _say(f"job {job.label}: {job.name} ({job.program.folder.name}/), lr {job.options.lr:g}")
        order = "one after the other" if options.sequential else "crossover"
        rounds = run_rounds(jobs, crossover=not options.sequential, say=_say)
        steady = rounds[1:] or rounds
        median = sorted(steady)[len(steady) // 2]
        _say(f"{order}: mean round (one step of each job) {sum(steady) / len(steady) * 1e3:.2f} ms over "
             f"{len(steady)} rounds (first excluded); median {median * 1e3:.2f} ms")
        status = DONE
        if options.check:
            status = DONE if _check_alone(jobs) else PARITY_FAILED
        dist.barrier()
        return status
    except JobFailed as error:
        report_failure(f"error: {error}", dist.get_rank(), debug=options.debug and not error.user_error)
        return USER_ERROR if error.user_error else INTERNAL_ERROR
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - the last line of defence against a traceback
        return failure_status(error, argv)
    finally:
        tear_down()


def _loop_options(program: Program, options: argparse.Namespace, label: str, folder: str) -> LoopOptions:
    """Job ``label``'s training options, its checkpoints under ``--checkpoint-dir``/``folder``
    (refused before the process group starts when they cannot be resumed)."""
    check_world_size(program.plan)
    program.check_model()
    optimizer = options.optimizer or program.plan.optimizer
    lr = {"A": options.lr_a, "B": options.lr_b}[label] or options.lr
    directory = str(Path(options.checkpoint_dir) / folder) if options.checkpoint_dir else None
    try:
        identity, found = prepare_checkpoints(program, directory, options.resume, None, optimizer)
    except LaunchError as error:
        raise LaunchError(f"job {label}: {error}") from None
    return LoopOptions(steps=options.steps, lr=lr, optimizer=optimizer, warmup_steps=options.warmup_steps,
                       clip_grad_norm=options.clip_grad_norm, checkpoint_dir=directory,
                       save_every=options.save_every, keep=options.keep, resume=options.resume,
                       run_identity=identity, resume_from=found)


def _job_meshes(programs: list[Program]) -> list[DeviceMesh]:
    """Start the default process group, then give each job a group of its own over every
    rank, as the one-axis ``dp`` mesh its program expects."""
    device = programs[0].device()
    if not dist.is_initialized():
        programs[0].build_mesh()  # the default group, as a single-job program starts it
    meshes = []
    for _ in programs:
        group = dist.new_group(list(range(dist.get_world_size())))
        meshes.append(DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp",)))
    return meshes


def _check_alone(jobs: list[Job]) -> bool:
    """Train each job alone from the same seeds with the single-job loop (``train``, on the
    job's own mesh) and compare every parameter with the co-located run's: exactly equal."""
    equal = True
    for job in jobs:
        together = job.parameters()
        alone: dict = {}

        def keep_last(step, module, optimizer, job=job, alone=alone):
            if step == job.options.steps:
                alone.update({name: param.detach().clone() for name, param in module.module.named_parameters()})

        _say(f"job {job.label} alone:")
        options = replace(job.options, checkpoint_dir=None, save_every=0, keep=0, resume=False, run_identity=None,
                          resume_from=None)
        train(job.program, job.mesh, options, after_step=[keep_last])
        differing = [name for name, value in together.items() if not value.equal(alone[name])]
        if differing:
            worst = max(float((together[name] - alone[name]).abs().max()) for name in differing)
            _say(f"job {job.label}: {len(differing)} of {len(together)} parameters differ after {job.options.steps} "
                 f"steps co-located and alone (first {differing[0]}, largest difference {worst:.3g})")
            equal = False
        else:
            _say(f"job {job.label}: all {len(together)} parameters equal after {job.options.steps} steps, co-located "
                 f"and alone")
    return equal


def _say(text: str) -> None:
    """Print ``text`` once, on rank 0 (called once the process group is up)."""
    if dist.get_rank() == 0:
        print(text, flush=True)
