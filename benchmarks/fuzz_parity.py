"""Property-based parity: random models, random valid strategies, checked against one device.

Each case builds a random small model (``tests/fuzz/random_model.py``: linear, matmul/bmm,
layer and RMS norm, softmax, attention, elementwise ops, reductions, views, embedding,
convolutions and a loss), draws one of the rule registry's candidates for every op on a mesh
of 2 ranks (``dp=2`` or ``tp=2``) or 4 (``dp=4``, ``tp=4``, ``dp=2 x tp=2``), compiles the
plan and checks one sharded training step against one device (``launch.py --check``'s
comparison). Programs of a world size are checked in as few torchrun launches as possible.

    python benchmarks/fuzz_parity.py --cases 200          # cases 0..199, prints the mismatches
    python benchmarks/fuzz_parity.py --cases 50 --seed 1000   # cases 1000..1049
    python benchmarks/fuzz_parity.py --case 17            # one case again, with its plan

The last line is ``fuzz parity: N cases, M mismatches, K refused at compile``; each mismatch
is printed with its case number (the model's seed; the mesh and the strategy draw follow
from it), mesh, model and the one-line result. A compile that refuses with a one-line
``PlannerError`` is a refusal, counted apart; a compile that crashes otherwise is a mismatch.
Exit status 1 when there is a mismatch.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "fuzz"))

from cases import Compiled, case, compile_case, random_plan  # noqa: E402
from parity_launch import check_programs  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200, help="how many cases (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="first case number (default 0)")
    parser.add_argument("--case", type=int, default=None, help="run this one case and print its plan")
    parser.add_argument("--keep", type=Path, default=None, help="write the compiled programs here (kept)")
    parser.add_argument("--chunk", type=int, default=40, help="programs per torchrun launch (default 40)")
    parser.add_argument("--stall", type=float, default=180, help="seconds a launch may go without a result before it is stopped (default 180)")
    options = parser.parse_args(argv)
    if options.cases < 1 or options.chunk < 1 or options.seed < 0 or (options.case or 0) < 0 or not options.stall > 0:
        parser.error("--cases and --chunk must be >= 1, --seed and --case >= 0, --stall > 0")
    numbers = [options.case] if options.case is not None else list(range(options.seed, options.seed + options.cases))

    started = time.perf_counter()
    root = options.keep or Path(tempfile.mkdtemp(prefix="fuzz_parity_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        compiled, crashed = _compile_all(numbers, root, verbose=options.case is not None)
        compile_s = time.perf_counter() - started
        results = _check_all(compiled, root, options.chunk, options.stall)
    finally:
        if options.keep is None:
            shutil.rmtree(root, ignore_errors=True)

    refused = [c for c in compiled if c.refusal]
    mismatches = [(c, results[c.folder]) for c in compiled if c.folder and not results[c.folder].startswith("ok ")]
    mismatches += crashed
    for item, result in sorted(mismatches, key=lambda pair: pair[0].case.number):
        print(f"MISMATCH {item.describe()}\n    {result}\n    rerun: python benchmarks/fuzz_parity.py --case {item.case.number}")
    for item in refused:
        print(f"refused {item.describe()}\n    {item.refusal}")
    if options.case is not None and compiled and compiled[0].folder:
        kept = f" (program in {compiled[0].folder})" if options.keep else " (--keep DIR keeps the program)"
        print(f"result: {results[compiled[0].folder]}{kept}")
    elapsed = time.perf_counter() - started
    print(f"compile {compile_s:.0f} s, parity launches {elapsed - compile_s:.0f} s, total {elapsed:.0f} s")
    print(f"fuzz parity: {len(numbers)} cases, {len(mismatches)} mismatches, {len(refused)} refused at compile")
    return 1 if mismatches else 0


def _compile_all(numbers: list[int], root: Path, verbose: bool) -> tuple[list[Compiled], list[tuple[Compiled, str]]]:
    """Compile every case; a crash (anything but a ``PlannerError``) is a mismatch."""
    compiled, crashed = [], []
    for number in numbers:
        this = case(number)
        if verbose:
            plan = random_plan(this)
            print(this)
            for strategy in plan.strategies:
                print(f"  {strategy.node:<28} {strategy.op:<40} {strategy.describe()}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # ops without a rule: the plan says so already
                compiled.append(compile_case(this, root / f"case{number}"))
        except Exception as error:  # noqa: BLE001 - an internal error is a finding, reported below
            last = traceback.extract_tb(error.__traceback__)[-1]
            message = f"compile crashed: {type(error).__name__}: {' '.join(str(error).split())[:300]} (at {last.filename}:{last.lineno})"
            crashed.append((Compiled(this, _recipe_line(number), None, None, 0, 0), message))
        print(f"\rcompiled {len(compiled) + len(crashed)}/{len(numbers)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return compiled, crashed


def _check_all(compiled: list[Compiled], root: Path, chunk: int, stall_s: float) -> dict[Path, str]:
    results: dict[Path, str] = {}
    for world in (2, 4):
        folders = [c.folder for c in compiled if c.folder and c.case.world == world]
        for start in range(0, len(folders), chunk):
            part = folders[start : start + chunk]
            print(f"checking {len(part)} programs at world size {world}", file=sys.stderr, flush=True)
            results.update(check_programs(world, part, root, stall_s))
    return results


def _recipe_line(number: int) -> str:
    from random_model import recipe

    return recipe(number).structure


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
