"""A language model's cross entropy as eager PyTorch runs it on a GPU: memory-bound passes
over fp32 logits, not one read of 16-bit ones.

The trace keeps ``F.cross_entropy`` as one op (``aten.cross_entropy_loss``) whose bytes are
its input once; the roofline would price it as one pass over 16-bit logits. A real step does
more, and over a 50k-256k vocabulary the logits are the largest activation of the step:

* 16-bit logits are cast to fp32 first: autocast runs ``cross_entropy`` in fp32 (its
  "ops that autocast to float32" list, torch.amp docs), torchtitan calls it on
  ``pred.float()`` (torchtitan/components/loss.py). Read 2, write 4 bytes per logit; in
  backward the cast's gradient reads 4 and writes 2.
* ``log_softmax`` (aten/src/ATen/native/cuda/SoftMax.cu, ``host_softmax``): a row that fits
  the register-cached kernel (``cunn_SoftMaxForwardReg``: fewer than 10 x ILP x 1024
  elements, ILP 4 for fp32, so under 40,960 classes) is read once; a longer row runs
  ``cunn_SoftMaxForward``: one pass for the maximum, one for the sum of exponentials, one
  to write the result: three reads and one write of 4 bytes.
* ``nll_loss`` reads one logit and one target per row (no pass over the classes).
* backward: ``nll_loss_backward`` fills a zero fp32 gradient of the logits' size (write 4)
  and scatters one value per row; ``log_softmax``'s backward (``cunn_SoftMaxBackward``)
  sums the incoming gradient per row (read 4), then reads it and the saved output and
  writes the input gradient (read 8, write 4); its shared-memory variant, for rows that fit
  48 KiB (``sharedMemPerBlock``: 12,288 fp32 classes), reads the gradient once.

So per logit of a 16-bit step over a long vocabulary: forward 6 + 16 = 22 bytes (3 kernels),
backward 4 + 16 + 6 = 26 bytes (4 kernels), against 2 and 4 in the roofline. Megatron-LM's
unfused vocabulary-parallel cross entropy (max, subtract, exp, sum, divide over fp32 logits
in forward; one in-place multiply in backward) moves about as much (52 bytes against 48).
Each kernel streams at the device's memory efficiency (``cost_model.defaults``) and pays
the launch overhead. Priced on GPUs of a known generation (``gpu_kernels.generation_of``),
where these kernels are the ones that run; CPUs keep the roofline.

Another system's run may compute its loss otherwise (``Plan.loss_implementation``,
``Plan.metric_cross_entropies``; ``benchmarks/fidelity.py`` sets them, the search never does):

* ``"fused_xentropy"``: FlashAttention's fused softmax cross entropy (flash_attn/losses/
  cross_entropy.py over the ``xentropy_cuda_lib`` extension, csrc/xentropy/xentropy_kernel.cu,
  Dao-AILab/flash-attention at tag v1.0.9, 6d48e14a6, which llm-foundry v0.3.0's ``gpu``
  extras install and its MPT models take by default: ``loss_fn: fused_crossentropy``). It reads
  the 16-bit logits as they are, no fp32 copy: its forward kernel (``cunn_SoftMaxXEntropyForward``,
  one thread block per row) reads the row once for the maximum and the plain sum together
  (the two-reduction ``ilpReduce``) and once more for the sum of exponentials, and writes one
  loss and one log-sum-exp per row; its backward kernel (``cunn_SoftMaxXEntropyBackward``)
  reads the row once and writes its gradient once (``inplace_backward`` False: a new tensor).
  Per 16-bit logit: forward 2 x 2 bytes, backward 2 + 2, one kernel each.
* metric cross entropies: a trainer that computes training metrics from each micro-batch's
  logits runs more cross entropies, forward only and without storing anything. Composer of
  2023 (mosaicml/composer 18f2d3c33, the release llm-foundry v0.3.0 pinned) updates the train
  metrics after every micro-batch's backward (``Trainer._train_microbatch`` ->
  ``_eval_train_metrics``, under ``torch.no_grad`` and the autocast precision context), and
  llm-foundry's MPT has two (``ComposerMPTCausalLM``: ``LanguageCrossEntropy`` and
  ``LanguagePerplexity``, whose ``update`` each call ``torch.nn.CrossEntropyLoss(reduction=
  'sum')`` on the logits: composer/metrics/nlp.py). Each is an eager cross entropy's forward
  (the fp32 cast under autocast, ``log_softmax``, ``nll_loss``): 22 bytes per 16-bit logit
  over a long vocabulary, three kernels. They are charged to the loss op's forward: a
  micro-batch's total is the same wherever in it they run.
"""

from __future__ import annotations

import math

from cost_model.loss_parallel import CROSS_ENTROPY
from planner.cluster import DeviceSpec
from planner.graph import OpNode
from planner.run_settings import LOSS_IMPLEMENTATIONS

FP32_BYTES = 4
# SoftMax.cu: the register-cached forward kernel takes rows of fewer than 10 x ILP x 1024
# elements, ILP = 16 bytes / element size = 4 for fp32.
REGISTER_ROW_ELEMENTS = 10 * 4 * 1024
# SoftMax.cu: the shared-memory backward kernel takes rows that fit sharedMemPerBlock, 48 KiB
# on every CUDA GPU since Kepler (CUDA C Programming Guide, "Compute Capabilities" table).
SHARED_MEMORY_ROW_ELEMENTS = 48 * 1024 // FP32_BYTES


def log_softmax_forward_bytes(classes: int) -> int:
    """Bytes per fp32 logit that ``log_softmax``'s forward kernel moves (module docstring)."""
    reads = 1 if classes < REGISTER_ROW_ELEMENTS else 3
    return (reads + 1) * FP32_BYTES


def log_softmax_backward_bytes(classes: int) -> int:
    """Bytes per fp32 logit that ``log_softmax``'s backward kernel moves: the gradient read
    once (rows in shared memory) or twice, the saved output read, the input gradient written."""
    gradient_reads = 1 if classes <= SHARED_MEMORY_ROW_ELEMENTS else 2
    return (gradient_reads + 1 + 1) * FP32_BYTES


def cross_entropy_bytes_per_logit(classes: int, logits_bytes: int) -> tuple[int, int]:
    """(forward, backward) bytes moved per logit by eager cross entropy over ``classes``
    classes of ``logits_bytes``-byte logits: the fp32 cast of 16-bit logits and its
    gradient, ``log_softmax`` and its backward, and the zero-filled gradient of ``nll_loss``."""
    cast_forward = logits_bytes + FP32_BYTES if logits_bytes < FP32_BYTES else 0
    cast_backward = FP32_BYTES + logits_bytes if logits_bytes < FP32_BYTES else 0
    forward = cast_forward + log_softmax_forward_bytes(classes)
    backward = FP32_BYTES + log_softmax_backward_bytes(classes) + cast_backward
    return forward, backward


def cross_entropy_kernels(logits_bytes: int) -> tuple[int, int]:
    """(forward, backward) kernel launches: [cast,] log_softmax, nll_loss; zero fill,
    nll_loss's scatter, log_softmax's backward[, the cast's gradient]."""
    cast = 1 if logits_bytes < FP32_BYTES else 0
    return 2 + cast, 3 + cast


# FlashAttention v1.0.9 xentropy: passes over the logits (forward: max and sum, then the sum of
# exponentials; backward: read the logits, write their gradient) and kernels, each way.
FUSED_XENTROPY_PASSES = (2, 2)
FUSED_XENTROPY_KERNELS = (1, 1)


def loss_bytes_per_logit(classes: int, logits_bytes: int, implementation: str = "",
                         metric_cross_entropies: int = 0) -> tuple[int, int]:
    """(forward, backward) bytes moved per logit by the loss as ``implementation`` computes
    it (``LOSS_IMPLEMENTATIONS``), the forward with ``metric_cross_entropies`` eager cross
    entropies more (a trainer's metrics: no backward)."""
    if implementation not in LOSS_IMPLEMENTATIONS:
        raise ValueError(f"loss implementation must be one of {LOSS_IMPLEMENTATIONS[1:]} or empty, got {implementation!r}")
    eager_forward, eager_backward = cross_entropy_bytes_per_logit(classes, logits_bytes)
    if implementation == "fused_xentropy":
        forward, backward = (passes * logits_bytes for passes in FUSED_XENTROPY_PASSES)
    else:
        forward, backward = eager_forward, eager_backward
    return forward + metric_cross_entropies * eager_forward, backward


def loss_kernels(logits_bytes: int, implementation: str = "", metric_cross_entropies: int = 0) -> tuple[int, int]:
    """(forward, backward) kernel launches of the loss as ``loss_bytes_per_logit`` prices it."""
    eager_forward, eager_backward = cross_entropy_kernels(logits_bytes)
    forward, backward = FUSED_XENTROPY_KERNELS if implementation == "fused_xentropy" else (eager_forward, eager_backward)
    return forward + metric_cross_entropies * eager_forward, backward


def cross_entropy_times(node: OpNode, fraction: float, device: DeviceSpec, logits_bytes: int,
                        memory_efficiency: float, overhead_s: float, implementation: str = "",
                        metric_cross_entropies: int = 0) -> tuple[float, float]:
    """(forward, backward) seconds of the language-model loss doing ``fraction`` of the
    traced op's work, its logits stored in ``logits_bytes``-byte elements (module docstring):
    eager ``F.cross_entropy`` or another ``implementation``, plus ``metric_cross_entropies``
    forward-only cross entropies, streaming at ``memory_efficiency`` of the device's
    bandwidth, each kernel paying ``overhead_s``. The rows' gather of one logit and target
    each is left out (a row is thousands of logits)."""
    logits = node.input_meta[0]
    classes = logits.shape[1] if len(logits.shape) >= 2 else logits.shape[0]
    elements = math.prod(logits.shape) * fraction
    forward_bytes, backward_bytes = loss_bytes_per_logit(classes, logits_bytes, implementation, metric_cross_entropies)
    forward_kernels, backward_kernels = loss_kernels(logits_bytes, implementation, metric_cross_entropies)
    bandwidth = device.memory_bandwidth * memory_efficiency
    return (forward_bytes * elements / bandwidth + forward_kernels * overhead_s,
            backward_bytes * elements / bandwidth + backward_kernels * overhead_s)
