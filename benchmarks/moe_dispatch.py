"""One DeepSeek-V3 MoE layer's all-to-all across nodes, by algorithm and placement.

    python benchmarks/moe_dispatch.py                      # EP64 on 8 HGX H800 nodes (DeepSeek's)
    python benchmarks/moe_dispatch.py --preset dgx-h100 --nodes 32

The layer is DeepSeek-V3's (HF config: hidden 7168, 256 routed experts of width 2048, top-8,
8 groups with 4 per token), ``--tokens`` tokens per device (4096: DeepEP's benchmark setting,
"4096 tokens per batch"), bf16 rows, expert parallel over every device of ``--nodes`` nodes.
For each placement (round-robin, expert ``e`` on device ``e mod n``; and by group, each
routing group's experts on consecutive devices, so on as few nodes as can hold them) and
each algorithm of ``cost_model.all_to_all``, it prints the nodes a token reaches, the bytes
one device sends over InfiniBand and NVLink in one dispatch, and the time of one dispatch,
as ``cost_model.moe.moe_layer_cost`` prices it. Pure arithmetic: a second or two.
"""

from __future__ import annotations

import argparse

from cost_model.all_to_all import RoutingGroups, dispatch_traffic, node_fanout
from cost_model.collectives import group_shape, peers_in_flight
from cost_model.moe import MoELayer, moe_layer_cost
from planner.cluster import Cluster
from planner.strategy import ExpertPlacement

# DeepSeek-V3's HF config (deepseek-ai/DeepSeek-V3 config.json): hidden_size, moe_intermediate_size,
# n_routed_experts, num_experts_per_tok, n_group, topk_group.
HIDDEN, FFN, EXPERTS, TOP_K, GROUPS, GROUPS_PER_TOKEN = 7168, 2048, 256, 8, 8, 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="hgx-h800")
    parser.add_argument("--nodes", type=int, default=8, help="nodes of 8 GPUs (default 8: EP64)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per device (default 4096)")
    options = parser.parse_args()
    cluster = Cluster.preset(options.preset, nodes=options.nodes)
    ranks = list(range(cluster.world_size))
    devices = len(ranks)
    layer = MoELayer(tokens=options.tokens * devices, hidden=HIDDEN, ffn=FFN, experts=EXPERTS, top_k=TOP_K)
    per_device = max(1, EXPERTS // devices)
    placements = {
        "round-robin": ExpertPlacement.round_robin(EXPERTS, devices),
        "by group": ExpertPlacement(devices, tuple(((e // per_device % devices, 1.0),) for e in range(EXPERTS)), "by group"),
    }
    row = HIDDEN * 2
    shape = group_shape(cluster, ranks)
    print(f"DeepSeek-V3 MoE layer, EP{devices} on {options.nodes} x {options.preset}, {options.tokens} tokens/device, "
          f"bf16 rows of {row} B")
    print(f"{'placement':<12} {'algorithm':<13} {'routing':<14} {'nodes/token':>11} {'IB MB':>7} {'NVLink MB':>9} "
          f"{'dispatch ms':>11} {'fwd+bwd a2a ms':>14}")
    for name, placement in placements.items():
        for algorithm in ("flat", "hierarchical", "deduplicated"):
            for groups in ((), (GROUPS, GROUPS_PER_TOKEN)):
                if algorithm != "deduplicated" and groups:
                    continue  # copies are not merged: the node limit changes nothing
                fanout = node_fanout(placement, cluster, ranks, TOP_K, RoutingGroups(*groups) if groups else None)
                traffic = dispatch_traffic(algorithm, options.tokens * TOP_K, options.tokens, row, shape, fanout,
                                           in_flight=peers_in_flight(cluster))
                cost = moe_layer_cost(layer, "expert_parallel", cluster, ranks, placement=placement,
                                      algorithm=algorithm, routing_groups=groups)
                routing = f"top-{GROUPS_PER_TOKEN} of {GROUPS} groups" if groups else "any expert"
                print(f"{name:<12} {algorithm:<13} {routing:<14} {fanout.reached:>11.2f} "
                      f"{traffic.network_bytes / 1e6:>7.1f} {traffic.nvlink_bytes / 1e6:>9.1f} "
                      f"{traffic.time_s * 1e3:>11.3f} {cost.communication_s * 1e3:>14.3f}")


if __name__ == "__main__":
    main()
