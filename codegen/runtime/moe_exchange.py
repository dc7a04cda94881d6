"""How an expert-parallel MoE layer moves rows between ranks: one flat all-to-all, or two
levels (inside each node, then across nodes), with autograd and uneven splits.

The flat one is ``codegen.runtime.moe.FlatExchange``; this file holds the two-level one.
Both give the same result: ``exchange(rows, send_sizes)`` sends ``rows`` (ordered by
destination rank, ``send_sizes[d]`` rows for rank ``d`` of the group) and returns the rows
this rank received, ordered by source rank, with how many came from each.

Two levels (Tutel's and DeepSpeed's hierarchical all-to-all): with ``G`` ranks per node,
rank ``(node n, local g)`` first sends, inside its node, to local peer ``g'`` every row bound
for any rank ``(n'', g')``; each rank then holds its node's rows for its own local index and
sends them, across nodes, to the rank with the same local index on each destination node.
The inter-node step sends ``G`` times fewer, ``G`` times larger messages than a flat
all-to-all does, which is what makes it pay on many nodes. Between the steps the rows are
reordered (source-local-major to destination-node-major) so that they arrive in source-rank
order, exactly as the flat all-to-all delivers them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from codegen.runtime.moe import all_to_all_rows, exchange_counts

__all__ = ["TwoLevelExchange"]


class TwoLevelExchange:
    """A two-level all-to-all over ``group`` (see the module docstring): ranks
    ``[n * ranks_per_node, (n + 1) * ranks_per_node)`` of the group are node ``n``. Creating it
    creates the node and cross-node subgroups: every rank of the default group calls it, in
    the same order (``parallelize`` does, once)."""

    def __init__(self, group, ranks_per_node: int):
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        world = len(ranks)
        if ranks_per_node < 1 or world % ranks_per_node:
            raise ValueError(f"{world} ranks do not split into nodes of {ranks_per_node}")
        self.nodes, self.per_node = world // ranks_per_node, ranks_per_node
        node_members = [ranks[n * ranks_per_node:(n + 1) * ranks_per_node] for n in range(self.nodes)]
        cross_members = [ranks[g::ranks_per_node] for g in range(ranks_per_node)]
        self.node_group, _ = dist.new_subgroups_by_enumeration(node_members)
        self.cross_group, _ = dist.new_subgroups_by_enumeration(cross_members)

    def __call__(self, rows: torch.Tensor, send_sizes: list[int]) -> tuple[torch.Tensor, list[int]]:
        """``rows`` to their ranks in two steps; returns what ``FlatExchange`` returns: the
        received rows by source rank, and how many came from each."""
        nodes, per_node = self.nodes, self.per_node
        counts = torch.tensor(send_sizes, device=rows.device).view(nodes, per_node)  # [destination node, destination local]

        # Step 1, inside the node: to local peer g' every row bound for (any node, g'), by node.
        by_local = _block_transpose(counts.tolist(), rows.device)  # rows now ordered (g', n'')
        step1_send = counts.sum(dim=0).tolist()
        # From each local source g: its counts for (n'', my local index), n'' = 0..nodes-1.
        from_locals = exchange_counts(counts.t().contiguous(), self.node_group)  # (per_node, nodes)
        step1_receive = from_locals.sum(dim=1).tolist()
        held = all_to_all_rows(rows.index_select(0, by_local), step1_receive, step1_send, self.node_group)

        # Step 2, across nodes: to node n'' (same local index) its rows, by source local rank.
        by_node = _block_transpose(from_locals.tolist(), rows.device)  # rows now ordered (n'', g)
        step2_send = from_locals.sum(dim=0).tolist()
        from_nodes = exchange_counts(from_locals.t().contiguous(), self.cross_group)  # (nodes, per_node)
        step2_receive = from_nodes.sum(dim=1).tolist()
        received = all_to_all_rows(held.index_select(0, by_node), step2_receive, step2_send, self.cross_group)
        return received, from_nodes.reshape(-1).tolist()  # source rank n * per_node + g


def _block_transpose(sizes: list[list[int]], device: torch.device) -> torch.Tensor:
    """Row indices, on ``device`` (the rows'), that reorder rows held in blocks ``(a, b)``
    (a-major, ``sizes[a][b]`` rows each) into b-major order, each block's rows kept in order."""
    # Worked out on the host (the sizes are Python numbers already), moved once.
    table = torch.tensor(sizes, dtype=torch.long, device="cpu")
    blocks_a, blocks_b = table.shape
    block = torch.repeat_interleave(torch.arange(blocks_a * blocks_b, device="cpu"), table.reshape(-1))
    return torch.argsort((block % blocks_b) * blocks_a + block // blocks_b, stable=True).to(device)
