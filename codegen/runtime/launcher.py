"""The body of a compiled ``launch.py``: parse its flags, set up the mesh, check or train.

Errors a user can act on (a bad flag, a missing or corrupt plan.json, a model file that is
gone or now builds another model, the wrong world size) are found before the process group
starts; rank 0 prints them as one line on stderr and every rank exits 2, with no traceback.
A failed parity check exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from codegen.runtime.parity import check_parity, optimizer_class
from codegen.runtime.precision import parity_tolerances
from codegen.runtime.program import Program, check_world_size, load_program
from planner.arguments import OneLineParser, flag_type, integer_at_least, non_negative_finite, positive_finite
from planner.errors import LaunchError, PlannerError


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``launch.py``; a bad value raises ``ArgumentError`` (one line)."""
    tolerance = flag_type(float, non_negative_finite, "a finite number >= 0")
    parser = OneLineParser(prog="launch.py", description="Run a compiled soap-planner program under torchrun.")
    parser.add_argument("--check", action="store_true", help="one step sharded vs one device; exit 1 on mismatch")
    parser.add_argument(
        "--steps", default=0, type=flag_type(int, lambda value, name: integer_at_least(value, name, 0), "an integer >= 0"),
        help="train N steps on synthetic data and print step times",
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
    parser.add_argument("--checkpoint-dir", metavar="DIR", default=None, help="with --steps: save checkpoints (torch.distributed.checkpoint) under DIR")
    parser.add_argument(
        "--save-every", metavar="N", default=0,
        type=flag_type(int, lambda value, name: integer_at_least(value, name, 1), "an integer >= 1"),
        help="with --checkpoint-dir: save every N steps (and after the last step)",
    )
    parser.add_argument(
        "--keep", metavar="N", default=0,
        type=flag_type(int, lambda value, name: integer_at_least(value, name, 1), "an integer >= 1"),
        help="with --checkpoint-dir: keep only the N newest complete checkpoints (default: all)",
    )
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint in --checkpoint-dir (any plan's)")
    parser.add_argument("--init-from", metavar="FILE", default=None, help="start from the weights of a state_dict file (planner export-checkpoint)")
    return parser


def main(folder: Path, argv: list[str]) -> int:
    """Run ``launch.py`` in ``folder`` with command-line ``argv``; returns the exit code."""
    try:
        # Everything a user can get wrong is checked before the process group starts: a
        # rank that failed later would leave the others waiting in a collective.
        options = build_parser().parse_args(argv)
        if not options.check and options.steps == 0:
            raise LaunchError("say what to run: --check, --steps N, or both; see launch.py --help")
        program = load_program(folder)
        check_checkpoint_options(options)
        if options.record_routing is not None:
            check_routing_output(program, options.steps, options.record_routing)
        check_world_size(program.plan)
        program.check_model()
        mesh = program.build_mesh()
        optimizer = options.optimizer or program.plan.optimizer
        status = 0
        if options.check:
            atol, rtol = parity_tolerances(program.plan.precision, options.atol, options.rtol)
            result = check_parity(program, mesh, atol, rtol, options.lr, optimizer)
            if result.randomness:
                _say(result.randomness)
            _say(result.message(atol, rtol))
            status = 0 if result.ok else 1
        if options.steps > 0:
            train_synthetic(program, mesh, options.steps, options.lr, optimizer, options.record_routing, options)
        # Every rank is done communicating before any tears gloo down: without this, a rank
        # that leaves first sometimes makes another abort at exit after a successful run.
        dist.barrier()
        return status
    except PlannerError as error:
        if os.environ.get("RANK", "0") == "0":  # every rank fails the same way; say it once
            print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_now(status: int) -> None:
    """Leave the process with ``status``. After a success, once output is flushed, skip the
    interpreter's teardown: after the process group is destroyed, gloo's and autograd's
    native threads can still be joinable while C++ statics are destroyed, which now and then
    aborts a rank ("terminate called without an active exception") after a run that
    succeeded. A failure exits normally: a rank that left at once could get the others
    killed by torchrun before rank 0 has printed the error."""
    if status != 0:
        sys.exit(status)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_routing_output(program: Program, steps: int, path: str) -> None:
    """Refuse ``--record-routing`` with one line when it cannot record anything: no training
    steps, a plan whose MoE layers do not run through the expert runtime, or a file that
    cannot be written."""
    if steps == 0:
        raise LaunchError("--record-routing records the routing of training steps; add --steps N")
    if not program.plan.expert_layouts:
        raise LaunchError(
            "--record-routing needs a plan whose MoE layers have expert layouts (their routing is counted by the "
            "expert runtime); this plan has none"
        )
    target = Path(path)
    if target.is_dir():
        raise LaunchError(f"--record-routing: '{target}' is a folder; give a file name such as routing.json")
    if not target.resolve().parent.is_dir():
        raise LaunchError(f"--record-routing: folder '{target.resolve().parent}' does not exist; create it first")


def check_checkpoint_options(options: argparse.Namespace) -> None:
    """Refuse checkpoint flags that cannot work together, with one line, before the process group starts."""
    from codegen.runtime.checkpoint import latest_checkpoint

    directory = options.checkpoint_dir
    if (options.save_every or options.resume or options.keep) and directory is None:
        raise LaunchError("--save-every, --keep and --resume need --checkpoint-dir DIR: the folder checkpoints are saved in")
    if (directory or options.init_from) and options.steps == 0:
        raise LaunchError("--checkpoint-dir and --init-from are for training; add --steps N")
    if options.resume and options.init_from:
        raise LaunchError("--resume continues a run (weights, optimizer, step); --init-from starts a new one from weights: pick one")
    if directory is not None and Path(directory).exists() and not Path(directory).is_dir():
        raise LaunchError(f"--checkpoint-dir: '{directory}' is a file; give a folder")
    if options.resume and latest_checkpoint(Path(directory)) is None:
        raise LaunchError(f"--resume: no complete checkpoint in '{directory}'; run without --resume to start from step 0")
    if options.init_from is not None and not Path(options.init_from).is_file():
        raise LaunchError(f"--init-from: no file '{options.init_from}'; write one with `python -m planner export-checkpoint DIR -o FILE`")


def train_synthetic(
    program: Program, mesh, steps: int, lr: float, optimizer_name: str, record_routing: str | None = None,
    options: argparse.Namespace | None = None,
) -> list[float]:
    """Train ``steps`` steps on random batches shaped like the example batch; print each
    step's time and the loss (the mean over every rank's). With ``record_routing``, write the
    MoE layers' routing over the steps there (``codegen.runtime.routing_record``). ``options``
    (the parsed flags) carry the checkpoint flags (``codegen.runtime.checkpoint``)."""
    model, module, args, kwargs = program.build_module(mesh)  # this rank's shards only
    if program.is_pipeline:
        pipeline = program.module.make_pipeline(module, mesh)

        def forward_backward(batch_args, batch_kwargs):  # every micro-batch, through the schedule
            local_args, local_kwargs = program.shard_batch(batch_args, batch_kwargs, mesh)
            return pipeline.step(local_args, local_kwargs)

    else:

        def forward_backward(batch_args, batch_kwargs):  # in the plan's micro-batches, if it accumulates
            return program.forward_backward(module, batch_args, batch_kwargs, mesh)[0]

    optimizer = program.make_optimizer(module, mesh, optimizer_class(optimizer_name), lr=lr)  # the program's hook, if any
    checkpointer, first_step = _start_checkpoints(program, options, model, module, optimizer)
    times = []
    for step in range(first_step, steps):
        torch.manual_seed(1000 + step)  # the same global batch on every rank
        batch_args, batch_kwargs = random_like(args), random_like(kwargs)  # global; sharded in forward_backward
        _synchronize()
        start = time.perf_counter()
        loss = forward_backward(batch_args, batch_kwargs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _synchronize()
        times.append(time.perf_counter() - start)
        _say(f"step {step + 1}/{steps}: {times[-1] * 1e3:.2f} ms  loss {_mean_over_ranks(loss):.6f}")
        if checkpointer is not None and (step + 1 == steps or (options.save_every and (step + 1) % options.save_every == 0)):
            _said_complete(checkpointer.save(step + 1))
    if checkpointer is not None:
        _said_complete(checkpointer.wait())
    steady = times[1:] or times
    _say(f"mean step time: {sum(steady) / len(steady) * 1e3:.2f} ms over {len(steady)} steps (first step excluded)")
    if record_routing is not None:
        from codegen.runtime.routing_record import write_recorded_routing

        stats = write_recorded_routing(model, steps, record_routing)
        _say(f"routing of {len(stats.layers)} MoE layer(s) written to {record_routing} ({stats.source})")
    return times


def _start_checkpoints(program: Program, options, model, module, optimizer):
    """The run's ``Checkpointer`` (None without --checkpoint-dir) and its first step: the
    checkpoint's with --resume, else 0 (after loading --init-from's weights, if given)."""
    from codegen.runtime.checkpoint import Checkpointer, init_from

    if options is not None and options.init_from is not None:
        count = init_from(Path(options.init_from), model, module)
        _say(f"initialised {count} tensors from {options.init_from}")
    if options is None or options.checkpoint_dir is None:
        return None, 0
    checkpointer = Checkpointer(Path(options.checkpoint_dir), model, module, optimizer, program.plan.name, options.keep)
    if not options.resume:
        return checkpointer, 0
    step = checkpointer.resume(Path(options.checkpoint_dir))
    _say(f"resumed from {options.checkpoint_dir} at step {step}")
    return checkpointer, step


def _said_complete(folder) -> None:
    if folder is not None:
        _say(f"checkpoint complete: {folder}")


def _mean_over_ranks(loss: torch.Tensor) -> float:
    """The step's loss: the mean of every rank's (data-parallel ranks each hold their
    slice's; tensor- and pipeline-parallel ranks the same value)."""
    value = loss.detach().float().reshape(()).clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def random_like(tree):
    """A batch with the structure of ``tree``: floats ~ N(0, 1), integers in the example's range."""
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point():
            return torch.randn_like(tree)
        high = int(tree.max().item()) + 1 if tree.numel() else 1
        return torch.randint_like(tree, 0, max(high, 1))
    if isinstance(tree, dict):
        return {key: random_like(value) for key, value in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(random_like(value) for value in tree)
    return tree


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()


def _say(text: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text, flush=True)
