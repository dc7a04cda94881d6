"""Costs against numbers worked out by hand (cost_model/*.py).

Each expectation is written out as arithmetic in a comment, then compared with
``pytest.approx``. Efficiencies come from ``cost_model.defaults`` so a recalibration changes
the expected value and the predicted one together; the comments use today's values
(matmul 0.55, memory 0.8, 5 µs per kernel). The multi-algorithm collectives
(``collective_time``) are tested in tests/test_collectives.py; here the single-link ring
helpers and the per-op roofline.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from cost_model import defaults
from cost_model.collectives import all_gather_time, group_link, reduce_scatter_time, ring_all_reduce_time
from cost_model.compute import op_times, optimizer_step_time, roofline_time
from planner.cluster import Cluster, LinkSpec
from planner.graph import OpNode, TensorMeta
from planner.trace import trace
from search.data_parallel import data_parallel_plan

F32 = torch.float32

# A link of 100 GB/s per direction and 10 µs latency.
LINK = LinkSpec(bandwidth=100e9, latency=10e-6)
GB = 1e9  # bytes


# ------------------------------------------------------------------- collectives


def test_ring_all_reduce():
    # S = 1 GB over n = 8 devices: 2(n-1)/n * S/β + 2(n-1) α
    #   = 2*7/8 * 1e9/100e9 + 2*7 * 10e-6 = 1.75 * 0.01 + 14e-5 = 0.0175 + 0.00014 = 0.01764 s
    assert ring_all_reduce_time(GB, 8, LINK) == pytest.approx(0.01764)
    # n = 2: 2*1/2 * 0.01 + 2*1*10e-6 = 0.01 + 0.00002 = 0.01002 s
    assert ring_all_reduce_time(GB, 2, LINK) == pytest.approx(0.01002)


def test_all_gather_and_reduce_scatter():
    # All-gather of S = 1 GB in total over n = 8: (n-1)/n * S/β + (n-1) α
    #   = 7/8 * 0.01 + 7 * 10e-6 = 0.00875 + 0.00007 = 0.00882 s
    assert all_gather_time(GB, 8, LINK) == pytest.approx(0.00882)
    # Reduce-scatter moves the same volume.
    assert reduce_scatter_time(GB, 8, LINK) == pytest.approx(0.00882)
    # All-reduce = reduce-scatter + all-gather in the ring algorithm.
    assert ring_all_reduce_time(GB, 8, LINK) == pytest.approx(2 * all_gather_time(GB, 8, LINK))


@pytest.mark.parametrize("collective", [ring_all_reduce_time, all_gather_time, reduce_scatter_time])
def test_trivial_collectives_are_free(collective):
    assert collective(GB, 1, LINK) == 0.0  # one device: nothing to send
    assert collective(0, 8, LINK) == 0.0  # nothing to send


def test_group_link_intra_vs_inter_node():
    # Two DGX A100 nodes: ranks 0-7 on node 0, 8-15 on node 1.
    cluster = Cluster.preset("dgx-a100-80g", nodes=2)
    intra = group_link(cluster, list(range(8)))
    assert (intra.bandwidth, intra.latency) == (300e9, 3e-6)  # NVLink 3 per direction, NVSwitch hop
    for ranks in ([0, 8], [7, 8], list(range(16))):
        inter = group_link(cluster, ranks)
        assert (inter.bandwidth, inter.latency) == (25e9, 8e-6)  # one HDR IB NIC per GPU
    assert group_link(cluster, [8, 15]) == intra  # inside node 1
    # All-reduce of 1 GB over the 16 ranks is bounded by InfiniBand:
    #   2*15/16 * 1e9/25e9 + 2*15 * 8e-6 = 1.875 * 0.04 + 0.00024 = 0.075 + 0.00024 = 0.07524 s
    assert ring_all_reduce_time(GB, 16, group_link(cluster, list(range(16)))) == pytest.approx(0.07524)
    # ... while over the 8 GPUs of one node it rides NVLink:
    #   2*7/8 * 1e9/300e9 + 2*7 * 3e-6 = 1.75/300 + 42e-6 = 0.0058333 + 0.000042 = 0.0058753 s
    assert ring_all_reduce_time(GB, 8, intra) == pytest.approx(0.0058753, rel=1e-4)


# --------------------------------------------------------------------- compute


def matmul_node(m: int, k: int, n: int) -> OpNode:
    """(m, k) @ (k, n) in fp32, with FLOPs and bytes as the tracer records them."""
    a, b, out = TensorMeta((m, k), F32), TensorMeta((k, n), F32), TensorMeta((m, n), F32)
    return OpNode(
        name="mm",
        op="aten.mm.default",
        inputs=("a", "b"),
        input_meta=(a, b),
        output_meta=(out,),
        flops=2 * m * k * n,
        bytes_moved=a.nbytes + b.nbytes + out.nbytes,
    )


# The A100's datasheet numbers under a name of no known GPU generation: these tests check the
# roofline, which unknown devices keep (named A100s get cost_model.gpu_kernels, tested in
# tests/test_gpu_kernels.py).
# 19.5e12 fp32, 312e12 bf16, 2.039e12 B/s
A100 = dataclasses.replace(Cluster.preset("dgx-a100-80g").device_of(0), name="roofline-device")


def test_matmul_time_is_compute_bound():
    node = matmul_node(4096, 4096, 4096)
    # FLOPs = 2 * 4096^3 = 137,438,953,472; bytes = 3 * 4096^2 * 4 = 201,326,592.
    assert node.flops == 137_438_953_472 and node.bytes_moved == 201_326_592
    # compute: 1.374e11 / (19.5e12 fp32 * 0.55) = 12.814 ms
    # memory:  2.013e8 / (2.039e12 B/s * 0.8)    = 0.123 ms  -> compute-bound
    compute = node.flops / (19.5e12 * defaults.MATMUL_EFFICIENCY)
    memory = node.bytes_moved / (2.039e12 * defaults.MEMORY_EFFICIENCY)
    assert compute > memory
    forward, backward = op_times(node, 1.0, A100, "fp32")
    assert forward == pytest.approx(compute + defaults.KERNEL_OVERHEAD_S)  # 12.814 ms + 5 µs
    assert forward == pytest.approx(0.012819, rel=1e-3)
    # Backward: two matmuls of the same size (input and weight gradients): 2x the FLOPs.
    assert backward == pytest.approx(2 * compute + defaults.KERNEL_OVERHEAD_S)
    assert roofline_time(node.flops, node.bytes_moved, A100, "float32") == pytest.approx(forward)


def test_matmul_time_split_and_in_bf16():
    node = matmul_node(4096, 4096, 4096)
    compute = node.flops / (19.5e12 * defaults.MATMUL_EFFICIENCY)
    # Split over 4 ranks each does a quarter of the work; the launch overhead stays.
    forward, _ = op_times(node, 0.25, A100, "fp32")
    assert forward == pytest.approx(compute / 4 + defaults.KERNEL_OVERHEAD_S)  # 3.2035 ms + 5 µs
    # bf16 mixed precision runs at 312 TFLOP/s: 1.374e11 / (312e12 * 0.55) = 0.8009 ms, + 5 µs
    forward, _ = op_times(node, 1.0, A100, "bf16")
    assert forward == pytest.approx(node.flops / (312e12 * defaults.MATMUL_EFFICIENCY) + defaults.KERNEL_OVERHEAD_S)
    assert forward == pytest.approx(0.8059e-3, rel=1e-3)


def test_elementwise_time_is_memory_bound():
    x = TensorMeta((1024, 1024), F32)  # 4 MiB
    relu = OpNode("relu", "aten.relu.default", ("x",), (x,), (x,), bytes_moved=2 * x.nbytes)
    # forward: 2 * 4,194,304 B read + written / (2.039e12 * 0.8) = 5.143 µs, + 5 µs launch
    streaming = 2 * x.nbytes / (2.039e12 * defaults.MEMORY_EFFICIENCY)
    forward, backward = op_times(relu, 1.0, A100, "fp32")
    assert forward == pytest.approx(streaming + defaults.KERNEL_OVERHEAD_S)
    assert forward == pytest.approx(10.143e-6, rel=1e-3)
    # backward moves twice the bytes (gradient in, saved input in, gradient out)
    assert backward == pytest.approx(2 * streaming + defaults.KERNEL_OVERHEAD_S)
    # bf16 activations are half the bytes of the fp32 trace
    assert op_times(relu, 1.0, A100, "bf16")[0] == pytest.approx(streaming / 2 + defaults.KERNEL_OVERHEAD_S)


def test_view_and_integer_ops():
    x = TensorMeta((8, 64), F32)
    view = OpNode("view", "aten.view.default", ("x",), (x,), (TensorMeta((512,), F32),))
    assert op_times(view, 1.0, A100, "fp32") == (0.0, 0.0)
    ids = TensorMeta((8, 64), torch.int64)
    eq = OpNode("eq", "aten.eq.Tensor", ("a", "b"), (ids, ids), (TensorMeta((8, 64), torch.bool),), bytes_moved=8704)
    forward, backward = op_times(eq, 1.0, A100, "fp32")
    assert forward > 0 and backward == 0.0  # no gradient flows through a comparison


def test_optimizer_step_is_memory_bound():
    # Fused AdamW over 1e9 bytes of weights + gradients + states (fp32, 16 bytes per element:
    # 62.5e6 elements): 7 accesses per 4-byte element: 1e9 * 7/4 = 1.75e9 bytes /
    # (2.039e12 * 0.8) = 1.0728 ms, + 3 chunks of 320 x 65536 elements x 5 µs
    expected = 1e9 * defaults.ADAM_BYTES_ACCESSED_PER_PARAM_BYTE / 4 / (2.039e12 * defaults.MEMORY_EFFICIENCY)
    assert optimizer_step_time(1e9, A100) == pytest.approx(expected + 3 * defaults.KERNEL_OVERHEAD_S)
    assert optimizer_step_time(1e9, A100) == pytest.approx(1.0878e-3, rel=1e-3)
    # Foreach (PyTorch's default): 20 accesses per element over 8 kernels per chunk, at the
    # 0.304 of HBM bandwidth torchtitan's measurement gives it (cost_model.compute):
    # 1e9 * 20/4 / (2.039e12 * 0.304) = 8.0664 ms + 24 x 5 µs.
    foreach = 1e9 * 20 / 4 / (2.039e12 * 0.304) + 24 * defaults.KERNEL_OVERHEAD_S
    assert optimizer_step_time(1e9, A100, "foreach") == pytest.approx(foreach)
    assert foreach == pytest.approx(8.1864e-3, rel=1e-3)
    with pytest.raises(ValueError, match="fused, foreach"):
        optimizer_step_time(1e9, A100, "apex")


# ---------------------------------------------------------------------- memory


class OneLayer(nn.Module):
    """Linear 128 -> 256 plus a buffer of 256 floats: ``(fc(x) + running).relu().mean()``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(128, 256)
        self.register_buffer("running", torch.zeros(256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) + self.running).relu().mean()


@pytest.fixture(scope="module")
def small_graph():
    with torch.device("meta"):
        model, x = OneLayer(), torch.randn(8, 128)
    return trace(model, (x,))


# Parameters: weight 256*128 + bias 256 = 33,024 (132,096 bytes fp32).
PARAMS = 256 * 128 + 256
PARAM_BYTES = 4 * PARAMS
BUFFER_BYTES = 256 * 4  # 1,024, never sharded
# Saved activations, as autograd keeps them: the linear's and the add's outputs are read only
# by ops whose backward needs no input (add passes the gradient through, relu keeps its own
# output), so what stays is relu's output (8, 256) fp32 = 8,192 bytes and the 4-byte loss:
# 8,196 bytes. Over 4 ranks the batch-split relu output takes 2,048 bytes; the loss is a
# partial sum over dp, a whole 4-byte scalar on every rank: 2,052.
ACTIVATION_BYTES = 8 * 256 * 4 + 4
DP4_ACTIVATION_BYTES = 8 * 256 * 4 // 4 + 4

# n = 4. Adam: 2 fp32 states = 8 bytes/param = 8 * 33,024 = 264,192 bytes.
MEMORY_BY_FLAVOUR = [
    # flavour, weights (+ buffer), gradients, optimizer states, communication buffers
    # DDP: everything replicated; one gradient bucket in flight = min(25 MiB, 132,096).
    ("ddp", PARAM_BYTES + BUFFER_BYTES, PARAM_BYTES, 8 * PARAMS, PARAM_BYTES),
    # ZeRO-1: optimizer states / 4 = 66,048.
    ("zero1", PARAM_BYTES + BUFFER_BYTES, PARAM_BYTES, 8 * PARAMS // 4, PARAM_BYTES),
    # ZeRO-2: gradients / 4 = 33,024 too.
    ("zero2", PARAM_BYTES + BUFFER_BYTES, PARAM_BYTES // 4, 8 * PARAMS // 4, PARAM_BYTES),
    # ZeRO-3/FSDP: weights / 4 = 33,024 (+ the unsharded buffer); two units unsharded at
    # once (in use + prefetched), here the root unit: 2 * 132,096.
    ("fsdp", PARAM_BYTES // 4 + BUFFER_BYTES, PARAM_BYTES // 4, 8 * PARAMS // 4, 2 * PARAM_BYTES),
]


def test_small_graph_totals(small_graph):
    assert small_graph.parameter_count == PARAMS and small_graph.parameter_bytes == PARAM_BYTES


@pytest.mark.parametrize("flavour, weights, gradients, optimizer_states, buffers", MEMORY_BY_FLAVOUR)
def test_simulated_data_parallel_memory(small_graph, flavour, weights, gradients, optimizer_states, buffers):
    plan = data_parallel_plan(small_graph, Cluster.preset("cpu", 1, 4), None, "OneLayer", flavour)
    memory = plan.estimate.memory
    assert (memory.weights, memory.gradients, memory.optimizer_states) == (weights, gradients, optimizer_states)
    assert memory.activations == DP4_ACTIVATION_BYTES  # the batch is split: 2,052
    assert memory.communication_buffers == buffers
    assert memory.total == weights + gradients + optimizer_states + DP4_ACTIVATION_BYTES + buffers


def test_single_device_has_no_communication_buffer(small_graph):
    plan = data_parallel_plan(small_graph, Cluster.preset("cpu", 1, 1), None, "OneLayer", "ddp")
    memory = plan.estimate.memory
    assert memory.communication_buffers == 0
    # 133,120 + 132,096 + 264,192 + 24,580 = 553,988 bytes
    assert memory.activations == ACTIVATION_BYTES  # the whole batch on one device
    assert memory.total == 537_604
