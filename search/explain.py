"""Why an op runs the way the plan says: its placement's cost beside every other the search had.

``planner explain PLAN --op NAME`` (or ``--module PATH``, ``--layer N``) re-traces the plan's
model and, for each chosen op, costs every candidate strategy the rule registry offers on the
plan's mesh (``search.node_candidates``) with the same functions the search's objective reads
(``search.cost_tables``):

    compute        forward + backward of the op's share of work (all micro-batches)
    communication  the op's own collectives (partial sums reduced, data-parallel gradient
                   sync of its weights, sequence-parallel gathers)
    resharding     turning the chosen producers' outputs into what this candidate reads,
                   and this candidate's output into what the chosen consumers read
    memory         its weights, gradients and optimizer states after sharding, plus the
                   activations it saves for backward, per device

Each candidate is priced with its neighbours held where the plan put them, so the table
answers "what would change if only this op ran differently". Each alternative gets a
verdict: ``slower`` (by how much, and which part), ``does not fit`` (the plan's fullest
device would overflow), ``not allowed`` (a rule of the search keeps it out: weights split
per op on ``dp``, which the data-parallel flavours do for the whole model), ``tie``, or
``cheaper here``: the whole-step search can prefer a
locally dearer choice (repeated blocks share one choice, the simulator decides overlap and
memory), and the explanation says so rather than hiding it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cost_model.simulator import Simulator
from planner.errors import ArgumentError
from planner.graph import OpGraph
from planner.strategy import NodeStrategy
from planner.units import format_bytes, format_seconds
from search.cost_tables import CostTables, candidate_cost
from search.node_candidates import node_strategies

__all__ = ["OptionCost", "OpExplanation", "explain_ops", "select_ops"]

# Why the search never splits an op's weights on dp itself (search.node_candidates).
DP_WEIGHTS_RULE = ("weights split on dp are the data-parallel flavour's choice (ZeRO/FSDP shard them for the "
                   "whole model, --dp), not a per-op placement")
# Relative difference under which two candidates are called a tie (the costs are sums of
# floating-point terms; a millionth of a step is below anything the simulator resolves).
TIE = 1e-6


@dataclass(frozen=True)
class OptionCost:
    """One candidate strategy of an op and its cost parts (seconds per step, bytes per device)."""

    strategy: NodeStrategy
    compute_s: float
    communication_s: float
    resharding_s: float
    memory_bytes: float
    chosen: bool
    not_allowed: str = ""  # the rule that keeps the search from choosing it, if one does

    @property
    def total_s(self) -> float:
        return self.compute_s + self.communication_s + self.resharding_s

    def placement(self) -> str:
        """``inputs -> outputs`` with the weights' placements, as the report writes them."""
        from planner.strategy import placements_str

        weights = ", ".join(f"{name.rsplit('.', 1)[-1]} {placements_str(p)}" for name, p in self.strategy.params.items())
        return self.strategy.describe() + (f"; {weights}" if weights else "")


@dataclass(frozen=True)
class OpExplanation:
    """An op of the plan, its chosen placement's cost and every alternative's, cheapest first
    (the chosen one wherever it falls)."""

    node: str
    op: str
    module: str
    options: tuple[OptionCost, ...]
    spare_bytes: float  # the plan's free memory on its fullest device

    @property
    def chosen(self) -> OptionCost:
        return next(option for option in self.options if option.chosen)

    def verdict(self, option: OptionCost) -> str:
        """Why ``option`` is not the plan's choice (or ``chosen``)."""
        if option.chosen:
            return "chosen"
        if option.not_allowed:
            return f"not allowed: {option.not_allowed}"
        chosen = self.chosen
        extra_memory = option.memory_bytes - chosen.memory_bytes
        if extra_memory > self.spare_bytes:
            return f"does not fit: needs {format_bytes(extra_memory - self.spare_bytes)} more than the fullest device has"
        difference = option.total_s - chosen.total_s
        if abs(difference) <= TIE * max(chosen.total_s, option.total_s, 1e-12):
            return "tie: costs the same here"
        if difference < 0:
            return f"cheaper here by {format_seconds(-difference)}; the whole step decided (see below)"
        parts = {"compute": option.compute_s - chosen.compute_s,
                 "communication": option.communication_s - chosen.communication_s,
                 "resharding": option.resharding_s - chosen.resharding_s}
        worst = max(parts, key=parts.get)
        share = f" (+{difference / chosen.total_s:.0%})" if chosen.total_s > 0 else ""
        return f"slower by {format_seconds(difference)}{share}, mostly {worst}"


def select_ops(plan, *, op: str | None = None, module: str | None = None, layer: int | None = None) -> list[NodeStrategy]:
    """The plan's ops that ``--op`` (a node name), ``--module`` (a module path and what is
    under it) or ``--layer`` (the N-th of each repeated block: a path with ``.N.``) name.

    Raises:
        ArgumentError: nothing matches (naming where to find valid names).
    """
    strategies = plan.strategies
    if op is not None:
        chosen = [s for s in strategies if s.node == op]
        what = f"no op named {op!r} in the plan"
    elif module is not None:
        chosen = [s for s in strategies if s.module == module or s.module.startswith(module + ".")]
        what = f"no op under module {module!r} in the plan"
    elif layer is not None:
        pattern = re.compile(rf"(^|\.){int(layer)}(\.|$)")
        chosen = [s for s in strategies if pattern.search(s.module)]
        what = f"no module path with a layer index {layer} in the plan"
    else:
        raise ArgumentError("explain needs one of --op NAME, --module PATH or --layer N")
    if not chosen:
        modules = sorted({s.module for s in strategies if s.module})[:5]
        raise ArgumentError(f"{what}; the strategy table of `planner report` lists its modules (e.g. {', '.join(modules)})")
    return chosen


def explain_ops(plan, graph: OpGraph, chosen: list[NodeStrategy]) -> list[OpExplanation]:
    """Every candidate of each op in ``chosen`` costed beside the plan's choice (module docstring)."""
    simulator = Simulator(plan, graph)
    tables = CostTables(graph=graph, candidates={}, simulator=simulator)
    choice = {s.node: s for s in plan.strategies}
    consumers: dict[str, list[tuple[str, int]]] = {}
    for node in graph.nodes:
        for position, source in enumerate(node.inputs):
            consumers.setdefault(source, []).append((node.name, position))
    spare = plan.estimate.device_memory_bytes - plan.estimate.memory.total
    names = {s.node for s in chosen}
    options_of = node_strategies(graph, plan.mesh, only=names)
    # The layouts the dp rule keeps out (weights split per op on dp), shown as not allowed.
    lifted = node_strategies(graph, plan.mesh, only=names, weights_split_on_dp=True) if "dp" in plan.mesh.names else {}
    explanations = []
    for strategy in chosen:
        node = graph.node(strategy.node)
        offered = list(options_of.get(node.name, []))
        if not any(_same_layout(option, strategy) for option in offered):
            offered.insert(0, strategy)  # built by a layout the registry does not offer (Megatron's, SUMMA's)
        excluded = [option for option in lifted.get(node.name, [])
                    if not any(_same_layout(option, allowed) for allowed in offered)]
        options = []
        for option in offered + excluded:
            cost = candidate_cost(simulator, node, option)
            resharding = 0.0
            for position, source in enumerate(node.inputs):
                producer = choice.get(source)
                if producer is not None and producer.outputs:
                    resharding += tables.edge_cost(source, node.name, position, producer.outputs[0], option.inputs[position])
            if option.outputs:
                for consumer, position in consumers.get(node.name, []):
                    reader = choice.get(consumer)
                    if reader is not None and position < len(reader.inputs):
                        resharding += tables.edge_cost(node.name, consumer, position, option.outputs[0], reader.inputs[position])
            options.append(OptionCost(option, cost.compute_s, cost.communication_s, resharding, cost.memory_bytes,
                                      chosen=_same_layout(option, strategy),
                                      not_allowed=DP_WEIGHTS_RULE if option in excluded else ""))
        # One chosen row: the first equal layout (the registry may offer a layout twice).
        seen_chosen = False
        unique = []
        for option in options:
            if option.chosen and seen_chosen:
                continue
            seen_chosen = seen_chosen or option.chosen
            unique.append(option)
        unique.sort(key=lambda option: (option.total_s, not option.chosen))
        explanations.append(OpExplanation(node.name, strategy.op, strategy.module, tuple(unique), spare))
    return explanations


def _same_layout(a: NodeStrategy, b: NodeStrategy) -> bool:
    return a.inputs == b.inputs and a.outputs == b.outputs and a.params == b.params and a.layout == b.layout
