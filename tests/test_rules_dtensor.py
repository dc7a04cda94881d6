"""Candidates the rules offer that graph programs hand to DTensor must run there as promised.

``tests/test_rules.py`` checks the arithmetic of every candidate by brute force; a graph
program, though, runs each op through DTensor's own sharding rule, which may not implement
a candidate whose arithmetic is right. Here each candidate of such ops runs as DTensor runs
it, as rank 1 of a fake two-rank process group (collectives move no data, so only shapes and
placements are checked): the output must have the placements the candidate promises and a
local piece of the size those placements give.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

from planner.graph import OpNode, TensorMeta
from search.rules import axis_candidates

F32 = torch.float32


@pytest.fixture(scope="module")
def mesh_rank1():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def _node(op: str, inputs, output, attrs) -> OpNode:
    return OpNode(
        name=op.split(".")[1], op=op, inputs=tuple(f"in{i}" for i in range(len(inputs))),
        input_meta=tuple(TensorMeta(tuple(shape), F32) for shape in inputs),
        output_meta=(TensorMeta(tuple(output), F32),), attrs=tuple(attrs),
    )


def _dtensor(shape, placement, mesh) -> DTensor:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    size = torch.Size(shape)
    local_shape = size if isinstance(placement, Partial) else compute_local_shape_and_global_offset(size, mesh, [placement])[0]
    stride = torch.empty(size, device="meta").stride()
    return DTensor.from_local(torch.randn(local_shape), mesh, [placement], run_check=False, shape=size, stride=stride)


# Found by benchmarks/fuzz_parity.py (cases 1 and 19): DTensor's convolution gives the output
# the input's placements whatever the weight's, so the output-channel split, whose
# arithmetic is right, ran as a "replicated" output holding half the channels.
CONVOLUTIONS = {
    "conv1d": (_node("aten.conv1d.default", [(4, 6, 5), (9, 6, 3), (9,)], (4, 9, 5), [None, None, None, [1], [1]]),
               torch.ops.aten.conv1d.default, ([1], [1])),
    "conv1d, no bias": (_node("aten.conv1d.default", [(4, 6, 5), (9, 6, 1)], (4, 9, 5), [None, None, None]),
                        torch.ops.aten.conv1d.default, (None,)),
    "conv2d": (_node("aten.conv2d.default", [(4, 3, 5, 5), (7, 3, 3, 3), (7,)], (4, 7, 5, 5), [None, None, None, [1, 1], [1, 1]]),
               torch.ops.aten.conv2d.default, ([1, 1], [1, 1])),
}


@pytest.mark.parametrize("case", sorted(CONVOLUTIONS))
def test_dtensor_runs_every_convolution_candidate_as_promised(mesh_rank1, case):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    node, op, extra = CONVOLUTIONS[case]
    offered = axis_candidates(node, 2)
    assert any(not c.is_replicated for c in offered), [str(c) for c in offered]
    for candidate in offered:
        args = [_dtensor(meta.shape, placement, mesh_rank1) for meta, placement in zip(node.input_meta, candidate.inputs)]
        out = op(*args, *extra)
        promised = candidate.outputs[0]
        assert list(out.placements) == [promised], f"{case} {candidate}: DTensor gives {out.placements}"
        expected = compute_local_shape_and_global_offset(out.shape, mesh_rank1, [promised])[0]
        assert tuple(out.to_local().shape) == tuple(expected), f"{case} {candidate}: local {tuple(out.to_local().shape)}"
