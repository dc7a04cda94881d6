"""Weak scaling of one GPT layer on the simulator: 1-D, 2-D, 2.5-D and 3-D tensor parallelism.

    python benchmarks/summa_weak_scaling.py                # h = 12288, 1024 tokens per device
    python benchmarks/summa_weak_scaling.py --hidden 4096 --tokens-per-device 4096

Benchmark (a) and (b) of issue 10, through the whole planner rather than the per-matmul
model of ``benchmarks/summa_bytes.py``: the model is ``examples/gpt.py`` with one block
(hidden h, 128 heads so 1-D can split them 64 ways, sequences of 2048 tokens, a vocabulary
of 256 so the embedding and the head stay small beside the block), traced on meta tensors,
and for each device count p and layout the search plans it on that one mesh
(``search.auto.plan_on_mesh``: CP-SAT over the per-op candidates, linears restricted to the
layout's family; 1-D is Megatron-LM's layout on a ``tp`` axis of p) and the simulator runs
the step. The batch grows with p (weak scaling).
Clusters: DGX A100 nodes of 8 (NVLink inside, InfiniBand between); p < 8 uses one node of p.

Printed per (p, layout): step time, tokens per second per device, bytes sent per device
per step (the simulator's, every op: matmuls, resharding at the attention boundary, norm
statistics, gradient all-reduces), the matmuls' bytes from ``cost_model.summa`` alone and
the hand-derived closed form of those (``summa_bytes.closed_form_bytes``), and memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from summa_bytes import closed_form_bytes  # noqa: E402

from planner.api import prepare_model  # noqa: E402
from planner.cluster import Cluster  # noqa: E402
from planner.model_spec import ModelSpec  # noqa: E402
from planner.strategy import Mesh  # noqa: E402
from cost_model.simulator import simulated  # noqa: E402
from search.mesh_search import plan_on_mesh  # noqa: E402
from search.layouts import megatron_layout  # noqa: E402
from search.plan_builder import unsimulated_plan  # noqa: E402
from search.summa_savings import layer_savings  # noqa: E402

SEQ = 2048
# (devices, family, q, d): the grids weak scaling walks through, up to 64 A100s on 8 nodes.
LAYOUTS = [
    (8, "1d", 8, 1), (8, "2.5d", 2, 2), (8, "3d", 2, 2),
    (16, "1d", 16, 1), (16, "2d", 4, 1),
    (64, "1d", 64, 1), (64, "2d", 8, 1), (64, "2.5d", 4, 4), (64, "3d", 4, 4),
]
LABELS = {"1d": "1-D ({p})", "2d": "2-D [{q},{q},1]", "2.5d": "2.5-D [{q},{q},{d}]", "3d": "3-D [{q},{q},{q}]"}


def mesh_of(family: str, q: int, d: int) -> Mesh:
    """The mesh of a layout over all the devices (no data parallelism: weak scaling of TP)."""
    if family == "1d":
        return Mesh((("tp", q),))
    axes = {"2d": (("row", q), ("col", q)), "2.5d": (("dep", d), ("row", q), ("col", q)),
            "3d": (("row", q), ("col", q), ("dep", d))}[family]
    return Mesh(axes)


def cluster_of(devices: int, uniform: bool = False) -> Cluster:
    """DGX A100 nodes of 8 (one node of p below 8), or with ``uniform`` p single-GPU nodes on
    HDR InfiniBand: every link alike, as on a fat-tree of one GPU per port."""
    if uniform:
        return Cluster.preset("dgx-a100-80g", nodes=devices, devices_per_node=1)
    return Cluster.preset("dgx-a100-80g", nodes=max(1, devices // 8), devices_per_node=min(8, devices))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=12288)
    parser.add_argument("--tokens-per-device", type=int, default=1024)
    parser.add_argument("--effort", type=float, default=0.25, help="search effort per mesh (default 0.25)")
    parser.add_argument("--uniform", action="store_true", help="single-GPU nodes on InfiniBand: a uniform network")
    options = parser.parse_args()
    if options.hidden % 128 or options.tokens_per_device < 1 or options.effort <= 0:
        parser.error("--hidden must be a multiple of 128, --tokens-per-device and --effort positive")
    gb = 1e9
    print(f"one GPT layer, h={options.hidden}, {options.tokens_per_device} tokens per device, seq {SEQ}, bf16, "
          f"{'single-A100 nodes on InfiniBand' if options.uniform else 'DGX A100 nodes of 8'}; plans searched on each mesh, "
          f"simulated")
    print(f"{'p':>3} {'layout':<16} {'step ms':>8} {'tok/s/dev':>10} {'sim GB/dev':>11} {'matmul GB':>10} "
          f"{'closed form':>11} {'memory GB':>10} {'linears in layout':>18}")
    times = {}
    for devices, family, q, d in LAYOUTS:
        tokens = options.tokens_per_device * devices
        if tokens % SEQ:
            continue
        spec = ModelSpec("examples/gpt.py", {"n_layer": 1, "n_embd": options.hidden, "n_head": 128, "seq_len": SEQ,
                                             "vocab_size": 256, "batch_size": tokens // SEQ, "dropout": 0.0})
        cluster = cluster_of(devices, options.uniform)
        graph, spec, name, cluster = prepare_model(spec, cluster)
        started = time.perf_counter()
        mesh = mesh_of(family, q, d)
        if family == "1d":
            # Megatron-LM's layout itself: a search on a lone tp axis may replicate the
            # weights and split the batch instead (data parallelism under another name).
            strategies, inputs = megatron_layout(graph, mesh)
            plan = simulated(unsimulated_plan(graph, cluster, spec, name, mesh, strategies, inputs, precision="bf16"), graph)
        else:
            plan = plan_on_mesh(graph, cluster, mesh, tp_layouts="summa", precision="bf16", effort=options.effort,
                                model_name=name, spec=spec)
        planned_s = time.perf_counter() - started
        estimate = plan.estimate
        sent = sum(estimate.bytes_per_axis.values())
        savings = layer_savings(plan, graph)
        matmul = sum(s.summa_bytes for s in savings) if family != "1d" else float("nan")
        summa_linears = [s.layout for s in plan.strategies if s.layout is not None and s.op == "aten.linear.default"]
        # The search may keep 3-D's gathered operands (fewer bytes): the closed form follows it.
        kept = bool(summa_linears) and all(layout.keep_gathered for layout in summa_linears)
        closed = closed_form_bytes("3d kept" if kept else family, q, d, options.hidden, tokens)
        in_layout = len(summa_linears)
        label = LABELS[family].format(p=devices, q=q, d=d) + (" kept" if kept else "")
        times[(devices, family)] = estimate.step_time_s
        print(f"{devices:>3} {label:<16} {estimate.step_time_s * 1e3:>8.2f} {tokens / devices / estimate.step_time_s:>10.0f} "
              f"{sent / gb:>11.3f} {matmul / gb:>10.3f} {closed / gb:>11.3f} {estimate.memory.total / gb:>10.2f} "
              f"{in_layout:>18}   (planned in {planned_s:.0f} s)", flush=True)
    if (64, "2d") in times and (64, "2.5d") in times:
        print(f"\nat 64 devices, step time of 2-D [8,8,1] / 2.5-D [4,4,4]: {times[(64, '2d')] / times[(64, '2.5d')]:.2f}x "
              f"(SUMMA2.5-LM reports 1.45x); 3-D [4,4,4]: {times[(64, '2d')] / times[(64, '3d')]:.2f}x; "
              f"1-D (64) / 2.5-D: {times[(64, '1d')] / times[(64, '2.5d')]:.2f}x")


if __name__ == "__main__":
    main()
