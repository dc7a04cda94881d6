"""Per-op sharding rules (search/rules/), checked by brute force on tiny tensors.

Every distinct (op, shapes, arguments, candidate) of seven traced models, and of a zoo of
ops they do not use, is run on 2 and 3 virtual ranks (3 makes most sizes uneven) and
compared with the op on whole tensors; wrong rules and missing rules (ops with no rule) are
collected separately, as DTensor's strategy validation reports them. On small nodes the
rules must also offer every candidate brute force finds valid. The checker itself is checked
against candidates known to be wrong, among them the ones an earlier hand-written walk rule (``op_rule``, removed) got wrong.
"""

from __future__ import annotations

import dataclasses

import sys
import uuid
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from planner.graph import OpGraph, OpNode, TensorMeta
from planner.model_spec import ModelSpec
from planner.strategy import Mesh
from planner.trace import trace
from search.rules import (
    MAX_CANDIDATES,
    AxisCandidate,
    axis_candidates,
    candidates,
    check_rule,
    register_rule,
    unknown_ops,
)
from search.rules.check import valid_candidates

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_model_spec import TINY_HF  # noqa: E402 - the tiny HF configs live with the spec tests

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODELS = {
    "mlp": (str(EXAMPLES / "mlp.py"), {}),
    "gpt": (str(EXAMPLES / "gpt.py"), {}),
    "cnn": (str(EXAMPLES / "cnn.py"), {}),
    "llama": (str(EXAMPLES / "llama.py"), {"size": "tiny"}),
    **{f"hf:{name}": (f"hf:{name}", config) for name, config in TINY_HF.items()},
}
AXIS_SIZES = (2, 3)
R = Replicate()
F32 = torch.float32




class OpZoo(nn.Module):
    """Ops the seven models do not use, on uneven sizes (5, 6, 7, 9), so their rules are
    checked too: mm/bmm/matmul/baddbmm/addmm with a full bias, sums and maxima, softmaxes,
    cumsum, unbind/split/chunk, flatten/unflatten, where, gather, conv1d, pooling, reflect
    padding, group norm, NLL, L1 and BCE losses; and a tensor passed twice, which the graph
    records once (``cat((x, x))`` as HF rotary embeddings write it, ``x * x``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(7, 9))
        self.conv = nn.Conv1d(6, 9, 3, padding=1)
        self.table = nn.Embedding(11, 7)

    def forward(self, x, ids, target):  # x (5, 6, 7), ids (5, 6), target (5,)
        rows = torch.mm(x[:, 0, :], self.weight)  # (5, 9)
        scores = torch.bmm(x, x.transpose(1, 2))  # (5, 6, 6)
        projected = torch.matmul(x, self.weight)  # (5, 6, 9)
        scores = torch.baddbmm(scores, x, x.permute(0, 2, 1))
        biased = torch.addmm(rows, x[:, 1, :], self.weight)  # a full (5, 9) bias
        pooled = projected.sum(dim=1) + projected.amax(dim=1) + projected.mean()
        pooled = pooled + torch.max(projected, dim=2).values.sum(-1, keepdim=True)
        probabilities = F.softmax(scores, dim=-1) + F.log_softmax(scores, dim=1)
        running = torch.cumsum(projected, dim=1)
        first, second = torch.unbind(x[:, :2, :], dim=1)
        left, right = torch.split(projected, [4, 5], dim=2)
        pieces = torch.chunk(projected, 3, dim=1)
        regrouped = projected.flatten(1).unflatten(1, (6, 9))
        squeezed = x[:, :1, :].squeeze(1)
        doubled = torch.cat((squeezed, squeezed), dim=-1) + torch.cat((squeezed * squeezed, squeezed), dim=-1)  # (5, 14)
        chosen = torch.where(running > 0, torch.cat([left, right], dim=2), regrouped).masked_fill(running > 1, 0.0)
        gathered = torch.gather(projected, 2, ids.unsqueeze(-1).clamp(0, 8))
        features = self.conv(x)  # (5, 9, 7)
        images = F.avg_pool1d(features, 2).sum() + F.pad(features, (1, 2), mode="reflect").sum()
        normed = F.group_norm(features, 3)
        nll = F.nll_loss(F.log_softmax(rows, dim=-1), target, reduction="sum")
        l1 = F.l1_loss(projected, regrouped)
        bce = F.binary_cross_entropy_with_logits(rows, torch.sigmoid(biased))
        parts = (pooled, probabilities, first, second, *pieces, squeezed, doubled, chosen, gathered, normed, self.table(ids))
        return sum(part.sum() for part in parts) + images + nll + l1 + bce


@pytest.fixture(scope="module")
def graphs():
    pytest.importorskip("transformers")
    traced = {}
    for name, (source, overrides) in MODELS.items():
        model, args, kwargs = ModelSpec(source, overrides).build("meta")
        traced[name] = trace(model, args, kwargs)
    with torch.device("meta"):
        zoo = OpZoo()
        inputs = (torch.randn(5, 6, 7), torch.randint(0, 11, (5, 6)), torch.randint(0, 9, (5,)))
    traced["op zoo"] = trace(zoo, inputs)
    return traced


def _distinct_checks(graphs):
    """(model, node, candidate, axis size) once per op, shapes, arguments and candidate;
    nodes whose every candidate is all-replicate have nothing to check."""
    seen = set()
    for model, graph in graphs.items():
        for node in graph.nodes:
            for axis_size in AXIS_SIZES:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # unknown ops are reported as missing below
                    found = axis_candidates(node, axis_size)
                for candidate in found[1:]:
                    key = (node.op, node.input_meta, repr(node.attrs), candidate, axis_size)
                    if key not in seen:
                        seen.add(key)
                        yield model, node, candidate, axis_size


def test_every_candidate_of_seven_models_is_right_and_every_op_has_a_rule(graphs):
    missing = [
        f"{model}: {op} ({count} nodes)" for model, graph in graphs.items() for op, count in unknown_ops(graph).items()
    ]
    wrong = []
    checked = 0
    for model, node, candidate, axis_size in _distinct_checks(graphs):
        checked += 1
        problem = check_rule(node, candidate, axis_size)
        if problem:
            wrong.append(f"{model} {node.name}: {problem}")
    assert checked > 500, f"only {checked} candidates checked; the rules offer far less than expected"
    assert not wrong and not missing, (
        f"{len(wrong)} wrong rule candidates:\n  " + "\n  ".join(wrong or ["none"])
        + f"\n{len(missing)} ops without a rule:\n  " + "\n  ".join(missing or ["none"])
    )


def test_all_replicate_comes_first_for_every_node(graphs):
    for graph in graphs.values():
        for node in graph.nodes:
            for axis_size in AXIS_SIZES:
                first = axis_candidates(node, axis_size)[0]
                assert first.is_replicated and len(first.inputs) == len(node.inputs), (node.name, str(first))


def test_the_rules_split_the_work_of_the_big_ops(graphs):
    """Data and tensor parallelism are in the space: the matmuls, attention and embeddings
    of the transformers have batch, column and row splits."""
    gpt = graphs["gpt"]
    linear = next(n for n in gpt.nodes if n.op == "aten.linear.default" and len(n.inputs) == 3)
    offered = {str(c) for c in axis_candidates(linear, 2)}
    assert {"(S(0), R, R) -> (S(0))", "(R, S(0), S(0)) -> (S(2))", "(S(2), S(1), P) -> (P)"} <= offered
    attention = next(n for n in graphs["hf:llama"].nodes if n.op.startswith("aten.scaled_dot_product_attention"))
    offered = {str(c) for c in axis_candidates(attention, 2)}
    batch, heads = "(S(0), S(0), S(0), S(0)) -> (S(0))", "(S(1), S(1), S(1), R) -> (S(1))"
    assert {batch, heads} <= offered
    # Its mask is proven causal, so it runs as the causal kernel, which a query split on the
    # sequence cannot run; a mask not proven causal offers that split too.
    sequence = "(S(2), R, R, S(2)) -> (S(2))"
    assert attention.attention_mask_kind == "causal" and sequence not in offered
    unproven = dataclasses.replace(attention, attention_mask_kind="arbitrary")
    assert sequence in {str(c) for c in axis_candidates(unproven, 2)}


# ------------------------------------------------------------------------ unknown ops


def test_an_op_without_a_rule_runs_replicated_without_a_python_warning():
    # The user hears of it in the plan's warnings (tests/test_report.py), not on stderr.
    op = f"aten.made_up_{uuid.uuid4().hex[:8]}.default"
    node = _node(op, [(4, 6), (6,)], [(4, 6)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = axis_candidates(node, 2)
        assert found == [AxisCandidate((R, R), (R,))]
        assert candidates(node, Mesh((("dp", 2), ("tp", 4)))) == [(found[0], found[0])]


def test_unknown_ops_counts_nodes_without_a_rule():
    op = f"aten.made_up_{uuid.uuid4().hex[:8]}.default"
    nodes = [_node("aten.relu.default", [(4,)], [(4,)]), _node(op, [(4,)], [(4,)]), _node(op, [(4,)], [(4,)])]
    nodes[2].name = "second"
    graph = OpGraph(nodes=nodes, inputs=[], parameters={}, buffers={}, batch_size=4)
    assert unknown_ops(graph) == {op: 2}


def test_register_rule_refuses_a_second_rule_for_the_same_op():
    with pytest.raises(ValueError, match="aten.mm.default"):
        register_rule("aten.mm.default")(lambda node, axis_size: [])


# ------------------------------------------------------------------- mesh combinations


def test_candidates_combine_axes_and_cap_the_count(graphs):
    linear = next(n for n in graphs["gpt"].nodes if n.op == "aten.linear.default" and len(n.inputs) == 3)
    mesh = Mesh((("dp", 2), ("tp", 4)))
    found = candidates(linear, mesh)
    assert 1 < len(found) <= MAX_CANDIDATES
    assert all(len(combination) == 2 for combination in found)
    assert all(c.is_replicated for c in found[0])
    # The most work-splitting combinations come first: batch on dp with a tp split.
    assert found[1][0].shards_work and found[1][1].shards_work
    # A dim split by both axes must divide by 2 * 4 = 8 (batch 8: yes; 192 features: yes).
    for combination in found:
        for index, meta in enumerate(linear.input_meta):
            dims = [c.inputs[index].dim for c in combination if isinstance(c.inputs[index], Shard)]
            if len(dims) == 2 and dims[0] == dims[1]:
                assert meta.shape[dims[0]] % 8 == 0


def test_candidates_filter_before_the_cap(graphs):
    linear = next(n for n in graphs["gpt"].nodes if n.op == "aten.linear.default" and len(n.inputs) == 3)
    mesh = Mesh((("dp", 2), ("tp", 4)))

    def weights_whole_on_dp(combination):
        return all(isinstance(combination[0].inputs[i], Replicate) for i in (1, 2))

    kept = candidates(linear, mesh, keep=weights_whole_on_dp)
    assert len(kept) == MAX_CANDIDATES and all(weights_whole_on_dp(c) for c in kept)


def test_candidates_drop_combinations_that_split_a_dim_below_one_row_per_rank():
    node = _node("aten.relu.default", [(6, 5)], [(6, 5)])
    for combination in candidates(node, (2, 2)):
        placements = [c.inputs[0] for c in combination]
        if placements == [Shard(1), Shard(1)]:
            pytest.fail("5 columns cannot be split over 2 x 2 ranks")
    assert any([c.inputs[0] for c in comb] == [Shard(0), Shard(1)] for comb in candidates(node, (2, 2)))


# ---------------------------------------------------------------- the checker itself


def _node(op: str, inputs, outputs, attrs=None, dtypes=None, params=()) -> OpNode:
    dtypes = dtypes or [F32] * len(inputs)
    return OpNode(
        name=op.split(".")[1],
        op=op,
        inputs=tuple(f"in{i}" for i in range(len(inputs))),
        input_meta=tuple(TensorMeta(tuple(s), d) for s, d in zip(inputs, dtypes)),
        output_meta=tuple(TensorMeta(tuple(s), F32) for s in outputs),
        params=params,
        attrs=tuple(attrs) if attrs is not None else tuple(None for _ in inputs),
    )


def _c(inputs, outputs) -> AxisCandidate:
    return AxisCandidate(tuple(inputs), tuple(outputs))


S0, S1, S2, P, AVG = Shard(0), Shard(1), Shard(2), Partial(), Partial("avg")
I64 = torch.int64

# (node, candidate, axis size, what the message must say): each candidate is wrong.
WRONG = {
    # op_rule's row-parallel linear adds the replicated bias on every rank.
    "row-parallel bias counted per rank": (
        _node("aten.linear.default", [(5, 8), (6, 8), (6,)], [(5, 6)]), _c([S1, S1, R], [P]), 2, "sum of the local"),
    "norm over the split dim": (
        _node("aten.layer_norm.default", [(4, 6), (6,), (6,)], [(4, 6)], [None, [6], None, None, 1e-5, False]),
        _c([S1, R, R], [S1]), 2, "cannot run"),
    "softmax over the split dim": (
        _node("aten._softmax.default", [(4, 6)], [(4, 6)], [None, 1, False]), _c([S1], [S1]), 3, "concatenated"),
    "transpose keeps the dim number": (
        _node("aten.transpose.int", [(4, 6)], [(6, 4)], [None, 0, 1]), _c([S0], [S0]), 2, ""),
    # op_rule: a mean over an uneven split is not the average of the local means.
    "mean over an uneven split": (
        _node("aten.mean.dim", [(4, 7)], [(4, 1)], [None, [-1], True]), _c([S1], [AVG]), 3, "avg of the local"),
    # op_rule: merging an unevenly split dim does not give torch.chunk pieces.
    "merge of an uneven split": (
        _node("aten.view.default", [(4, 3, 5)], [(12, 5)], [None, [12, 5]]), _c([S0], [S0]), 3, ""),
    # op_rule: vocabulary-parallel embedding is not the plain op on local rows.
    "vocabulary-parallel embedding": (
        _node("aten.embedding.default", [(10, 4), (3, 5)], [(3, 5, 4)], dtypes=[F32, I64]), _c([S0, R], [P]), 2, ""),
    # op_rule: class-sharded cross entropy needs a cross-rank log-sum-exp, which
    # the plain op on each rank's classes has not (the program runs it by loss_parallel).
    "class-parallel cross entropy": (
        _node("aten.cross_entropy_loss.default", [(6, 10), (6,)], [()], dtypes=[F32, I64]), _c([S1, R], [R]), 2, ""),
    # op_rule: adding a number to partial sums adds it once per rank.
    "number added to a partial sum": (
        _node("aten.add.Tensor", [(4, 6)], [(4, 6)], [None, 1.0]), _c([P], [P]), 2, "sum of the local"),
    # op_rule: a fused q|k|v split on the split feature dim.
    "fused projection split": (
        _node("aten.split.Tensor", [(2, 12)], [(2, 4), (2, 4), (2, 4)], [None, 4, 1]), _c([S1], [S1, S1, S1]), 2, ""),
    # op_rule keeps a full (not broadcast) addmm bias whole while rows are split.
    "full addmm bias left whole": (
        _node("aten.addmm.default", [(5, 9), (5, 7), (7, 9)], [(5, 9)]), _c([R, S0, R], [S0]), 2, "cannot run"),
    # op_rule adds a partial sum to a partial average.
    "sum of mixed partials": (_node("aten.add.Tensor", [(4, 6), (4, 6)], [(4, 6)]), _c([P, AVG], [P]), 2, ""),
    # op_rule ignores reduction='sum' of losses and always answers P(avg).
    "summed loss read as an average": (
        _node("aten.nll_loss_nd.default", [(6, 9), (6,)], [()], [None, None, None, 2], dtypes=[F32, I64]),
        _c([S0, S0], [AVG]), 2, "avg of the local"),
    # op_rule lets a padded dim stay split (pad of a 1-d tensor).
    "padding the split dim": (_node("aten.pad.default", [(6,)], [(9,)], [None, [1, 2]]), _c([S0], [S0]), 2, ""),
    "replicated claim of a split result": (
        _node("aten.relu.default", [(4, 6)], [(4, 6)]), _c([S0], [R]), 2, "whole result"),
    "running sum along the split dim": (
        _node("aten.cumsum.default", [(4, 6)], [(4, 6)], [None, 1]), _c([S1], [S1]), 3, ""),
    "max over a split dim is no sum": (
        _node("aten.amax.default", [(4, 6)], [(4,)], [None, [1]]), _c([S1], [P]), 2, "sum of the local"),
    "attention mask left whole under a batch split": (
        _node("aten.scaled_dot_product_attention.default", [(2, 2, 4, 3)] * 3 + [(2, 1, 4, 4)], [(2, 2, 4, 3)],
              dtypes=[F32] * 3 + [torch.bool]),
        _c([S0, S0, S0, R], [S0]), 2, "cannot run"),
}

RIGHT = {
    "column-parallel linear, uneven": (
        _node("aten.linear.default", [(5, 8), (7, 8), (7,)], [(5, 7)]), _c([R, S0, S0], [S1]), 3),
    "row-parallel linear with a partial bias": (
        _node("aten.linear.default", [(5, 8), (6, 8), (6,)], [(5, 6)]), _c([S1, S1, P], [P]), 3),
    "mean over an even split": (
        _node("aten.mean.dim", [(4, 6)], [(4, 1)], [None, [-1], True]), _c([S1], [AVG]), 3),
    "heads split in a reshape, even": (
        _node("aten.view.default", [(2, 5, 12)], [(2, 5, 3, 4)], [None, [2, 5, 3, 4]]), _c([S2], [S2]), 3),
    "rows split unevenly through a transpose": (
        _node("aten.transpose.int", [(5, 6)], [(6, 5)], [None, 0, 1]), _c([S0], [S1]), 3),
    "number added to a partial average": (
        _node("aten.add.Tensor", [(4, 6)], [(4, 6)], [None, 1.0]), _c([AVG], [AVG]), 3),
    "embedding ids split": (
        _node("aten.embedding.default", [(10, 4), (5, 3)], [(5, 3, 4)], dtypes=[F32, I64]), _c([R, S0], [S0]), 3),
    "sequence-split attention with a mask": (
        _node("aten.scaled_dot_product_attention.default", [(2, 2, 5, 3)] * 3 + [(2, 1, 5, 5)], [(2, 2, 5, 3)],
              dtypes=[F32] * 3 + [torch.bool]),
        _c([S2, R, R, S2], [S2]), 3),
}


# Right arithmetic that the registry does not offer, because DTensor cannot run it (see the
# rule's docstring); tests/test_rules_dtensor.py runs the offered ones through DTensor.
RIGHT_NOT_RUN_BY_DTENSOR = {
    # DTensor's backward of a max-partial value reaches every rank's local maximum.
    "max over a split dim": (_node("aten.amax.default", [(4, 7)], [(4,)], [None, [1]]), _c([S1], [Partial("max")]), 3),
}


@pytest.mark.parametrize("case", sorted(WRONG))
def test_check_rule_rejects_wrong_candidates(case):
    node, candidate, axis_size, says = WRONG[case]
    problem = check_rule(node, candidate, axis_size)
    assert problem is not None, f"{case}: {candidate} passed"
    assert says in problem and node.op in problem


@pytest.mark.parametrize("case", sorted(RIGHT) + sorted(RIGHT_NOT_RUN_BY_DTENSOR))
def test_check_rule_accepts_right_candidates(case):
    node, candidate, axis_size = {**RIGHT, **RIGHT_NOT_RUN_BY_DTENSOR}[case]
    assert check_rule(node, candidate, axis_size) is None


@pytest.mark.parametrize("case", sorted(WRONG))
def test_the_registry_never_offers_the_known_wrong_candidates(case):
    node, candidate, axis_size, _ = WRONG[case]
    assert candidate not in axis_candidates(node, axis_size)


@pytest.mark.parametrize("case", sorted(RIGHT))
def test_the_registry_offers_the_known_right_candidates(case):
    node, candidate, axis_size = RIGHT[case]
    assert candidate in axis_candidates(node, axis_size)


@pytest.mark.parametrize("case", sorted(RIGHT_NOT_RUN_BY_DTENSOR))
def test_the_registry_leaves_out_right_candidates_dtensor_cannot_run(case):
    node, candidate, axis_size = RIGHT_NOT_RUN_BY_DTENSOR[case]
    assert candidate not in axis_candidates(node, axis_size)


# Small nodes whose every valid single-axis candidate the rules must offer (DTensor's
# "missing rules": brute force over every input placement and output placement).
COMPLETE = {
    "pointwise": _node("aten.relu.default", [(4, 5)], [(4, 5)]),
    "broadcast product": _node("aten.mul.Tensor", [(4, 6), (6,)], [(4, 6)]),
    "linear": _node("aten.linear.default", [(5, 8), (6, 8)], [(5, 6)]),
    "merging reshape": _node("aten.view.default", [(4, 3, 5)], [(12, 5)], [None, [12, 5]]),
    "splitting reshape": _node("aten.view.default", [(6, 10)], [(6, 2, 5)], [None, [6, 2, 5]]),
    "transpose": _node("aten.transpose.int", [(5, 6)], [(6, 5)], [None, 0, 1]),
    "sum": _node("aten.sum.dim_IntList", [(4, 6)], [(4,)], [None, [1]]),
    "mean": _node("aten.mean.dim", [(4, 6)], [(4,)], [None, [1]]),
    "softmax": _node("aten._softmax.default", [(4, 6)], [(4, 6)], [None, 1, False]),
    "embedding": _node("aten.embedding.default", [(10, 4), (5, 3)], [(5, 3, 4)], dtypes=[F32, I64]),
}


@pytest.mark.parametrize("case", sorted(COMPLETE))
@pytest.mark.parametrize("axis_size", AXIS_SIZES)
def test_the_rules_miss_no_valid_candidate_of_small_ops(case, axis_size):
    node = COMPLETE[case]
    offered = axis_candidates(node, axis_size)
    missing = [str(c) for c in valid_candidates(node, axis_size) if c not in offered]
    assert not missing, f"{node.op} on {axis_size} ranks: valid but not offered: {missing}"


def test_check_rule_scales_big_nodes_down():
    """A (4096 x 1024) @ (1024 x 3000) linear is checked on small stand-in sizes."""
    node = _node("aten.linear.default", [(4096, 1024), (3000, 1024), (3000,)], [(4096, 3000)])
    assert check_rule(node, _c([R, S0, S0], [S1]), 3) is None
    assert check_rule(node, _c([S1, S1, R], [P]), 3) is not None


# ------------------------------------------------- what DTensor runs: convolution
#
# A candidate can be right by arithmetic and still be wrong in a program: DTensor runs a
# convolution through a handler of its own that reads the input's placements only (a split
# weight comes out as a slice DTensor labels whole). So the convolution rule is also checked
# by running DTensor on every candidate it offers, on simulated ranks (LocalTensorMode: every
# rank's piece in this one process, a fake process group), forward and backward.

CONVOLUTIONS = {
    "conv2d with bias": ("aten.conv2d.default", [(4, 3, 6, 6), (6, 3, 3, 3), (6,)], (4, 6, 6, 6), ([1, 1], [1, 1])),
    "conv1d without bias": ("aten.conv1d.default", [(4, 4, 7), (8, 4, 3)], (4, 8, 7), ([1], [1])),
    "strided conv2d": ("aten.conv2d.default", [(8, 2, 8, 8), (4, 2, 2, 2), (4,)], (8, 4, 4, 4), ([2, 2], [0, 0])),
}


@pytest.fixture(scope="module")
def simulated_ranks():
    """A fake process group of 4 ranks (no communication) for LocalTensorMode."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group is already up in this test process"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield 4
    dist.destroy_process_group()


def _dtensor_problem(op: str, shapes, stride_padding, candidate: AxisCandidate, axis_size: int) -> str | None:
    """Run ``op`` on DTensors placed as ``candidate`` (on the first axis of a 4-rank mesh
    whose first axis has ``axis_size`` ranks) and compare the result and every gradient
    with the op on whole tensors; the problem, or None."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    function = getattr(torch.ops.aten, op.split(".")[1]).default
    generator = torch.Generator().manual_seed(0)
    whole = [torch.randn(shape, generator=generator) for shape in shapes]
    leaves = [t.clone().requires_grad_() for t in whole]
    expected = function(*leaves, *([None] if len(leaves) == 2 else []), *stride_padding)
    expected.square().sum().backward()
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", (axis_size, 4 // axis_size) if axis_size < 4 else (4,))
        rest = (Replicate(),) * (mesh.ndim - 1)

        def place(tensor: torch.Tensor, placement) -> DTensor:
            placements = (placement, *rest)
            if isinstance(placement, Partial):
                piece = tensor / axis_size if placement.reduce_op == "sum" else tensor
                return DTensor.from_local(piece, mesh, placements, run_check=False)
            return distribute_tensor(tensor, mesh, placements)

        operands = [place(t, p).detach().requires_grad_() for t, p in zip(whole, candidate.inputs)]
        try:
            result = function(*operands, *([None] if len(operands) == 2 else []), *stride_padding)
            full = result.full_tensor()
            full.square().sum().backward()
        except Exception as error:  # noqa: BLE001 - what DTensor raised is the finding
            return f"DTensor raised {type(error).__name__}: {str(error)[:120]}"
        if full.shape != expected.shape:
            return f"the result has shape {tuple(full.shape)}, not {tuple(expected.shape)} (DTensor says {tuple(result.placements)})"
        if not torch.allclose(full, expected, atol=1e-4):
            return f"the result is wrong (DTensor says {tuple(result.placements)})"
        for index, (operand, leaf) in enumerate(zip(operands, leaves)):
            gradient = operand.grad.full_tensor()
            if gradient.shape != leaf.grad.shape or not torch.allclose(gradient, leaf.grad, atol=1e-3):
                return f"the gradient of input {index} is wrong"
    return None


@pytest.mark.parametrize("case", sorted(CONVOLUTIONS))
@pytest.mark.parametrize("axis_size", (2, 4))
def test_dtensor_runs_every_convolution_candidate(simulated_ranks, case, axis_size):
    op, shapes, out, stride_padding = CONVOLUTIONS[case]
    node = _node(op, shapes, [out], [None] * len(shapes) + list(stride_padding))
    offered = axis_candidates(node, axis_size)[1:]
    assert offered, f"{case}: no split offered (the batch split at least)"
    problems = [f"{c}: {p}" for c in offered if (p := _dtensor_problem(op, shapes, stride_padding, c, axis_size))]
    assert not problems, f"{case} on {axis_size} ranks:\n  " + "\n  ".join(problems)


# Right by arithmetic (check_rule accepts them) but wrong on DTensor: never offered.
CONVOLUTION_WRONG_ON_DTENSOR = {
    "output channels split": _c([R, S0, S0], [S1]),
    "input channels split": _c([S1, S1, P], [P]),
    "partial input": _c([P, R, P], [P]),
}


@pytest.mark.parametrize("case", sorted(CONVOLUTION_WRONG_ON_DTENSOR))
def test_convolution_splits_dtensor_gets_wrong_are_not_offered(simulated_ranks, case):
    op, shapes, out, stride_padding = CONVOLUTIONS["conv2d with bias"]
    node = _node(op, shapes, [out], [None] * len(shapes) + list(stride_padding))
    candidate = CONVOLUTION_WRONG_ON_DTENSOR[case]
    assert check_rule(node, candidate, 2) is None, f"{case} is right by arithmetic"
    assert _dtensor_problem(op, shapes, stride_padding, candidate, 2) is not None, f"DTensor now runs {case}: offer it again"
    assert candidate not in axis_candidates(node, 2)
