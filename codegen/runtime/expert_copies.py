"""Expert data parallelism: each expert's weights, gradients and optimizer states sharded over
the ranks that hold its copies, with FSDP2 over a copy sub-mesh.

An expert-parallel layer whose placement is a grid (``ExpertPlacement.copy_groups``: the
ranks split into groups of r, each group holding the same experts) runs its experts as a
module of their own, sharded with ``fully_shard`` over the r ranks of this rank's group
(the ``copies`` dim of a (groups x copies) ``DeviceMesh``), as torchtitan shards routed
experts over its expert-replica mesh dim. FSDP2 all-gathers the experts' weights before
the module's forward and again before its backward, and reduce-scatters their gradients
after it; each rank steps only its shard, with optimizer states for it alone.

The gradient FSDP2 reduces is each copy's own (the tokens that copy processed, already
divided by the dp group size in the layer, ``rank_losses_averaged``), so the reduction must
sum over the copies, not average them: the divide factor is 1. The whole-copies layout
sums the same gradients with an all-reduce over the whole group instead
(``codegen.runtime.moe.sum_copies``).

Why FSDP2 and not a ZeRO-style optimizer: the point is to hold 1/r of the weights, not only
of the optimizer states, which needs the gather before each use and the release after;
FSDP2 does that with prefetching and its own streams, and the rest of an MoE program is
already FSDP2 or DDP over "dp", with which a nested unit on another mesh composes.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

__all__ = ["copy_group_names", "copy_mesh", "shard_over_copies", "shard_dim", "plain_and_sharded_groups"]

# The process groups copy_mesh made in this process (their names), for the comm audit.
_COPY_GROUP_NAMES: list[str] = []


def copy_mesh(dp_mesh: DeviceMesh, copy_groups) -> DeviceMesh:
    """This rank's 1-D mesh of the ranks holding the same experts: ``copy_groups`` lists each
    group's positions on ``dp_mesh`` (equal sizes, every position once), which become a
    (groups x copies) ``DeviceMesh`` whose ``copies`` dim is returned. A collective over
    ``dp_mesh``'s ranks (every rank builds every group's process group)."""
    groups = torch.tensor(copy_groups, dtype=torch.long, device="cpu")  # indexes DeviceMesh.mesh, a CPU tensor
    if groups.dim() != 2 or sorted(groups.flatten().tolist()) != list(range(dp_mesh.size())):
        raise ValueError(f"copy groups {copy_groups!r} must split the {dp_mesh.size()} ranks of the mesh into equal groups")
    ranks = dp_mesh.mesh.flatten()[groups]  # global ranks, one row per group
    grid = DeviceMesh(dp_mesh.device_type, ranks, mesh_dim_names=("expert_groups", "copies"))
    _COPY_GROUP_NAMES.append(grid.get_group("copies").group_name)
    return grid["copies"]


def copy_group_names() -> tuple[str, ...]:
    """Names of the process groups ``copy_mesh`` made in this process (this rank's copy
    group of each mesh): what ``codegen.runtime.comm_audit`` counts as the expert copies."""
    return tuple(_COPY_GROUP_NAMES)


def shard_dim(shape: torch.Size, copies: int) -> int:
    """The dim a tensor of ``shape`` is sharded on over ``copies`` ranks: dim 0 (the
    experts) when it divides evenly, else the first dim that does (a rank holding one expert
    shards its width), else dim 0 (FSDP2 pads the last shards)."""
    for dim, size in enumerate(shape):
        if size % copies == 0:
            return dim
    return 0


def shard_over_copies(experts: torch.nn.Module, mesh: DeviceMesh,
                      mp_policy: MixedPrecisionPolicy | None = None) -> torch.nn.Module:
    """``fully_shard`` ``experts`` (a module holding only expert weights, whose forward runs
    them) over ``mesh`` (``copy_mesh``): gathered for forward and again for backward (it
    reshards after forward also when it is a root, as under DDP), gradients summed over the
    copies (see the module docstring). ``mp_policy``: FSDP2's mixed precision (a bf16 plan's
    ``BF16_FSDP_POLICY``: bf16 gathers, fp32 gradient reductions, as the cost model prices
    them, ``planner.program_shape.shards_expert_copies_in_bf16``); None keeps the weights'
    own dtype. Returns the module."""
    copies = mesh.size()
    fully_shard(
        experts,
        mesh=mesh,
        reshard_after_forward=True,
        shard_placement_fn=lambda param: Shard(shard_dim(param.shape, copies)),
        mp_policy=mp_policy or MixedPrecisionPolicy(),
    )
    # A plain sum (SUM collectives, no division): NCCL would take a divide factor as a
    # pre-multiplied sum, which gloo does not have.
    experts.set_gradient_divide_factor(1.0)
    experts.set_force_sum_reduction_for_comms(True)
    return experts


def plain_and_sharded_groups(params) -> list[dict]:
    """``params`` as optimizer parameter groups: the plain tensors (DDP's replicated weights)
    in one, the DTensors (expert shards) in another. A multi-tensor (``foreach``) optimizer
    step, the default on GPUs, runs once per group and refuses a list mixing the two."""
    params = list(params)
    plain = [param for param in params if not isinstance(param, DTensor)]
    sharded = [param for param in params if isinstance(param, DTensor)]
    return [{"params": group} for group in (plain, sharded) if group]
