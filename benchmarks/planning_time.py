"""End-to-end planning time at GPT-3 and Llama-3 405B scale: trace on meta + search + simulation.

    python benchmarks/planning_time.py                               # GPT-3: layers, then GPUs
    python benchmarks/planning_time.py --model llama405b             # Llama-3 405B: the same tables
    python benchmarks/planning_time.py --layers 96 --nodes           # GPT-3 175B alone
    python benchmarks/planning_time.py --model llama405b --layers --nodes 256   # 405B, 2048 GPUs

Models (bf16 mixed precision, ``search_plan`` at the default budget, ``search="auto"``: CP-SAT
then MCMC per mesh, the pipeline grid, the data-parallel and Megatron baselines; every budget
counts work, not seconds, see search/budget.py):

- ``gpt3``: GPT-3 shapes (hidden 12288, 96 heads, sequence 2048, vocabulary 51200, global
  batch 1536), 96 layers, on DGX A100 80GB nodes (128 nodes, 1024 GPUs, by default);
- ``llama405b``: Llama-3 405B (hidden 16384, 128 heads, 8 key/value heads, feed-forward
  53248, sequence 8192, global batch 2048), 126 layers, on DGX H100 nodes (256 nodes, 2048
  GPUs, by default).

Two tables: time against depth (``--layers``, on the default node count) and time against
the cluster (``--nodes``, at the full depth). Each row prints the trace, search + simulation
and total wall-clock seconds, then the plan picked and its predicted step. Repeated blocks are
solved once, so the search grows slowly with depth while tracing grows linearly; the
pipeline grid grows with the divisors of the GPU count. Targets on a 2-core machine: GPT-3
175B on 128 nodes under 20 s, Llama-3 405B on 256 nodes under 60 s.
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
MODELS = {
    # name: (example, overrides without the depth, depth option, full depth, preset, nodes,
    #        default depths, default node counts)
    "gpt3": (
        "gpt.py", {"n_embd": 12288, "n_head": 96, "vocab_size": 51200, "seq_len": 2048, "batch_size": 1536},
        "n_layer", 96, "dgx-a100-80g", 128, [12, 24, 48, 96], [16, 32, 64, 128],
    ),
    "llama405b": (
        "llama.py",
        {"size": "8b", "dim": 16384, "n_heads": 128, "n_kv_heads": 8, "ffn_dim": 53248, "batch_size": 2048, "seq_len": 8192},
        "n_layer", 126, "dgx-h100", 256, [16, 32, 63, 126], [32, 64, 128, 256],
    ),
}


def plan_once(model: str, layers: int, nodes: int, search: str, effort: float) -> str:
    """Trace and search one configuration; the row of the table."""
    example, overrides, depth_option, _, preset, _, _, _ = MODELS[model]
    spec = ModelSpec(str(EXAMPLES / example), {**overrides, depth_option: layers}).resolved()
    start = time.perf_counter()
    graph, spec, name, cluster = prepare_model(spec, f"{preset}:{nodes}")
    traced = time.perf_counter()
    plan = search_plan(graph, cluster, spec, name, search=search, budget=SearchBudget(effort=effort), precision="bf16")
    done = time.perf_counter()
    estimate = plan.estimate
    recompute = f", recompute {plan.recompute}" if plan.recompute != "none" else ""
    return (
        f"{layers:>6} {cluster.world_size:>5} {graph.parameter_count / 1e9:>7.1f}B {traced - start:>6.1f}s "
        f"{done - traced:>10.1f}s {done - start:>6.1f}s  {plan.name}{recompute}: {estimate.step_time_s:.2f} s/step, "
        f"MFU {estimate.mfu:.1%}, {estimate.memory.total / 2**30:.0f} GiB/GPU{'' if estimate.fits else ' (does not fit)'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt3")
    parser.add_argument(
        "--layers", type=int, nargs="*",
        help="depths for the table over layers (default: four up to the full depth; the flag alone: no such table)",
    )
    parser.add_argument(
        "--nodes", type=int, nargs="*",
        help="node counts for the table over GPUs (default: four up to the default count; the flag alone: no such table)",
    )
    parser.add_argument("--search", default="auto", choices=("ilp", "auto", "mcmc"))
    parser.add_argument("--effort", type=float, default=1.0, help="search effort (work, not seconds; default 1)")
    options = parser.parse_args()
    _, _, _, depth, _, nodes, default_depths, default_nodes = MODELS[options.model]
    depths = default_depths if options.layers is None else options.layers
    node_counts = default_nodes if options.nodes is None else options.nodes
    header = f"{'layers':>6} {'GPUs':>5} {'params':>8} {'trace':>7} {'search+sim':>11} {'total':>7}  plan, predicted step"
    if depths:
        print(f"{options.model}: time against depth, {nodes} nodes\n{header}")
        for layers in depths:
            print(plan_once(options.model, layers, nodes, options.search, options.effort), flush=True)
    if node_counts:
        print(f"{options.model}: time against the cluster, {depth} layers\n{header}")
        for count in node_counts:
            print(plan_once(options.model, depth, count, options.search, options.effort), flush=True)


if __name__ == "__main__":
    main()
