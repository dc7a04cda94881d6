"""Which kind of program a plan compiles to, read from the plan alone.

Vocabulary layer: the compiler dispatches on it, the cost model prices DTensor dispatch by it
and the family declarations (``planner.families``) say which plans their emitters claim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.strategy import placements_str

if TYPE_CHECKING:
    from planner.plans import Plan


def is_data_parallel(plan: "Plan") -> bool:
    """Whether ``plan``'s program is plain data parallel (``codegen`` emits the model module
    under DDP/ZeRO/FSDP) rather than a replay of the traced graph on DTensors: a plan named by
    its flavour (label empty) on a ``dp``-only mesh, no pipeline, every parameter replicated. A
    searched plan on a ``dp`` mesh may replicate some inputs or activations, which DDP's batch
    split would not honour; it goes through the graph path. An MoE plan of that shape
    (labelled, with expert layouts) is data parallel around its MoE layers. The cost model
    reads it too: only graph programs pay DTensor's per-op dispatch."""
    labelled = getattr(plan, "label", "") and not plan.expert_layouts
    if plan.mesh.names != ("dp",) or plan.pipeline is not None or labelled:
        return False
    return all(
        placements_str(placements) == "(R)" for strategy in plan.strategies for placements in strategy.params.values()
    )


FSDP2_FLAVOURS = ("zero2", "fsdp")  # flavours whose weights FSDP2 units shard


def wraps_bf16_fsdp_units(plan: "Plan") -> bool:
    """Whether ``plan``'s program shards its weights in FSDP2 units under the bf16 mixed
    precision policy (``codegen.runtime.precision.BF16_FSDP_POLICY``: bf16 gathers and
    unsharded weights, fp32 reductions): a bf16 plan of flavour zero2 or fsdp whose program is
    plain data parallel (``codegen.data_parallel_emit``, HSDP's), or a simulated plan of
    another system's FSDP that names its units (``Plan.fsdp_units`` on a graph program, as
    ``benchmarks/fidelity.py`` builds them). Not a plan with MoE layers: its rank-local
    experts stay outside the units in fp32, and its units stay fp32 too. The compiler and the
    cost model (``cost_model.mixed_precision``) both decide by this."""
    if plan.precision != "bf16" or plan.dp_flavour not in FSDP2_FLAVOURS or getattr(plan, "expert_layouts", ()):
        return False
    return bool(plan.fsdp_units) or is_data_parallel(plan)


def shards_expert_copies_in_bf16(precision: str) -> bool:
    """Whether a plan of ``precision`` shards its experts over their copies
    (``ExpertLayout.sharded_copies``, ``codegen.runtime.expert_copies``) under the bf16 mixed
    precision policy (``codegen.runtime.precision.BF16_FSDP_POLICY``): bf16 all-gathers and
    gathered weights, fp32 gradient reduce-scatters into fp32 shards, as torchtitan shards its
    routed experts. True for bf16 plans. The compiler (``codegen.moe_emit``) and the cost model
    (``cost_model.moe_layers.copy_shard_costs``) both decide by this."""
    return precision == "bf16"
