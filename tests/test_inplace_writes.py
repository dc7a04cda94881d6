"""In-place writes into tensors a forward makes itself (planner/functionalize.py).

Models that fill a buffer by slices (DeepSeek-V3's attention assembles its keys in a
``new_empty`` buffer with ``copy_``) or scale a view in place are traced into functional
ops (``slice_scatter``, ``select_scatter``, ...), so the per-rank program never writes into
a view of a tensor it also holds as a DTensor. Before that rewrite such programs either
crashed (autograd refuses in-place writes into views of ``to_local``'s output) or silently
lost the write and its gradient (the batch-split plan below failed parity on
``embed.weight``'s gradient).

Unit tests check which writes are rewritten and that graphs without them are traced as
before, and that tiny HuggingFace DeepSeek-V3's key buffers trace without writes into views
and compute the model's loss and gradients on real values; the distributed test compiles tests/models/filled_buffer.py under two
tensor-parallel plans (its batch split over ``tp``, and Megatron's layout) and a tiny
HuggingFace DeepSeek-V3 as the search plans it on two ranks and under Megatron's layout, and
checks all four against one device in ONE torchrun launch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import planner
from planner.api import prepare_model
from planner.functionalize import aliased_writes, functional_program
from planner.graph import OpNode, TensorMeta
from planner.model_loss import extract_loss
from planner.model_spec import ModelSpec
from planner.trace import trace
from search.megatron import megatron_plan
from search.rules import axis_candidates
from search.rules.check import check_rule, valid_candidates
from launch_groups import register_group
from test_parity import result_of
from test_zoo import batch_split_plan

FILLED_BUFFER = str(Path(__file__).resolve().with_name("models") / "filled_buffer.py") + ":build"
# A tiny DeepSeek-V3: two layers (the second an MoE layer), four heads.
DEEPSEEK_TINY = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 64,
    "intermediate_size": 48, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "batch_size": 4, "seq_len": 8,
}
WORLD = 2
# Work, not seconds: the same plan on a loaded machine.
EFFORT = 0.25


def _exported(spec: ModelSpec) -> torch.export.ExportedProgram:
    model, args, kwargs = spec.build("meta")
    model.train()
    return torch.export.export(model, args, kwargs, strict=False)


def _ops(graph) -> set[str]:
    return {node.op for node in graph.nodes}


def test_the_writes_seen_through_other_handles_are_found():
    """The key halves copied into slices of ``new_empty``, the scaling through a view read
    later, the feature slice and the bias column; not the ``scatter_`` into a fresh
    ``zeros_like`` that only its own result is read through."""
    writes = aliased_writes(_exported(ModelSpec(FILLED_BUFFER, {})).graph_module)
    assert writes == ["copy_", "copy__1", "mul_", "copy__2", "fill_"]


def test_the_traced_graph_has_functional_ops_only():
    model, args, kwargs = ModelSpec(FILLED_BUFFER, {}).build("meta")
    graph = trace(model, args, kwargs)
    fx_nodes = graph.graph_module.graph.nodes
    mutating = [node.name for node in fx_nodes if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable]
    assert mutating == [], mutating
    ops = _ops(graph)
    assert {"aten.slice_scatter.default", "aten.select_scatter.default", "aten.fill.Scalar"} <= ops, ops
    # the keys' buffer, both of its slices written, is one cat of the two parts
    keys = [node for node in graph.nodes if node.op == "aten.cat.default"]
    assert len(keys) == 1 and [meta.shape for meta in keys[0].input_meta] == [(4, 4, 8, 4), (4, 4, 8, 4)], keys
    assert "aten.new_empty.default" not in ops
    # functionalization's copy has no derivative: replaced by the value it computes
    assert "aten.copy.default" not in ops
    assert "aten.linear.default" in ops and "aten.scaled_dot_product_attention.default" in ops


class _HalfFilled(nn.Module):
    """A zero buffer with only its first half written: its zeros are part of the value."""

    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffer = x.new_zeros(x.shape[0], 16)
        buffer[:, :8] = self.project(x)
        return (buffer.softmax(-1) * torch.arange(16.0)).sum()


@pytest.mark.parametrize("build", [lambda: ModelSpec(FILLED_BUFFER, {}).build("cpu")[:2], lambda: (_HalfFilled(), (torch.randn(4, 8),))],
                         ids=["filled_buffer", "half_filled"])
def test_the_functional_program_computes_the_models_loss_and_gradients(build):
    """Run on real values: the rewritten graph (functional ops, copies replaced, whole fills
    joined by cat) gives the model's loss and the gradient of every parameter."""
    torch.manual_seed(0)
    model, args = build()
    program = functional_program(torch.export.export(model, args, strict=False))
    assert aliased_writes(program.graph_module) == []
    rewritten = program.module()
    expected, got = model(*args), rewritten(*args)
    torch.testing.assert_close(got, expected)
    names = [name for name, _ in model.named_parameters()]
    wanted = torch.autograd.grad(expected, [p for _, p in model.named_parameters()])
    given = torch.autograd.grad(got, [dict(rewritten.named_parameters())[name] for name in names])
    for name, a, b in zip(names, given, wanted):
        torch.testing.assert_close(a, b, msg=lambda text: f"gradient of {name}: {text}")


def test_tiny_deepseek_v3_traces_without_writes_into_views_and_computes_the_same():
    """DeepSeek-V3's attention (MLA) assembles its keys with ``new_empty`` and two ``copy_``
    into slices, in each of the two layers: those four writes are found, the functional
    program has none and gives the model's loss and every parameter's gradient on real
    values, and the planner's trace holds no mutating op and no ``new_empty``."""
    spec = ModelSpec("hf:deepseek_v3", DEEPSEEK_TINY)
    torch.manual_seed(0)
    model, args, kwargs = spec.build("cpu")
    model.train()
    exported = torch.export.export(model, args, kwargs, strict=False)
    assert len(aliased_writes(exported.graph_module)) == 4  # 2 layers x (nope keys, rope keys)
    program = functional_program(exported)
    assert aliased_writes(program.graph_module) == []
    rewritten = program.module()
    expected, got = extract_loss(model(*args, **kwargs)), extract_loss(rewritten(*args, **kwargs))
    torch.testing.assert_close(got, expected)
    names = [name for name, _ in model.named_parameters()]
    wanted = torch.autograd.grad(expected, [p for _, p in model.named_parameters()], allow_unused=True)
    given = torch.autograd.grad(got, [dict(rewritten.named_parameters())[name] for name in names], allow_unused=True)
    for name, a, b in zip(names, given, wanted):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, msg=lambda text: f"gradient of {name}: {text}")
    graph = trace(*spec.build("meta"))
    mutating = [node.name for node in graph.graph_module.graph.nodes
                if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable]
    assert mutating == [] and "aten.new_empty.default" not in _ops(graph), mutating


def test_a_buffer_written_in_part_is_not_joined_by_cat():
    with torch.device("meta"):
        model, x = _HalfFilled(), torch.randn(4, 8)
    ops = _ops(trace(model, (x,)))
    assert "aten.slice_scatter.default" in ops and "aten.cat.default" not in ops, ops


class _NoGradScale(nn.Module):
    """A scale computed from a weight under ``torch.no_grad()`` (no gradient to the weight
    through it) and a buffer filled by slices."""

    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = self.project.weight.norm()
        buffer = x.new_empty(x.shape[0], 16)
        buffer[:, :8].copy_(self.project(x) / scale)
        buffer[:, 8:].copy_(x)
        return buffer.sum()


def test_a_no_grad_region_that_reads_a_weight_keeps_the_graph_as_exported():
    """Functionalization would inline the region without its grad mode: the weight would get
    a gradient through the scale."""
    model, x = _NoGradScale(), torch.randn(4, 8)
    program = torch.export.export(model, (x,), strict=False)
    assert aliased_writes(program.graph_module) == ["copy_", "copy__1"]
    assert functional_program(program) is program


class _FreshWrites(nn.Module):
    """Writes that are plain data flow (a residual added in place into a fresh tensor), next
    to ops functionalization would rename (``to``, ``reshape``, ``contiguous``)."""

    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.project(x)
        h += x
        h = h.transpose(0, 1).contiguous().reshape(-1).to(torch.float32)
        return F.relu(h).sum()


def test_a_graph_without_aliased_writes_is_traced_as_exported():
    with torch.device("meta"):
        model = _FreshWrites()
        x = torch.randn(4, 8)
    program = torch.export.export(model, (x,), strict=False)
    assert aliased_writes(program.graph_module) == []
    assert functional_program(program) is program
    ops = _ops(trace(model, (x,)))
    assert {"aten.add_.Tensor", "aten.contiguous.default", "aten.reshape.default", "aten.to.dtype"} <= ops, ops


class _BatchNormAndSlices(nn.Module):
    """Batch norm (running statistics: state updates) and a buffer filled by slices."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        buffer = h.new_zeros(h.shape[0], 16)
        buffer[:, :8].copy_(h)
        return buffer.sum()


def test_writes_into_buffers_alone_are_not_aliased_writes():
    """Writes into the model's own state are not rewritten: the functional program would
    return the new running statistics as outputs the model does not have."""
    with torch.device("meta"):
        norm = nn.Sequential(nn.BatchNorm1d(8))
        x = torch.randn(4, 8)
    norm.train()
    assert aliased_writes(torch.export.export(norm, (x,), strict=False).graph_module) == []
    with torch.device("meta"):
        both = _BatchNormAndSlices()
    both.train()
    program = torch.export.export(both, (x,), strict=False)
    assert aliased_writes(program.graph_module) == ["copy_"]
    # functionalizing it would add the statistics' updates: the program is kept as exported
    assert functional_program(program) is program


# A (4, 6, 5) base with a (4, 3, 5) part written into dim 1's slice [1:4], and one with a
# (4, 5) part written into dim 1's index 2.
SCATTERS = {
    "slice_scatter": ("aten.slice_scatter.default", (4, 3, 5), (None, None, 1, 1, 4)),
    "select_scatter": ("aten.select_scatter.default", (4, 5), (None, None, 1, 2)),
}


def _scatter_node(case: str) -> OpNode:
    op, part, attrs = SCATTERS[case]
    f32 = torch.float32
    return OpNode(name=case, op=op, inputs=("base", "part"), input_meta=(TensorMeta((4, 6, 5), f32), TensorMeta(part, f32)),
                  output_meta=(TensorMeta((4, 6, 5), f32),), attrs=attrs)


@pytest.mark.parametrize("axis_size", (2, 3))
@pytest.mark.parametrize("case", sorted(SCATTERS))
def test_scatter_rules_offer_every_split_of_the_other_dims_and_only_right_ones(case, axis_size):
    """Brute force: each offered candidate combines into the op's result, and every valid
    candidate without partial sums (DTensor runs none through these ops) is offered."""
    node = _scatter_node(case)
    offered = axis_candidates(node, axis_size)
    assert len(offered) == 3, offered  # all-replicate, dim 0 and dim 2 split
    for candidate in offered:
        assert check_rule(node, candidate, axis_size) is None, candidate
    wanted = [c for c in valid_candidates(node, axis_size, partial_flavours=()) if not any(
        isinstance(p, torch.distributed.tensor.Partial) for p in c.inputs + c.outputs)]
    assert [str(c) for c in wanted if c not in offered] == []


# ------------------------------------------------------------------------ distributed

PROGRAMS = ("filled_buffer_batch_split", "filled_buffer_megatron", "deepseek_v3_searched", "deepseek_v3_megatron")


def _megatron(spec: ModelSpec) -> planner.Plan:
    """Megatron-LM's layout of ``spec``: every rank of the world on ``tp``."""
    graph, resolved, name, cluster = prepare_model(spec, f"cpu:1x{WORLD}")
    return megatron_plan(graph, cluster, resolved, name, tp=WORLD, precision="fp32")


def _programs(root, world):
    spec, deepseek = ModelSpec(FILLED_BUFFER, {}), ModelSpec("hf:deepseek_v3", DEEPSEEK_TINY)
    plans = {
        "filled_buffer_batch_split": batch_split_plan(spec, WORLD),
        "filled_buffer_megatron": _megatron(spec),
        "deepseek_v3_searched": planner.plan(deepseek, f"cpu:1x{WORLD}", effort=EFFORT, progress=False),
        # Megatron's layout splits the rope keys' features over tp: the compile-time dry run
        # must write the program from what its latest round saw, not from an earlier round
        # that ran before a redistribution it asked for (codegen.dry_run.refine)
        "deepseek_v3_megatron": _megatron(deepseek),
    }
    folders = {key: planner.compile(plan, root / key) for key, plan in plans.items()}
    return (plans, folders), list(folders.values())


PROGRAMS_GROUP = register_group(WORLD, _programs)  # checked in the session's launch (launch_groups.py)


@pytest.fixture(scope="module")
def launch(parity_launches):
    (plans, folders), launch = parity_launches.result(PROGRAMS_GROUP)
    return plans, folders, launch


@pytest.mark.distributed
@pytest.mark.parametrize("name", PROGRAMS)
def test_programs_that_fill_buffers_train_like_one_device(launch, name):
    plans, folders, run = launch
    assert "tp" in plans[name].mesh.names, f"{name}: {plans[name].name} is not tensor parallel"
    source = (folders[name] / "model_spmd.py").read_text()
    assert "(SpmdModule)" in source, f"{name} is not a graph program"
    # the writes are functional ops of the program, none in place; DeepSeek-V3's key buffer,
    # both of its slices written, is a cat
    if name.startswith("filled_buffer"):
        assert "aten.select_scatter.default" in source, source
    else:
        assert "new_empty" not in source and "slice_scatter" not in source, source
    assert not re.search(r"aten\.(?!__)\w+_\.\w+\(", source), source  # copy_, fill_, ... (not __and__)
    result = result_of(run, folders[name])
    assert result.startswith("ok parity ok: "), f"{name} ({plans[name].name}): {result}"


def test_an_op_dtensor_cannot_differentiate_runs_on_whole_inputs(launch):
    """DTensor's backward of ``select_scatter`` into a tensor that needs a gradient makes a
    plain tensor beside distributed ones and fails: the compile-time dry run finds it, the
    program runs that op on inputs gathered whole and says so, and the step still equals one
    device (test_programs_that_fill_buffers_train_like_one_device[filled_buffer_batch_split])."""
    _, folders, _ = launch
    source = (folders["filled_buffer_batch_split"] / "model_spmd.py").read_text()
    fallbacks = re.findall(r"# DTensor cannot run (\w+) on these placements .*\n\s*\w+ = self\._replicated\(aten\.\1\.", source)
    assert "select_scatter" in fallbacks, source
