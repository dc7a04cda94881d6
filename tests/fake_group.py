"""A compiled graph program run as rank 0 of a fake process group (no communication), for
tests that look at what one rank holds and saves without launching processes."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def graph_program_on_rank0(plan, device: str = "meta") -> Iterator[tuple[torch.nn.Module, tuple, dict]]:
    """The program of ``plan`` (``render_graph_program``) parallelized on rank 0 of a fake
    group over ``plan``'s mesh, with the model and example batch built on ``device`` (meta:
    shapes only; cpu: real tensors, collectives returning garbage). Yields the rank's module
    and its part of the example batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from codegen import dry_run
    from codegen.spmd_emit import render_graph_program

    module = dry_run._load(render_graph_program(plan))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        mesh = init_device_mesh("cpu", plan.mesh.shape, mesh_dim_names=plan.mesh.names)
        model, args, kwargs = plan.model.build(device)
        spmd = module.parallelize(model, mesh)
        if device == "meta":
            spmd.device = torch.device("meta")
        local_args, local_kwargs = module.shard_batch(args, kwargs, mesh)
        yield spmd, local_args, local_kwargs
    finally:
        dist.destroy_process_group()
