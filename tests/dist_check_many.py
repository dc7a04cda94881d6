"""Parity-check many compiled programs in one torchrun launch.

Starting gloo processes costs seconds on a small CI machine, so the distributed tests compile
every program first and check them all here, in one launch per world size::

    torchrun --nproc_per_node 2 tests/dist_check_many.py out/mlp_ddp out/mlp_fsdp ...

For each folder, every rank loads the program, builds its mesh (the process group is
initialised by the first one and reused by the others) and runs ``launch.py --check``'s
comparison: one sharded training step against the same step on one device. Rank 0 prints
one line per folder, in order::

    RESULT <folder> ok parity ok: max_abs_err=... | --check: switched off randomness: ...
    RESULT <folder> FAILED parity FAILED: worst tensor ... | --check: ...
    RESULT <folder> FAILED error: LaunchError: ...

and the script exits 0 once every folder has a line: the pytest side parses the lines, so one
broken program names itself and does not hide the others. An exception raised on every rank
alike (a wrong world size, a bad folder) becomes a FAILED line; one raised on some ranks
only leaves the others waiting in a collective, which the caller's timeout catches.

A folder given as ``--fp64 FOLDER`` is checked with both steps in float64 (``launch.py
--check --fp64``: models whose fp32 rounding the tolerance cannot judge).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch.distributed as dist

from codegen.runtime import load_program
from codegen.runtime.launcher import exit_now
from codegen.runtime.parity import check_parity
from codegen.runtime.precision import parity_tolerances


def check_folder(folder: str, atol: float | None, rtol: float | None, lr: float, float64: bool = False) -> tuple[bool, str]:
    """Parity-check the program in ``folder`` (tolerances: launch.py's defaults for its
    plan's precision unless given; in float64 when ``float64``); returns (ok, one-line message)."""
    try:
        program = load_program(folder)
        mesh = program.build_mesh()
        atol, rtol = parity_tolerances(program.plan.precision, atol, rtol)
        result = check_parity(program, mesh, atol, rtol, lr, program.plan.optimizer, float64=float64)
        return result.ok, f"{result.message(atol, rtol)} | {result.randomness}"
    except Exception as error:  # noqa: BLE001 - reported as this folder's FAILED line
        last = traceback.extract_tb(error.__traceback__)[-1]
        where = f" (at {last.filename}:{last.lineno})" if last else ""
        message = " ".join(str(error).split())  # one line, whatever the exception says
        return False, f"error: {type(error).__name__}: {message}{where}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", help="compiled program folders (planner compile -o FOLDER)")
    parser.add_argument("--fp64", action="append", default=[], metavar="FOLDER",
                        help="a folder to check in float64 (launch.py --check --fp64); repeatable")
    parser.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: as launch.py)")
    parser.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: as launch.py)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate of the step (default 1e-3)")
    options = parser.parse_intermixed_args(argv)  # folders and --fp64 folders in any order
    checks = [(folder, False) for folder in options.folders] + [(folder, True) for folder in options.fp64]
    if not checks:
        parser.error("give at least one folder")
    try:
        for folder, float64 in checks:
            ok, message = check_folder(folder, options.atol, options.rtol, options.lr, float64)
            # RANK, not dist.get_rank(): a folder may fail before the process group exists.
            if os.environ.get("RANK", "0") == "0":
                print(f"RESULT {folder} {'ok' if ok else 'FAILED'} {message}", flush=True)
    finally:
        tear_down_process_group()
    return 0


def tear_down_process_group() -> None:
    """End a grouped launch: every rank is done communicating before any tears gloo down
    (without the barrier about one launch in eight aborted at exit after printing its
    results)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
