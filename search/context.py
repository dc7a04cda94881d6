"""What every family's search candidates are given: one ``SearchContext`` per search.

``search.auto.search_plan`` builds it once and asks each family's ``candidates`` part
(``planner.families``) for its plans, in the families' search order; the plans found so far
are in ``found``, so a family may build on them (accumulation variants, a pipeline grid
searched only when the plans before it fall short) and ``notes`` collects the search
summary's sentences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from planner.cluster import Cluster
from planner.constraints import SearchConstraints
from planner.graph import OpGraph
from planner.model_spec import ModelSpec
from planner.routing import RoutingStats
from planner.strategy import Mesh
from search.budget import SearchBudget

if TYPE_CHECKING:
    from planner.plans import Plan
    from search.batch_coupling import CoupledOp


@dataclass
class SearchContext:
    """One search's inputs, shared by every family's candidates.

    Attributes:
        graph, cluster, spec, model_name, precision, warnings: the model traced, where it
            runs, how it is rebuilt, its name, the precision and the notes every plan carries.
        search: ``"ilp"``, ``"mcmc"`` or ``"auto"``; seed: MCMC's.
        budget: the work each searched mesh may take (``search.budget``).
        constraints: the user's (``planner.constraints``); families check the ones they
            can act on early, and the search drops every plan they do not allow.
        routing: MoE routing statistics (None: uniform).
        moe_dispatch: ``"compiled"``, or ``"deduplicated"`` when expert-parallel layers may
            use DeepEP's all-to-all too, or ``"overlapped"`` when also their all-to-alls may
            run under another micro-batch's compute (``planner.api.plan``).
        tp_layouts: ``"auto"``, ``"1d"`` or ``"summa"`` (SUMMA meshes alone: the other
            families stay out).
        meshes: the meshes searched op by op: the allowed ``dp x tp`` meshes, then SUMMA's.
        coupled: the ops at which the samples of the batch mix (an MoE router's counts):
            only programs over the whole batch may run such a model.
        moe_layouts: the MoE layers may be planned by layout (``search.moe_search``).
        found: the plans of the families asked so far.
        notes: sentences for the plan's search summary.
        on_progress: called with (what is being searched, fraction done), or None.
    """

    graph: OpGraph
    cluster: Cluster
    spec: ModelSpec | None
    model_name: str
    search: str
    budget: SearchBudget
    seed: int
    warnings: tuple[str, ...]
    precision: str
    constraints: SearchConstraints
    routing: RoutingStats | None
    tp_layouts: str
    meshes: list[Mesh]
    coupled: tuple["CoupledOp", ...] = ()
    moe_layouts: bool = False
    found: list["Plan"] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    on_progress: Callable[[str, float], None] | None = None
    moe_dispatch: str = "compiled"

    @property
    def summa_only(self) -> bool:
        """``--tp-layouts summa``: only SUMMA meshes are searched, no other family competes."""
        return self.tp_layouts == "summa"

    @property
    def whole_batch_only(self) -> bool:
        """The batch's samples mix: no data-parallel wrappers, micro-batches or pipelines."""
        return bool(self.coupled)

    def progress(self, what: str, fraction: float) -> None:
        if self.on_progress:
            self.on_progress(what, fraction)
