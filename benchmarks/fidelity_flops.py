"""Published throughput figures as step times, with each source's own FLOP count.

A source publishing tokens/s per GPU gives the step directly (``tokens_step``); one publishing
TFLOP/s per GPU counts FLOPs its own way, and the step is that count over TFLOP/s x GPUs:
Megatron-DeepSpeed's (``megatron_deepspeed_flops``), Megatron-Core's (``megatron_core_flops``)
and PaLM's model FLOPs (``palm_model_flops``, Llama 3's MFU).
"""

from __future__ import annotations


def tokens_step(batch: int, seq: int, tokens_per_gpu_s: float, gpus: int) -> float:
    """Step seconds from a published tokens/s per GPU."""
    return batch * seq / (tokens_per_gpu_s * gpus)


def megatron_deepspeed_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool) -> float:
    """FLOPs per step as Megatron-DeepSpeed prints its TFLOP/s (Narayanan et al. SC'21,
    section 5.1's formula, 72 B s l h^2 (1 + s/6h + V/16lh), with 96 in place of 72 when
    activations are recomputed: the "checkpoint_activations_factor" of its throughput log)."""
    factor = 96 if recompute else 72
    return factor * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def megatron_core_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, ffn: int,
                        heads: int, query_groups: int, swiglu: bool = False) -> float:
    """FLOPs per step as Megatron-Core prints its TFLOP/s per GPU
    (``num_floating_point_operations`` in megatron/training/training.py, r0.8.0):
    12 B s L h^2 ((1 + g/a + s/h) + f/h x (3/2 if SwiGLU) + V / (2 L h)), g the query groups,
    a the heads, f the FFN width, V the padded vocabulary (forward, backward, no recomputation;
    the attention scores counted in full, not halved for causality)."""
    gated = 1.5 if swiglu else 1.0
    return 12 * batch * seq * layers * hidden**2 * (
        (1 + query_groups / heads + seq / hidden) + ffn / hidden * gated + vocab / (2 * layers * hidden))


def palm_model_flops(params: float, layers: int, hidden: int, seq: int, tokens: float) -> float:
    """Model FLOPs per step for MFU (Chowdhery et al. 2022, PaLM, appendix B):
    6 N + 12 L H Q T per token (H x Q = the model width, T the sequence)."""
    return (6 * params + 12 * layers * hidden * seq) * tokens

