"""Numbers as a report prints them: bytes, seconds, counts and FLOPs with their units."""

from __future__ import annotations


def format_bytes(value: float) -> str:
    """``1.5 * 2**30`` -> ``"1.50 GiB"``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def format_seconds(value: float) -> str:
    """``0.0123`` -> ``"12.300 ms"``."""
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3f} ms"
    return f"{value * 1e6:.1f} µs"


def format_count(value: int) -> str:
    """``8_030_261_248`` -> ``"8.03B"``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f}{unit}"
    return str(value)


def format_flops(value: float) -> str:
    """``4.5e15`` -> ``"4.50 PFLOP"``."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} FLOP"
