"""The memory verdict of Llama 3 405B's rows (``benchmarks/fidelity_runs.py``: Dubey et al.
2024, tp 8, pp 16 with eight one-layer chunks per rank, micro-batches of one 8,192-token
sequence, no recomputation) worked out by hand on the busiest rank, against what
``cost_model.step_memory`` holds. ``docs/fidelity_log.md`` (session 12, s12mem) has the
account and what Meta's program would need to hold less.

One unit u is a (8192, 16384) bf16 activation cut 8 ways (sequence-parallel norms, tensor-
parallel projections): 8192 x 16384 / 8 x 2 B = 33,554,432 B. A layer of examples/llama.py
(eager ops, as the planner's own programs run them) keeps per micro-batch:
  * each of its two RMSNorms: its input (the residual stream), x * rsqrt and the scaled output
    that the projections read: 3u, twice: 6u;
  * attention: rotated q (u), rotated k and v (8 of 128 heads: u/16 each), the attention
    output that wo reads (u): 2.125u;
  * SwiGLU: w1's output (53,248 / 16,384 = 3.25u), its silu (3.25u), w3's output (3.25u) and
    their product that w2 reads (3.25u): 13u.
21.125u = 708,837,376 B per layer pass.
Weights per rank: a layer has 2 x 16384^2 (wq, wo) + 2 x 16384 x 1024 (wk, wv) + 3 x 16384 x
53248 (w1, w2, w3) = 3,187,671,040 elements cut 8 ways, and 2 x 16,384 norm weights whole:
398,491,648 per layer; rank 1 holds 8 layers: 3,187,933,184 elements, 2 bytes each of bf16
weights and of gradients, 12 / dp of fp32 master weights and Adam moments (ZeRO-1).
"""

from __future__ import annotations

import pytest

from benchmarks.fidelity import simulate
from benchmarks.fidelity_runs import runs

GIB = 2**30
UNIT = 8192 * 16384 // 8 * 2
LAYER_PASS = 21.125 * UNIT
RANK_1_ELEMENTS = 8 * ((2 * 16384**2 + 2 * 16384 * 1024 + 3 * 16384 * 53248) // 8 + 2 * 16384)
H100_USABLE = (81_559 - 300 - 688) * 2**20  # nvidia-smi's total less the cited reserve (planner.gpu_presets)


@pytest.mark.parametrize(("gpus", "dp", "passes"), [
    # Passes in flight on rank 1 (tests/test_pipeline_schedules.py): 141 of 32 x 8 at 8,192
    # GPUs; all 128 of 16 x 8 at 16,384.
    (8192, 64, 141),
    (16384, 128, 128),
])
def test_busiest_rank_holds_what_the_schedule_keeps(gpus: int, dp: int, passes: int) -> None:
    """8,192 GPUs: 141 x 708.84 MB = 99.95 GB (93.08 GiB) of activations, 5.94 GiB of weights,
    5.94 of gradients, 0.56 of states: 105.6 GiB with the point-to-point buffers. 16,384: 128
    passes = 84.50 GiB, states 0.28: 96.7 GiB. Both over an H100's 78.68 GiB: the eager
    program the planner would emit for this layout does not fit."""
    run = next(run for run in runs() if run.name == f"Llama3-405B@{gpus}xH100")
    estimate = simulate(run)[0].estimate
    memory = estimate.memory
    assert memory is not None and estimate.stage_memory[1] == memory  # rank 1 is the busiest
    assert memory.weights == pytest.approx(2 * RANK_1_ELEMENTS, rel=1e-6)
    assert memory.gradients == pytest.approx(2 * RANK_1_ELEMENTS, rel=1e-6)
    assert memory.optimizer_states == pytest.approx(12 * RANK_1_ELEMENTS / dp, rel=1e-3)
    assert memory.activations == pytest.approx(passes * LAYER_PASS, rel=1e-3)
    assert memory.communication_buffers <= 0.1 * GIB  # a send and a receive buffer of 2u
    assert estimate.device_memory_bytes == H100_USABLE
    assert not estimate.fits
