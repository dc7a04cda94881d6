"""What ``benchmarks/compression_convergence.py`` measured of each compression the search can
pick, and the report's convergence-risk line for a pick that missed the tolerance.

A compressed plan cannot pass parity, so the search's speed figures are not the whole story:
a method whose training ends far above uncompressed training's loss is a risk the report
names. The figures are the benchmark's, run as its docstring says at world 2 for 300 steps
(``torchrun --nproc_per_node 2 benchmarks/compression_convergence.py --steps 300``; CPU, gloo,
same seeds): the final held-out loss over uncompressed training's, on the GPT of
``examples/train_gpt.py`` (AdamW) and the CNN of ``examples/cnn.py`` (SGD with momentum).
Rerun the benchmark after changing a hook, and update ``MEASURED``.

Vocabulary layer: imports the compression sections only.
"""

from __future__ import annotations

from planner.families.gradient_compression.section import HalfReduceSection, PowerSgdSection, TopKSection

# A method with error feedback converges when its final loss is within this fraction of
# uncompressed training's (the benchmark's verdict; its TOLERANCE is this one).
TOLERANCE = 0.10
MEASURED_BY = "torchrun --nproc_per_node 2 benchmarks/compression_convergence.py --steps 300"
# The benchmark's method name -> {model: final loss / uncompressed final loss}, measured
# 2026-11-29 with MEASURED_BY.
MEASURED: dict[str, dict[str, float]] = {
    "fp16": {"gpt": 0.964, "cnn": 0.906},
    "powersgd-1": {"gpt": 5.222, "cnn": 1.864},
    "powersgd-4": {"gpt": 1.441, "cnn": 0.921},
    "top-k": {"gpt": 6.311, "cnn": 2.973},
}
_DESCRIBED = {"fp16": "fp16 reduction", "powersgd-1": "PowerSGD rank 1", "powersgd-4": "PowerSGD rank 4",
              "top-k": "top-k 1%"}


def benchmark_method(section: object) -> str | None:
    """The benchmark's name for ``section``'s setting, or None when it does not run that setting
    (PowerSGD ranks other than 1 and 4, top-k fractions other than 1%, anything without error
    feedback, bf16 reduction, which PyTorch's hook runs on NCCL only)."""
    if isinstance(section, PowerSgdSection) and section.error_feedback and section.warm_start:
        return f"powersgd-{section.rank}" if section.rank in (1, 4) else None
    if isinstance(section, TopKSection) and section.error_feedback:
        return "top-k" if section.fraction == 0.01 else None
    if isinstance(section, HalfReduceSection):
        return "fp16" if section.dtype == "fp16" else None
    return None


def convergence_risk(section: object, describe: str) -> str | None:
    """The report's line on ``section``'s convergence (``describe``: its setting in words):
    None when the benchmark measured it within ``TOLERANCE`` on every model, else the
    measured ratios and what to do, or that it was not measured."""
    method = benchmark_method(section)
    if method is None:
        return (f"Convergence risk: {describe} is not among the settings {MEASURED_BY} measures; run it with a "
                f"setting near this one, or compare the loss curve with uncompressed training before relying on it.")
    ratios = MEASURED[method]
    if all(ratio <= 1 + TOLERANCE for ratio in ratios.values()):
        return None
    measured = ", ".join(f"x{ratio:.2f} ({model.upper()})" for model, ratio in ratios.items())
    return (f"Convergence risk: {_DESCRIBED[method]} ended at {measured} of uncompressed training's final loss in "
            f"{MEASURED_BY}, outside the {TOLERANCE:.0%} tolerance: compare its loss curve with uncompressed "
            f"training on your model before relying on it, or plan with --family ddp,layer-separation.")
