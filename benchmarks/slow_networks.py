"""Where gradient compression pays: a bandwidth sweep of the simulated step, best
uncompressed plan against PowerSGD and top-k, for a 1.3B GPT and a VGG-16-shaped CNN.

    python benchmarks/slow_networks.py                       # both models, 8 and 64 GPUs
    python benchmarks/slow_networks.py --models vgg16 --gpus 8

Clusters: A100-40GB machines, one GPU each (8 GPUs: ``a2-highgpu-1g``-like) or eight (64
GPUs: ``a2-highgpu-8g``-like, NVSwitch inside), their network swept from 10 to 400 Gb/s per
machine (machines of 8 GPUs also at 1600 and 3200 Gb/s: a DGX A100's or H100's 8 NICs). Up to 100 Gb/s the machines talk through NCCL's socket transport
(``planner.ethernet_presets``: 60% of line rate up to 50 Gb/s, 40% at 100, 40 µs a hop);
above, through RDMA (InfiniBand/EFA class): 24 GB/s of a 200 Gb/s NIC's
25 GB/s (NVIDIA/nccl-tests#160, as the dgx-a100-80g preset cites) and 8 µs a hop.

Per point, every plan is simulated (bf16 mixed precision, gradients reduced in bf16, bucketed
and overlapped with backward): the best uncompressed plan among DDP, ZeRO-1, ZeRO-2 and
FSDP, each with and without recomputation (what fits), and DDP (or DDP with recomputation,
whichever fits and is faster) again with PowerSGD rank 1 and 4 and top-k 1% and 0.1%. The
chosen plan applies the search's rule (``planner.families.gradient_compression.candidates``):
a compressed plan only when it is predicted more than 10% faster than the best uncompressed.
Tensor- and pipeline-parallel plans are not searched here (``planner plan`` does that for one
point): on these slow links their activations' traffic would cross machines too.

Printed per model and GPU count: a table of step times (ms) per bandwidth, the chosen plan,
and each method's crossover: the highest swept bandwidth at which it beats the best
uncompressed plan by the search's margin.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cost_model.simulator import simulated  # noqa: E402
from planner.api import prepare_model  # noqa: E402
from planner.cluster import Cluster  # noqa: E402
from planner.cluster_edits import with_inter_node  # noqa: E402
from planner.errors import PlanningError  # noqa: E402
from planner.ethernet_presets import SOCKET_LATENCY, socket_bandwidth  # noqa: E402
from planner.families.gradient_compression.candidates import MIN_PREDICTED_GAIN  # noqa: E402
from planner.families.gradient_compression.section import PowerSgdSection, TopKSection  # noqa: E402
from planner.model_spec import ModelSpec  # noqa: E402
from search.data_parallel import data_parallel_plan  # noqa: E402
from search.plan_variants import recomputing  # noqa: E402

BANDWIDTHS_GBPS = (10, 25, 50, 100, 200, 400)
# Machines of 8 GPUs also at a DGX's 8 x 200 and 8 x 400 Gb/s (dgx-a100-80g, dgx-h100 presets).
DGX_GBPS = (1600, 3200)
RDMA_EFFICIENCY = 24 / 25  # 24 GB/s per 200 Gb/s HDR NIC (NVIDIA/nccl-tests#160)
RDMA_LATENCY = 8e-6  # s, GPUDirect RDMA over InfiniBand (planner.presets, estimate)
FLAVOURS = ("ddp", "zero1", "zero2", "fsdp")
METHODS = {"powersgd r1": ("powersgd", PowerSgdSection(1)), "powersgd r4": ("powersgd", PowerSgdSection(4)),
           "top-k 1%": ("top-k", TopKSection(0.01)), "top-k 0.1%": ("top-k", TopKSection(0.001))}
VGG_SOURCE = REPO / "benchmarks" / "slow_networks_vgg.py"


def models(per_gpu: dict[str, int]) -> dict[str, tuple[ModelSpec, int]]:
    """The two models (spec, samples per GPU): GPT-3 XL's shape (Brown et al. 2020, table
    2.1: 24 layers, width 2,048, 16 heads, 2,048 tokens; 1.3B parameters) and VGG-16
    (Simonyan & Zisserman 2015, configuration D; 138M parameters, 224 x 224 images)."""
    gpt = ModelSpec(str(REPO / "examples/gpt.py"), {"n_layer": 24, "n_embd": 2048, "n_head": 16, "seq_len": 2048,
                                                      "vocab_size": 50257})
    vgg = ModelSpec(str(VGG_SOURCE), {})
    return {"gpt-1.3b": (gpt, per_gpu["gpt-1.3b"]), "vgg16": (vgg, per_gpu["vgg16"])}


def cluster(gpus: int, gbps: float) -> Cluster:
    """``gpus`` A100-40GB on machines of 1 (8 GPUs) or 8 (64 GPUs), at ``gbps`` per machine."""
    per_node = 1 if gpus <= 8 else 8
    base = Cluster.preset("a2-highgpu-1g" if per_node == 1 else "a2-highgpu-8g", nodes=gpus // per_node)
    if gbps <= 100:
        return with_inter_node(base, socket_bandwidth(gbps, per_node), SOCKET_LATENCY)
    return with_inter_node(base, gbps * 1e9 / 8 * RDMA_EFFICIENCY / per_node, RDMA_LATENCY)


def _fitting(plans):
    return [plan for plan in plans if plan.estimate.fits]


def point(graph, spec, name, gpus: int, gbps: float) -> dict[str, object]:
    """The best uncompressed plan and each method's plan at one point (None: nothing fits)."""
    where = cluster(gpus, gbps)
    uncompressed, ddp = [], []
    for flavour in FLAVOURS:
        try:
            base = data_parallel_plan(graph, where, spec, name, flavour, (), "bf16")
        except PlanningError:
            continue
        variants = [base, *recomputing([base], graph)]
        uncompressed += variants
        if flavour == "ddp":
            ddp = variants
    best = min(_fitting(uncompressed), key=lambda plan: plan.estimate.step_time_s, default=None)
    result: dict[str, object] = {"uncompressed": best}
    for label, (key, section) in METHODS.items():
        compressed = [simulated(dataclasses.replace(plan, sections={key: section}), graph) for plan in ddp]
        result[label] = min(_fitting(compressed), key=lambda plan: plan.estimate.step_time_s, default=None)
    return result


def _ms(plan) -> str:
    return "-" if plan is None else f"{plan.estimate.step_time_s * 1e3:,.0f}"


def chosen(result: dict[str, object]):
    """The search's choice: the fastest compressed plan if more than ``MIN_PREDICTED_GAIN``
    faster than the best uncompressed one, else that one."""
    base = result["uncompressed"]
    methods = [plan for label, plan in result.items() if label != "uncompressed" and plan is not None]
    fastest = min(methods, key=lambda plan: plan.estimate.step_time_s, default=None)
    if base is None:
        return fastest
    if fastest is not None and fastest.estimate.step_time_s < base.estimate.step_time_s * (1 - MIN_PREDICTED_GAIN):
        return fastest
    return base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt-1.3b", "vgg16"])
    parser.add_argument("--gpus", nargs="+", type=int, default=[8, 64])
    parser.add_argument("--bandwidths", nargs="+", type=float, default=list(BANDWIDTHS_GBPS), help="Gb/s per machine")
    parser.add_argument("--no-dgx", dest="dgx", action="store_false",
                        help="leave out 1600 and 3200 Gb/s (a DGX's 8 NICs) for machines of 8 GPUs")
    options = parser.parse_args()
    per_gpu = {"gpt-1.3b": 4, "vgg16": 32}
    for model_name in options.models:
        for gpus in options.gpus:
            spec, samples = models(per_gpu)[model_name]
            spec = dataclasses.replace(spec, overrides={**spec.overrides, "batch_size": samples * gpus})
            graph, spec, name, _ = prepare_model(spec, cluster(gpus, options.bandwidths[0]))
            print(f"\n{model_name} on {gpus} A100-40GB ({'1' if gpus <= 8 else '8'} per machine), global batch "
                  f"{samples * gpus}; simulated step (ms), bf16", flush=True)
            header = f"{'Gb/s':>6} {'uncompressed (best)':>34} " + " ".join(f"{label:>12}" for label in METHODS)
            print(header + "  chosen", flush=True)
            results = {}
            swept = [*options.bandwidths, *(DGX_GBPS if gpus > 8 and options.dgx else ())]
            for gbps in swept:
                result = results[gbps] = point(graph, spec, name, gpus, gbps)
                base = result["uncompressed"]
                base_text = "-" if base is None else f"{_ms(base)} {base.name.split(' (')[0]}" + (
                    f"+rc" if base.recompute != "none" else "")
                pick = chosen(result)
                print(f"{gbps:>6g} {base_text:>34} " + " ".join(f"{_ms(result[label]):>12}" for label in METHODS)
                      + f"  {'-' if pick is None else pick.name}", flush=True)
            for label in METHODS:
                winning = [gbps for gbps, result in results.items() if result[label] is not None
                           and result["uncompressed"] is not None
                           and result[label].estimate.step_time_s
                           < result["uncompressed"].estimate.step_time_s * (1 - MIN_PREDICTED_GAIN)]
                print(f"  {label}: " + (f"wins by >{MIN_PREDICTED_GAIN:.0%} up to {max(winning):g} Gb/s"
                                         if winning else "never wins by the margin"), flush=True)


if __name__ == "__main__":
    main()
