"""Ready for the first GPU: one command that checks, on one GPU, what every CPU test assumed.

    python benchmarks/gpu_check.py [-o gpu_check.json] [--budget 450] [--only SECTION ...]
    python benchmarks/gpu_check.py --dry-run            # on CPU (gloo, tiny shapes): what CI runs

Sections (``--only`` reruns some of them into the same results file, keeping the others):

* ``programs``: the CUDA path of compiled programs at world 1: ``examples/gpt.py``, a tiny
  ``hf:llama`` and ``examples/moe.py`` planned for a one-GPU cluster in fp32 and bf16,
  compiled, and run with ``launch.py --check --steps 20`` under torchrun and NCCL: the parity
  verdict and the median step time against the plan's predicted step
  (``gpu_check_programs.py``).
* ``gemm``: sustained bf16 GEMM time of the QKV, output, MLP up and MLP down projections of
  7B, 13B and 70B layers over 4096 tokens, forward and backward.
* ``attention``: PyTorch's fused attention (FlashAttention) at 2k, 4k and 8k tokens, causal
  and not, forward and backward.
* ``memory``: LayerNorm, RMSNorm (torch's and HuggingFace Llama's eager ops), SwiGLU, and
  AdamW's foreach and fused steps over a 7B layer.
* ``launch``: a tiny kernel back to back and with a synchronisation.

Every kernel figure stands beside the simulator's prediction for the same work
(``gpu_check_kernels.py``: the module traced by the planner, each op priced by the cost
model), for the preset of the GPU it runs on (an H200 is the H100 preset with its own memory
size and bandwidth; see ``gpu_check_report.simulated_cluster``). Nothing is downloaded.

Time: ``--budget`` seconds in all (default 450 on a GPU, 240 on a dry run): each section gets
its share (``gpu_check_report.SECTION_SHARES``) of the time the sections before it left, so
what one leaves unspent goes to the next; an item that starts after its section's time is
up is skipped, and the results file says why (one item may overrun it: a kernel item by a
few seconds, a program by its planning). Progress
is printed as it goes and the results file (JSON: the device, driver, CUDA and torch
versions, then every item) is rewritten after every item, so a run cut short keeps what it
measured. At the end it prints the table of predicted against measured figures.

On the ``device`` tool's GPU machine (one H200; its image has its own torch, 2.11 when last
read, and no OR-tools, which the MoE model's plan needs), carry OR-tools as wheels, as the
tool's README says (Python 3.12, manylinux x86-64, ``--no-deps``): ``ortools==9.15.6755``,
``immutabledict`` and ``protobuf==6.33.6`` (OR-tools pins ``protobuf<6.34,>=6.33.1``), then

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py -o $OUT/gpu_check.json 2>&1 | tee $OUT/log

with a ``timeout_s`` of about 540. Without OR-tools the other models still run (searched over
data parallelism, which is what one device gets anyway) and the MoE rows say why they failed.

Exit status: 0 when every item ran (skipped items included) and every program's parity
check passed, 1 when something failed (the table and the file say what), 2 for a bad flag
or output path, or no GPU without ``--dry-run``.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.gpu_check_kernels import (  # noqa: E402
    DRY_TIMING,
    GPU_TIMING,
    adamw_results,
    attention_items,
    gemm_items,
    launch_results,
    memory_items,
    module_results,
    settle,
)
from benchmarks.gpu_check_programs import MODELS, PRECISIONS, program_results, search_here  # noqa: E402
from benchmarks.gpu_check_report import (  # noqa: E402
    SECTION_SHARES,
    SECTIONS,
    Budget,
    Results,
    check_results_path,
    environment,
    load_cluster,
    say,
    simulated_cluster,
    table,
    work_folder,
)
from planner.arguments import OneLineParser, flag_type, integer_at_least, positive_finite  # noqa: E402
from planner.errors import PlannerError  # noqa: E402


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="run on CPU with gloo and tiny shapes against the cpu preset (figures not meaningful)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, metavar="SECTION",
                        help=f"run only these sections ({', '.join(SECTIONS)}), keeping the others' results in the file")
    parser.add_argument("-o", "--output", default="gpu_check.json", metavar="FILE",
                        help="results JSON (default gpu_check.json); replaced only if this script wrote it")
    parser.add_argument("--force", action="store_true", help="let -o overwrite a file this script did not write")
    parser.add_argument("--budget", type=flag_type(float, positive_finite, "a positive number of seconds"), default=None,
                        metavar="SECONDS", help="time for all the sections together (default 450; dry run 240)")
    parser.add_argument("--steps", type=flag_type(int, lambda value, name: integer_at_least(value, name, 2), "an integer >= 2"),
                        default=None, help="training steps of each program (default 20; dry run 3); the first is "
                        "left out of the median")
    parser.add_argument("--work", metavar="DIR", default=None,
                        help="folder for the plans and compiled programs, kept after the run: a new or empty one, or one this "
                        "script wrote (default: a temporary folder, removed after)")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        options = build_parser().parse_args(argv)
        output = check_results_path(options.output, options.force)
        if not options.dry_run and not torch.cuda.is_available():
            raise PlannerError("no CUDA device here: run on a machine with a GPU, or add --dry-run to check the "
                               "script on CPU")
        work = work_folder(options.work) if options.work is not None else None
    except PlannerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    dry_run = options.dry_run
    budget = options.budget or (240.0 if dry_run else 450.0)
    steps = options.steps or (3 if dry_run else 20)
    sections = tuple(options.only) if options.only else SECTIONS
    facts = environment(dry_run)
    cluster_data, reason = simulated_cluster(facts["device"], dry_run)
    # A scheduler's or timeout's SIGTERM ends the run as Ctrl-C does: what was measured is
    # already in the results file, which says the run is not complete.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if work is not None:
            return run(work, output, facts, cluster_data, reason, sections, budget, steps, dry_run)
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
            return run(Path(folder), output, facts, cluster_data, reason, sections, budget, steps, dry_run)
    except KeyboardInterrupt:
        print(f"interrupted: the items measured so far are in {output}", file=sys.stderr)
        return 130


def _interrupt(number: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(work: Path, output: Path, facts: dict[str, Any], cluster_data: dict[str, Any], reason: str,
        sections: tuple[str, ...], budget: float, steps: int, dry_run: bool) -> int:
    """Run ``sections`` within ``budget`` seconds, writing ``output`` as it goes; the exit status."""
    started = time.monotonic()
    cluster, _ = load_cluster(cluster_data, work)
    results = Results(output, facts, cluster_data, reason, sections)
    device = torch.device("cuda", 0) if not dry_run else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    say(f"gpu_check on {facts['device']} (torch {facts['torch']}, CUDA {facts['cuda']}, driver {facts['driver']}); "
        f"predictions for {cluster.device_of(0).name}: {reason}")
    say(f"results: {output} (rewritten after every item)")
    if "programs" in sections and search_here()[1]:
        say(f"note: {search_here()[1]}")
    timing = DRY_TIMING if dry_run else GPU_TIMING
    failed = False
    for index, section in enumerate(sections):
        # The section's share of the time left, so what one section leaves unspent goes to the next.
        left = budget - (time.monotonic() - started)
        share = SECTION_SHARES[section] / sum(SECTION_SHARES[name] for name in sections[index:])
        section_budget = Budget(section, max(0.0, left * share))
        say(f"[{section}] budget {section_budget.seconds:.0f} s")
        if section != "programs" and section_budget.allows(4 * timing.settle_s):
            settle(device, timing.settle_s)
        for name, step in section_steps(section, dry_run, device, cluster, timing, work, steps, section_budget):
            if not section_budget.allows(0.0):
                results.add(section, {"name": name, "status": "skipped", "reason": section_budget.skip_reason()})
                say(f"  {name}: skipped ({section_budget.skip_reason()})")
                continue
            try:
                rows = step()
            except Exception as error:  # a failure is a result of this check: record it, go on
                rows = [{"name": name, "status": "failed", "reason": f"{type(error).__name__}: {error}",
                         "traceback": traceback.format_exc().splitlines()[-12:]}]
            for row in rows:
                results.add(section, row)
                failed = failed or row.get("status") == "failed" or row.get("parity_ok") is False
                say(f"  {_progress_line(row)}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    results.finish(time.monotonic() - started)
    say("")
    say(table(results.data))
    say(f"\nwrote {output} in {time.monotonic() - started:.0f} s")
    return 1 if failed else 0


def section_steps(section: str, dry_run: bool, device: torch.device, cluster, timing, work: Path, steps: int,
                  budget: Budget) -> list[tuple[str, Callable[[], list[dict[str, Any]]]]]:
    """(item name, a call that measures it and returns its result rows) for every item of ``section``."""
    spec = cluster.device_of(0)
    if section == "programs":
        return [(f"{case.name} {precision}",
                 lambda case=case, precision=precision: [program_results(
                     case, precision, cluster, work / f"{case.name}-{precision}", steps, budget.left, say)])
                for case in MODELS for precision in PRECISIONS]
    if section == "memory":
        return [*_module_steps(memory_items(dry_run), device, spec, timing),
                *[(f"adamw {implementation}", lambda implementation=implementation: [
                    adamw_results(implementation, dry_run, device, spec, timing)]) for implementation in ("foreach", "fused")]]
    if section == "launch":
        return [("tiny op", lambda: launch_results(device, spec, timing))]
    items = gemm_items(dry_run) if section == "gemm" else attention_items(dry_run)
    return _module_steps(items, device, spec, timing)


def _module_steps(items, device, spec, timing) -> list[tuple[str, Callable[[], list[dict[str, Any]]]]]:
    return [(item.name, lambda item=item: module_results(item, device, spec, timing)) for item in items]


def _progress_line(row: dict[str, Any]) -> str:
    if "measured_s" not in row:
        return f"{row['name']}: {row['status']}: {row['reason']}"
    return (f"{row['name']}: measured {row['measured_s'] * 1e3:.3f} ms, predicted {row['predicted_s'] * 1e3:.3f} ms"
            f" ({row['error']:+.0%})" + (f"; {row['note']}" if row.get("note") else ""))


if __name__ == "__main__":
    sys.exit(main())
