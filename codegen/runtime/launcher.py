"""The body of a compiled ``launch.py``: parse its flags, set up the mesh, check or train.

Errors a user can act on (a bad flag, a missing or corrupt plan.json, a model file that is
gone or now builds another model, the wrong world size, a --data file that does not import)
are found before the process group starts; rank 0 prints them as one line on stderr and every
rank exits 2, with no traceback. A failed parity check exits 1; the statuses and how a failure
reaches torchrun's summary: ``codegen.runtime.exit_status``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from codegen.runtime import exit_status
from codegen.runtime.exit_status import (
    DONE,
    INTERNAL_ERROR,
    INTERRUPTED,
    PARITY_FAILED,
    USER_ERROR,
    internal_error_line,
    report_failure,
)
from codegen.runtime.flag_rules import check_flag_combinations
from codegen.runtime.checkpoint_runs import RESUME_AUTO, prepare_checkpoints
from codegen.runtime.parity import check_float64_applies, check_parity
from codegen.runtime.precision import parity_tolerances
from codegen.runtime.program import Program, check_world_size, load_program
from codegen.runtime.run_outputs import check_run_outputs
from codegen.runtime.stop_request import STOPPED_EXIT_STATUS
from codegen.runtime.training_loop import (  # noqa: F401 - random_like re-exported
    SCHEDULES,
    LoopOptions,
    TrainingRun,
    random_like,
    train,
)
from codegen.runtime.user_data import load_data_function
from planner.arguments import (
    OneLineParser,
    flag_type,
    integer_at_least,
    non_negative_finite,
    positive_finite,
)
from planner.errors import ArgumentError, LaunchError, PlannerError, one_line
from planner.outputs import path_kind
from planner.launch_command import check_refusal


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``launch.py``; a bad value raises ``ArgumentError`` (one line)."""
    tolerance = flag_type(float, non_negative_finite, "a finite number >= 0")
    parser = OneLineParser(prog="launch.py", description="Run a compiled soap-planner program under torchrun.")
    parser.add_argument("--check", action="store_true", help="one step sharded vs one device; exit 1 on mismatch")
    parser.add_argument(
        "--steps", default=0, type=flag_type(int, lambda value, name: integer_at_least(value, name, 0), "an integer >= 0"),
        help="train N steps on synthetic data and print step times",
    )
    parser.add_argument(
        "--fp64", action="store_true",
        help="with --check: run both steps in float64, for fp32 models whose single-device fp32 step is itself "
        "further from exact than the tolerance (e.g. batch norm over a few values per channel)",
    )
    parser.add_argument("--atol", type=tolerance, default=None, help="absolute tolerance of --check (default 1e-5; bf16 plans 1e-2)")
    parser.add_argument("--rtol", type=tolerance, default=None, help="relative tolerance of --check (default 1e-4; bf16 plans 1e-2)")
    parser.add_argument(
        "--lr", default=1e-3, type=flag_type(float, positive_finite, "a positive finite number"),
        help="learning rate (default 1e-3)",
    )
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default=None, help="default: the plan's optimizer")
    parser.add_argument(
        "--record-routing", metavar="FILE", default=None,
        help="with --steps: write the MoE layers' routing over the steps as routing statistics (planner plan --routing FILE)",
    )
    parser.add_argument(
        "--comm-audit", action="store_true",
        help="run one training step with every collective counted and print the bytes sent per mesh axis beside the plan's prediction",
    )
    add_training_flags(parser)
    parser.add_argument("--checkpoint-dir", metavar="DIR", default=None, help="with --steps: save checkpoints (torch.distributed.checkpoint) under DIR")
    parser.add_argument(
        "--save-every", metavar="N", default=0,
        type=flag_type(int, lambda value, name: integer_at_least(value, name, 1), "an integer >= 1"),
        help="with --checkpoint-dir: save every N steps (and after the last step)",
    )
    parser.add_argument(
        "--keep", metavar="N", default=0,
        type=flag_type(int, lambda value, name: integer_at_least(value, name, 1), "an integer >= 1"),
        help="with --checkpoint-dir: keep only this run's N newest complete checkpoints (default: all)",
    )
    parser.add_argument(
        "--resume", nargs="?", const=True, default=False, metavar="auto", type=_resume_mode,
        help="continue the run whose checkpoints are in --checkpoint-dir from its latest complete one (on any plan); "
        "--resume auto: the same when there is one, else start from step 0 (for schedulers that restart jobs)",
    )
    parser.add_argument("--init-from", metavar="FILE", default=None, help="start from the weights of a state_dict file (planner export-checkpoint)")
    parser.add_argument("--debug", action="store_true", help="on an internal error (exit 3), print the traceback on every rank")
    parser.add_argument(
        "--force", action="store_true",
        help="let --metrics, --profile and --record-routing overwrite a file soap-planner did not write "
        "(never this program's files, a plan, or a file the run reads)",
    )
    return parser


def _resume_mode(value: str) -> str:
    """``--resume``'s optional value: only ``auto``."""
    if value != RESUME_AUTO:
        raise argparse.ArgumentTypeError(f"--resume takes no value or 'auto', got {value[:40]!r}")
    return value


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """The training loop's flags (``codegen.runtime.training_loop``, ``profiling``)."""
    count = flag_type(int, lambda value, name: integer_at_least(value, name, 0), "an integer >= 0")
    parser.add_argument("--data", metavar="FILE.py:FUNCTION", default=None,
                        help="train on FUNCTION(batch_size)'s global batches instead of synthetic ones; without --steps, "
                        "until the data ends")
    parser.add_argument("--lr-schedule", choices=SCHEDULES, default="constant",
                        help="learning-rate decay after warm-up, to --min-lr-ratio x lr at the last step (default constant)")
    parser.add_argument("--warmup-steps", type=count, default=0, help="linear warm-up steps (default 0)")
    parser.add_argument("--min-lr-ratio", type=flag_type(float, non_negative_finite, "a finite number >= 0"), default=0.0,
                        help="final learning rate of cosine/linear decay as a fraction of --lr (default 0)")
    parser.add_argument("--clip-grad-norm", type=flag_type(float, positive_finite, "a positive finite number"), default=None,
                        metavar="MAX", help="clip gradients to this global L2 norm")
    parser.add_argument("--log-every", type=flag_type(int, lambda value, name: integer_at_least(value, name, 1), "an integer >= 1"),
                        default=1, metavar="N", help="print every N-th step (default 1)")
    parser.add_argument("--metrics", metavar="FILE", default=None, help="write each step's figures to FILE as JSON lines")
    parser.add_argument("--slowdown-from-cluster", nargs="?", const=1.0, default=0.0, metavar="BASE",
                        type=flag_type(float, _at_least_one, "a finite number >= 1"),
                        help="with --steps: each rank computes BASE (default 1) times slower than a core, times how much "
                             "slower its device in the plan's cluster is than the fastest (a heterogeneous cluster on one "
                             "CPU host; codegen/runtime/slowdown.py)")
    parser.add_argument("--profile", metavar="FILE", default=None,
                        help="with --steps N (>= 5): profile the last steps with torch.profiler and write per-op, "
                        "per-collective and step times to FILE (measured.json) for `planner compare` / `planner calibrate`")


def main(folder: Path, argv: list[str]) -> int:
    """Run ``launch.py`` in ``folder`` with command-line ``argv``; returns the exit status
    (``codegen.runtime.exit_status``). A failure is one line, printed last by rank 0 and
    written into torchrun's error file by every rank; no traceback unless ``--debug``."""
    try:
        # Everything a user can get wrong is checked before the process group starts: a
        # rank that failed later would leave the others waiting in a collective.
        options = build_parser().parse_args(argv)
        if not options.check and not options.comm_audit and options.steps == 0 and options.data is None:
            raise LaunchError(
                "say what to run: --check, --steps N, --data FILE.py:FUNCTION, --comm-audit, or a mix; see launch.py --help"
            )
        check_training_flags(options)
        check_run_outputs(options, folder)
        if options.fp64 and not options.check:
            raise LaunchError("--fp64 says how --check runs its step; add --check")
        program = load_program(folder)
        # A program whose step cannot equal one device's (lossy gradient compression) says why.
        refusal = getattr(program.module, "CHECK_REFUSAL", None)
        if options.check and refusal:
            raise LaunchError(str(refusal))
        if options.fp64:
            check_float64_applies(program)
        if options.check:
            # A family whose step differs from one device's by design (Adasum) says why.
            _refuse_by_section(program, "parity_refusal")
        if options.checkpoint_dir or options.init_from:
            # A family whose ranks hold different parts of the model (layer separation) says
            # so before a checkpoint takes one rank's stale copy of another part.
            _refuse_by_section(program, "checkpoint_refusal")
        check_checkpoint_options(options)
        if options.record_routing is not None:
            check_routing_output(program, options.steps, options.record_routing)
        check_world_size(program.plan)
        program.check_model()
        if options.data is not None:
            load_data_function(options.data)  # the file imports and defines the function
        optimizer = options.optimizer or program.plan.optimizer
        options.run_identity, options.resume_from = prepare_checkpoints(
            program, options.checkpoint_dir, options.resume, options.init_from, optimizer)
        if options.check:
            check_fits_this_gpu(program)
        mesh = program.build_mesh()
        status = DONE
        if options.check:
            atol, rtol = parity_tolerances(program.plan.precision, options.atol, options.rtol)
            result = check_parity(program, mesh, atol, rtol, options.lr, optimizer, float64=options.fp64)
            if result.randomness:
                _say(result.randomness)
            _say(result.message(atol, rtol))
            status = DONE if result.ok else PARITY_FAILED
        if options.comm_audit:
            from codegen.runtime.comm_audit import audit_step, audit_table

            predicted = dict(program.plan.estimate.bytes_per_axis) if program.plan.estimate else {}
            _say(audit_table(predicted, audit_step(program, mesh, options.lr, optimizer)))
        if options.steps > 0 or options.data is not None:
            run = run_training(program, mesh, options, optimizer)
            if run.stopped_by is not None:
                status = STOPPED_EXIT_STATUS  # stopped early on a signal: the job did not finish
        # Every rank is done communicating before any tears gloo down: without this, a rank
        # that leaves first sometimes makes another abort at exit after a successful run.
        dist.barrier()
        return status
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - the last line of defence against a traceback
        return failure_status(error, argv)
    finally:
        tear_down()


def failure_status(error: BaseException, argv: list[str]) -> int:
    """Report ``error``, which ended a ``launch.py``, as one line (printed last by rank 0 and
    written into torchrun's error file by every rank; the traceback only with ``--debug`` in
    ``argv``) and return its exit status: a user error, an interruption, or an internal error."""
    if isinstance(error, PlannerError):
        report_failure(f"error: {error}", _rank())
        return USER_ERROR
    if isinstance(error, KeyboardInterrupt):
        report_failure("interrupted", _rank())
        return INTERRUPTED
    report_failure(internal_error_line(error), _rank(), debug="--debug" in argv)
    return INTERNAL_ERROR


def tear_down() -> None:
    """Destroy the process group, if one was started, whatever state it is in."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - e.g. NCCL after a rank died: the status already says what happened
            pass


def exit_now(status: int) -> None:
    """Leave the process with ``status`` (``codegen.runtime.exit_status.exit_now``)."""
    exit_status.exit_now(status, _rank())


def _rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
    text = os.environ.get("RANK", "0")
    return int(text) if text.isdigit() else 0


def _refuse_by_section(program: Program, attribute: str) -> None:
    """LaunchError with the first line a plan section gives as ``attribute`` (one line
    naming why its program cannot do what was asked, and what to do instead)."""
    refusals = [getattr(section, attribute) for section in program.plan.sections.values()
                if getattr(section, attribute, "")]
    if refusals:
        raise LaunchError(refusals[0])


def check_fits_this_gpu(program: Program) -> None:
    """LaunchError when ``--check``'s one-device reference cannot hold the model on this
    rank's GPU (``planner.launch_command``); on CPUs the host's memory decides, unchecked."""
    if torch.cuda.is_available():
        refusal = check_refusal(program.plan, torch.cuda.get_device_properties(program.device()).total_memory)
        if refusal:
            raise LaunchError(refusal)


def check_routing_output(program: Program, steps: int, path: str) -> None:
    """Refuse ``--record-routing`` with one line when it cannot record anything: no training
    steps, a plan whose MoE layers do not run through the expert runtime, or run inside
    pipeline stages (whether the file may be written: ``codegen.runtime.run_outputs``)."""
    if steps == 0:
        raise LaunchError("--record-routing records the routing of training steps; add --steps N")
    if not program.plan.expert_layouts:
        raise LaunchError(
            "--record-routing needs a plan whose MoE layers have expert layouts (their routing is counted by the "
            "expert runtime); this plan has none"
        )
    if program.plan.pipeline is not None:
        raise LaunchError(
            "--record-routing does not collect the routing of MoE layers inside pipeline stages yet (each stage's "
            "ranks hold only their own layers); record it with a plan without pipeline stages"
        )


def check_checkpoint_options(options: argparse.Namespace) -> None:
    """Refuse checkpoint flags that cannot work together, with one line, before the process group starts."""
    directory = options.checkpoint_dir
    if (options.save_every or options.resume or options.keep) and directory is None:
        raise LaunchError("--save-every, --keep and --resume need --checkpoint-dir DIR: the folder checkpoints are saved in")
    if (directory or options.init_from) and options.steps == 0 and options.data is None:
        raise LaunchError("--checkpoint-dir and --init-from are for training; add --steps N (or --data)")
    if options.resume is True and options.init_from:
        raise LaunchError("--resume continues a run (weights, optimizer, step); --init-from starts a new one from weights: "
                          "pick one (or --resume auto --init-from FILE: resume when there is a checkpoint, else start from FILE)")
    if directory is not None and path_kind(directory, "--checkpoint-dir") not in ("missing", "folder"):
        raise LaunchError(f"--checkpoint-dir: '{one_line(directory)}' is a file; give a folder")
    if options.init_from is not None and path_kind(options.init_from, "--init-from") != "file":
        raise LaunchError(f"--init-from: no file '{one_line(options.init_from)}'; write one with "
                          f"`python -m planner export-checkpoint DIR -o FILE`")


def check_training_flags(options: argparse.Namespace) -> None:
    """One line for training flags that cannot work together, before anything starts."""
    check_flag_combinations(options)
    if options.profile is not None:
        from codegen.runtime.profiling import profile_split

        profile_split(options.steps)  # LaunchError when --steps is too small
    if options.lr_schedule != "constant" and options.steps == 0:
        raise LaunchError(f"--lr-schedule {options.lr_schedule} decays over --steps N; give --steps")


def run_training(program: Program, mesh, options: argparse.Namespace, optimizer: str) -> TrainingRun:
    """Train as the flags say (``codegen.runtime.training_loop``); with ``--profile``, write
    measured.json (``codegen.runtime.profiling``). Returns the run."""
    loop = LoopOptions(
        steps=options.steps, lr=options.lr, optimizer=optimizer, schedule=options.lr_schedule,
        warmup_steps=options.warmup_steps, min_lr_ratio=options.min_lr_ratio, clip_grad_norm=options.clip_grad_norm,
        data=options.data, log_every=options.log_every, metrics=options.metrics, record_routing=options.record_routing,
        checkpoint_dir=options.checkpoint_dir, save_every=options.save_every, keep=options.keep,
        resume=options.resume, init_from=options.init_from, slowdown=options.slowdown_from_cluster,
        run_identity=options.run_identity,
        resume_from=options.resume_from,
    )
    if options.profile is None:
        return train(program, mesh, loop)
    from codegen.runtime.profiling import profile_split, start_profiler, write_measured

    wait, _, active = profile_split(options.steps)
    profiler = start_profiler(options.steps)
    try:
        run = train(program, mesh, loop, profiler=profiler)
    finally:
        profiler.stop()
    write_measured(options.profile, program.folder / "plan.json", run.step_times[:wait], profiler, active)
    _say(f"measured per-op, per-collective and step times written to {options.profile} "
         f"(compare: python -m planner compare {program.folder / 'plan.json'} {options.profile})")
    return run


def _say(text: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text, flush=True)


def _at_least_one(value: float, name: str) -> float:
    """A finite number >= 1: a rank can be slowed down by sleeping, never sped up."""
    if not 1.0 <= positive_finite(value, name) < float("inf"):
        raise ArgumentError(f"{name} must be a finite number >= 1, got {value!r}")
    return value
