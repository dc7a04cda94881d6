"""A language model's cross entropy priced as the memory-bound kernels eager PyTorch runs
(``cost_model.loss_kernels``), against figures worked out by hand.

H100 SXM5 preset: 3.35e12 B/s of HBM at the default memory efficiency 0.8 = 2.68e12 B/s;
every kernel pays the default 5 us launch overhead.
"""

from __future__ import annotations

import pytest
import torch

from cost_model import defaults
from cost_model.compute import op_times, roofline_time
from cost_model.loss_kernels import cross_entropy_bytes_per_logit, cross_entropy_kernels
from planner.cluster import Cluster
from planner.graph import OpNode, TensorMeta

H100_DEVICE = Cluster.preset("dgx-h100").device_of(0)
STREAM = 3.35e12 * defaults.MEMORY_EFFICIENCY  # 2.68e12 B/s
OVERHEAD = defaults.KERNEL_OVERHEAD_S


def cross_entropy_node(rows: int, classes: int) -> OpNode:
    """``F.cross_entropy`` as the trace records it: fp32 logits (rows, classes), int64 targets."""
    logits, targets = TensorMeta((rows, classes), torch.float32), TensorMeta((rows,), torch.int64)
    return OpNode(name="loss", op="aten.cross_entropy_loss.default", inputs=("logits", "targets"),
                  input_meta=(logits, targets), output_meta=(TensorMeta((), torch.float32),),
                  attrs=(None, None), bytes_moved=logits.nbytes + targets.nbytes + 4)


def test_long_vocabulary_in_bf16_moves_22_and_26_bytes_per_logit():
    # Forward: the fp32 cast (read 2, write 4) and cunn_SoftMaxForward over a 131,072-class row
    # (max, sum and write passes: 3 reads + 1 write of 4 bytes = 16): 22.
    # Backward: nll_loss's zero-filled gradient (4), cunn_SoftMaxBackward (gradient read for
    # the row sum, then gradient and output read, input gradient written: 16), the cast's
    # gradient (read 4, write 2): 26.
    assert cross_entropy_bytes_per_logit(131072, 2) == (22, 26)
    assert cross_entropy_kernels(2) == (3, 4)


def test_short_rows_take_the_cached_kernels():
    # 32,000 classes (Llama 2): under 40,960 the forward keeps the row in registers (read 4,
    # write 4 = 8; + the cast's 6 = 14); over 12,288 the backward does not fit 48 KiB of shared
    # memory: still 26. 8,000 classes: the backward reads the gradient once (12; + 4 + 6 = 22).
    assert cross_entropy_bytes_per_logit(32000, 2) == (14, 26)
    assert cross_entropy_bytes_per_logit(8000, 2) == (14, 22)


def test_fp32_logits_are_not_cast():
    # An fp32 step: no cast either way: forward 16, backward 4 + 16 = 20; kernels 2 and 3.
    assert cross_entropy_bytes_per_logit(131072, 4) == (16, 20)
    assert cross_entropy_kernels(4) == (2, 3)


def test_megatron_core_loss_on_h100_by_hand():
    # Megatron-Core's 1.7B row: 4 sequences of 4,096 tokens per GPU over a 131,072 vocabulary
    # = 16,384 x 131,072 = 2^31 logits, bf16. Forward 22 x 2^31 B / 2.68e12 B/s = 17.628 ms
    # + 3 launches; backward 26 x 2^31 / 2.68e12 = 20.834 ms + 4 launches.
    node = cross_entropy_node(16384, 131072)
    forward, backward = op_times(node, 1.0, H100_DEVICE, "bf16")
    assert forward == pytest.approx(22 * 2**31 / STREAM + 3 * OVERHEAD)
    assert backward == pytest.approx(26 * 2**31 / STREAM + 4 * OVERHEAD)
    assert forward == pytest.approx(17.643e-3, rel=1e-3)
    # A quarter of the work (say 4 micro-batches) moves a quarter of the bytes; launches stay.
    quarter_forward, _ = op_times(node, 0.25, H100_DEVICE, "bf16")
    assert quarter_forward == pytest.approx(22 * 2**29 / STREAM + 3 * OVERHEAD)


def test_cpu_keeps_the_roofline():
    # The pass counts are of the CUDA kernels: a CPU device prices the traced op's bytes.
    cpu = Cluster.preset("cpu").device_of(0)
    node = cross_entropy_node(64, 1000)
    forward, _ = op_times(node, 1.0, cpu, "fp32")
    assert forward == pytest.approx(roofline_time(0.0, node.bytes_moved, cpu, "float32"))
