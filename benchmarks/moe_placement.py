"""Expert placement under skewed routing: round-robin, EPLB and ours on one MoE layer.

    python benchmarks/moe_placement.py                    # 64 experts, 64 GPUs, zipf 1.2
    python benchmarks/moe_placement.py --alpha 0.8 --slots 3

The layer: 64 experts (Mixtral-sized FFNs: hidden 4096, expert FFN 14336, SwiGLU), top-2,
8,192 tokens per GPU (a micro-batch of 2 sequences of 4096), bf16, expert parallel over 64
H100s on 8 ``dgx-h100`` nodes, routing skewed as Zipf with exponent ALPHA (expert e gets a
share proportional to 1 / (e + 1) ** ALPHA: the hottest expert takes ~29% of the tokens at
1.2). Each GPU has ``--slots`` expert slots (2: one expert of its own plus one redundant copy).

For each placement: the busiest GPU's share of the routed copies over the mean (max/mean),
and the layer's simulated forward + backward time (``cost_model.moe``: the busiest GPU's
expert compute and the dispatch/combine all-to-alls, flat or two-level, the faster). Ours
minimises that simulated time; EPLB and round-robin are the published baselines
(``search.expert_placement``). Dropless routing (no capacity factor).
"""

from __future__ import annotations

import argparse
import time

from cost_model.moe import MoELayer, moe_layer_cost
from planner.cluster import Cluster
from planner.routing import zipf_layer
from search.expert_placement import balanced, eplb, load_balance, round_robin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=1.2)
    parser.add_argument("--slots", type=int, default=2, help="expert slots per GPU (default 2)")
    options = parser.parse_args()
    cluster = Cluster.preset("dgx-h100", nodes=options.nodes)
    gpus = cluster.world_size
    layer = MoELayer(tokens=8192 * gpus, hidden=4096, ffn=14336, experts=options.experts, top_k=2, matmuls=3)
    shares = list(zipf_layer(options.experts, options.alpha, top_k=2).token_share)
    ranks = range(gpus)

    def layer_time(placement) -> float:
        return min(
            moe_layer_cost(layer, "expert_parallel", cluster, ranks, shares, placement, algorithm=algorithm).total_s
            for algorithm in ("flat", "hierarchical")
        )

    print(f"{options.experts} experts on {gpus} GPUs ({cluster.name}), zipf {options.alpha}, "
          f"{options.slots} slots per GPU; hottest expert {shares[0]:.1%} of the routed tokens")
    print(f"{'placement':<22} {'max/mean':>9} {'layer fwd+bwd':>14} {'vs round-robin':>15} {'placed in':>10}")
    baseline = None
    rows = [
        ("round-robin", lambda: round_robin(options.experts, gpus) if options.experts % gpus == 0 else None),
        ("EPLB", lambda: eplb(shares, gpus, options.slots, cluster.devices_per_node)),
        ("ours (LP + swaps)", lambda: balanced(shares, gpus, options.slots, layer_time, cluster.devices_per_node)),
    ]
    for name, build in rows:
        start = time.perf_counter()
        placement = build()
        elapsed = time.perf_counter() - start
        if placement is None:
            print(f"{name:<22} {'-':>9}  (experts do not divide over the GPUs)")
            continue
        seconds = layer_time(placement)
        baseline = baseline or seconds
        print(f"{name:<22} {load_balance(placement, shares)[1]:>9.3f} {seconds * 1e3:>11.2f} ms "
              f"{baseline / seconds:>14.2f}x {elapsed:>9.2f}s", flush=True)


if __name__ == "__main__":
    main()
