"""Tests of the front end (planner/trace.py): models on meta tensors -> OpGraph.

FLOPs are checked against counts worked out by hand; every model is built under
``torch.device("meta")`` so nothing here allocates weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import planner
from planner.errors import PlannerError, TraceError
from planner.graph import BlockRun, OpGraph
from planner.model_spec import ModelSpec
from planner.trace import trace
from search.blocks import block_representatives

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_model_spec import TINY_HF  # noqa: E402 - the tiny HF configs live with the spec tests

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# spec source -> overrides; built on meta and traced once per module (see `traced`).
MODELS = {
    "mlp": (str(EXAMPLES / "mlp.py"), {}),
    "gpt": (str(EXAMPLES / "gpt.py"), {"n_layer": 3}),
    "cnn": (str(EXAMPLES / "cnn.py"), {}),
    "hf:gpt2": ("hf:gpt2", TINY_HF["gpt2"]),
    "hf:llama": ("hf:llama", TINY_HF["llama"]),
    "hf:bert": ("hf:bert", TINY_HF["bert"]),
}
# Expected repeated-block groups: group -> number of blocks.
BLOCKS = {
    "mlp": {},
    "gpt": {"blocks": 3},
    "cnn": {},
    "hf:gpt2": {"transformer.h": 2},
    "hf:llama": {"model.layers": 2},
    "hf:bert": {"bert.encoder.layer": 2},
}
# Models whose parameters include tied (shared) weights.
TIED = {"hf:gpt2", "hf:bert"}


@pytest.fixture(scope="module")
def traced():
    """name -> (model, args, kwargs, graph), each traced lazily once per module."""
    cache: dict[str, tuple[nn.Module, tuple, dict, OpGraph]] = {}

    def get(name: str):
        if name not in cache:
            source, overrides = MODELS[name]
            torch.manual_seed(0)
            model, args, kwargs = ModelSpec(source, overrides).build("meta")
            cache[name] = (model, args, kwargs, trace(model, args, kwargs))
        return cache[name]

    return get


def meta_model(cls, *args, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return cls(*args, **kwargs)


# ------------------------------------------------------------------ structure per model


@pytest.mark.parametrize("name", list(MODELS))
def test_graph_structure(traced, name):
    model, args, kwargs, graph = traced(name)
    assert len(graph) > 0 and graph.tracer == "export"
    assert graph.graph_module is not None

    # Batch: dim 0 of the first tensor input; every batched input says so.
    first = next(v for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor))
    assert graph.batch_size == first.shape[0]
    values = dict(zip([i.name for i in graph.inputs], [*args, *kwargs.values()]))
    for graph_input in graph.inputs:
        value = values[graph_input.name]
        assert graph_input.meta.shape == tuple(value.shape)
        assert graph_input.batch_dim == 0

    # Nodes in topological order, each input produced earlier (or a placeholder).
    produced = {i.name for i in graph.inputs}
    placeholders = {n.name for n in graph.graph_module.graph.nodes if n.op == "placeholder"}
    for node in graph.nodes:
        assert all(src in produced or src in placeholders for src in node.inputs), node
        assert len(node.input_meta) == len(node.inputs), node
        produced.add(node.name)

    # Repeated blocks, and every node of a block carries (group, index).
    assert graph.blocks == BLOCKS[name]
    for group, count in BLOCKS[name].items():
        indices = {n.block[1] for n in graph.nodes if n.block and n.block[0] == group}
        assert indices == set(range(count))
        assert all(n.module.startswith(f"{group}.{n.block[1]}") for n in graph.nodes if n.block)


@pytest.mark.parametrize("name", [n for n in MODELS if n not in TIED])
def test_parameters_match_named_parameters(traced, name):
    model, _, _, graph = traced(name)
    expected = {fqn: tuple(p.shape) for fqn, p in model.named_parameters()}
    assert {fqn: meta.shape for fqn, meta in graph.parameters.items()} == expected
    assert graph.parameter_count == sum(p.numel() for p in model.parameters())
    assert {fqn: meta.shape for fqn, meta in graph.buffers.items()} == {
        fqn: tuple(b.shape) for fqn, b in model.named_buffers()
    }


@pytest.mark.parametrize("name", sorted(TIED))
def test_tied_parameters_have_real_names_and_shapes(traced, name):
    model, _, _, graph = traced(name)
    every_name = {fqn: tuple(p.shape) for fqn, p in model.named_parameters(remove_duplicate=False)}
    for fqn, meta in graph.parameters.items():
        assert every_name[fqn] == meta.shape
    # Every parameter object is reachable from some name in the graph.
    assert {id(model.get_parameter(fqn)) for fqn in graph.parameters} == {id(p) for p in model.parameters()}


@pytest.mark.parametrize("name", sorted(TIED))
def test_tied_parameters_counted_once(traced, name):
    model, _, _, graph = traced(name)
    assert graph.parameter_count == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(MODELS))
def test_module_paths_on_linear_nodes(traced, name):
    model, _, _, graph = traced(name)
    modules = dict(model.named_modules())
    linears = [n for n in graph.nodes if n.op == "aten.linear.default"]
    assert linears, "every model here has at least one nn.Linear"
    for node in linears:
        assert node.module in modules, node
        assert node.module_type == "Linear" == type(modules[node.module]).__name__
        assert node.params and node.params[0].endswith("weight")
    for node in graph.nodes:
        assert node.module == "" or node.module in modules, node


@pytest.mark.parametrize("name", list(MODELS))
def test_view_ops_move_no_bytes(traced, name):
    _, _, _, graph = traced(name)
    views = [n for n in graph.nodes if n.is_view]
    assert all(n.bytes_moved == 0 for n in views)
    non_views = [n for n in graph.nodes if not n.is_view and n.output_meta and n.op != "aten._assert_tensor_metadata.default"]
    assert all(n.bytes_moved > 0 for n in non_views)


def test_chunk_is_a_view_of_its_input():
    """torch.export keeps ``torch.chunk`` as ``aten.chunk.default`` (a fused gate|up
    projection split in two, as Hugging Face's gated MLPs do); its pieces are views, so it
    moves no bytes. Before, it was priced as a copy of its whole input."""
    from planner.trace import trace

    class GatedHalves(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = torch.nn.Linear(8, 32)

        def forward(self, x):
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return gate * up

    graph = trace(GatedHalves(), (torch.randn(4, 8),))
    chunks = [n for n in graph.nodes if n.op == "aten.chunk.default"]
    assert len(chunks) == 1 and chunks[0].is_view and chunks[0].bytes_moved == 0


def test_meta_model_stays_meta(traced):
    model, args, _, graph = traced("gpt")
    assert all(p.is_meta for p in model.parameters())
    assert all(a.is_meta for a in args)
    assert all(
        t.is_meta for t in [*graph.graph_module.parameters(), *graph.graph_module.buffers()]
    ), "the exported program must not materialise weights"


# --------------------------------------------------------------------------- FLOPs


def test_mlp_flops_are_two_b_in_out_per_linear(traced):
    # examples/mlp.py defaults: batch B=16, widths 32 -> 64 -> 64 -> 8 (3 Linear layers).
    # A Linear on (B, in) -> (B, out) does B*out dot products of length in: 2*B*in*out FLOPs
    # (the bias add is not counted by torch's flop counter):
    #   2*16*32*64 = 65,536;  2*16*64*64 = 131,072;  2*16*64*8 = 16,384;  total 212,992.
    _, _, _, graph = traced("mlp")
    linears = [n for n in graph.nodes if n.op == "aten.linear.default"]
    assert [n.flops for n in linears] == [65_536, 131_072, 16_384]
    assert graph.total_flops == 212_992


def test_gpt_linear_flops(traced):
    # examples/gpt.py with B=8, T=32, C=64: c_attn is (B*T, C) x (C, 3C): 2*256*64*192 =
    # 6,291,456; lm_head is (B*T, C) x (C, V=256): 2*256*64*256 = 8,388,608.
    _, _, _, graph = traced("gpt")
    by_module = {n.module: n.flops for n in graph.nodes if n.op == "aten.linear.default"}
    assert by_module["blocks.0.attn.c_attn"] == 6_291_456
    assert by_module["lm_head"] == 8_388_608


class BatchedMatmul(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a, b).sum() + torch.matmul(a.unsqueeze(1), c).sum()


def test_bmm_and_matmul_flops():
    # bmm of (B=4, n=8, k=16) x (B, k=16, m=32): 4*8*32 dot products of length 16,
    # 2*4*8*16*32 = 32,768 FLOPs. matmul of (4, 1, 8, 16) x (4, 3, 16, 32) broadcasts to
    # 4*3 = 12 matrix products of 8x16 by 16x32: 2*12*8*16*32 = 98,304 FLOPs.
    with torch.device("meta"):
        a, b, c = torch.randn(4, 8, 16), torch.randn(4, 16, 32), torch.randn(4, 3, 16, 32)
    graph = trace(BatchedMatmul(), (a, b, c))
    flops = {n.op: n.flops for n in graph.nodes if n.flops}
    assert flops == {"aten.bmm.default": 32_768, "aten.matmul.default": 98_304}
    assert graph.total_flops == 32_768 + 98_304


# -------------------------------------------------------------- getitem after split


class UnevenSplit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        small, large = self.proj(x).split([2, 6], dim=1)
        return small.sum() + (large + bias[:6]).sum()


def test_getitem_after_split_reads_its_piece():
    model = meta_model(UnevenSplit)
    with torch.device("meta"):
        x, bias = torch.randn(5, 8), torch.randn(8)
    graph = trace(model, (x, bias))
    split = next(n for n in graph.nodes if n.op.startswith("aten.split"))
    assert [m.shape for m in split.output_meta] == [(5, 2), (5, 6)]
    pieces = [n for n in graph.nodes if n.op == "getitem"]
    assert [n.inputs for n in pieces] == [(split.name,), (split.name,)]
    assert [n.input_meta[0].shape for n in pieces] == [(5, 2), (5, 6)]
    assert [n.output_meta[0].shape for n in pieces] == [(5, 2), (5, 6)]
    # `bias` (8,) is not batched: only x carries the batch.
    assert [(i.name, i.batch_dim) for i in graph.inputs] == [("x", 0), ("bias", None)]
    assert graph.batch_size == 5


def test_trace_restores_training_mode(traced):
    model = meta_model(UnevenSplit).eval()
    with torch.device("meta"):
        trace(model, (torch.randn(5, 8), torch.randn(8)))
    assert not model.training


# ------------------------------------------------------------------------- failures


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:  # Python branching on a tensor value: neither tracer can take it
            return y
        return -y


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), Gate())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).mean()


def test_data_dependent_control_flow_is_a_trace_error():
    model = meta_model(Gated)
    with torch.device("meta"):
        x = torch.randn(8, 4)
    with pytest.raises(TraceError) as info:
        trace(model, (x,))
    message = str(info.value)
    assert isinstance(info.value, PlannerError) and planner.TraceError is TraceError
    assert "'body.1' (Gate)" in message, "names the innermost module that failed"
    assert "at test_trace.py:" in message and "(`if y.sum() > 0:" in message, "names the line of the model that failed"
    assert "Fix:" in message and "torch.where" in message, "says how to fix it"
    assert "\n" not in message


class MovesItsHead(nn.Module):
    """Calls .to() on a submodule in forward, as some models do to follow their input."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.body, self.head, self.how = nn.Linear(4, 4), nn.Linear(4, 2), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "device":
            self.head.to(x.device)
        elif self.how == "dtype":
            self.head.to(dtype=x.dtype)
        else:
            self.head.to(torch.float16)
        return self.head(torch.relu(self.body(x))).float().mean()


@pytest.mark.parametrize("how", ["device", "dtype"])
def test_moving_a_module_to_where_it_is_traces(how):
    """``self.head.to(x.device)`` in forward moves nothing once the model sits with its input:
    the model traces (torch.export alone cannot: it refuses to swap the head's weights), with
    the head's op in the graph, and .to() works again afterwards."""
    with torch.device("meta"):
        x = torch.randn(8, 4)
    graph = trace(meta_model(MovesItsHead, how), (x,))
    assert graph.tracer == "export"
    assert [node.module for node in graph.nodes if node.op == "aten.linear.default"] == ["body", "head"]
    assert nn.Linear(2, 2).to(torch.float64).weight.dtype == torch.float64


def test_casting_a_module_in_forward_is_one_line_naming_it():
    """A .to() that would cast the module's weights while tracing is not what a traced program
    can do: one TraceError line names the module, the call and the fix."""
    with torch.device("meta"):
        x = torch.randn(8, 4)
    with pytest.raises(TraceError) as info:
        trace(meta_model(MovesItsHead, "half"), (x,))
    message = str(info.value)
    assert "calls .to() on module 'head' (Linear)" in message and "torch.float16" in message, message
    assert "Fix:" in message and "\n" not in message


def test_no_tensor_input_is_a_trace_error():
    class Constant(nn.Module):
        def forward(self, scale: float) -> torch.Tensor:
            return torch.ones(3) * scale

    with pytest.raises(TraceError, match="no tensor with a batch dimension"):
        trace(Constant(), (2.0,))


# ------------------------------------------------------------ symbolic_trace fallback


class Scale:
    """A plain Python object: not a pytree, so torch.export rejects it as an input."""

    def __init__(self, factor: float) -> None:
        self.factor = factor


class ScaledLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: Scale) -> torch.Tensor:
        return (self.lin(x) * scale.factor).sum()


def test_symbolic_trace_fallback_when_export_rejects_the_inputs():
    model = meta_model(ScaledLinear)
    with torch.device("meta"):
        x = torch.randn(8, 4)
    with pytest.raises(ValueError, match="Unsupported input type"):
        torch.export.export(model, (x, Scale(2.0)), strict=False)

    graph = trace(model, (x, Scale(2.0)))
    assert graph.tracer == "symbolic_trace"
    assert graph.batch_size == 8
    assert [(i.name, i.batch_dim) for i in graph.inputs] == [("x", 0), ("scale", None)]
    assert {fqn: m.shape for fqn, m in graph.parameters.items()} == {"lin.weight": (3, 4), "lin.bias": (3,)}
    lin = next(n for n in graph.nodes if n.op == "module:Linear")
    assert lin.module == "lin" and lin.params == ("lin.weight", "lin.bias")
    assert lin.output_meta[0].shape == (8, 3)
    assert lin.flops == 2 * 8 * 4 * 3  # 192
    assert all(p.is_meta for p in model.parameters())


# ------------------------------------------------------------------- a 7B model


def test_llama_7b_traces_on_meta():
    # LLaMA-7B: 32 layers, hidden 4096, MLP 11008, 32 heads, vocab 32000 -> 6,738,415,616
    # parameters (untied embeddings). In fp32 that is 27 GB: only meta tensors make this fast.
    spec = ModelSpec(
        "hf:llama",
        {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32},
    )
    model, args, kwargs = spec.build("meta")
    graph = trace(model, args, kwargs)
    assert graph.parameter_count == pytest.approx(6.74e9, rel=1e-3)
    assert graph.parameter_count == sum(p.numel() for p in model.parameters())
    assert graph.blocks == {"model.layers": 32}
    assert all(p.is_meta for p in model.parameters())


# ------------------------------------------------------------- tensors made in forward

ZOO = Path(__file__).resolve().with_name("zoo_models.py")


def test_tensor_constants_made_in_forward_keep_their_values():
    """export lifts tensors a forward makes from Python data out of the graph; made on the
    meta device they hold no values, so the tracer exports again on fake CPU tensors to keep
    them (codegen writes them into the program)."""
    model, args, kwargs = ModelSpec(f"{ZOO}:tensor_constants").build("meta")
    graph = trace(model, args, kwargs)
    values = sorted((value.tolist() for value in graph.constants.values()), key=str)
    assert values == [0.5, [0, 2, 4, 6, 8, 10, 12, 14], [1.0, -2.0, 0.25, 3.0]], values
    readers = [n for n in graph.nodes if set(n.inputs) & set(graph.constants)]
    assert len(readers) == 3
    assert all(p.is_meta for p in model.parameters())  # the model's own tensors are put back


class CpuVectorInForward(nn.Module):
    """``torch.tensor([...])`` without a device: a CPU vector that a meta input cannot meet."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x):
        return (self.linear(x) * torch.tensor([1.0, -1.0])).sum()


def test_a_cpu_constant_in_forward_traces_on_meta():
    model = meta_model(CpuVectorInForward)
    with torch.device("meta"):
        x = torch.randn(4, 2)
    graph = trace(model, (x,))
    assert graph.tracer == "export"
    assert [value.tolist() for value in graph.constants.values()] == [[1.0, -1.0]]


def test_multi_output_ops_have_one_meta_per_output():
    model, args, kwargs = ModelSpec(f"{ZOO}:multi_output").build("meta")
    graph = trace(model, args, kwargs)
    outputs = {n.op: len(n.output_meta) for n in graph.nodes}
    for op in ("aten.max.dim", "aten.min.dim", "aten.topk.default", "aten.sort.default", "aten.var_mean.dim",
               "aten.aminmax.default"):
        assert outputs.get(op) == 2, (op, outputs)


class _FirstLayersDense(nn.Module):
    """``wide`` wide layers, then ``narrow`` narrow ones of one structure: a stack whose
    blocks are not all alike (as DeepSeek-V3's dense layers before its MoE ones)."""

    def __init__(self, wide: int = 2, narrow: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(wide)] + [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(narrow)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_every_run_of_alike_blocks_is_marked_with_its_kind_and_first_index():
    # Layers 0-1 repeat, then layers 2-5 repeat in another structure: two runs of one stack
    # (as DeepSeek-V3's dense layers before its MoE ones), each a kind of its own, so that
    # recomputation and pipeline stages cover both.
    graph = trace(_FirstLayersDense(), (torch.randn(4, 8),))
    assert graph.block_runs == (BlockRun("layers", 0, 2, kind=0), BlockRun("layers", 2, 4, kind=1))
    assert graph.blocks == {"layers": 6} and graph.block_start == {"layers": 0}
    assert graph.block_paths() == tuple(f"layers.{index}" for index in range(6))
    marked = {node.block for node in graph.nodes if node.block is not None}
    assert marked == {("layers", index) for index in range(6)}
    assert graph.block_run_of(("layers", 3)) == graph.block_runs[1]
    # Each run is solved once: its blocks' ops stand for by its own first block's.
    representative = block_representatives(graph)
    first_linear = {block: next(n.name for n in graph.nodes if n.block == ("layers", block) and "linear" in n.op)
                    for block in range(6)}
    assert {representative[first_linear[block]] for block in range(6)} == {first_linear[0], first_linear[2]}


def test_a_block_alike_to_neither_neighbour_stays_ordinary_ops():
    # One wide first layer, then three alike narrow ones (T5's first block, with its bias).
    graph = trace(_FirstLayersDense(wide=1, narrow=3), (torch.randn(4, 8),))
    assert graph.block_runs == (BlockRun("layers", 1, 3),) and graph.block_start == {"layers": 1}
    assert all(node.block is None for node in graph.nodes if node.module.startswith("layers.0"))
