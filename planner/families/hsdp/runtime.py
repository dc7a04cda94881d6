"""What a compiled HSDP program calls at run time: its 2-D ``replicate x shard`` mesh.

Codegen layer: imports torch and the planner's vocabulary, never search or cost_model.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

HSDP_AXES = ("replicate", "shard")

# The HSDP meshes built in this process, by (default process group, device type, ranks,
# shape). As with the plan's own mesh (codegen.runtime.program's _MESHES): a DeviceMesh
# equals any other of the same ranks, shape and names whatever its process groups, and
# DTensor caches sharding decisions (which hold their mesh) under that equality, so two
# meshes of one shape in one process (two programs checked in one process) would let ranks
# run a collective in different groups and wait for ever. Each is built once per process.
_HSDP_MESHES: dict[tuple, DeviceMesh] = {}


def hybrid_mesh(dp_mesh: DeviceMesh, shard: int) -> DeviceMesh:
    """The ranks of the 1-D ``dp_mesh`` as a 2-D mesh ``("replicate", "shard")``: each row
    holds ``shard`` consecutive ranks (one shard group, inside a node), the rows are the
    ``dp / shard`` replicas. Every rank of ``dp_mesh`` must call it (it makes the groups).

    Raises:
        ValueError: ``dp_mesh`` is not 1-D, or ``shard`` does not divide its size.
    """
    if dp_mesh.ndim != 1 or dp_mesh.size() % shard:
        raise ValueError(f"HSDP needs a 1-D dp mesh whose size {shard} divides, got mesh shape {tuple(dp_mesh.shape)}")
    ranks = dp_mesh.mesh.reshape(dp_mesh.size() // shard, shard)
    key = (dist.group.WORLD, dp_mesh.device_type, tuple(ranks.flatten().tolist()), tuple(ranks.shape))
    if key not in _HSDP_MESHES:
        _HSDP_MESHES[key] = DeviceMesh(dp_mesh.device_type, ranks, mesh_dim_names=HSDP_AXES)
    return _HSDP_MESHES[key]
