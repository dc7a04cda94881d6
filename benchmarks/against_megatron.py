"""The searched plan against published Megatron-LM and torchtitan configurations.

    python benchmarks/against_megatron.py                  # every row (about 10 minutes)
    python benchmarks/against_megatron.py --rows 1.7B 175B # some rows
    python benchmarks/against_megatron.py --rows 175B Llama-70B@64 Llama-405B@256  # item 4's rows

Rows: the GPT models of Megatron-LM's weak-scaling study (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21, table 1:
heads, hidden size, layers, tensor- and pipeline-parallel sizes, GPUs, global batch;
vocabulary 51,200, sequence 2,048, A100 80GB), and Llama 3.1 8B/70B/405B as torchtitan
publishes them (pytorch/torchtitan docs/performance.md, tables 1, 4 and 5, H100 nodes,
sequence 8,192 from its llama3 train configs). Each on the planner's preset of that node.

Three rows at production scale, each with column (d), the best hand-written configuration:

- ``175B``: GPT-3 175B (Brown et al. 2020, table 2.1: 96 layers, width 12,288, 96 heads,
  sequence 2,048) on 128 DGX A100 nodes (1,024 GPUs) with Megatron-LM's batch of 1,536
  sequences (Narayanan et al. SC'21, section 5.1, its 175B end-to-end estimate on 1,024 GPUs);
- ``Llama-70B@64``: Llama 3 70B on 64 DGX H100 nodes (512 GPUs), 1,024 sequences of 8,192
  (8M tokens). Meta publishes no 70B batch; the 405B schedule (Dubey et al. 2024, "The Llama 3
  Herd of Models", section 3.4.1) runs 8M-token batches of 8,192-token sequences in its middle
  stage, so 70B gets that batch;
- ``Llama-405B@256``: Llama 3 405B on 256 DGX H100 nodes (2,048 GPUs), 2,048 sequences of
  8,192: the 16M-token batch of the same schedule's final stage (and of the paper's table 4).

These rows publish no configuration at this scale and batch, so column (a) is empty there.

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
(c) the searched plan: ``search.auto.search_plan`` at the default budget;
(d) the best hand-written configuration (``hand_written_configurations``): what an engineer
    would write with ``planner.baselines.megatron`` (simulated by ``search.megatron.megatron_plan``,
    which it runs, on the graph traced once): tp = 8 inside the node with sequence
    parallelism; pp over nodes (1, 2, 4, 8 and 16 where they divide the nodes); micro-batches
    of 1 and 2 samples; 1F1B and interleaved 1F1B with 2 and 4 virtual stages; ZeRO-1 (Megatron's
    distributed optimizer) or FSDP over dp; no, selective or full recomputation; blocks split
    evenly, or with the end stages a block short where they do not divide
    (``nearly_even_layers``); without a pipeline, gradient accumulation when the batch does not
    fit at once. Every configuration is simulated; the fastest that fits is (d). "c>=d" says
    whether the searched plan's MFU is at least (d)'s.

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
from search.data_parallel import accumulating
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
    published: dict | None  # baselines.megatron keyword arguments; None where none is published
    source: str
    hand_written: bool = False  # column (d): simulate the hand-written configurations


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
LLAMA_70B = {"size": "8b", "n_layer": 80, "dim": 8192, "n_heads": 64, "n_kv_heads": 8, "ffn_dim": 28672, "seq_len": 8192}
LLAMA_405B = {
    "size": "8b", "n_layer": LLAMA_405B_LAYERS, "dim": 16384, "n_heads": 128, "n_kv_heads": 8, "ffn_dim": 53248,
    "seq_len": 8192,
}


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
    Row("Llama-70B", "llama.py", {**LLAMA_70B, "batch_size": 512}, "dgx-h100:32",
        {"tp": 8, "sequence_parallel": True, "dp_flavour": "fsdp", "recompute": "full"}, "titan t4"),
    # torchtitan table 5: 512 GPUs, FSDP 8 x TP 8 x PP 8, local batch 32 (global 256), full
    # checkpointing, interleaved 1F1B (its faster row; 2 stages per rank, micro-batch 1). 126
    # layers do not split into 16 stages evenly: the end stages take 7, the others 8
    # (what Megatron-Core's --decoder-first/last-pipeline-num-layers would give).
    Row("Llama-405B", "llama.py", {**LLAMA_405B, "batch_size": 256}, "dgx-h100:64",
        {"tp": 8, "sequence_parallel": True, "pp": 8, "micro_batch": 1, "schedule": "interleaved", "virtual_stages": 2,
         "dp_flavour": "fsdp",
         "recompute": "full", "layers_per_stage": nearly_even_layers(LLAMA_405B_LAYERS, 16)},
        "titan t5"),
    # Production scale (see the module docstring for the batches' sources): column (d).
    Row("175B", "gpt.py",
        {"n_layer": 96, "n_embd": 12288, "n_head": 96, "vocab_size": 51200, "seq_len": 2048, "batch_size": 1536},
        "dgx-a100-80g:128", None, "SC'21 5.1", hand_written=True),
    Row("Llama-70B@64", "llama.py", {**LLAMA_70B, "batch_size": 1024}, "dgx-h100:64", None, "Llama 3", hand_written=True),
    Row("Llama-405B@256", "llama.py", {**LLAMA_405B, "batch_size": 2048}, "dgx-h100:256", None, "Llama 3",
        hand_written=True),
]

# Column (d)'s options (see the module docstring).
HAND_PIPELINE_DEPTHS = (1, 2, 4, 8, 16)
HAND_MICRO_BATCH_SIZES = (1, 2)
HAND_SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("interleaved", 4))
HAND_FLAVOURS = ("zero1", "fsdp")
HAND_RECOMPUTE = ("none", "selective", "full")


def describe(plan) -> str:
    """``tp8 pp8 dp16 1f1b m96 full`` and the like: the knobs of a plan, short."""
    mesh = dict(plan.mesh.axes)
    parts = [f"{axis}{mesh[axis]}" for axis in ("tp", "pp", "dp") if mesh.get(axis, 1) > 1]
    if plan.label and plan.label != "megatron":
        parts.insert(0, plan.label)
    if plan.pipeline is not None:
        schedule = "int" + str(plan.pipeline.virtual_stages) if plan.pipeline.schedule == "interleaved" else "1f1b"
        parts.append(f"{schedule} m{plan.pipeline.micro_batches}")
    if plan.accumulation_steps > 1:
        parts.append(f"acc{plan.accumulation_steps}")
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


def hand_written_configurations(blocks: int, world: int, per_node: int, batch: int) -> list[dict]:
    """Column (d)'s configurations, as ``megatron_plan`` keyword arguments: tp = the devices
    of a node with sequence parallelism, every pp of ``HAND_PIPELINE_DEPTHS`` that divides the
    nodes, and every micro-batch size, schedule, dp flavour and recomputation of the
    ``HAND_*`` options that the batch and the blocks allow. Where the blocks do not divide
    into the (virtual) stages, Megatron-Core's split: the end stages a block short."""
    tp, nodes = per_node, world // per_node
    found = []
    for pp in HAND_PIPELINE_DEPTHS:
        dp = world // (tp * pp)
        if nodes % pp or pp > blocks or batch % dp:
            continue
        local = batch // dp
        # Without a pipeline the micro-batch is the whole local batch (accumulation comes later).
        for micro_batch in HAND_MICRO_BATCH_SIZES if pp > 1 else (local,):
            if local % micro_batch:
                continue
            micro_batches = local // micro_batch
            for schedule, chunks in HAND_SCHEDULES if pp > 1 else (("1f1b", 1),):
                if schedule == "interleaved" and (micro_batches % pp or pp * chunks > blocks):
                    continue
                stages = pp * chunks
                layers = None if blocks % stages == 0 else list(nearly_even_layers(blocks, stages))
                for flavour in HAND_FLAVOURS if dp > 1 else HAND_FLAVOURS[:1]:  # one dp rank: no flavour to pick
                    for recompute in HAND_RECOMPUTE:
                        found.append({
                            "tp": tp, "pp": pp, "micro_batch": micro_batch, "schedule": schedule,
                            "virtual_stages": chunks, "dp_flavour": flavour, "recompute": recompute,
                            "sequence_parallel": True, "layers_per_stage": layers,
                        })
    return found


def hand_written_best(graph, cluster, spec, name):
    """Column (d): every hand-written configuration simulated; the fastest that fits (with
    gradient accumulation where a plan without a pipeline does not fit at once), and how
    many were simulated."""
    configurations = hand_written_configurations(
        sum(graph.blocks.values()), cluster.world_size, cluster.devices_per_node, graph.batch_size
    )
    best = None
    for options in configurations:
        layers = options["layers_per_stage"]
        plan = megatron_plan(
            graph, cluster, spec, name, precision="bf16", **{**options, "layers_per_stage": layers and tuple(layers)}
        )
        plan = accumulating(plan, graph) or plan
        if plan.estimate.fits and (best is None or plan.estimate.step_time_s < best.estimate.step_time_s):
            best = plan
    return best, len(configurations)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="row names to run (default: all)")
    options = parser.parse_args()
    rows = [row for row in ROWS if not options.rows or row.name in options.rows]
    print(f"{'model':<14} {'GPUs':>5} {'(a) published':>15} {'(b) Megatron grid':>15} {'(c) searched':>15} "
          f"{'(d) hand-written':>15}  c<=b  c>=d  plan time  configurations (a) / (b) / (c) / (d)")
    for row in rows:
        spec = ModelSpec(str(EXAMPLES / row.example), row.overrides).resolved()
        graph, spec, name, cluster = prepare_model(spec, row.cluster)
        published = None
        try:
            # What planner.baselines.megatron runs, on the graph traced once for the row.
            if row.published is not None:
                published = megatron_plan(graph, cluster, spec, name, precision="bf16", **row.published)
        except PlanningError as error:
            print(f"  ({row.name}: the published configuration does not build: {error})")
        hand_best, hand_count = hand_written_best(graph, cluster, spec, name) if row.hand_written else (None, 0)
        grid_best = megatron_grid_best(graph, cluster, spec, name)
        searched_at = time.perf_counter()
        searched = search_plan(graph, cluster, spec, name, budget=SearchBudget(), precision="bf16")
        planned = time.perf_counter() - searched_at
        ok = grid_best is None or searched.estimate.step_time_s <= grid_best.estimate.step_time_s * (1 + 1e-9)
        beats_hand = "-" if not row.hand_written else (
            "yes" if hand_best is None or searched.estimate.mfu >= hand_best.estimate.mfu * (1 - 1e-9) else "NO"
        )
        print(
            f"{row.name:<14} {cluster.world_size:>5} {cell(published)} {cell(grid_best)} {cell(searched)} "
            f"{cell(hand_best)}  {'yes' if ok else 'NO':>4}  {beats_hand:>4}  {planned:>7.1f}s  "
            f"{describe(published) if published else '-'} / {describe(grid_best) if grid_best else '-'} / "
            f"{describe(searched)} / {describe(hand_best) + f' (best of {hand_count})' if hand_best else '-'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
