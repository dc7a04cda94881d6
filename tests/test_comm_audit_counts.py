"""``codegen.runtime.comm_audit.CollectiveCounter``'s byte conventions, worked by hand, as
rank 0 of a fake process group of 4 ranks (no processes; collectives move nothing but
dispatch as real ones do)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from codegen.runtime.comm_audit import CollectiveCounter, mesh_group_axes

WORLD = 4


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


def test_each_collective_is_counted_in_the_simulators_conventions(mesh) -> None:
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    counter = CollectiveCounter(mesh_group_axes(mesh))
    with counter:
        dist.all_reduce(torch.ones(100), group=dp)  # 400 B: 2 x 1/2 x 400 = 400
        dist.all_gather_into_tensor(torch.empty(20), torch.ones(10), group=tp)  # whole 80 B: 1/2 x 80 = 40
        dist.reduce_scatter_tensor(torch.empty(10), torch.ones(20), group=tp)  # whole 80 B: 40
        dist.broadcast(torch.ones(30), group_src=0, group=dp)  # 120 B: 1/2 x 120 = 60
        # Uneven all-to-all over dp: 3 rows of 8 B to itself (rank 0 of dp), 5 to the other.
        dist.all_to_all_single(torch.empty(8, 2), torch.ones(8, 2), [4, 4], [3, 5], group=dp)  # 5 x 8 = 40
        dist.send(torch.ones(7), group_dst=1, group=tp)  # 28 B
        funcol.all_reduce(torch.ones(50), "sum", tp).wait()  # 200 B: 200
        dist.all_reduce(torch.ones(1))  # the world group spans both axes: other(n=4), 2 x 3/4 x 4 = 6
    sent = {}
    for call in counter.calls:
        sent[call.axis] = sent.get(call.axis, 0.0) + call.sent_bytes
    assert [(c.op, c.axis, c.sent_bytes) for c in counter.calls] == [
        ("allreduce_", "dp", 400.0), ("_allgather_base_", "tp", 40.0), ("_reduce_scatter_base_", "tp", 40.0),
        ("broadcast_", "dp", 60.0), ("alltoall_base_", "dp", 40.0), ("send", "tp", 28.0), ("all_reduce", "tp", 200.0),
        ("allreduce_", "other(n=4)", 6.0),
    ]
    assert sent == {"dp": 500.0, "tp": 308.0, "other(n=4)": 6.0}


def test_collectives_inside_a_dtensor_op_are_counted(mesh) -> None:
    """A redistribute, and the gather DTensor's own sharding propagation makes inside an op
    (a matmul whose two operands are split on the same tp dim gathers one of them)."""
    x = distribute_tensor(torch.ones(8, 6), mesh, [Replicate(), Shard(0)])  # (4, 6) per tp rank
    counter = CollectiveCounter(mesh_group_axes(mesh))
    with counter:
        x.redistribute(mesh, [Replicate(), Replicate()])  # all-gather of 8 x 6 x 4 = 192 B over tp: 96
        y = distribute_tensor(torch.ones(6, 8), mesh, [Replicate(), Shard(0)])
        torch.mm(x, y)
    gathered = [c for c in counter.calls if c.op == "all_gather_into_tensor"]
    assert gathered and gathered[0].axis == "tp" and gathered[0].sent_bytes == 96.0
    assert len(gathered) >= 2, "the gather inside mm was not counted"


PROGRAM = '''\
from torch.distributed.tensor import Replicate, Shard


def forward(value):
    whole = value.redistribute(value.device_mesh, [Replicate(), Replicate()])  # all-gather over tp
    return whole.redistribute(value.device_mesh, [Replicate(), Shard(1)])  # a slice; its backward all-gathers
'''


def test_each_collective_is_tied_to_the_program_line_behind_it(mesh, tmp_path) -> None:
    """``with_sites``: a forward collective names its line of ``model_spmd.py``; a backward
    one names the autograd step and the forward line that made it (anomaly mode's record);
    one issued outside the program names the function that issued it."""
    import importlib.util

    (tmp_path / "model_spmd.py").write_text(PROGRAM)
    spec = importlib.util.spec_from_file_location("model_spmd_sites", tmp_path / "model_spmd.py")
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    leaf = torch.ones(8, 6, requires_grad=True)
    x = distribute_tensor(leaf, mesh, [Replicate(), Shard(0)])
    counter = CollectiveCounter(mesh_group_axes(mesh), with_sites=True)

    def outside() -> None:
        funcol.all_reduce(torch.ones(2), "sum", mesh.get_group("dp")).wait()

    with torch.autograd.set_detect_anomaly(True, check_nan=False), counter:
        program.forward(x).to_local().sum().backward()
        outside()
    assert [(c.op, c.axis, c.site) for c in counter.calls] == [
        ("all_gather_into_tensor", "tp", "forward L5: whole = value.redistribute(value.device_mesh, [Replicate(), Replicate()])"),
        ("all_gather_into_tensor", "tp",
         "backward RedistributeBackward of L6: return whole.redistribute(value.device_mesh, [Replicate(), Shard(1)])"),
        ("all_reduce", "dp", "test_comm_audit_counts.py:outside"),
    ]
