"""End-to-end planning time of DeepSeek-V3 at a realistic batch: trace on meta + every search.

    python benchmarks/moe_planning_time.py                       # 256 H100s (dgx-h100:32), then 2,048 H800s (hgx-h800:256)
    python benchmarks/moe_planning_time.py --clusters dgx-h100:32
    python benchmarks/moe_planning_time.py --model mixtral --clusters dgx-a100-80g:16

The model is HuggingFace's own implementation built from its published configuration
(``hf:deepseek_v3``: 61 layers, the first 3 dense, 256 routed experts and 1 shared expert
per MoE layer, top-8 with grouped routing, multi-head latent attention, 671B parameters;
``hf:mixtral``: Mixtral-8x7B, 32 layers, 8 experts, top-2, 46.7B), never downloaded: it is
built on the meta device and traced there. The global batch is ``--batch`` sequences of
``--seq`` tokens. ``planner.plan`` then runs everything a user's ``planner plan`` runs: the
SOAP search per mesh, the data-parallel flavours, the pipeline grid (with each stage's MoE
layers laid out over its dp ranks), the Megatron baselines and the MoE family's layouts
(each layer's mode, placement and all-to-all from the routing statistics, ``--routing``),
in bf16. Budgets count work, so the plan is the same on any machine; the times printed are
this machine's, wall clock and this process's CPU time (``time.process_time``: what a busy
machine does not inflate). Targets (issue 26): 60 s for 256 H100s, 120 s for 2,048 H800s.
The chosen layout is printed beside the one DeepSeek trained V3 with (technical report,
arXiv 2412.19437, section 3.2: 16-way pipeline (DualPipe), 64-way expert parallelism over 8
nodes, ZeRO-1 data parallelism, no tensor parallelism, on 2,048 H800s).

Measured 2026-11-29 with ``flock /work/locks/heavy.lock /usr/bin/time -v python
benchmarks/moe_planning_time.py`` on 2 CPU cores shared with other jobs (load about 3):
dgx-h100:32 trace 6.1 s + search 25.8 s = 31.9 s wall (30.1 s CPU; target 60 s), megatron
pp=32 x dp=8, 1F1B over 128 micro-batches, EP8 round-robin, full recomputation, 18.082 s per
step, MFU 25.7%, 74.5 GiB; hgx-h800:256 trace 3.8 s + search 31.0 s = 34.8 s wall (31.3 s CPU;
target 120 s), megatron pp=8 x dp=256, 1F1B over 4 micro-batches, ZeRO-1, EP256 round-robin,
7.780 s, MFU 7.5%, 72.4 GiB. Peak RSS 1.04 GiB. Earlier measurements, 88.3 s and 90.0 s, predate
the search's later speed-ups: 49d6dd5 already plans hgx-h800:256 in 35.5 s here, the same plan.

Measured again 2026-11-30 (session 12, s12mem), the same command, after the H100 and H800
presets' memory became 78.68 GiB (nvidia-smi's total less a cited reserve,
``planner.gpu_presets.usable_memory_bytes``; it was 74.5): dgx-h100:32 trace 7.0 s + search
53.6 s = 60.6 s wall (61.4 s CPU; over the 60 s target, as e999556 already was before the change:
62.5 s CPU, choosing moe pp=32 x dp=4 x tp=2, 256 micro-batches, recompute full_keep_a2a,
18.776 s, 72.8 GiB), moe pp=32 x dp=2 x tp=4, 1F1B over 512 micro-batches, ZeRO-1, EP8 folded
over dp x tp, no recomputation, 17.365 s per step, MFU 26.8%, 78.3 GiB (over the old cap);
hgx-h800:256 trace 4.1 s + search 36.2 s = 40.4 s wall (40.5 s CPU), megatron pp=32 x dp=64,
1F1B over 16 micro-batches, ZeRO-1, EP64, no recomputation, 7.066 s, MFU 8.2%, 76.7 GiB (over
the old cap too). Peak RSS 1.27 GiB.

Measured again 2026-11-30 (session 14), the same command, after the experts of a plan are
priced as its compiled program runs them (``Plan.expert_implementation``: DeepSeek-V3's
HuggingFace experts laid out expert parallel run ``codegen/runtime/expert_dispatch.py``'s loop of
one GEMM per local expert, with per-expert copies of the output, where they were priced as
Transformer Engine's grouped GEMM) and an MoE layer's routing ops are costed once per kind:
dgx-h100:32 trace 7.6 s + search 54.0 s = 61.6 s wall (62.6 s CPU; just over the 60 s target),
moe pp=4 x dp=16 x tp=4, 1F1B over 64 micro-batches, ZeRO-1, EP64 folded over dp x tp, no
recomputation, 27.275 s per step, MFU 17.1%, 76.4 GiB (the loop's cost grows with the local
experts, so fewer a rank win; 19.677 s for the earlier choice under the earlier pricing);
hgx-h800:256 trace 5.1 s + search 38.8 s = 43.9 s wall (44.1 s CPU), megatron pp=16 x dp=128,
1F1B over 8 micro-batches, ZeRO-1, EP128, 7.902 s, MFU 7.4%, 78.5 GiB.
"""

from __future__ import annotations

import argparse
import time

import planner
from planner.model_spec import ModelSpec

MODELS = {"deepseek_v3": "hf:deepseek_v3", "mixtral": "hf:mixtral"}
# Seconds of planning the issue asks for, by cluster (issue 26).
TARGETS = {"dgx-h100:32": 60.0, "hgx-h800:256": 120.0}
# How DeepSeek trained V3 (technical report, arXiv 2412.19437, section 3.2), for comparison.
PUBLISHED = "DeepSeek-V3 as trained on 2,048 H800s: pp=16 (DualPipe) x EP=64 over 8 nodes, ZeRO-1 dp, no tp"


def layout_text(plan) -> str:
    """The chosen plan's parallel layout in the terms of the published one: pipeline degree,
    expert-parallel degree (devices a layer's experts spread over), dp flavour, tp."""
    mesh = dict(plan.mesh.axes)
    spread = [layout.placement.devices for layout in plan.expert_layouts
              if layout.mode == "expert_parallel" and layout.placement is not None]
    expert_parallel = f"EP={max(spread)}" if spread else "no EP"
    micro = plan.pipeline.micro_batches if plan.pipeline is not None else plan.accumulation_steps
    schedule = f" ({plan.pipeline.schedule})" if plan.pipeline is not None else ""
    return (f"pp={mesh.get('pp', 1)}{schedule} x {expert_parallel} x dp={mesh.get('dp', 1)} ({plan.dp_flavour}), "
            f"tp={mesh.get('tp', 1)}, {micro} micro-batches, recompute {plan.recompute}")


def plan_once(options, cluster: str) -> None:
    spec = ModelSpec(MODELS[options.model], {"batch_size": options.batch, "seq_len": options.seq})
    cpu = time.process_time()
    plan = planner.plan(spec, cluster, routing=options.routing, progress=False,
                        time_budget_s=None, moe_dispatch=options.moe_dispatch)
    cpu = time.process_time() - cpu
    summary = plan.summary
    print(f"{MODELS[options.model]} (HuggingFace config), {summary.parameters / 1e9:.1f}B parameters, "
          f"{len(plan.expert_layouts)} MoE layers planned by layout, on {cluster} ({plan.world_size} GPUs), "
          f"global batch {options.batch} x {options.seq} tokens, routing {options.routing}")
    timings = plan.timings
    target = TARGETS.get(cluster)
    print(f"planning time: trace {timings['trace_s']:.1f} s + search {timings['search_s']:.1f} s = "
          f"{timings['total_s']:.1f} s wall clock; {cpu:.1f} s CPU time"
          f"{f' (target {target:.0f} s)' if target else ''}")
    estimate = plan.estimate
    print(f"chosen: {plan.name}; predicted step {estimate.step_time_s:.3f} s, MFU {estimate.mfu:.1%}, "
          f"{estimate.memory.total / 2**30:.1f} GiB on the fullest GPU ({'fits' if estimate.fits else 'does not fit'})")
    print(f"  step parts: compute {estimate.compute_s:.2f} s on the busiest GPU (recomputation included), "
          f"exposed communication {estimate.communication_s:.2f} s, pipeline bubble {estimate.bubble_fraction:.1%}; "
          + ", ".join(f"{kind} {size / 2**30:.1f} GiB" for kind, size in vars(estimate.memory).items() if size))
    print(f"  layout:    {layout_text(plan)}")
    print(f"  published: {PUBLISHED}")
    modes = {}
    for layout in plan.expert_layouts:
        way = layout.mode + (f" {layout.all_to_all}" if layout.mode == "expert_parallel" else "")
        modes[way] = modes.get(way, 0) + 1
    if modes:
        print("MoE layers: " + ", ".join(f"{count} {mode.replace('_', ' ')}" for mode, count in modes.items()))
    for alternative in plan.runners_up[:5]:
        print(f"  runner-up: {alternative.name}: {alternative.step_time_s:.3f} s"
              f"{'' if alternative.fits else ' (does not fit)'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="deepseek_v3")
    parser.add_argument("--clusters", nargs="+", default=list(TARGETS),
                        help="clusters to plan for (default: dgx-h100:32 and hgx-h800:256)")
    parser.add_argument("--batch", type=int, default=1024, help="sequences per global batch (default 1024)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    parser.add_argument("--routing", default="uniform", help="uniform, zipf:ALPHA or a routing statistics file")
    parser.add_argument("--moe-dispatch", default="compiled", choices=("compiled", "deduplicated", "overlapped"),
                        help="also price DeepEP's deduplicated all-to-all, and with overlapped the all-to-alls "
                             "under another micro-batch's compute and DualPipe (planner plan --moe-dispatch)")
    options = parser.parse_args()
    for cluster in options.clusters:
        plan_once(options, cluster)


if __name__ == "__main__":
    main()
