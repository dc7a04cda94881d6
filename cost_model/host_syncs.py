"""Host synchronisations inside a step: where the host stops running ahead of the GPU.

``cost_model.host_dispatch`` prices a run of ops as the longer of the device's and the
host's time (``max(device, host)`` per segment, ``cost_model.segments``): the host issues
ops ahead of the kernels, so its time hides behind theirs. A host synchronisation (a
``.cpu()``, ``.item()``, ``.tolist()`` of a GPU tensor, ``torch.cuda.current_stream().synchronize()``,
a CPU busy-wait on a flag the GPU writes) stops that: the host waits until the device has
reached the sync point, and the device's queue then holds nothing the host issued after it.
The ops after the sync start from an empty queue: the device waits for the host to issue
the first of them, and again wherever the host falls behind, until the host is ahead again.
So a sync splits the segment's forward (or backward) into parts:

  * before the first sync, as without syncs: ``wait = max(0, host - device)`` (the host may
    have come into the segment ahead of the device, ``cost_model.host_dispatch``);
  * from each sync on, the host's lead is known to be zero, so the ops are replayed in
    order: the host issues op k when it has spent its time on ops 1..k, the device starts
    it when that op is issued and the one before it is done,

        issued_k = h_1 + ... + h_k,   done_k = max(done_(k-1), issued_k) + d_k,

    and the wait is ``done_last - (d_1 + ... + d_last)``: at least the first op's host time
    (the device is idle until it is issued), and more wherever the host falls behind.

The sum is at least the unsplit segment's ``max(0, host - device)``: the host's lead built up
over one part no longer hides the host time of the next. The sync's own round trip (the
GPU's completion reaching the waiting host thread, the small device-to-host copy) is not
priced: no public measurement of it for these GPUs was found here, so the rule is the
optimistic side of a sync's cost by that much.

Where the MoE layers sync, per micro-batch (the Megatron-Core MoE rows' software:
NVIDIA/Megatron-LM at 0d77a93b7bc69735330a6b2e8d4c0bdd7781b768, 2025-05-26, the main
branch the day before the model zoo's first Qwen3 results, yanring/Megatron-MoE-ModelZoo
at 8017e1120):

  * ``alltoall`` dispatcher (``MoEAlltoAllTokenDispatcher``,
    megatron/core/transformer/moe/token_dispatcher.py): dropless with EP > 1 or TP > 1,
    ``preprocess`` sets ``cuda_sync_point = "before_ep_alltoall"``: the split sizes are copied
    to the host on ``cuda_dtoh_stream`` at ``"before_permutation_1"`` and
    ``_maybe_dtoh_and_synchronize`` calls ``self.cuda_dtoh_stream.synchronize()`` right before
    the tokens' all-to-all. One sync per layer in forward. Backward: the all-to-all's
    backward reuses the host split lists, ``TEGroupedMLP`` reads ``tokens_per_expert``
    already on the host (experts.py, ``tokens_per_expert.tolist()`` of a CPU tensor): none.
    (The permutation issued between the copy and the sync may still run when the sync
    returns, a little lead the rule above does not give: pessimistic by that kernel.)
  * ``flex`` dispatcher with DeepEP (``MoEFlexTokenDispatcher`` / ``_DeepepManager``,
    megatron/core/transformer/moe/fused_a2a.py ``FusedDispatch.forward``): DeepEP's normal
    ``Buffer.dispatch`` without a cached handle waits on the CPU for the received token
    counts ("the CPU will wait for GPU's signal to arrive", fused_a2a.py; DeepEP's
    deep_ep/buffer.py: no CPU sync only with ``num_worst_tokens``, which Megatron does not
    pass) before it launches the dispatch kernel. One sync per layer in forward. Backward:
    the dispatch's backward is a combine and the combine's backward a dispatch with the
    forward's handle (cached layout, no CPU wait): none.
  * tensor parallelism with ETP 1 (every Megatron-Core MoE row here) adds no sync: the
    dispatchers' ``tp_size`` is the expert-tensor-parallel size (1), so no
    ``output_splits_tp.tolist()``; its sequence-parallel collectives are asynchronous to
    the host. The pipeline's P2P adds none either: the interleaved schedule defaults to
    ``overlap_p2p_comm`` (megatron/training/arguments.py), so ``batch_p2p_comm`` and its
    ``torch.cuda.synchronize()`` (p2p_communication.py, ``batch_p2p_sync``) are off.

Activation recomputation that repeats a layer's forward in backward repeats its sync
(``cost_model.recompute`` adds the segment's forward, waits included). The compiled
programs' own expert-parallel layers sync too, three times in forward a few small ops apart
(codegen/runtime/moe.py, ``ExpertParallelMoE.run_experts``: ``int(kept.sum())``, the
per-destination counts' ``.tolist()``, and ``FlatExchange``'s exchanged counts'
``.tolist()``); they are priced as the one sync above (optimistic by the other two's
launch each).
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_model.host_dispatch import host_wait

# Host syncs of an expert-parallel MoE layer's token dispatch per micro-batch, forward and
# backward (module docstring: Megatron-Core's alltoall and flex/DeepEP dispatchers).
DISPATCH_SYNCS_FORWARD = 1
DISPATCH_SYNCS_BACKWARD = 0


def run_ahead_wait(ops: Sequence[tuple[float, float]]) -> float:
    """Seconds the device waits for the host over ``ops`` ((device seconds, host seconds)
    each, in issue order) when the host starts with no lead: right after a host sync
    (module docstring)."""
    issued = done = busy = 0.0
    for device_s, host_s in ops:
        issued += host_s
        done = max(done, issued) + device_s
        busy += device_s
    return done - busy


def synced_host_wait(before: tuple[float, float], after_syncs: Sequence[Sequence[tuple[float, float]]] = ()) -> float:
    """Seconds the device waits for the host over a run of ops split by host syncs:
    ``before`` the (device, host) seconds of the ops before the first sync, ``after_syncs``
    for each sync the (device, host) seconds of each op from it to the next, in issue
    order. With no sync this is ``host_wait`` of the whole run."""
    return host_wait(*before) + sum(run_ahead_wait(ops) for ops in after_syncs)


def layer_syncs_in_forward(mode: str, exchanges_tokens: bool) -> int:
    """Host syncs per micro-batch in the forward of an MoE layer run in ``mode``: its
    dispatch syncs (``DISPATCH_SYNCS_FORWARD``) when it is expert parallel and moves tokens
    between devices, none otherwise (a layer whose experts all run on the token's own device
    needs no split sizes on the host to exchange)."""
    return DISPATCH_SYNCS_FORWARD if mode == "expert_parallel" and exchanges_tokens else 0
