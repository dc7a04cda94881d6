"""Uneven data parallelism: each ``dp`` rank takes a share of the global batch in proportion
to its device's speed, within its memory, so fast devices stop waiting for slow ones on a
heterogeneous cluster (an A100 node beside an H100 node; a fast and a slow CPU host).

Weights, gradients and optimizer states are held as the plan's data-parallel flavour holds
them (ddp, zero1, zero2, fsdp), except that a ZeRO-1 plan may split its optimizer states by
each device's memory instead of evenly (``state_shares``, Cephalo: a fast device with little
memory holds fewer states while it takes more samples); otherwise only the batch slices
differ, and each rank's loss is weighted by its share, so the step equals one device's step
on the whole batch. Where no
shares fit at once, every rank runs its share in the same number of micro-batches, smaller
ones on a rank of fewer samples, each weighted by its rows. Everything it is lives in this
folder:

- ``section.py``: ``UnevenSection(shares)``, the plan's ``"uneven"`` key (vocabulary).
- ``shares.py``: the exact integer shares that minimise the slowest rank's time (vocabulary).
- ``state_shares.py``: optimizer states split by memory apart from the batch (Cephalo): the
  parts, the exact max-min split by room, the busiest rank's elements in an exchange
  (vocabulary).
- ``costs.py``: every op priced on the slowest rank's device at its share, and a plan with
  ``state_shares`` priced as its program runs (cost-model layer).
- ``candidates.py``: the even data-parallel plans again with balanced shares, and the plans
  on the fastest devices alone (leaving the others out, as Sailor may) (search layer).
- ``emit.py``, ``runtime.py``: the flavour's program with uneven ``shard_batch`` slices and
  share-weighted losses (codegen layer, and what the compiled program imports);
  ``state_runtime.py``: the reduce-scatter-v, the optimizer over this rank's part and the
  all-gather-v of a plan with ``state_shares`` (what its compiled program imports).
- ``report.py``: per device, its type, share, predicted busy time and memory (vocabulary).
"""

from __future__ import annotations

from planner.families import Family
from planner.families.uneven_dp.section import UnevenSection

FAMILIES = (
    Family(
        "uneven", "data parallel, batch shares by device speed (mixed GPUs)",
        lambda plan: "uneven" in plan.sections, data_parallel=True, refines=("ddp", "zero1", "zero2", "fsdp"),
        section=UnevenSection,
        candidates="planner.families.uneven_dp.candidates:uneven_candidates", search_order=26,
        costs="planner.families.uneven_dp.costs:UnevenShareStep",
        emitter="planner.families.uneven_dp.emit:compile_uneven_plan", claims=lambda plan: "uneven" in plan.sections,
        emit_order=14, report="planner.families.uneven_dp.report:uneven_section",
    ),
)
