"""How much slower a causal fused-attention kernel runs than the same kernel without the mask.

FLOPs are counted as the kernels' benchmarks count them (4·B·H·S²·D, halved when causal), so
a causal call's throughput over the non-causal one's at the same shape is the published
causal / non-causal ratio. It is below 1 by more than the diagonal blocks the kernel computes
whole ((n+1)/2n of the tiles): the diagonal tiles also pay the masking, and the thread blocks of
the first query rows finish early and leave SMs idle (load imbalance), which is why the gap
shrinks with the sequence length. The ratios here are read from each kernel's own published
bars, per GPU generation, direction, head dim and sequence length (``causal_rate_factor``);
where no reading exists the caller keeps the diagonal-block count.

Readings: (causal TFLOP/s, non-causal TFLOP/s) at each sequence length, 16k tokens per call,
bf16/fp16, the figure's bar labels as printed.
"""

from __future__ import annotations

import math

__all__ = ["CAUSAL_SPEED_READINGS", "causal_rate_factor"]

# FlashAttention-2 on A100 80GB SXM4, forward + backward: FlashAttention-2 paper (Dao 2023,
# arXiv:2307.08691), figure 4 (the image is Dao-AILab/flash-attention
# assets/flash2_a100_fwd_bwd_benchmark.png, 4f285b35), panels (a)/(c) head dim 64 and (b)/(d)
# head dim 128. Left out: head dim 64 at 1k and head dim 128 at 512 and 1k, whose non-causal
# labels the legend covers. The paper's forward-only and backward-only figures (5, 6) were not
# at hand, so the forward + backward ratio stands for both directions (ASSUMED).
_A100_FLASH2 = {
    64: ((512, 88, 132), (2048, 140, 162), (4096, 156, 171), (8192, 165, 175), (16384, 171, 176)),
    128: ((2048, 155, 187), (4096, 173, 196), (8192, 182, 201), (16384, 189, 203)),
}
# FlashAttention-2 on H100 80GB SXM5, forward: FlashAttention-3 paper (Shah et al. 2024,
# arXiv:2407.08608), figure 5, FlashAttention-2's bars, panels (a)/(b) head dim 64, (c)/(d) 128,
# (e)/(f) 256 (the image is Dao-AILab/flash-attention assets/flash3_fp16_fwd.png, 7ef24848).
# The paper's backward figure (6) has no causal panel: the forward ratio stands for the
# backward (ASSUMED).
_H100_FLASH2 = {
    64: ((512, 180, 282), (1024, 229, 306), (2048, 262, 318), (4096, 284, 321), (8192, 295, 322),
         (16384, 299, 324)),
    128: ((512, 191, 309), (1024, 260, 350), (2048, 298, 362), (4096, 319, 368), (8192, 333, 370),
          (16384, 335, 370)),
    256: ((512, 208, 275), (1024, 251, 313), (2048, 278, 321), (4096, 293, 323), (8192, 297, 324),
          (16384, 298, 326)),
}
# cuDNN's fused attention on H100 80GB SXM5, forward: the same figure 5, cuDNN's bars. Left out:
# head dim 64 at 2k, where cuDNN's and Triton's non-causal labels overlap.
_HOPPER_CUDNN_FORWARD = {
    64: ((512, 225, 335), (1024, 288, 373), (4096, 363, 408), (8192, 379, 412), (16384, 388, 413)),
    128: ((512, 315, 497), (1024, 410, 574), (2048, 484, 617), (4096, 518, 609), (8192, 529, 600),
          (16384, 539, 595)),
    256: ((512, 308, 470), (1024, 391, 546), (2048, 450, 580), (4096, 483, 581), (8192, 497, 580),
          (16384, 509, 581)),
}
# cuDNN's fused attention backward on the GH100 die: NVIDIA/cudnn-frontend 505fcfe,
# benchmark/benchmark_results.csv (H200 locked at 1980 MHz, 700 W, cuDNN 9.1), head dim 128,
# 4 x 16 heads x 4096 and 1 x 16 x 16384: 443.6 / 517.3 and 497.7 / 538.5 TFLOP/s. Other head
# dims take head dim 128's ratio (no reading).
_HOPPER_CUDNN_BACKWARD = {128: ((4096, 443.6, 517.3), (16384, 497.7, 538.5))}

# (kernel, GPU generation, "forward" or "backward") -> {head dim: readings}. The H200 is the
# GH100 die of the H100 and takes its readings. The Triton FlashAttention kernel and cuDNN on
# Ampere (priced as FlashAttention-2 there) take FlashAttention-2's (``causal_rate_factor``).
CAUSAL_SPEED_READINGS = {
    ("flash-attention-2", "A100", "forward"): _A100_FLASH2,
    ("flash-attention-2", "A100", "backward"): _A100_FLASH2,
    **{("flash-attention-2", die, direction): _H100_FLASH2
       for die in ("H100", "H200") for direction in ("forward", "backward")},
    **{("cudnn-fused-attention", die, "forward"): _HOPPER_CUDNN_FORWARD for die in ("H100", "H200")},
    **{("cudnn-fused-attention", die, "backward"): _HOPPER_CUDNN_BACKWARD for die in ("H100", "H200")},
}


def _ratio_at(readings: tuple[tuple[int, float, float], ...], seq: float) -> float:
    """Causal over non-causal speed at ``seq``: linear in log2(seq) between readings, held at
    the nearest reading outside them."""
    points = [(math.log2(s), causal / full) for s, causal, full in readings]
    x = math.log2(max(seq, 1.0))
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def causal_rate_factor(kernel: str, generation_name: str, seq: float, head_dim: int,
                       direction: str) -> float | None:
    """Causal over non-causal throughput (FLOPs counted halved when causal) of ``kernel`` on a
    GPU generation at sequence length ``seq`` and ``head_dim``, ``direction`` "forward" or
    "backward"; None where no reading exists (the caller keeps the diagonal-block count).

    Between the head dims read the ratio is linear in the head dim; outside them the nearest
    head dim's holds."""
    by_head = CAUSAL_SPEED_READINGS.get((kernel, generation_name, direction))
    if by_head is None:
        by_head = CAUSAL_SPEED_READINGS.get(("flash-attention-2", generation_name, direction))
    if by_head is None:
        return None
    dims = sorted(by_head)
    if head_dim <= dims[0]:
        return _ratio_at(by_head[dims[0]], seq)
    for low, high in zip(dims, dims[1:]):
        if head_dim <= high:
            weight = (head_dim - low) / (high - low)
            return (1 - weight) * _ratio_at(by_head[low], seq) + weight * _ratio_at(by_head[high], seq)
    return _ratio_at(by_head[dims[-1]], seq)
