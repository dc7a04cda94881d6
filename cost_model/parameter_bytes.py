"""Bytes per parameter element of weights, gradients and optimizer states, by precision."""

from __future__ import annotations

from cost_model.compute import check_precision

# bytes per parameter by precision: (weights, gradients, optimizer states). Mixed
# precision keeps fp16/bf16 weights and gradients and fp32 master weights plus Adam's two
# moments: 2 + 2 + 12 bytes (ZeRO, Rajbhandari et al. SC'20, section 3.1, K = 12).
PARAM_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}
FP32_GRADIENT_BYTES = 4  # an fp32 gradient element


def bytes_per_parameter(precision: str) -> tuple[int, int, int]:
    """Bytes per parameter element of (weights, gradients, optimizer states) before any
    sharding, for mixed-precision Adam at ``precision``."""
    check_precision(precision)
    return PARAM_BYTES[precision]
