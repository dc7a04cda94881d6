"""The settings of a plan that say how a program runs beside its sharding: the optimizer and
its implementation, the loss kernel, gradient clipping, the fused norm and rotary kernels, the train metrics, and the switches
that describe other systems' programs (Megatron-LM's distributed optimizer and
communication overlap, 16-bit weights, the MoE exchange overlap), with the checks that keep
them consistent with the rest of the plan (``check_run_settings``, run by ``Plan``).

Most of them exist to simulate other systems' published runs (``benchmarks/fidelity.py``);
``codegen.plan_checks`` refuses the ones the compiled program cannot honour.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.errors import one_line
from planner.expert_kernels import EXPERT_IMPLEMENTATIONS

if TYPE_CHECKING:
    from planner.plans import Plan

OPTIMIZERS = ("adamw", "sgd")
# How another system's program runs AdamW (``Plan.optimizer_implementation``; priced by
# ``cost_model.compute.optimizer_step_time``); "" is the compiled program's own.
OPTIMIZER_IMPLEMENTATIONS = ("", "fused", "foreach", "per_parameter")
# How another system's program computes its loss (``Plan.loss_implementation``; priced by
# ``cost_model.loss_kernels``); "" is the compiled program's own eager cross entropy.
LOSS_IMPLEMENTATIONS = ("", "fused_xentropy")
# How another system's loop clips its gradients to a global norm (``Plan.gradient_clipping``):
# torch's foreach ``clip_grad_norm_``, FSDP1's per tensor, Megatron's multi-tensor kernels; "" none.
GRADIENT_CLIPPINGS = ("", "foreach", "per_tensor", "multi_tensor")
# Which chains of eager kernels another system's run computes as one fused kernel each
# (``Plan.fused_chains``; priced by ``cost_model.fused_chains``): the norms, or the norms and
# the rotary embeddings (Transformer Engine's in Megatron-Core); "" each traced op as it runs.
FUSED_CHAINS = ("", "norms", "norms_rope")


def check_run_settings(plan: "Plan") -> None:
    """Raise ValueError, in one line naming the field and the fix, where a run setting of
    ``plan`` is not one of its values or contradicts the rest of the plan."""
    if not isinstance(plan.fused_splits_local, bool):
        raise ValueError(f"field 'fused_splits_local' must be true or false, got {one_line(str(plan.fused_splits_local))!r}")
    if not isinstance(plan.tp_comm_overlap, bool):
        raise ValueError(f"field 'tp_comm_overlap' must be true or false, got {one_line(str(plan.tp_comm_overlap))!r}")
    if not isinstance(plan.megatron_distributed_optimizer, bool):
        raise ValueError(f"field 'megatron_distributed_optimizer' must be true or false, "
                         f"got {one_line(str(plan.megatron_distributed_optimizer))!r}")
    if plan.megatron_distributed_optimizer and plan.dp_flavour != "zero1":
        raise ValueError(f"field 'megatron_distributed_optimizer' is true but dp_flavour is "
                         f"'{one_line(plan.dp_flavour)}'; Megatron's distributed optimizer is ZeRO-1: set dp_flavour "
                         f"to zero1 or the field to false")
    if not isinstance(plan.half_precision_weights, bool):
        raise ValueError(f"field 'half_precision_weights' must be true or false, "
                         f"got {one_line(str(plan.half_precision_weights))!r}")
    if plan.half_precision_weights and plan.precision == "fp32":
        raise ValueError("field 'half_precision_weights' is true but the plan is in fp32; it describes 16-bit "
                         "weights: set the precision to bf16 or fp16, or the field to false")
    if not isinstance(plan.moe_a2a_overlap, bool):
        raise ValueError(f"field 'moe_a2a_overlap' must be true or false, got {one_line(str(plan.moe_a2a_overlap))!r}")
    if plan.moe_a2a_overlap and not any(layout.mode == "expert_parallel" for layout in plan.expert_layouts):
        raise ValueError("field 'moe_a2a_overlap' is true but no MoE layer of the plan is expert parallel; set it "
                         "to false")
    if plan.optimizer not in OPTIMIZERS:
        raise ValueError(f"field 'optimizer' must be one of {OPTIMIZERS}, got '{one_line(plan.optimizer)}'")
    if plan.optimizer_implementation not in OPTIMIZER_IMPLEMENTATIONS:
        raise ValueError(f"field 'optimizer_implementation' must be one of {OPTIMIZER_IMPLEMENTATIONS[1:]} or empty, "
                         f"got {one_line(str(plan.optimizer_implementation))!r}")
    if plan.loss_implementation not in LOSS_IMPLEMENTATIONS:
        raise ValueError(f"field 'loss_implementation' must be one of {LOSS_IMPLEMENTATIONS[1:]} or empty, "
                         f"got {one_line(str(plan.loss_implementation))!r}")
    if plan.expert_implementation not in EXPERT_IMPLEMENTATIONS:
        raise ValueError(f"field 'expert_implementation' must be one of {EXPERT_IMPLEMENTATIONS[1:]} or empty, "
                         f"got {one_line(str(plan.expert_implementation))!r}")
    if plan.gradient_clipping not in GRADIENT_CLIPPINGS:
        raise ValueError(f"field 'gradient_clipping' must be one of {GRADIENT_CLIPPINGS[1:]} or empty, "
                         f"got {one_line(str(plan.gradient_clipping))!r}")
    if plan.fused_chains not in FUSED_CHAINS:
        raise ValueError(f"field 'fused_chains' must be one of {FUSED_CHAINS[1:]} or empty, "
                         f"got {one_line(str(plan.fused_chains))!r}")
    count = plan.metric_cross_entropies
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"field 'metric_cross_entropies' must be a whole number of 0 or more, "
                         f"got {one_line(str(count))!r}")
