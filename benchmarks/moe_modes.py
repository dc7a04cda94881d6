"""Each fixed way of running a Mixtral-8x7B-sized model's MoE layers against the searched plan.

    python benchmarks/moe_modes.py                       # uniform routing, 16 dgx-a100-80g nodes
    python benchmarks/moe_modes.py --routing zipf:1.2 --nodes 8
    python benchmarks/moe_modes.py --model hf                # HuggingFace's Mixtral-8x7B itself

The model: ``examples/moe.py`` at Mixtral-8x7B's sizes (width 4096, 32 layers, 32 heads, 8
experts, top-2, expert FFN 14336, vocabulary 32000, sequences of 4096, one sequence per GPU,
capacity factor 1.25). Its experts are GELU MLPs, 2 matmuls each, not Mixtral's SwiGLU with
3: expert weights and FLOPs are 2/3 of Mixtral's. ``--model hf`` plans HuggingFace's own
Mixtral-8x7B instead (``hf:mixtral``'s published configuration: SwiGLU experts, grouped-query
attention, 46.7B parameters), whose blocks compiled programs run expert parallel or
replicated (not sliced). Traced on meta tensors (nothing is allocated), planned in bf16 on
``dgx-a100-80g`` nodes.

For each mode run by every MoE layer (``search.moe_search``'s fixed plans: experts
replicated, experts sliced, expert parallel with a flat all-to-all and round-robin placement,
or EPLB's when the 8 experts do not divide over the GPUs) and for the searched plan (each
layer's mode, placement and all-to-all chosen from the routing statistics): the simulated
step, whether it fits in 80 GB, memory on the fullest GPU, and the exposed communication.
The dense part is data parallel over every GPU (DDP, ZeRO-2 or FSDP: the
search picks one, and the fixed modes use the same). Every plan is shown without and with its
blocks recomputed in backward; the search recomputes only when nothing fits otherwise. The
searched plan must be no slower than the best fixed mode that fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from cost_model.simulator import simulated
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from planner.routing import read_routing_option, routing_for_layers
from search.moe_search import search_moe_plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MIXTRAL_SIZED = {
    "n_embd": 4096, "n_layer": 32, "n_head": 32, "n_expert": 8, "top_k": 2, "ffn": 14336, "vocab_size": 32000,
    "seq_len": 4096, "capacity_factor": 1.25,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16, help="dgx-a100-80g nodes (default 16: 128 GPUs)")
    parser.add_argument("--routing", default="uniform", help="uniform, zipf:ALPHA or a routing statistics file")
    parser.add_argument("--layers", type=int, default=32, help="transformer layers (default 32, as Mixtral)")
    parser.add_argument("--model", choices=("gelu", "hf"), default="gelu",
                        help="examples/moe.py at Mixtral's sizes (default) or HuggingFace's Mixtral-8x7B")
    options = parser.parse_args()
    gpus = options.nodes * 8
    if options.model == "hf":
        spec = ModelSpec("hf:mixtral", {"num_hidden_layers": options.layers, "batch_size": gpus, "seq_len": 4096})
        described = "HuggingFace Mixtral-8x7B (SwiGLU experts)"
    else:
        spec = ModelSpec(str(EXAMPLES / "moe.py"), {**MIXTRAL_SIZED, "n_layer": options.layers, "batch_size": gpus})
        described = "Mixtral-8x7B-sized MoE GPT (GELU experts, 2 matmuls)"
    started = time.perf_counter()
    graph, spec, name, cluster = prepare_model(spec, f"dgx-a100-80g:{options.nodes}")
    traced = time.perf_counter() - started
    routing = routing_for_layers(read_routing_option(options.routing),
                                 {b.module: (b.experts, b.top_k) for b in graph.moe_blocks})
    searched, fixed = search_moe_plan(graph, cluster, spec, name, routing, precision="bf16")
    planned = time.perf_counter() - started - traced
    print(f"{described}, {graph.parameter_count / 1e9:.1f}B parameters, "
          f"{len(graph.moe_blocks)} MoE layers, on {cluster.name}: {gpus} GPUs, global batch {gpus} x 4096 tokens, "
          f"bf16, routing {routing.source}")
    print(f"traced in {traced:.1f} s, MoE layouts searched in {planned:.1f} s")
    print(f"{'plan':<70} {'step':>9} {'fits':>5} {'memory':>10} {'exposed comm':>13}")
    rows = [(f"fixed: {plan.name}", plan) for plan in fixed]
    rows.append((f"searched: {searched.name}", searched))
    fitting_fixed = []
    for label, plan in rows:
        for recompute in ("none", "full"):
            variant = plan if plan.recompute == recompute else simulated(dataclasses.replace(plan, recompute=recompute), graph)
            _row(f"{label}{', blocks recomputed' if recompute == 'full' else ''}", variant)
            if label.startswith("fixed") and variant.estimate.fits:
                fitting_fixed.append(variant.estimate.step_time_s)
    if len(fixed) < 3:
        print("(a fixed mode whose layouts are the searched plan's is not repeated)")
    print(f"chosen by the search: {searched.name}, recompute {searched.recompute} (fixed modes use its dp flavour)")
    if fitting_fixed and searched.estimate.fits:
        print(f"searched / best fitting fixed mode: {searched.estimate.step_time_s / min(fitting_fixed):.3f}")


def _row(label: str, plan) -> None:
    estimate = plan.estimate
    print(f"{label[:70]:<70} {estimate.step_time_s:>8.3f}s {'yes' if estimate.fits else 'no':>5} "
          f"{estimate.memory.total / 2**30:>7.1f} GiB {estimate.communication_s:>12.3f}s")


if __name__ == "__main__":
    main()
