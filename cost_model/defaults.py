"""Documented default efficiencies, used until a calibration profile says otherwise.

Peak numbers are never reached in training. These fractions turn a device's datasheet peak
into what a typical kernel achieves; a profile of the real machine (a later feature,
``python -m planner profile``) replaces them.
"""

# Fraction of dense peak FLOP/s reached by large matmuls in training. Megatron-LM reports
# 52% MFU for GPT-3 175B on A100 (Narayanan et al., SC'21, table 1: 138 of 312 TFLOP/s
# per GPU incl. communication); 0.55 for the matmul kernels alone is slightly above that.
MATMUL_EFFICIENCY = 0.55

# Fraction of peak memory bandwidth reached by elementwise and normalisation kernels
# (streaming kernels reach 80-90% of HBM bandwidth on A100/H100 in the STREAM-like
# benchmarks of NVIDIA's best-practices guide; 0.8 is a round, slightly pessimistic value).
# On GPUs of a known generation the kinds of eager kernel with a public measurement have their
# own (``cost_model.memory_kernels``: contiguous pointwise 0.913, broadcasting pointwise 0.539,
# fused norms 0.525); this value stands for the rest (reductions, casts, softmax: Hugging Face's
# cross entropy on A100 streams at 0.81 of the bandwidth, ``benchmarks/components.py``), for
# CPUs and unknown devices, and for the fused and per-parameter optimizer steps.
MEMORY_EFFICIENCY = 0.8

# Fixed cost of one kernel launch plus framework dispatch, seconds (typical PyTorch eager
# overhead per op on GPU is 5-10 µs; we take the low end since CUDA graphs/fusion hide some).
KERNEL_OVERHEAD_S = 5e-6

# Backward costs about twice the forward (one matmul for the input gradient, one for the
# weight gradient: Kaplan et al. 2020, "Scaling laws", section 2.1).
BACKWARD_TO_FORWARD = 2.0

# AdamW keeps two fp32 states per parameter (exp_avg, exp_avg_sq), and one step reads
# param, grad and both states and writes param and both states: 7 accesses per element.
ADAM_STATES_PER_PARAM = 2
ADAM_BYTES_ACCESSED_PER_PARAM_BYTE = 7

# DDP all-reduces gradients in buckets of this size (torch DDP's default bucket_cap_mb=25),
# the first (last layers' gradients) smaller so communication starts early
# (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB); the last bucket cannot overlap.
DDP_BUCKET_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
