"""Megatron-Core's distributed optimizer as the data-parallel part of a simulated step
(``Plan.megatron_distributed_optimizer``), as Megatron-LM core_v0.8.0 runs it with
``--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --bf16``:

- **Gradients in fp32, reduced once.** Under ``--bf16`` megatron/training/arguments.py sets
  ``accumulate_allreduce_grads_in_fp32`` ("bfloat16 requires gradient accumulation and
  all-reduce to be done in fp32"), so ``DistributedDataParallel`` allocates its gradient
  buffer in fp32 (``grad_reduce_in_fp32``: ``allocate_buffers_for_parameters`` in
  megatron/core/distributed/distributed_data_parallel.py). Every micro-batch adds into that
  buffer; ``ParamAndGradBuffer.register_grad_ready`` (param_and_grad_buffer.py) marks a
  gradient ready only while ``is_last_microbatch``, which the schedules clear through
  ``no_sync`` for every micro-batch but the last (megatron/core/pipeline_parallel/
  schedules.py: ``forward_backward_no_pipelining`` runs the first ``num_microbatches - 1``
  under ``no_sync_func()``, the last outside it): one reduction per step, in fp32.
- **Reduce-scatter, bucket by bucket, during the last backward.** With the distributed
  optimizer ``Bucket.start_grad_sync`` reduce-scatters the bucket (``_reduce_scatter_base``),
  issued asynchronously when the bucket's last gradient is ready. A bucket holds
  ``max(40,000,000, 1,000,000 x dp)`` parameters (``DistributedDataParallel.__init__``:
  "make buckets larger to ensure that chunks used in NCCL ring-reduce implementations are
  large enough"), but only on the first pipeline stage: a later stage's whole gradient is one
  bucket (``bucket_size = None`` when ``get_pipeline_model_parallel_rank() > 0``, "since
  data-parallel communication on these stages is not on the critical path"), so it is
  reduced after that stage's last backward.
- **Weights gathered during the next forward.** ``DistributedOptimizer.zero_grad`` issues
  the all-gather of the first bucket of updated bf16 weights; the forward pre-hook of a
  module whose bucket is still arriving waits for it and issues the next bucket's
  (``_finish_param_sync_helper``: one all-gather in flight, "to ensure that the
  communication kernels don't head-of-line block the compute kernels"). In a simulated step
  the gathers of the step's own weights run during its first micro-batch's forward: the
  gather a segment waits for is issued once the segment two before it is done
  (``step_tasks.prefetch_after``, the same depth), all of a later stage's weights before its
  first forward (one bucket). Nothing is gathered after the optimizer step.

- **Each bucket checked and scaled before its reduce-scatter.** ``Bucket.start_grad_sync``
  (megatron/core/distributed/param_and_grad_buffer.py) first takes the bucket's norm,
  ``self.grad_data.norm(p=2)``, and asserts it is not NaN when ``check_for_nan_in_grad`` is
  set, which megatron/training/training.py sets from ``args.check_for_nan_in_loss_and_grad``,
  on unless ``--no-check-for-nan-in-loss-and-grad`` is given (arguments.py); then, unless
  ``--ddp-average-in-collective``, it multiplies the bucket by its ``gradient_scaling_factor``,
  1/dp (``DistributedDataParallel.__init__``: "gradient_scaling_factor = 1.0 /
  data_parallel_world_size"), so the collective sums averages. Both are kernels on the compute
  stream, in the backward hook that issues the collective: the bucket's fp32 gradients read
  once by a reduction (``defaults.MEMORY_EFFICIENCY``), then read and written by a contiguous
  multiply (``memory_kernels.STREAMING_EFFICIENCY``) - 12 bytes per gradient element -
  before the reduce-scatter may start and before the backward goes on (``bucket_checks_time``).
- **The gradient buffer zeroed every step.** ``train_step`` (megatron/training/training.py)
  begins with ``model_chunk.zero_grad_buffer()`` for every model chunk, and
  ``ParamAndGradBuffer.reset`` runs ``self.grad_data.zero_()`` over the whole fp32 buffer, not
  1/dp of it: 4 bytes written per local parameter, a contiguous fill, on the compute stream
  before the step's first forward; in a simulated step it follows the optimizer step
  (``zero_buffer_time``).

- **Gradients autograd produces added into the fp32 buffer, every micro-batch.** The DDP hook
  on each parameter's gradient accumulator (``DistributedDataParallel._make_param_hook``)
  runs ``param.main_grad.add_(param.grad.data)`` unless ``param.grad_added_to_main_grad``,
  which only the weight-gradient GEMMs set, accumulating into ``main_grad`` themselves
  (``--gradient-accumulation-fusion``, Megatron-LM's default: Transformer Engine's
  ``fuse_wgrad_accumulation`` and ``LinearWithGradAccumulationAndAsyncCommunication``'s
  ``wgrad_gemm_accum_fp32`` for the output layer). So the embeddings (``F.embedding``'s dense
  gradient), the norms' weights and biases and the linear layers' biases are added by the
  hook on every micro-batch, one kernel per tensor reading the fp32 ``main_grad`` and the
  16-bit gradient and writing ``main_grad`` (4 + 2 + 4 bytes per element with bf16 weights),
  on the compute stream as the backward produces them (``main_grad_add_time``: a parameter
  read by ``aten.embedding`` or of at most one dimension; a 2-D weight read by a matmul, and
  an MoE layer's expert weights, are the GEMMs' own. A router's 2-D weight, which Megatron
  multiplies with ``torch.nn.functional.linear`` and so adds by the hook, is left out: it is
  hidden x experts elements, a few microseconds).

All as Megatron-LM core_v0.8.0 (commit baf94af3c667248865f23df73b9fb8e2395e6fd0) runs them with
its defaults. Not priced: the host's wait at each bucket's NaN assertion (``assert not
norm.isnan()`` copies the norm to the host), and at the loss's (pretrain_gpt.py's
``loss_func``), after which the device idles until the host issues the next kernels; no
public profile gives that gap's length.

Memory (``step_memory``): the fp32 buffer, 4 bytes per local gradient element, not sharded;
the fp32 master weights and Adam's moments (12 bytes) divided by dp for every weight, since the
flat buffer is cut into dp equal ranges whatever the tensor boundaries
(``_build_model_gbuf_range``, megatron/core/optimizer/distrib_optimizer.py): 6 + 12/dp bytes
per parameter with the bf16 weights, as Megatron-LM's docs/source/api-guide/dist_optimizer.md
tabulates it ("bf16 param, fp32 grads").

Not modelled: bucket boundaries inside a segment (a segment's gradients are ready when its backward ends), and, under the interleaved
schedule, the single bucket Megatron gives the first stage's later model chunks
(``disable_bucketing``).
"""

from __future__ import annotations

from cost_model.compute import roofline_time
from cost_model.memory_kernels import kind_memory_efficiency
from cost_model.parameter_bytes import FP32_GRADIENT_BYTES, PARAM_BYTES

# megatron/core/distributed/distributed_data_parallel.py, core_v0.8.0, ``__init__``:
# ``bucket_size = max(40000000, 1000000 * get_data_parallel_world_size())`` (parameters).
BUCKET_MIN_PARAMETERS = 40_000_000
BUCKET_PARAMETERS_PER_DP_RANK = 1_000_000


# Bytes per fp32 gradient element of each bucket's checks before its reduce-scatter (module
# docstring): the NaN check's norm reads it (4), the 1/dp scaling reads and writes it (4 + 4).
NAN_CHECK_BYTES = FP32_GRADIENT_BYTES
SCALING_BYTES = 2 * FP32_GRADIENT_BYTES


def runs_megatron_sync(context) -> bool:
    """Whether the step's data parallelism is Megatron-Core's distributed optimizer."""
    return bool(getattr(context.plan, "megatron_distributed_optimizer", False)) and context.dp > 1


def gradient_bytes() -> int:
    """Bytes per gradient element reduced: the fp32 gradient buffer under ``--bf16``."""
    return FP32_GRADIENT_BYTES


def bucket_cap_bytes(context, stage: int) -> float:
    """Bytes of fp32 gradients per reduce-scatter bucket on pipeline ``stage``: Megatron's
    bucket size on the first stage, the whole stage's gradients (one bucket) on the others."""
    if stage > 0:
        return float("inf")
    return max(BUCKET_MIN_PARAMETERS, BUCKET_PARAMETERS_PER_DP_RANK * context.dp) * gradient_bytes()


def weight_gather(tasks, device: str, segment, issue_after: list[int]) -> int | None:
    """The all-gather of ``segment``'s updated weights that its first forward of the step
    waits for (module docstring): per segment on the first pipeline stage, issued after
    ``issue_after``; on a later stage one gather of the whole stage's weights before its first
    segment, and nothing for the others. None after the first micro-batch."""
    context = tasks.context
    if tasks.micro_batch != 0:
        return None
    if segment.stage % context.pp > 0:
        gathered = tasks.segments_of(device)
        if segment is not gathered[0]:
            return None
        issue_after = []
    else:
        gathered = [segment]
    # The weights live in one flat buffer, evenly sharded over dp: every element is gathered
    # (``DistributedOptimizer._dispatch_gather_model_params``: ``_all_gather_base`` of the
    # bucket's whole param buffer).
    element_bytes = PARAM_BYTES[context.plan.precision][0]
    size = sum(s.shardable_elements() for s in gathered) * element_bytes
    if size <= 0:
        return None
    return tasks.graph.add(f"all-gather updated weights {segment.name}", (device, "param gather"),
                           context.collective("all_gather", size, "dp"), deps=issue_after, kind="comm")


def bucket_checks_time(context, bucket_bytes: float, buckets: int = 1) -> float:
    """Seconds of the compute-stream kernels Megatron runs on ``buckets`` buckets of
    ``bucket_bytes`` fp32 gradient bytes each before reduce-scattering them: the NaN check's
    norm (a reduction reading each element once) and the scaling by 1/dp (a contiguous
    multiply reading and writing it), each one kernel per bucket (module docstring)."""
    if bucket_bytes <= 0 or buckets <= 0:
        return 0.0
    elements = bucket_bytes / gradient_bytes()
    norm = roofline_time(0.0, elements * NAN_CHECK_BYTES, context.device, "float32")
    streaming = kind_memory_efficiency("streaming", context.device)
    scale = roofline_time(0.0, elements * SCALING_BYTES, context.device, "float32", memory_efficiency=streaming)
    return buckets * (norm + scale)


def zero_buffer_time(context, elements: float) -> float:
    """Seconds of ``zero_grad_buffer``'s fill of the fp32 gradient buffer holding ``elements``
    local gradient elements at the start of every step (module docstring): one contiguous
    write of 4 bytes each."""
    if elements <= 0:
        return 0.0
    streaming = kind_memory_efficiency("streaming", context.device)
    return roofline_time(0.0, elements * gradient_bytes(), context.device, "float32", memory_efficiency=streaming)


def hook_added_parameters(context, segment) -> list[str]:
    """The parameters of ``segment`` whose gradients Megatron's DDP hook adds into the fp32
    ``main_grad`` (module docstring): those read by ``aten.embedding`` and those of at most
    one dimension (norm weights and biases, linear biases), in name order."""
    parameters = context.graph.parameters
    embedded = {name for node_name in segment.nodes for node in (context.nodes[node_name],)
                if node.op.startswith("aten.embedding.") for name in node.params}
    return sorted(name for name in segment.params
                  if name in parameters and (name in embedded or len(parameters[name].shape) <= 1))


def main_grad_add_time(context, segment) -> float:
    """Seconds of one micro-batch's hook adds of ``segment``'s autograd gradients into the
    fp32 ``main_grad`` (module docstring): per tensor one contiguous add reading the fp32
    buffer and the gradient in the weights' precision and writing the buffer, at
    ``memory_kernels.STREAMING_EFFICIENCY``, each its own kernel launch."""
    gradient_element = PARAM_BYTES[context.plan.precision][0]
    per_element = 2 * gradient_bytes() + gradient_element
    streaming = kind_memory_efficiency("streaming", context.device)
    return sum(roofline_time(0.0, segment.params[name] * per_element, context.device, "float32",
                             memory_efficiency=streaming)
               for name in hook_added_parameters(context, segment) if segment.params[name] > 0)
