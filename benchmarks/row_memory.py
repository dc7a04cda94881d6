"""Where a fidelity row's memory goes: the busiest device's breakdown against its capacity,
every pipeline rank's total, and, asked for, the bytes one repeated block keeps per micro-batch
node by node (what ``cost_model.step_memory`` multiplies by the passes in flight).

    python benchmarks/row_memory.py --runs 'Llama3-405B*'            # breakdown and per-rank totals
    python benchmarks/row_memory.py --runs 'Llama3-405B@8192*' --block 5   # and block 5's saved bytes

The rows are ``benchmarks/fidelity_runs.py``'s, simulated as ``benchmarks/fidelity.py``
simulates them. ``docs/fidelity_log.md`` (session 12, s12mem) accounts Llama 3 405B's rows with
this script's figures.
"""

from __future__ import annotations

import argparse

from cost_model.simulator import Simulator
from planner.api import prepare_model
from planner.model_spec import ModelSpec

try:  # run as a script or imported as benchmarks.row_memory
    from benchmarks.fidelity import EXAMPLES, simulate
    from benchmarks.fidelity_runs import Run, chosen_runs
except ModuleNotFoundError:  # pragma: no cover - the script's own folder is on sys.path instead
    from fidelity import EXAMPLES, simulate
    from fidelity_runs import Run, chosen_runs

GIB = 2**30


def memory_lines(run: Run) -> list[str]:
    """The busiest device's memory by kind against its capacity, then each pipeline rank's total."""
    estimate = simulate(run)[0].estimate
    memory = estimate.memory
    parts = ", ".join(f"{kind} {value / GIB:.2f}" for kind, value in vars(memory).items())
    verdict = "fits" if estimate.fits else "does not fit"
    lines = [f"{run.name}: {memory.total / GIB:.2f} GiB of {estimate.device_memory_bytes / GIB:.2f} ({verdict}): {parts}"]
    if len(estimate.stage_memory) > 1:
        totals = " ".join(f"{stage.total / GIB:.1f}" for stage in estimate.stage_memory)
        lines.append(f"  per pipeline rank, GiB: {totals}")
    return lines


def block_lines(run: Run, block: int) -> list[str]:
    """The bytes each node of repeated block ``block`` keeps for backward, one micro-batch on one
    device (``NodeCost.saved_bytes``), and their sum."""
    plan, cluster = simulate(run)
    spec = ModelSpec(str(EXAMPLES / run.example), run.overrides).resolved()
    graph = prepare_model(spec, cluster)[0]
    blocks = sorted({node.block[1] for node in graph.nodes if node.block is not None})
    if block not in blocks:
        raise ValueError(f"{run.name} has no repeated block {block}; its blocks are "
                         f"{blocks[0]}..{blocks[-1]}" if blocks else f"{run.name} has no repeated blocks")
    costs = Simulator(plan, graph).costs
    lines, total = [], 0.0
    for node in graph.nodes:
        if node.block is None or node.block[1] != block or not costs[node.name].saved_bytes:
            continue
        kept = costs[node.name].saved_bytes
        total += kept
        shape = tuple(node.output_meta[0].shape) if node.output_meta else ()
        lines.append(f"  {node.module:<34} {node.op:<42} {kept / 1e6:9.1f} MB  traced {shape}")
    lines.append(f"  block {block} keeps {total / 1e6:.1f} MB per micro-batch")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True, help="run names or shell patterns, e.g. 'Llama3-405B*'")
    parser.add_argument("--block", type=int, help="also list what this repeated block keeps, node by node")
    options = parser.parse_args()
    chosen = chosen_runs(parser, options.runs)
    for run in chosen:
        print("\n".join(memory_lines(run)))
        if options.block is not None:
            try:
                print("\n".join(block_lines(run, options.block)))
            except ValueError as error:
                parser.error(f"{error}: pass --block with one of them")


if __name__ == "__main__":
    main()
