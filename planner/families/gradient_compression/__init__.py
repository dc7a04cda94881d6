"""Gradient compression for data parallelism over slow networks: PowerSGD, top-k, 16 bits.

Three families share this folder: ``powersgd`` (PyTorch's ``powerSGD_hook``), ``top-k``
(our own DDP hook, ``runtime.top_k_hook``) and ``half-reduce`` (an fp32 plan's buckets
all-reduced in fp16 or bf16 by PyTorch's hooks), each a ddp plan with a section of its own key.

- ``section.py``: ``PowerSgdSection``, ``TopKSection``, ``HalfReduceSection`` (vocabulary).
- ``candidates.py``: the ddp plans again with each setting, kept only where they win by
  more than the simulator's error (search layer).
- ``costs.py``: the hook's encode, collectives, decode and buffers in the simulated step
  (cost-model layer).
- ``emit.py``, ``runtime.py``: the DDP program with the hook registered (codegen layer).
- ``report.py``: the report's lines (vocabulary).
- ``convergence.py``: what the convergence benchmark measured of each setting, and the
  report's convergence-risk line for one outside its tolerance (vocabulary).

Lossy: a compressed program's ``--check`` refuses (no parity); convergence is measured by
``benchmarks/compression_convergence.py``.
"""

from __future__ import annotations

from planner.families import Family
from planner.families.gradient_compression.section import (
    HALF_REDUCE,
    POWERSGD,
    TOP_K,
    HalfReduceSection,
    PowerSgdSection,
    TopKSection,
)


def _family(name: str, summary: str, section: type) -> Family:
    return Family(
        name, summary, lambda plan: name in plan.sections, data_parallel=True, refines=("ddp",), section=section,
        candidates="planner.families.gradient_compression.candidates:compressed_candidates", search_order=60,
        costs="planner.families.gradient_compression.costs:CompressedDataParallelStep",
        emitter="planner.families.gradient_compression.emit:compile_compressed_plan",
        claims=lambda plan: name in plan.sections, emit_order=16,
        report="planner.families.gradient_compression.report:compression_section",
    )


FAMILIES = (
    _family(POWERSGD, "DDP with PowerSGD low-rank gradients (lossy; slow networks)", PowerSgdSection),
    _family(TOP_K, "DDP with top-k gradients and error feedback (lossy; slow nets)", TopKSection),
    _family(HALF_REDUCE, "DDP of an fp32 plan, gradients reduced in fp16/bf16",
            HalfReduceSection),
)
