"""Where a fidelity run's kernel time goes, by kind of op: the component view of a row.

    python benchmarks/fidelity_ops.py --runs MPT-7B@8xH100
    python benchmarks/fidelity_ops.py --runs 'MCore-GPT-1.7B*' --top 8

For each run of ``benchmarks/fidelity.py``, the simulator's own node costs (one micro-batch on
one device, ``cost_model.simulator.Simulator.costs``) summed by ATen op (matmuls together),
forward and backward, times the step's micro-batches: the figures to hold against a public
measurement of each component (GEMM throughput, FlashAttention, memory-bound kernels).
Recomputation's extra forward and everything outside the kernels (collectives, the
optimizer step, pipeline bubbles) are not in it: ``fidelity.py --breakdown`` shows the step.
With a pipeline the sum runs over every stage's ops, not one device's.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass

from cost_model.gpu_kernels import MATMUL_OPS
from cost_model.simulator import Simulator

try:  # run as a script (python benchmarks/fidelity_ops.py) or imported as benchmarks.fidelity_ops
    from benchmarks.fidelity import simulate
    from benchmarks.fidelity_runs import chosen_runs
except ModuleNotFoundError:  # pragma: no cover - the script's own folder is on sys.path instead
    from fidelity import simulate
    from fidelity_runs import chosen_runs


@dataclass(frozen=True)
class OpKind:
    """The kernel time of one kind of op over a step on one device."""

    kind: str
    count: int
    forward_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def op_kind(op: str) -> str:
    """The group an ATen op's time is summed in: matmuls together, others by op name."""
    return "matmul" if op.startswith(MATMUL_OPS) else op.rsplit(".", 1)[0]


def kernel_time_by_kind(plan, graph) -> list[OpKind]:
    """Forward and backward kernel seconds of ``plan``'s step by kind of op, largest first:
    the simulator's per-micro-batch node costs times the step's micro-batches."""
    simulator = Simulator(plan, graph)
    micro_batches = simulator.context.micro_batches
    nodes = {node.name: node for node in graph.nodes}
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for name, cost in simulator.costs.items():
        if cost.forward_s == 0.0 and cost.backward_s == 0.0:
            continue  # views and other free ops
        entry = sums[op_kind(nodes[name].op)]
        entry[0] += 1
        entry[1] += cost.forward_s * micro_batches
        entry[2] += cost.backward_s * micro_batches
    kinds = [OpKind(kind, int(count), forward, backward) for kind, (count, forward, backward) in sums.items()]
    return sorted(kinds, key=lambda kind: -kind.total_s)


def table(kinds: list[OpKind], top: int) -> list[str]:
    """The kinds as printed lines: count, forward and backward ms, share of the kernel time."""
    total = sum(kind.total_s for kind in kinds) or 1.0
    lines = [f"  {kind.kind:<36} {kind.count:>5} ops  forward {kind.forward_s * 1e3:9.1f} ms  backward "
             f"{kind.backward_s * 1e3:9.1f} ms  {kind.total_s / total:6.1%}" for kind in kinds[:top]]
    lines.append(f"  {'all kernels':<36} {sum(kind.count for kind in kinds):>5} ops  {total * 1e3:.1f} ms")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True, help="run names or shell patterns (fidelity.py --rows-only)")
    parser.add_argument("--top", type=int, default=12, help="kinds of op to print per run (default 12)")
    options = parser.parse_args(argv)
    chosen = chosen_runs(parser, options.runs)
    for run in chosen:
        plan, _ = simulate(run)
        print(f"{run.name}: kernel time of one step on one device, by kind of op")
        print("\n".join(table(kernel_time_by_kind(plan, plan.graph), options.top)))


if __name__ == "__main__":
    main()
