"""End-to-end planning time at GPT-3 scale: trace on meta + search + simulation.

    python benchmarks/planning_time.py                 # 12, 24, 48 and 96 layers
    python benchmarks/planning_time.py --layers 96     # just GPT-3 175B

GPT-3 shapes (hidden 12288, 96 heads, sequence 2048, vocabulary 51200, global batch 1536)
on 128 DGX A100 nodes (1024 GPUs), bf16 mixed precision, ``search="ilp"`` at effort 1 (a deterministic
budget of work; see search/budget.py). Repeated blocks
are solved once, so the search time should barely grow with depth; tracing grows linearly.
Target for 96 layers: under 60 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.auto import search_plan
from search.budget import SearchBudget

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="*", default=[12, 24, 48, 96])
    parser.add_argument("--search", default="ilp", choices=("ilp", "auto", "mcmc"))
    parser.add_argument("--effort", type=float, default=1.0, help="search effort (work, not seconds; default 1)")
    options = parser.parse_args()
    print(f"{'layers':>6} {'params':>8} {'trace':>7} {'search+sim':>11} {'total':>7}  plan, predicted step")
    for layers in options.layers:
        spec = ModelSpec(
            str(EXAMPLES / "gpt.py"),
            {"n_layer": layers, "n_embd": 12288, "n_head": 96, "vocab_size": 51200, "seq_len": 2048, "batch_size": 1536},
        ).resolved()
        start = time.perf_counter()
        graph, spec, name, cluster = prepare_model(spec, "dgx-a100-80g:128")
        traced = time.perf_counter()
        plan = search_plan(
            graph, cluster, spec, name, search=options.search, budget=SearchBudget(effort=options.effort), precision="bf16"
        )
        done = time.perf_counter()
        print(
            f"{layers:>6} {graph.parameter_count / 1e9:>7.1f}B {traced - start:>6.1f}s {done - traced:>10.1f}s "
            f"{done - start:>6.1f}s  {plan.name}, {plan.estimate.step_time_s:.2f} s/step, MFU {plan.estimate.mfu:.0%}, "
            f"{plan.estimate.memory.total / 2**30:.0f} GiB/GPU{'' if plan.estimate.fits else ' (does not fit)'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
