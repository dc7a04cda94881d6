"""Fuzz cases: a random model, a mesh and a random valid strategy per op, compiled.

A case is a number. Case ``n`` plans the random model of seed ``n`` (``random_model.py``) on
one of the meshes of its world size (even cases on 2 ranks, odd cases on 4), and picks, for
every op, one of the candidates the rule registry offers on that mesh
(``search.auto.node_strategies``: the same candidates CP-SAT and MCMC choose from), at random
from a generator seeded by ``n``. Nothing else is random, so a case number is enough to
rebuild, recompile and recheck the same program.

The plan is not simulated: the simulator prices plans, and these plans are not meant to be
fast, only valid. ``compile_case`` compiles it; a ``PlannerError`` there is a refusal (a
strategy the compiler knows it cannot run), reported but not a failure of parity.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.tensor import Replicate

import planner
from planner.api import prepare_model
from planner.errors import PlannerError
from planner.graph import OpGraph
from planner.model_spec import ModelSpec
from planner.plans import Plan
from planner.strategy import Mesh, NodeStrategy
from search.node_candidates import node_strategies
from search.plan_builder import input_placements, unsimulated_plan

from random_model import recipe

RANDOM_MODEL = Path(__file__).resolve().with_name("random_model.py")

MESHES = {
    2: (Mesh((("dp", 2),)), Mesh((("tp", 2),))),
    4: (Mesh((("dp", 4),)), Mesh((("tp", 4),)), Mesh((("dp", 2), ("tp", 2)))),
}


@dataclass(frozen=True)
class Case:
    """One fuzz case: the model seed, the mesh, and the seed of the strategy draw."""

    number: int
    world: int
    mesh: Mesh

    @property
    def seed(self) -> int:
        return self.number

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(f"{RANDOM_MODEL}:build", {"seed": self.seed})

    def __str__(self) -> str:
        return f"case {self.number} (model seed {self.seed}) on {self.mesh}"


def case(number: int) -> Case:
    """Case ``number``: even numbers on 2 ranks, odd on 4; the mesh drawn from the number."""
    if not isinstance(number, int) or number < 0:
        raise ValueError(f"a case number is an int >= 0, got {number!r}")
    world = 2 if number % 2 == 0 else 4
    meshes = MESHES[world]
    return Case(number, world, meshes[random.Random(f"mesh {number}").randrange(len(meshes))])


@dataclass(frozen=True)
class Compiled:
    """A compiled case, or a refused one.

    Attributes:
        case: the case.
        model: the model's recipe, one line.
        folder: the compiled program (``None`` when refused).
        refusal: the compiler's one-line ``PlannerError`` message when it refused.
        sharded: how many ops the drawn strategy splits or leaves partial (not all-replicate).
        ops: how many ops the model has.
    """

    case: Case
    model: str
    folder: Path | None
    refusal: str | None
    sharded: int
    ops: int

    def describe(self) -> str:
        return f"{self.case}: {self.model} ({self.sharded}/{self.ops} ops sharded)"


def random_strategies(graph: OpGraph, mesh: Mesh, rng: random.Random) -> tuple[NodeStrategy, ...]:
    """One candidate of the rule registry per op, drawn at random.

    For half the ops the all-replicate candidate is left out of the draw (when the op has
    others): a uniform draw would leave an op with two candidates whole half the time."""
    options = node_strategies(graph, mesh)
    chosen = []
    for node in graph.nodes:
        candidates = options[node.name]
        if len(candidates) > 1 and rng.random() < 0.5:
            candidates = [c for c in candidates if not _replicated(c)] or candidates
        chosen.append(rng.choice(candidates))
    return tuple(chosen)


def random_plan(case_: Case) -> Plan:
    """The plan of ``case_``: its model traced on meta tensors, a random strategy per op."""
    graph, spec, name, cluster = prepare_model(case_.spec, f"cpu:1x{case_.world}")
    strategies = random_strategies(graph, case_.mesh, random.Random(f"strategies {case_.number}"))
    inputs = input_placements(graph, case_.mesh, strategies)
    # label: not a data-parallel plan, so even a dp-only mesh compiles to a graph program
    # that runs the drawn strategies (a data-parallel plan would run as DDP and ignore them).
    return unsimulated_plan(graph, cluster, spec, name, case_.mesh, strategies, inputs, label="fuzz")


def compile_case(case_: Case, folder: Path) -> Compiled:
    """Plan and compile ``case_`` into ``folder``; a ``PlannerError`` is a refusal."""
    model = recipe(case_.seed).structure
    plan = random_plan(case_)
    sharded = sum(not _replicated(s) for s in plan.strategies)
    try:
        planner.compile(plan, folder)
    except PlannerError as error:
        return Compiled(case_, model, None, " ".join(str(error).split()), sharded, len(plan.strategies))
    return Compiled(case_, model, folder, None, sharded, len(plan.strategies))


def _replicated(strategy: NodeStrategy) -> bool:
    return all(
        isinstance(p, Replicate) for placements in (*strategy.inputs, *strategy.outputs) for p in placements
    )


__all__ = ["MESHES", "Case", "Compiled", "case", "compile_case", "random_plan", "random_strategies"]
