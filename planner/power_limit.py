"""A GPU's peak FLOP/s under a board power limit below the one its datasheet assumes.

A GPU's tensor-core peak is its SM count x FLOPs per SM per clock x clock, and the clock it
can hold is set by the board's power limit: dynamic power grows as C·V²·f with the voltage
raised alongside the clock, so the clock grows as a power of the board power,
``clock ∝ power ** exponent``. NVIDIA sells the same GH100 die (132 SMs) at two power limits
and quotes each one's dense peak:

  * H100 SXM5, "Max thermal design power (TDP): up to 700W", BF16 tensor core 1,979 TFLOP/s
    with sparsity = 989.4 dense;
  * H100 NVL, "350-400W (configurable)", BF16 tensor core 1,671 TFLOP/s with sparsity =
    835.5 dense (its upper limit, 400 W, is the one its figures hold at)

(NVIDIA H100 Tensor Core GPU datasheet and product page, https://www.nvidia.com/en-us/
data-center/h100/, specification table, the "H100 SXM" and "H100 NVL" columns). The two points
give the exponent, ln(989.4 / 835.5) / ln(700 / 400) = 0.302, close to the 1/3 of the
textbook P ∝ f³ (V ∝ f), so the law and the two points agree; a limit between them takes the
peak the law puts there. It is an ESTIMATE between two vendor figures, not a measurement at
the limit: it lands inside the interval the figures bound, which is what sources that know
only the limit can say (torchtitan's Grand Teton H100s at 500 W: "the actual peak TFLOPs
number is between SXM and NVL, and we don't know its exact value", torchtitan
benchmarks/llama3_h100_202412_torchtitan.md, footnote 2).

Vocabulary layer: imports nothing from the planner.
"""

from __future__ import annotations

import math

# (board power limit W, dense BF16 peak FLOP/s) of the GH100 die's two datasheet products
# (NVIDIA H100 datasheet: H100 SXM 700 W, 1,979 sparse; H100 NVL 400 W, 1,671 sparse).
H100_POWER_POINTS = ((400.0, 835.5e12), (700.0, 989.4e12))
# Device names the H100 points apply to (the die, whatever its memory: the Grand Teton
# hosts' H100s carry 96 GB of HBM2e, torchtitan's benchmark notes).
H100_NAMES = ("H100",)


def clock_exponent(points: tuple[tuple[float, float], tuple[float, float]] = H100_POWER_POINTS) -> float:
    """The exponent of ``peak ∝ power ** exponent`` through two (watts, peak) points."""
    (low_watts, low_peak), (high_watts, high_peak) = points
    return math.log(high_peak / low_peak) / math.log(high_watts / low_watts)


def peak_scale_at_power_limit(watts: float,
                              points: tuple[tuple[float, float], tuple[float, float]] = H100_POWER_POINTS) -> float:
    """The factor on the datasheet peak (the higher point's) of a board limited to ``watts``:
    ``(watts / high_watts) ** exponent``, 1.0 at or above the higher point's limit (a higher
    limit than the datasheet's buys no clock the datasheet does not quote)."""
    if not watts > 0:
        raise ValueError(f"a power limit must be positive watts, got {watts!r}")
    high_watts = points[1][0]
    return min(1.0, (watts / high_watts) ** clock_exponent(points))
