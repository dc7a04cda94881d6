"""What a compiled Adasum program calls at run time: the combination rule, its recursive
doubling over ranks, and the DDP communication hook that runs it on every gradient bucket.

Granularity: per tensor, as Horovod does. Horovod fuses many gradients into one buffer but
computes the dot product and both squared norms of each tensor of the buffer on its own
(its fused Adasum loops over the buffer's tensors when it sums the partial dot products),
and its reference implementation in its tests combines tensor by tensor; a tensor of zero
norm keeps coefficient 1. So a DDP bucket here is cut back into its gradients
(``GradBucket.gradients()``'s sizes, in the buffer's order) and each is combined alone.

Codegen layer: imports torch only (the compiled program imports this module).
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist


def adasum_pair(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Adasum of two gradients of one tensor:
    ``(1 - g1.g2 / (2 |g1|^2)) g1 + (1 - g1.g2 / (2 |g2|^2)) g2``; a gradient of zero norm
    keeps coefficient 1 (the other gradient then passes unchanged). The three dot products
    accumulate in float32 at least (bf16/fp16 gradients are read as float32), the
    coefficients are Python floats, and the result is ``first * a`` then ``+= b * second``:
    the passes over the buffers ``costs.COMBINE_BUFFER_PASSES`` counts. Two ranks that
    combine the same pair in the same order get the same bits."""
    wide = (torch.float32, torch.float64)
    a = first.flatten() if first.dtype in wide else first.flatten().float()
    b = second.flatten() if second.dtype in wide else second.flatten().float()
    dot, a_norm, b_norm = torch.dot(a, b).item(), torch.dot(a, a).item(), torch.dot(b, b).item()
    a_coefficient = 1.0 - dot / (2 * a_norm) if a_norm > 0 else 1.0
    b_coefficient = 1.0 - dot / (2 * b_norm) if b_norm > 0 else 1.0
    combined = first * a_coefficient
    return combined.add_(second, alpha=b_coefficient)


def adasum_pair_per_tensor(first: torch.Tensor, second: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """``adasum_pair`` of each tensor of two flat buffers cut into consecutive ``sizes``."""
    pieces = [adasum_pair(a, b) for a, b in zip(first.split(list(sizes)), second.split(list(sizes)))]
    return torch.cat(pieces) if pieces else first.clone()


def adasum_tree(gradients: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
    """Adasum of a power-of-two list of flat gradients, in one process: neighbours combined
    pairwise, (0, 1), (2, 3), ..., then the results pairwise again, as the ranks of
    ``adasum_exchange`` do. The single-process reference of the distributed rule."""
    level = list(gradients)
    if not level or len(level) & (len(level) - 1):
        raise ValueError(f"Adasum combines a power of two of gradients, got {len(level)}")
    while len(level) > 1:
        level = [adasum_pair_per_tensor(level[k], level[k + 1], sizes) for k in range(0, len(level), 2)]
    return level[0]


def adasum_exchange(flat: torch.Tensor, sizes: Sequence[int], peers: Sequence[int], index: int) -> torch.Tensor:
    """This rank's gradient ``flat`` combined with those of ``peers`` (global ranks, this
    one at ``index``) by recursive doubling: at distance 1, 2, 4, ... each rank swaps its
    whole current gradient with the rank ``index ^ distance`` and both combine the pair
    lower index first, so after log2(len(peers)) swaps every peer holds the same bits,
    equal to ``adasum_tree`` of the peers' gradients."""
    count = len(peers)
    if count & (count - 1):
        raise ValueError(f"Adasum combines a power of two of ranks, got {count}")
    current = flat
    distance = 1
    while distance < count:
        partner = index ^ distance
        received = torch.empty_like(current)
        sent = dist.isend(current.contiguous(), peers[partner])
        dist.recv(received, peers[partner])
        sent.wait()
        lower, higher = (current, received) if index < partner else (received, current)
        current = adasum_pair_per_tensor(lower, higher, sizes)
        distance *= 2
    return current


class AdasumState:
    """What the hook of one DDP model needs: the process group of this rank's node (None
    when nothing is averaged inside nodes) and the ranks Adasum combines over, in order."""

    def __init__(self, local_group, local: int, peers: Sequence[int], index: int) -> None:
        self.local_group, self.local, self.peers, self.index = local_group, local, list(peers), index


# No ``from __future__ import annotations`` here: DDP's register_comm_hook reads this return
# annotation and refuses a string.
def adasum_hook(state: AdasumState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook (``DistributedDataParallel.register_comm_hook``): the bucket's
    gradients averaged over the node's ``state.local`` ranks (an all-reduce), then combined
    tensor by tensor with the other nodes' by ``adasum_exchange``. DDP writes the result
    back into the gradients (no division by the world size: Adasum's result is the step)."""
    buffer = bucket.buffer()
    sizes = [gradient.numel() for gradient in bucket.gradients()]
    if state.local > 1:
        dist.all_reduce(buffer, group=state.local_group)
        buffer.div_(state.local)
    combined = adasum_exchange(buffer, sizes, state.peers, state.index)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(combined)
    return done


def adasum_state(dp_ranks: Sequence[int], local: int, rank: int) -> AdasumState:
    """The hook's state for global ``rank`` among ``dp_ranks`` (consecutive groups of
    ``local`` share a node): the node groups are made here, so every rank of the default
    group must call it, in the same order. The peers are the ranks at this rank's place in
    every node group (each place runs the same Adasum, on the same node averages)."""
    ranks = list(dp_ranks)
    position = ranks.index(rank)
    local_group = None
    if local > 1:
        for start in range(0, len(ranks), local):  # every rank makes every group (torch's rule)
            group = dist.new_group(ranks[start:start + local])
            if start <= position < start + local:
                local_group = group
    offset = position % local
    peers = ranks[offset::local]
    return AdasumState(local_group, local, peers, position // local)
