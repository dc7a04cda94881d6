"""The search's budget: deterministic work, with a wall-clock safety cap.

The same model, cluster, seed and effort must give the same plan on a fast machine, a slow
one and a busy one, so every budget counts work, never seconds:

- CP-SAT gets ``ILP_WORK_PER_MESH x effort`` units of its deterministic time per mesh (a
  count of solver operations, scaled so that one unit is close to one second of one core);
  the LP relaxation that gives it its start (``search.ilp_start``) runs to its optimum, a
  deterministic simplex outside that count;
- MCMC gets ``MCMC_NODE_SIMULATIONS x effort / graph nodes`` proposals per mesh (a delta
  simulation costs about one pass over the graph), between ``MCMC_MIN_PROPOSALS`` and
  ``MCMC_MAX_PROPOSALS`` (``mcmc_proposals``);
- the meshes, flavours and layouts tried are a fixed list for the cluster and batch;
- the pipeline grid (``search.pipeline_search``) ranks its configurations by a cost model
  built from one simulation per (tp, micro-batch size), then simulates the best
  ``PIPELINE_SIMULATIONS x effort`` of them in full (``pipeline_candidates``); before
  that, each tensor-parallel degree among them gets one CP-SAT solve of its stage mesh
  (``search.stage_layouts``) with the same work as a mesh (``ilp_work``).

Those budgets bound every solve and walk already, so the search's total work is fixed by the
inputs. The wall clock is only a net against a runaway (``--time-budget``, 600 s by default,
against about 40 s for the README's quick start on two quiet cores): every solve and walk
may run until the whole ``plan()`` call has taken that long, and is stopped only then. The
net is not split between the meshes: a split would stop the first mesh at a fraction of the
cap, which a heavily loaded machine reaches on an ordinary model, and the same inputs would
then plan differently there. When the net does end a solve or a walk before its work budget
is spent, ``cut_short`` records where, and the plan's report says the answer may differ on
another machine; the meshes after it get 0.01 s and keep the layouts they start from.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

# Units of CP-SAT deterministic time per mesh at effort 1 (about 2 s of one core).
ILP_WORK_PER_MESH = 2.0
# MCMC work per mesh at effort 1, in nodes simulated (delta simulations re-run the graph).
MCMC_NODE_SIMULATIONS = 30_000
MCMC_MIN_PROPOSALS, MCMC_MAX_PROPOSALS = 20, 300
# Pipeline configurations simulated in full at effort 1 (one costs about 0.3 s at 96 layers).
PIPELINE_SIMULATIONS = 4
# Safety cap of the whole plan() call (tracing included) when the caller gives none.
DEFAULT_WALL_CLOCK_CAP_S = 600.0


@dataclass
class SearchBudget:
    """How much work one ``plan()`` may do, and the wall-clock cap that guards it.

    Attributes:
        effort: multiplies every work budget (1 = the default; 0.25 quick; 4 thorough).
        wall_clock_cap_s: seconds from ``started`` after which every solve stops (a net
            against a runaway, for the whole call: it makes the result depend on the machine,
            so it is reported when it acts).
        started: ``time.perf_counter()`` when planning began (tracing counts too).
        cut_short: what the cap stopped early, for the report.
    """

    effort: float = 1.0
    wall_clock_cap_s: float | None = DEFAULT_WALL_CLOCK_CAP_S
    started: float = field(default_factory=time.perf_counter)
    cut_short: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (isinstance(self.effort, (int, float)) and math.isfinite(self.effort) and self.effort > 0):
            raise ValueError(f"effort must be a positive number, got {self.effort!r}")

    def ilp_work(self) -> float:
        """CP-SAT deterministic time for one mesh."""
        return ILP_WORK_PER_MESH * self.effort

    def mcmc_proposals(self, graph_nodes: int) -> int:
        """MCMC proposals for one mesh: fewer on a large graph, where every proposal
        re-simulates more."""
        proposals = round(MCMC_NODE_SIMULATIONS * self.effort / max(1, graph_nodes))
        return max(MCMC_MIN_PROPOSALS, min(round(MCMC_MAX_PROPOSALS * self.effort), proposals))

    def pipeline_candidates(self) -> int:
        """How many of the pipeline grid's best-ranked configurations to simulate in full."""
        return max(1, round(PIPELINE_SIMULATIONS * self.effort))

    def seconds_left(self) -> float | None:
        """Wall-clock seconds before the cap, or None without one (never below 0.01)."""
        if self.wall_clock_cap_s is None:
            return None
        return max(0.01, self.wall_clock_cap_s - (time.perf_counter() - self.started))

    def note_cut(self, what: str) -> None:
        """Record that the cap stopped ``what`` before its work budget was spent."""
        self.cut_short.append(what)

    def cut_warning(self) -> str | None:
        """The warning a plan carries when the cap acted, else None."""
        if not self.cut_short:
            return None
        return (
            f"the wall-clock cap of {self.wall_clock_cap_s:g} s stopped the search before its work budget was spent "
            f"({'; '.join(self.cut_short)}): another machine may find a different plan; raise --time-budget, "
            f"or lower --effort for a faster deterministic search"
        )
