"""What a compiled compressed program calls at run time: its DDP communication hook.

``register_compression`` registers PyTorch's ``powerSGD_hook`` (with a ``PowerSGDState``) or
our ``top_k_hook`` (with a ``TopKState``) on a ``DistributedDataParallel`` module. Both
replace DDP's all-reduce of each gradient bucket; both are lossy.

Top-k (Aji & Heafield 2017; error feedback as in Lin et al., "Deep Gradient Compression",
ICLR 2018): each rank adds the error it kept last step to the bucket, selects the
``ceil(fraction n)`` entries of largest magnitude, keeps the rest as the next step's error,
and all-gathers its values and int32 indices (packed as bytes in one tensor, so one
collective carries both whatever the gradient dtype); every rank then sums the entries it
received into a zeroed bucket and divides by the world size (DDP averages).

Codegen layer: imports torch and the planner's vocabulary, never search or cost_model.
"""

# No "from __future__ import annotations": DDP checks that a hook's bucket annotation is
# dist.GradBucket itself, not a string.
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

POWERSGD, TOP_K, HALF_REDUCE = "powersgd", "top-k", "half-reduce"


@dataclass
class TopKState:
    """The top-k hook's settings and error-feedback buffers (one per bucket index)."""

    process_group: dist.ProcessGroup | None
    fraction: float
    error_feedback: bool = True
    # Steps all-reduced uncompressed first: DDP rebuilds its buckets after step 1, so an
    # error kept by bucket index before then belongs to other parameters (PowerSGD's
    # start_powerSGD_iter has the same floor of 2 for the same reason).
    start_iter: int = 2
    iteration: int = 0
    errors: dict[int, torch.Tensor] = field(default_factory=dict)


def top_k_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: the bucket's largest ``state.fraction`` entries of every rank,
    summed and averaged, with error feedback when ``state.error_feedback`` (module docstring)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if state.iteration < state.start_iter:  # counted as PowerSGDState counts: the last bucket ends a step
        if bucket.is_last():
            state.iteration += 1
        return default_hooks.allreduce_hook(group, bucket)
    grad = bucket.buffer()
    flat = grad.view(-1)
    if flat.numel() >= 2**31:
        raise ValueError(f"top-k's int32 indices cannot address a bucket of {flat.numel()} elements; use smaller buckets")
    if state.error_feedback:
        error = state.errors.get(bucket.index())
        if error is not None and error.shape == flat.shape:
            flat.add_(error)
    k = max(1, math.ceil(state.fraction * flat.numel()))
    indices = torch.topk(flat.abs(), k, sorted=False).indices
    values = flat[indices]
    if state.error_feedback:
        residual = flat.clone()
        residual[indices] = 0
        state.errors[bucket.index()] = residual
    payload = torch.cat([values.contiguous().view(torch.uint8), indices.to(torch.int32).view(torch.uint8)])
    gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=payload.device)
    work = dist.all_gather_into_tensor(gathered, payload, group=group, async_op=True)
    value_bytes = k * values.element_size()

    def decode(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()
        rows = gathered.view(world, payload.numel())
        received_values = rows[:, :value_bytes].contiguous().view(values.dtype).reshape(-1)
        received_indices = rows[:, value_bytes:].contiguous().view(torch.int32).reshape(-1).long()
        flat.zero_()
        flat.index_add_(0, received_indices, received_values)
        return grad.div_(world)

    return work.get_future().then(decode)


def powersgd_one_bucket_at_a_time(state: powersgd.PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``powerSGD_hook``, waited for before the hook returns: its future's callbacks issue the
    P and Q all-reduces and block on them inside a gloo worker thread, so two buckets' chains
    at once hold every worker and wait for each other for ever (seen at two buckets on gloo).
    One bucket at a time, a chain always finds a worker free; the price is no overlap of the
    reduction with backward, which the simulator charges on gloo too
    (``planner.families.gradient_compression.costs``)."""
    reduced = powersgd.powerSGD_hook(state, bucket).wait()
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(reduced)
    return done


def register_compression(module: torch.nn.parallel.DistributedDataParallel, kind: str, *, rank: int = 1,
                         fraction: float = 0.01, error_feedback: bool = True, warm_start: bool = True,
                         start_iter: int = 2, dtype: str = "fp16") -> object:
    """Register the ``kind`` hook (``"powersgd"``, ``"top-k"``, or ``"half-reduce"``: PyTorch's
    ``fp16_compress_hook``/``bf16_compress_hook`` by ``dtype``) on DDP ``module`` and return
    its state. PowerSGD and top-k run plain all-reduces for the first ``start_iter`` steps
    (``PowerSGDState.start_powerSGD_iter``, ``TopKState.start_iter``; 2 is the least that
    keeps error feedback sound across DDP's bucket rebuild after step 1).

    Raises:
        ValueError: ``kind`` is neither.
    """
    group = module.process_group
    if kind == POWERSGD:
        state = powersgd.PowerSGDState(
            process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter,
            use_error_feedback=error_feedback, warm_start=warm_start,
        )
        on_gloo = dist.get_backend(group) == dist.Backend.GLOO
        module.register_comm_hook(state, powersgd_one_bucket_at_a_time if on_gloo else powersgd.powerSGD_hook)
        return state
    if kind == TOP_K:
        state = TopKState(group, fraction, error_feedback, start_iter)
        module.register_comm_hook(state, top_k_hook)
        return state
    if kind == HALF_REDUCE:
        hook = default_hooks.bf16_compress_hook if dtype == "bf16" else default_hooks.fp16_compress_hook
        module.register_comm_hook(group, hook)
        return group
    raise ValueError(f"no gradient compression called {kind!r}; use 'powersgd', 'top-k' or 'half-reduce'")
