"""The searched plan against published Megatron-LM and torchtitan configurations.

    python benchmarks/against_megatron.py                  # every row (about 10 minutes)
    python benchmarks/against_megatron.py --rows 1.7B 175B # some rows

Rows: the GPT models of Megatron-LM's weak-scaling study (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21, table 1:
heads, hidden size, layers, tensor- and pipeline-parallel sizes, GPUs, global batch;
vocabulary 51,200, sequence 2,048, A100 80GB), and Llama 3.1 8B/70B/405B as torchtitan
publishes them (pytorch/torchtitan docs/performance.md, tables 1, 4 and 5, H100 nodes,
sequence 8,192 from its llama3 train configs). Each on the planner's preset of that node.

Columns, each simulated (step time and MFU):

(a) the published configuration (``planner.baselines.megatron``'s plan). Table 1 gives no
    micro-batch size or schedule: we use micro-batches of 1 sample, 1F1B and full
    recomputation, as the paper's runs recompute activations;
(b) the best of a grid of Megatron-LM configurations: tp (with or without sequence
    parallelism), pp (even stages; when the layers do not divide, the first and last stages
    a layer short: ``search.layouts.nearly_even_layers``), micro-batches of 1/2/4/8, 1F1B or
    interleaved (2 or 4 virtual stages), recomputation none/selective/full, DDP or Megatron's
    distributed optimizer (ZeRO-1). The grid is ranked by the pipeline cost model
    (``search.pipeline_search``) and its ``GRID_SIMULATIONS`` best are simulated;
(c) the searched plan: ``search.auto.search_plan`` at the default budget.

The published configurations are only plans to compare against: no simulator constant is
fitted to their published throughput.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from planner.api import prepare_model
from planner.errors import PlanningError
from planner.model_spec import ModelSpec
from search.auto import search_plan
from search.budget import SearchBudget
from search.layouts import nearly_even_layers
from search.megatron import megatron_plan
from search.pipeline_search import PipelineGrid, PipelineSpace

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GRID_SIMULATIONS = 6
MEGATRON_GRID = PipelineSpace(flavours=("ddp", "zero1"), uneven=False, per_stage_recompute=False)


@dataclass(frozen=True)
class Row:
    name: str
    example: str
    overrides: dict
    cluster: str
    published: dict  # baselines.megatron keyword arguments
    source: str


def gpt(name, heads, hidden, layers, tp, pp, gpus, batch) -> Row:
    """A row of Narayanan et al. SC'21, table 1."""
    return Row(
        name, "gpt.py",
        {"n_layer": layers, "n_embd": hidden, "n_head": heads, "vocab_size": 51200, "seq_len": 2048, "batch_size": batch},
        f"dgx-a100-80g:{gpus // 8}",
        {"tp": tp, "pp": pp, "micro_batch": 1, "schedule": "1f1b", "recompute": "full"},
        "SC'21 t1",
    )


LLAMA_405B_LAYERS = 126


ROWS = [
    gpt("1.7B", 24, 2304, 24, 1, 1, 32, 512),
    gpt("3.6B", 32, 3072, 30, 2, 1, 64, 512),
    gpt("7.5B", 32, 4096, 36, 4, 1, 128, 512),
    gpt("18B", 48, 6144, 40, 8, 1, 256, 1024),
    gpt("39B", 64, 8192, 48, 8, 2, 512, 1536),
    gpt("76B", 80, 10240, 60, 8, 4, 1024, 1792),
    gpt("146B", 96, 12288, 80, 8, 8, 1536, 2304),
    gpt("310B", 128, 16384, 96, 8, 16, 1920, 2160),
    gpt("530B", 128, 20480, 105, 8, 35, 2520, 2520),
    gpt("1T", 160, 25600, 128, 8, 64, 3072, 3072),
    # torchtitan table 1: FSDP on 8 GPUs, local batch 2 (global 16), selective checkpointing.
    Row("Llama-8B", "llama.py", {"size": "8b", "batch_size": 16, "seq_len": 8192}, "dgx-h100:1",
        {"dp_flavour": "fsdp", "recompute": "selective"}, "titan t1"),
    # torchtitan table 4: 256 GPUs, FSDP 32 x TP 8, local batch 16 (global 512), full checkpointing.
    # torchtitan's tensor parallelism splits the norms' sequence (Megatron's sequence parallelism).
    Row("Llama-70B", "llama.py",
        {"size": "8b", "n_layer": 80, "dim": 8192, "n_heads": 64, "n_kv_heads": 8, "ffn_dim": 28672,
         "batch_size": 512, "seq_len": 8192},
        "dgx-h100:32", {"tp": 8, "sequence_parallel": True, "dp_flavour": "fsdp", "recompute": "full"}, "titan t4"),
    # torchtitan table 5: 512 GPUs, FSDP 8 x TP 8 x PP 8, local batch 32 (global 256), full
    # checkpointing, interleaved 1F1B (its faster row; 2 stages per rank, micro-batch 1). 126
    # layers do not split into 16 stages evenly: the end stages take 7, the others 8
    # (what Megatron-Core's --decoder-first/last-pipeline-num-layers would give).
    Row("Llama-405B", "llama.py",
        {"size": "8b", "n_layer": LLAMA_405B_LAYERS, "dim": 16384, "n_heads": 128, "n_kv_heads": 8, "ffn_dim": 53248,
         "batch_size": 256, "seq_len": 8192},
        "dgx-h100:64",
        {"tp": 8, "sequence_parallel": True, "pp": 8, "micro_batch": 1, "schedule": "interleaved", "virtual_stages": 2,
         "dp_flavour": "fsdp",
         "recompute": "full", "layers_per_stage": nearly_even_layers(LLAMA_405B_LAYERS, 16)},
        "titan t5"),
]


def describe(plan) -> str:
    """``tp8 pp8 dp16 1f1b m96 full`` and the like: the knobs of a plan, short."""
    mesh = dict(plan.mesh.axes)
    parts = [f"{axis}{mesh[axis]}" for axis in ("tp", "pp", "dp") if mesh.get(axis, 1) > 1]
    if plan.label and plan.label != "megatron":
        parts.insert(0, plan.label)
    if plan.pipeline is not None:
        schedule = "int" + str(plan.pipeline.virtual_stages) if plan.pipeline.schedule == "interleaved" else "1f1b"
        parts.append(f"{schedule} m{plan.pipeline.micro_batches}")
    if plan.dp_flavour != "ddp" and "dp" in mesh:
        parts.append(plan.dp_flavour)
    if plan.recompute != "none":
        parts.append({"full": "rc-full", "selective": "rc-sel"}[plan.recompute])
    if plan.label == "megatron" and any(s.produced is not None for s in plan.strategies):
        parts.append("sp")
    return " ".join(parts)


def cell(plan) -> str:
    if plan is None:
        return f"{'-':>8} {'-':>5}"
    if not plan.estimate.fits:
        return f"{plan.estimate.step_time_s:>7.2f}s {'OOM':>5}"
    return f"{plan.estimate.step_time_s:>7.2f}s {plan.estimate.mfu:>5.1%}"


def megatron_grid_best(graph, cluster, spec, name):
    """Column (b): the Megatron-only grid, ranked by the cost model, best simulated that fits."""
    grid = PipelineGrid(graph, cluster, "bf16", MEGATRON_GRID)
    plans = [grid.plan(estimate, spec, name) for estimate in grid.best(GRID_SIMULATIONS)]
    fitting = [plan for plan in plans if plan.estimate.fits]
    return min(fitting, key=lambda p: p.estimate.step_time_s) if fitting else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="row names to run (default: all)")
    options = parser.parse_args()
    rows = [row for row in ROWS if not options.rows or row.name in options.rows]
    print(f"{'model':<10} {'GPUs':>5} {'(a) published':>15} {'(b) Megatron grid':>15} {'(c) searched':>15}  c<=b  "
          f"plan time  configurations (a) / (b) / (c)")
    for row in rows:
        spec = ModelSpec(str(EXAMPLES / row.example), row.overrides).resolved()
        graph, spec, name, cluster = prepare_model(spec, row.cluster)
        try:
            # What planner.baselines.megatron runs, on the graph traced once for the row.
            published = megatron_plan(graph, cluster, spec, name, precision="bf16", **row.published)
        except PlanningError as error:
            published = None
            print(f"  ({row.name}: the published configuration does not build: {error})")
        grid_best = megatron_grid_best(graph, cluster, spec, name)
        searched_at = time.perf_counter()
        searched = search_plan(graph, cluster, spec, name, budget=SearchBudget(), precision="bf16")
        planned = time.perf_counter() - searched_at
        ok = grid_best is None or searched.estimate.step_time_s <= grid_best.estimate.step_time_s * (1 + 1e-9)
        print(
            f"{row.name:<10} {cluster.world_size:>5} {cell(published)} {cell(grid_best)} {cell(searched)}  "
            f"{'yes' if ok else 'NO':>4}  {planned:>7.1f}s  "
            f"{describe(published) if published else '-'} / {describe(grid_best) if grid_best else '-'} / "
            f"{describe(searched)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
