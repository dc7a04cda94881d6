"""Pure helpers of the graph programs' runtime (``codegen.runtime.spmd``)."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from codegen.runtime.spmd import keep_whole


@pytest.mark.parametrize(
    ("held", "wanted", "expected"),
    [
        # Partial sums read where the plan says partial averages: they stay sums (DTensor
        # refuses P(sum) -> P(avg); a reader of partial values takes either).
        ((Partial("sum"),), (Partial("avg"),), (Partial("sum"),)),
        ((Partial("avg"),), (Partial("sum"),), (Partial("avg"),)),
        # A whole value read as partial stays whole (DTensor makes partial values only inside ops).
        ((Replicate(),), (Partial("avg"),), (Replicate(),)),
        # A split value read as partial is gathered whole (Shard -> Partial has no collective).
        ((Shard(0),), (Partial(),), (Replicate(),)),
        # Anything else is what the plan asks, axis by axis.
        ((Shard(0), Partial()), (Replicate(), Shard(1)), (Replicate(), Shard(1))),
    ],
)
def test_keep_whole_never_asks_dtensor_for_partial_values(held, wanted, expected):
    assert keep_whole(held, wanted) == expected


@pytest.fixture
def rank1_of_2():
    """A one-dimensional ``tp=2`` mesh as rank 1 of a fake process group (collectives move no
    data; shapes and strides are what a real rank 1 gets)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def test_uneven_all_to_all_leaves_a_contiguous_local_piece(rank1_of_2):
    # Found by benchmarks/fuzz_parity.py (case 2): an embedding split on its features is read
    # by a linear split on 5 tokens, 3 + 2. DTensor's all-to-all leaves rank 1 a (4, 2, 10)
    # slice of a padded (4, 3, 10) buffer, which linear's local view cannot flatten; rank 1
    # failed alone and rank 0 aborted in the next collective.
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    from codegen.runtime.spmd import redistribute

    mesh = rank1_of_2
    local = torch.randn(4, 5, 5, requires_grad=True)
    features = DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=torch.Size((4, 5, 10)), stride=(50, 10, 1))
    assert not features.redistribute(mesh, [Shard(1)]).to_local().is_contiguous()  # DTensor's own result
    tokens = redistribute(features, [Shard(1)])
    assert tokens.placements == (Shard(1),) and tokens.shape == (4, 5, 10) and tokens.to_local().shape == (4, 2, 10)
    assert tokens.to_local().is_contiguous()
    weight = distribute_tensor(torch.randn(10, 10, requires_grad=True), mesh, [Replicate()])
    out = torch.ops.aten.linear.default(tokens, weight)
    # Backward redistributes the gradient the other way (S(2) -> S(1)), with the same
    # all-to-all; linear's backward views that gradient too.
    redistribute(out, [Shard(2)]).to_local().sum().backward()
    assert local.grad is not None and local.grad.shape == (4, 5, 5)


def test_programs_checked_in_one_process_share_their_mesh(monkeypatch):
    # Found by benchmarks/fuzz_parity.py (case 139 after case 113 in one dist_check_many
    # launch): a second init_device_mesh of the same shape equals the first (same ranks,
    # shape, names) but has new process groups, and DTensor's caches, keyed by that equality,
    # handed some ranks values on the first mesh: they gathered in its groups, the others in
    # the second's, and the launch hung. Program.build_mesh builds each mesh once per process.
    from pathlib import Path

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from codegen.runtime.program import Program
    from planner.api import prepare_model
    from planner.model_spec import ModelSpec
    from search.megatron import megatron_plan

    examples = Path(__file__).resolve().parents[1] / "examples"
    graph, spec, name, cluster = prepare_model(ModelSpec(str(examples / "mlp.py"), {}), "cpu:1x4")
    plan = megatron_plan(graph, cluster, spec, name, tp=2)
    assert plan.mesh.names == ("dp", "tp")
    monkeypatch.setenv("WORLD_SIZE", "4")
    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=4)
    try:
        first = Program(Path("first"), plan, None).build_mesh()
        second = Program(Path("second"), plan, None).build_mesh()
        assert all(second.get_group(axis) is first.get_group(axis) for axis in ("dp", "tp"))
    finally:
        dist.destroy_process_group()


def test_gradients_of_redistributed_views_flow_back_through_the_view():
    # Found by benchmarks/fuzz_parity.py (case 111 of the second generator): attention's
    # (4, 4, 20) -> (4, 4, 4, 5) view, transposed, then split over 4 ranks on its 5 columns
    # (rank 3 holds none). The gradient came back with global strides that differ between
    # ranks and match no layout, so the view's backward (a reshape, which DTensor turns into
    # a view when the strides allow it) failed on rank 3 while the others went on. Values
    # redistributed by the program carry contiguous strides on every rank.
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from codegen.runtime.spmd import redistribute

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        leaf = torch.randn(4, 4, 20, requires_grad=True)
        whole = DTensor.from_local(leaf, mesh, [Replicate()], run_check=False)
        heads = torch.ops.aten.transpose.int(torch.ops.aten.view.default(whole, [4, 4, 4, 5]), 1, 2)
        columns = redistribute(heads, [Shard(3)])
        assert columns.to_local().shape == (4, 4, 4, 0) and columns.stride() == (80, 20, 5, 1)
        columns.to_local().sum().backward()
        assert leaf.grad is not None and leaf.grad.shape == (4, 4, 20)
    finally:
        dist.destroy_process_group()


def test_every_rank_records_the_same_autograd_steps_for_a_redistribution(rank1_of_2):
    # Found by benchmarks/fuzz_parity.py (case 483): the ranks whose piece was not
    # contiguous got an extra from_local step, whose backward redistributes the gradient (a
    # collective), and the ranks whose piece was contiguous skipped it: the launch hung.
    # contiguous_local records the same steps whatever this rank's piece looks like.
    import torch
    from torch.distributed.tensor import DTensor

    from codegen.runtime.spmd import contiguous_local

    mesh = rank1_of_2
    whole = DTensor.from_local(torch.randn(8, 3, requires_grad=True), mesh, [Replicate()], run_check=False)
    pieces = {
        "contiguous piece": torch.ops.aten.mul.Tensor(whole.redistribute(mesh, [Shard(0)]), 2),
        "transposed piece": torch.ops.aten.transpose.int(whole.redistribute(mesh, [Shard(1)]), 0, 1),
    }
    recorded = {}
    for name, value in pieces.items():
        result = contiguous_local(value)
        assert result.to_local().is_contiguous() and result.shape == value.shape, name
        recorded[name] = result.grad_fn is not value.grad_fn  # a step of its own
    assert recorded == {"contiguous piece": True, "transposed piece": True}, recorded


def test_an_in_place_op_run_on_whole_tensors_writes_into_a_copy(rank1_of_2):
    # Found on hf:fnet and hf:mobilebert (benchmarks/hf_sweep.py): DTensor cannot run their
    # broadcasting ``embeddings += positions`` (add_) on the tp mesh, so the program runs it on
    # whole tensors; writing into the local tensor of a DTensor (a custom Function's output
    # view) is forbidden by autograd.
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    from codegen.runtime.spmd import SpmdModule

    mesh = rank1_of_2
    module = SpmdModule(nn.Identity(), mesh, {})
    leaf = torch.randn(4, 3, 8, requires_grad=True)
    embeddings = DTensor.from_local(leaf * 1.0, mesh, [Replicate()], run_check=False)
    positions = DTensor.from_local(torch.randn(1, 3, 8), mesh, [Replicate()], run_check=False)
    summed = module._replicated(torch.ops.aten.add_.Tensor, embeddings, positions)
    assert isinstance(summed, DTensor) and summed.placements == (Replicate(),)
    torch.testing.assert_close(summed.to_local(), leaf.detach() + positions.to_local())
    summed.to_local().sum().backward()
    torch.testing.assert_close(leaf.grad, torch.ones_like(leaf))


@pytest.mark.parametrize(("weight_split", "collectives"), [(Shard(0), {"reduce_scatter_tensor": 1}), (Replicate(), {})])
def test_a_gathered_value_hands_partial_gradients_to_the_gathers_backward(rank1_of_2, weight_split, collectives):
    # Found by the comm audit (searched llama, Megatron's layout with sequence parallelism):
    # the sequence-split activation gathered for a column-parallel linear got its partial
    # gradient all-reduced by contiguous_local's backward, then sliced: twice the bytes of
    # the reduce-scatter the plan prices. A gradient that arrives whole is sliced, as before.
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from codegen.runtime.spmd import redistribute

    mesh = rank1_of_2
    leaf = torch.randn(3, 4, 8, requires_grad=True)
    tokens = DTensor.from_local(leaf * 1.0, mesh, [Shard(1)], run_check=False)  # (3, 8, 8), tokens split
    weight = DTensor.from_local(torch.randn(6, 8), mesh, [weight_split], run_check=False)
    whole = redistribute(tokens, [Replicate()])
    output = torch.ops.aten.linear.default(whole, weight)  # the input's gradient: partial sums when the weight is split
    counter = CommDebugMode()
    with counter:
        output.to_local().sum().backward()
    counts = {str(op).split(".")[-1]: n for op, n in counter.get_comm_counts().items()}
    assert counts == collectives, counts
    assert leaf.grad is not None and leaf.grad.shape == leaf.shape
