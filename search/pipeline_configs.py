"""The points of the pipeline grid (``search.pipeline_search``): the options it combines
(``PipelineSpace``), one configuration of them (``Configuration``) and its priced estimate
(``Estimate``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from planner.strategy import KEEP_A2A, ExpertLayout, Mesh

if TYPE_CHECKING:
    from planner.plans import Plan

RECOMPUTE_ORDER = ("none", "selective", "full")  # each keeps less and computes more
# An MoE model's: full recomputation keeping the MoE layers' exchanges (planner.strategy.
# KEEP_A2A) recomputes less than full and keeps more (the dispatch and combine outputs).
MOE_RECOMPUTE_ORDER = ("none", "selective", KEEP_A2A, "full")
# A configuration whose stages each choose their own mode (``Slicing.modes``).
PER_STAGE = "per-stage"


@dataclass(frozen=True)
class PipelineSpace:
    """The options the grid combines (see the module docstring). ``uneven`` lets stage
    slicing give stages different block counts; without it the blocks split as Megatron-LM
    splits them (``search.layouts.nearly_even_layers``). ``per_stage_recompute`` adds, for
    every pipeline, the configuration whose stages each recompute as little as fits them.
    ``searched_layout``: where the per-op placements CP-SAT finds on the stage mesh
    (``search.stage_layouts``) compete with Megatron-LM's: ``"finalists"`` for the
    configurations the walk keeps (each keeps the faster of its two layouts), ``"every"`` in
    the walk itself (every configuration priced with both), ``"off"`` never. ``allows_mesh``:
    a user's constraints (``planner.constraints``); a mesh it refuses is not in the grid."""

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    virtual_stages: tuple[int, ...] = (2, 4)
    flavours: tuple[str, ...] = ("ddp", "zero1", "fsdp")
    recompute: tuple[str, ...] = RECOMPUTE_ORDER
    per_stage_recompute: bool = True
    sequence_parallel: tuple[bool, ...] = (False, True)
    uneven: bool = True
    searched_layout: str = "finalists"
    allows_mesh: Callable[[Mesh], bool] | None = None
    # An MoE model's grid: (mesh, micro-batches) -> the MoE layers' layouts by variant name
    # (``search.stage_experts.stage_expert_variants``); every configuration with a dp axis
    # is priced with each variant. None for a dense model. A mesh with tp > 1 is priced only
    # with the variants it gives (MoE layers beside tensor parallelism run folded, by layout).
    expert_layouts: Callable[[Mesh, int], dict[str, tuple[ExpertLayout, ...]]] | None = None
    # (plan, its MoE layers' layouts, whether their all-to-alls overlap) -> the plan with them,
    # for every plan the grid builds with layouts, its segment probes included: the folded MoE
    # family's (``search.moe_folding.with_stage_layouts``). None: the two fields set as they are.
    lay_out_experts: Callable[["Plan", tuple[ExpertLayout, ...], bool], "Plan"] | None = None
    tensor_parallel: tuple[int, ...] | None = None  # the tp degrees allowed (None: every divisor of a node)
    # Whether an MoE grid also tries DeepSeek-V3's DualPipe on even pipelines
    # (``search.pipeline_step``); a dense one never does: without all-to-alls to hide, it only
    # doubles the weights per device.
    dualpipe: bool = False


def stage_recompute_order(space: PipelineSpace) -> tuple[str, ...]:
    """The modes each stage chooses among when a configuration recomputes per stage, least
    recomputation first: ``MOE_RECOMPUTE_ORDER`` for an MoE model's grid (its blocks have
    exchanges to keep), ``RECOMPUTE_ORDER`` otherwise (where ``full_keep_a2a`` is ``full``)."""
    return MOE_RECOMPUTE_ORDER if space.expert_layouts is not None else RECOMPUTE_ORDER


@dataclass(frozen=True, order=True)
class Configuration:
    """One point of the grid: degrees, micro-batching, schedule, dp flavour, recomputation."""

    tp: int
    pp: int
    dp: int
    micro_batch: int  # samples per micro-batch per dp rank
    micro_batches: int
    schedule: str  # "1f1b" (also used for pp = 1), "interleaved" or "dualpipe"
    virtual_stages: int
    flavour: str
    recompute: str  # a mode of RECOMPUTE_ORDER (MOE_RECOMPUTE_ORDER for MoE), or PER_STAGE
    sequence_parallel: bool = False  # tp > 1 only: the residual stream split on the sequence
    layout: str = "megatron"  # or "soap": placements searched on the stage mesh (search.stage_layouts)
    experts: str = ""  # an MoE model's variant of expert layouts (PipelineSpace.expert_layouts), or none

    @property
    def mesh(self) -> Mesh:
        return grid_mesh(self.pp, self.dp, self.tp)


def schedule_kind(config: Configuration) -> str:
    """What ``PipelineGrid.best`` keeps a finalist of: ``"none"`` without a pipeline, else
    the configuration's schedule."""
    return "none" if config.pp == 1 else config.schedule


def grid_mesh(pp: int, dp: int, tp: int) -> Mesh:
    """The mesh of a grid point: ``pp x dp x tp``, axes of size 1 left out."""
    axes = tuple((name, size) for name, size in (("pp", pp), ("dp", dp), ("tp", tp)) if size > 1)
    return Mesh(axes or (("dp", 1),))


@dataclass(frozen=True)
class Estimate:
    """A configuration priced by the stage-slicing cost model."""

    step_s: float
    config: Configuration
    layers_per_stage: tuple[int, ...] = field(compare=False)
    memory_bytes: float = field(compare=False)
    stage_recompute: tuple[str, ...] = field(default=(), compare=False)  # PER_STAGE: each stage's mode
