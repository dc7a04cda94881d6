"""``launch.py --record-routing FILE``: the routing a compiled MoE program saw while it
trained, written as routing statistics (``planner.routing``) the planner can place experts
from (``planner plan --routing FILE``).

Every MoE runtime layer (``codegen.runtime.moe.RoutedMoE``) counts, forward after forward,
its rank's routed choices per expert before capacity drops (what the router asked for, not
what the capacity let through: the demand a placement must serve) and how often two experts
were chosen for the same token. Here the counts are summed over the ranks, each layer's
shares are its counts over their total, and rank 0 writes the file.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from codegen.runtime.moe import RoutedMoE
from planner.routing import LayerRouting, RoutingStats


def routed_layers(model: torch.nn.Module) -> dict[str, RoutedMoE]:
    """The MoE runtime layers of ``model`` (as ``parallelize`` left it), by the module path of
    their MoE layer: their own, or their parent's for a module that replaced only a block's
    experts (``codegen.runtime.expert_dispatch``)."""
    found = {}
    for path, module in model.named_modules():
        if isinstance(module, RoutedMoE):
            found[path] = module
        elif getattr(module, "records_routing_of_parent", False):
            found[path.rpartition(".")[0]] = module
    return found


def recorded_routing(model: torch.nn.Module, steps: int) -> RoutingStats:
    """The routing statistics of ``model``'s MoE layers, summed over the ranks of each
    layer's group (a collective: every rank calls it)."""
    layers = {}
    total_choices = 0
    for path, layer in routed_layers(model).items():
        counts, pairs = layer.routed_counts.clone(), layer.coselected.clone()
        dist.all_reduce(counts, group=layer.group)
        dist.all_reduce(pairs, group=layer.group)
        total = float(counts.sum())
        if total == 0:
            continue
        total_choices += int(total)
        shares = tuple(float(count) / total for count in counts)
        layers[path] = LayerRouting(shares, layer.top_k, tuple(tuple(float(v) for v in row) for row in pairs))
    world = dist.get_world_size()
    tokens = total_choices // max(1, sum(layer.top_k for layer in layers.values())) // max(1, steps)
    source = (
        f"recorded by launch.py --record-routing over {steps} training steps on {world} ranks "
        f"({tokens} tokens per step; routed choices per expert before capacity drops)"
    )
    return RoutingStats(layers, source)


def write_recorded_routing(model: torch.nn.Module, steps: int, path: str | Path) -> RoutingStats:
    """``recorded_routing``, written to ``path`` by rank 0 (``RoutingStats.save``: into a
    temporary file beside it, then renamed, so a reader never sees half a file). ``path`` was
    checked before the run (``codegen.runtime.run_outputs``)."""
    stats = recorded_routing(model, steps)
    if dist.get_rank() == 0:
        stats.save(Path(path))
    return stats
