"""The registry of step contributors: which families add to a simulated step, in order.

A family adds its part to the simulated step (tasks, op costs, memory terms) through a
``cost_model.step_contributor.StepContributor`` and registers by appending it to
``_CONTRIBUTORS`` below; the order is the order the simulator calls them in (which fixes the
order of their tasks on a stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Callable

from cost_model.autocast_activations import add_autocast_activation_bytes
from cost_model.data_parallel_step import DataParallelStep
from cost_model.loss_parallel import add_vocabulary_parallel_loss
from cost_model.mixed_precision import add_autocast_weight_casts, reduced_gradient_bytes
from cost_model.replica_gradients import add_replica_gradient_sync
from cost_model.split_gather import add_split_gather
from cost_model.step_contributor import StepContributor
from cost_model.summa_node import add_summa_costs
from planner.families import resolve, with_part

__all__ = ["NodeCostTerm", "step_contributors"]


@dataclass(frozen=True)
class NodeCostTerm(StepContributor):
    """A contributor that only adds to op costs: ``add(context, node, strategy, cost)``."""

    add: Callable

    def node_cost(self, context, node, strategy, cost) -> None:
        self.add(context, node, strategy, cost)


def _replica_gradient_sync(context, node, strategy, cost) -> None:
    add_replica_gradient_sync(context, node, strategy, cost, reduced_gradient_bytes(context.plan))


# Meshes with SUMMA axes: SUMMA matmuls and block norms by their algorithms
# (cost_model.summa_node); vocabulary-parallel cross entropies (cost_model.loss_parallel);
# splits of a dim held split (cost_model.split_gather); any mesh: the gradient sync of weights
# replicated on a non-dp axis whose ranks saw other rows (cost_model.replica_gradients);
# autocast's casts of a bf16 program's fp32 weights (cost_model.mixed_precision) and the fp32
# activations it leaves (cost_model.autocast_activations); the
# data-parallel flavours' gathers, gradient reductions and sharding (cost_model.data_parallel_step).
_CONTRIBUTORS: tuple[StepContributor, ...] = (
    NodeCostTerm(add_summa_costs),
    NodeCostTerm(add_vocabulary_parallel_loss),
    NodeCostTerm(add_split_gather),
    NodeCostTerm(_replica_gradient_sync),
    NodeCostTerm(add_autocast_weight_casts),
    NodeCostTerm(add_autocast_activation_bytes),
    DataParallelStep(),
)


def step_contributors(plan) -> tuple[StepContributor, ...]:
    """The contributors that add to ``plan``'s simulated step, in the order they are called:
    the ones above, then the ``costs`` part of every family ``plan`` uses
    (``planner.families``), which replaces the contributors it names in its ``takes_over``
    (HSDP's runs the data-parallel one over its shard groups). Each decides from the context
    whether it has anything to add."""
    families = tuple(_family_contributor(family.costs) for family in with_part("costs") if family.uses(plan))
    if not families:
        return _CONTRIBUTORS
    replaced = tuple(kind for contributor in families for kind in contributor.takes_over)
    return (*(c for c in _CONTRIBUTORS if not isinstance(c, replaced)), *families)


@cache
def _family_contributor(reference: str) -> StepContributor:
    """One contributor per family's ``costs`` part (a ``StepContributor`` class)."""
    return resolve(reference)()
