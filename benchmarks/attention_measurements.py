"""The published attention-kernel speeds ``benchmarks/components.py`` checks the model against:
FlashAttention-2 with and without the causal mask, cuDNN's fused attention on Hopper, and its
dropout cost; each list with its source. Data only."""

# (preset, batch x heads, sequence, head dim, causal, published forward TFLOP/s, source, sets)
# FlashAttention-2's benchmark: hidden 2048, 16k tokens per batch, so 16 heads of 128 at 16k.
ATTENTION_MEASUREMENTS = [
    ("dgx-a100-80g", 16, 16384, 128, False, 0.73 * 312,
     "FlashAttention-2 paper fig. 4 (A100, 73% of peak forward, head dim 128, 16k)", True),
    ("dgx-h100", 16, 16384, 128, False, 0.35 * 989.4,
     "FlashAttention-3 paper figs. 5-6 (FlashAttention-2 on H100, ~35% forward, head dim 128, 16k)", True),
]

# (preset, batch x heads, sequence, head dim, causal, "fwd" or "fwd+bwd", published TFLOP/s,
# source, sets): FlashAttention-2 with and without the causal mask, 16k tokens per call (16 heads
# of 128 or 32 of 64), FLOPs 4·B·H·S²·D (halved when causal; fwd+bwd 3.5x the forward's). The
# model's causal factors (``cost_model.causal_attention``) are read from these figures' causal /
# non-causal ratios; the absolute speeds check the rest of the attention model.
FA2_A100_SOURCE = "FlashAttention-2 paper fig. 4 (A100 SXM4): FlashAttention-2 fwd+bwd"
FA2_H100_SOURCE = "FlashAttention-3 paper fig. 5 (H100 SXM5): FlashAttention-2 forward"
FLASH2_CAUSAL_MEASUREMENTS = [
    ("dgx-a100-80g", 8 * 16, 2048, 128, True, "fwd+bwd", 155.0, FA2_A100_SOURCE, True),
    ("dgx-a100-80g", 4 * 16, 4096, 128, True, "fwd+bwd", 173.0, FA2_A100_SOURCE, True),
    ("dgx-a100-80g", 1 * 16, 16384, 128, True, "fwd+bwd", 189.0, FA2_A100_SOURCE, True),
    ("dgx-a100-80g", 4 * 16, 4096, 128, False, "fwd+bwd", 196.0, FA2_A100_SOURCE, True),
    ("dgx-a100-80g", 1 * 16, 16384, 128, False, "fwd+bwd", 203.0, FA2_A100_SOURCE, True),
    ("dgx-a100-80g", 4 * 32, 4096, 64, True, "fwd+bwd", 156.0, FA2_A100_SOURCE, True),
    ("dgx-h100", 8 * 16, 2048, 128, True, "fwd", 298.0, FA2_H100_SOURCE, True),
    ("dgx-h100", 4 * 16, 4096, 128, True, "fwd", 319.0, FA2_H100_SOURCE, True),
    ("dgx-h100", 1 * 16, 16384, 128, True, "fwd", 335.0, FA2_H100_SOURCE, True),
    ("dgx-h100", 4 * 16, 4096, 128, False, "fwd", 368.0, FA2_H100_SOURCE, True),
    ("dgx-h100", 4 * 32, 4096, 64, True, "fwd", 284.0, FA2_H100_SOURCE, True),
]

# (batch x heads, sequence, head dim, causal, published cuDNN speed-up over flash-attention 2,
# forward + backward, sets): Transformer Engine's attention benchmark (docs/examples/attention/
# attention.ipynb, TE v1.8: benchmarks/attention/benchmark_attention.py's test_0, test_1 and
# test_3 on an H100 PCIe, cuDNN 9.0 against flash-attn 2.4.2), against the model's ratio on
# the dgx-h100 preset (an SXM board: the ratio, not the times, is compared). The model's cuDNN
# constant was read from the 2048-token row until session 12; it is now read from cuDNN's own
# speed on the SXM5 board (``CUDNN_SPEED_MEASUREMENTS``), and these rows are checks.
CUDNN_ATTENTION_MEASUREMENTS = [
    (2 * 16, 512, 64, False, 0.0858 / 0.0638, False),
    (2 * 16, 2048, 128, True, 0.7496 / 0.5415, False),
    (2 * 32, 8192, 128, True, 19.0716 / 12.0122, False),
]
CUDNN_ATTENTION_SOURCE = "Transformer Engine v1.8 attention.ipynb (H100 PCIe): cuDNN over flash-attn 2, fwd+bwd"

# (batch x heads, sequence, head dim, causal, published forward TFLOP/s, sets): cuDNN's fused
# attention forward on an H100 80GB SXM5, bf16, head dim 128 without a causal mask, 16k tokens
# per batch (batch x sequence = 16,384, 16 heads of 128), the bar labels of the FlashAttention-3
# paper's forward-speed figure (Shah et al. 2024, arXiv:2407.08608, figure 5): 609 TFLOP/s at
# 4k, 595 at 16k (FlashAttention-2 368 and 370 in the same figure). An independent check of the
# cuDNN kernel's absolute forward speed without the mask; no constant is read from these rows.
CUDNN_FORWARD_MEASUREMENTS = [(4 * 16, 4096, 128, False, 609.0, False), (1 * 16, 16384, 128, False, 595.0, False)]
CUDNN_FORWARD_SOURCE = "FlashAttention-3 paper fig. 5 (H100 SXM5): cuDNN forward, head dim 128, no causal mask"

# (batch x heads, sequence, head dim, causal, published time with dropout 0.1 over without,
# forward + backward, sets): NVIDIA/TransformerEngine#3312 (2026-08), ``DotProductAttention``
# with the fused (cuDNN) backend forced on an H200 (sm90), TE 2.15.0, bf16, ``sbhd``, 4,096
# tokens in 4 sequences (4 x 1,024), 16 heads of 128; causality not stated (TE's default
# ``attn_mask_type`` is "causal"): 0.614 / 0.594 ms. The row ``gpu_kernels``' dropout ratio
# was read from; the model applies it to kernel time, not to the launches.
CUDNN_DROPOUT_MEASUREMENTS = [(4 * 16, 1024, 128, True, 0.614 / 0.594, True)]
CUDNN_DROPOUT_SOURCE = "NVIDIA/TransformerEngine#3312 (H200, TE 2.15, sbhd): cuDNN fwd+bwd, dropout 0.1 over 0.0"

# (preset, batch x heads, sequence, head dim, causal, "fwd" or "bwd", published TFLOP/s, source,
# sets): cuDNN's fused attention speed on the GH100 die, bf16, 16k tokens per call, FLOPs
# counted 4·B·H·S²·D (halved when causal; backward 2.5x). The model's cuDNN-on-Hopper constants
# (``gpu_kernels.CUDNN_OVER_FLASH_ATTENTION_2_HOPPER``) were read at 4 x 16 heads x 4096 x d128,
# causal: forward from the FlashAttention-3 paper's 518, backward from its 499 without the mask
# times cudnn-frontend's causal / non-causal 443.6 / 517.3 (the rows so marked).
# FlashAttention-3 paper (Shah et al. 2024, arXiv:2407.08608), H100 80GB SXM5 at 700 W: figure 5
# (forward; panels b and d with the causal mask; the image is Dao-AILab/flash-attention
# assets/flash3_fp16_fwd.png, 7ef24848) and figure 6 (backward, no causal mask; the bar labels,
# as in the PDF's text layer: head dim 128 305/408/465/499/518/516, head dim 64
# 266/348/395/417/432/433 TFLOP/s at 512 to 16k). The forward rows without the mask are
# ``CUDNN_FORWARD_MEASUREMENTS`` (session 12, s12mcore), not repeated here.
FA3_FORWARD_SOURCE = "FlashAttention-3 paper fig. 5 (H100 SXM5): cuDNN forward, causal mask"
FA3_BACKWARD_SOURCE = "FlashAttention-3 paper fig. 6 (H100 SXM5): cuDNN backward, no causal mask"
# NVIDIA/cudnn-frontend 505fcfe, benchmark/benchmark_results.csv (benchmark/sdpa_benchmark/
# benchmark_flash_attention.py's output; benchmark/README.md: an H200 with its clocks locked at
# 1980 MHz SM / 3201 MHz memory and 700 W, cuDNN 9.1): an independent board and build, above the
# 1830 MHz the datasheet peak is counted at.
CUDNN_FRONTEND_SOURCE = "NVIDIA/cudnn-frontend 505fcfe benchmark/benchmark_results.csv (H200, 1980 MHz, cuDNN 9.1)"
CUDNN_SPEED_MEASUREMENTS = [
    ("dgx-h100", 4 * 16, 4096, 128, True, "fwd", 518.0, FA3_FORWARD_SOURCE, True),
    ("dgx-h100", 1 * 16, 16384, 128, True, "fwd", 539.0, FA3_FORWARD_SOURCE, False),
    ("dgx-h100", 8 * 32, 2048, 64, True, "fwd", 334.0, FA3_FORWARD_SOURCE, False),
    ("dgx-h100", 4 * 32, 4096, 64, True, "fwd", 363.0, FA3_FORWARD_SOURCE, False),
    ("dgx-h100", 4 * 16, 4096, 128, False, "bwd", 499.0, FA3_BACKWARD_SOURCE, True),
    ("dgx-h100", 8 * 16, 2048, 128, False, "bwd", 465.0, FA3_BACKWARD_SOURCE, False),
    ("dgx-h100", 1 * 16, 16384, 128, False, "bwd", 516.0, FA3_BACKWARD_SOURCE, False),
    ("dgx-h100", 4 * 32, 4096, 64, False, "bwd", 417.0, FA3_BACKWARD_SOURCE, False),
    ("dgx-h100", 1 * 32, 16384, 64, False, "bwd", 433.0, FA3_BACKWARD_SOURCE, False),
    ("h200", 4 * 16, 4096, 128, False, "fwd", 654.2, CUDNN_FRONTEND_SOURCE, False),
    ("h200", 1 * 16, 16384, 128, False, "fwd", 641.9, CUDNN_FRONTEND_SOURCE, False),
    ("h200", 4 * 16, 4096, 128, True, "fwd", 542.3, CUDNN_FRONTEND_SOURCE, False),
    ("h200", 1 * 16, 16384, 128, True, "fwd", 586.8, CUDNN_FRONTEND_SOURCE, False),
    ("h200", 4 * 16, 4096, 128, False, "bwd", 517.3, CUDNN_FRONTEND_SOURCE, True),
    ("h200", 1 * 16, 16384, 128, False, "bwd", 538.5, CUDNN_FRONTEND_SOURCE, False),
    ("h200", 4 * 16, 4096, 128, True, "bwd", 443.6, CUDNN_FRONTEND_SOURCE, True),
    ("h200", 1 * 16, 16384, 128, True, "bwd", 497.7, CUDNN_FRONTEND_SOURCE, False),
]
