"""Per-shard initialisation (``codegen.runtime.materialize``), in one process: a parameter's
values depend only on its name and shape, whatever block of it is drawn; the distributions
are PyTorch's defaults; a model built with ``parameters_on_meta`` keeps its buffers and tied
weights. The distributed side (shards of real plans) is in ``test_checkpoint.py``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from codegen.runtime import materialize as mat
from codegen.runtime.materialize import (
    InitRule,
    draw_region,
    init_rule,
    init_rules,
    materialize,
)
from planner.model_spec import parameters_on_meta


def _whole(rule: InitRule, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.empty(shape)
    for first, block in draw_region(rule, 0, name, shape, (0,) * len(shape), shape):
        out[first : first + block.shape[0]] = block
    return out


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_any_block_equals_the_same_slice_of_the_whole(monkeypatch, chunk: int) -> None:
    monkeypatch.setattr(mat, "CHUNK_ELEMENTS", chunk)
    rule = InitRule("uniform", -0.5, 0.5)
    shape = (13, 5, 3)
    whole = _whole(rule, "layer.weight", shape)
    for offset, local in [((0, 0, 0), (7, 5, 3)), ((7, 2, 1), (6, 3, 2)), ((12, 0, 0), (1, 5, 3)), ((4, 4, 0), (9, 1, 3))]:
        got = torch.empty(local)
        for first, block in draw_region(rule, 0, "layer.weight", shape, offset, local):
            got[first : first + block.shape[0]] = block
        index = tuple(slice(o, o + n) for o, n in zip(offset, local))
        assert torch.equal(got, whole[index]), (offset, local)


def test_chunk_size_changes_nothing_but_the_names_do(monkeypatch) -> None:
    rule = InitRule("normal", 0.0, 1.0)
    monkeypatch.setattr(mat, "CHUNK_ELEMENTS", 16)
    small = _whole(rule, "w", (10, 10))
    assert not torch.equal(small, _whole(rule, "v", (10, 10)))  # another name, other values
    assert torch.equal(small, _whole(rule, "w", (10, 10)))  # deterministic
    # The chunks tile the flat tensor: chunk 1 starts at element 16 whatever block asks for it.
    assert torch.equal(small.flatten()[16:32], _whole(rule, "w", (10, 10)).flatten()[16:32])


def test_rules_are_pytorch_defaults() -> None:
    linear = nn.Linear(12, 4)
    assert init_rule(linear, "weight", (4, 12)) == InitRule("uniform", -1 / math.sqrt(12), 1 / math.sqrt(12))
    assert init_rule(linear, "bias", (4,)) == InitRule("uniform", -1 / math.sqrt(12), 1 / math.sqrt(12))
    conv = nn.Conv2d(3, 8, kernel_size=(2, 5))
    assert init_rule(conv, "weight", (8, 3, 2, 5)).high == pytest.approx(1 / math.sqrt(3 * 2 * 5))
    assert init_rule(nn.Embedding(9, 4, padding_idx=2), "weight", (9, 4)) == InitRule("normal", 0.0, 1.0, 2)
    norm = nn.LayerNorm(4)
    assert init_rule(norm, "weight", (4,)) == InitRule("constant", 1.0)
    assert init_rule(norm, "bias", (4,)) == InitRule("constant", 0.0)


def test_drawn_values_follow_the_rule() -> None:
    bound = 1 / math.sqrt(64)
    values = _whole(InitRule("uniform", -bound, bound), "w", (256, 64))
    assert values.min() >= -bound and values.max() < bound
    assert values.mean().abs() < 0.01 * bound * 10 and values.std() == pytest.approx(bound / math.sqrt(3), rel=0.02)
    normal = _whole(InitRule("normal", 0.0, 1.0, zero_row=3), "e", (200, 50))
    assert normal.std() == pytest.approx(1.0, rel=0.03) and torch.all(normal[3] == 0) and torch.all(normal[4] != 0)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.arange(6.0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens)) * self.scale)


def test_meta_build_keeps_buffers_and_ties_and_materializes_whole() -> None:
    with parameters_on_meta():
        model = Tied()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert torch.equal(model.scale, torch.arange(6.0))  # buffers are built for real
    rules = init_rules(model)
    assert set(rules) == {"embed.weight", "norm.weight", "norm.bias"}  # the tied head is embed.weight
    size = materialize(model, model, torch.device("cpu"), rules)
    assert size == (11 * 6 + 6 + 6) * 4
    assert model.head.weight is model.embed.weight and model.embed.weight.device.type == "cpu"
    assert torch.equal(model.embed.weight, _whole(rules["embed.weight"], "embed.weight", (11, 6)))
    assert torch.equal(model.norm.weight, torch.ones(6)) and torch.equal(model.norm.bias, torch.zeros(6))
    model(torch.tensor([1, 2])).sum().backward()  # a trainable leaf: gradients arrive
    assert model.embed.weight.grad is not None


def test_hooks_survive_materialization() -> None:
    with parameters_on_meta():
        model = nn.Linear(3, 2)
    seen = []
    model.weight.register_hook(lambda grad: seen.append(grad.shape))
    materialize(model, model, torch.device("cpu"), init_rules(model))
    model(torch.ones(1, 3)).sum().backward()
    assert seen == [torch.Size([2, 3])]


class Recurrent(nn.Module):
    """An LSTM (two layers, bidirectional) then a GRU: layers that keep weak references to their weights."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(8, 5, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(self.lstm(x)[0])[0]


def test_recurrent_layers_materialise_and_run_on_their_values() -> None:
    """nn.RNNBase keeps a weak reference to each weight, which torch.utils.swap_tensors
    refuses: materialising must still give every weight its values, and the layers must run
    on them (the same output as the same model built with those values directly)."""
    with parameters_on_meta():
        model = Recurrent()
    rules = init_rules(model)
    materialize(model, model, torch.device("cpu"), rules)
    assert all(p.device.type == "cpu" for p in model.parameters())
    reference = Recurrent()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(_whole(rules[name], name, tuple(param.shape)))
    for name, param in model.named_parameters():
        assert torch.equal(param, reference.get_parameter(name)), name
    # The layers' own tables point at the materialised weights: the forward reads them.
    assert all(a is b for a, b in zip(model.lstm._flat_weights, model.lstm.parameters()))
    assert all(ref() is w for ref, w in zip(model.gru._flat_weight_refs, model.gru._flat_weights))
    x = torch.randn(2, 6, 3)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_parameter_the_model_does_not_hold_is_refused() -> None:
    with parameters_on_meta():
        model = nn.Linear(3, 2)
    stray = nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match="not a parameter of the model"):
        materialize(stray, model, torch.device("cpu"), init_rules(model))


def test_huggingface_models_draw_from_their_initializer_range() -> None:
    class Config:
        initializer_range = 0.02

    class Hf(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = Config()
            self.wte = nn.Embedding(7, 4, padding_idx=0)
            self.proj = nn.Linear(4, 4)
            self.ln = nn.LayerNorm(4)

    with parameters_on_meta():
        rules = init_rules(Hf())
    assert rules == {
        "wte.weight": InitRule("normal", 0.0, 0.02, 0), "proj.weight": InitRule("normal", 0.0, 0.02),
        "proj.bias": InitRule("constant", 0.0), "ln.weight": InitRule("constant", 1.0), "ln.bias": InitRule("constant", 0.0),
    }


class Experts(nn.Module):
    """Stacked experts as an MoE model holds them: (experts, width, ffn)."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(5, 3, 8))


def test_derived_parameters_get_their_part_of_the_model_weight(monkeypatch) -> None:
    """A runtime layer keeping experts 3 and 1 (rows), or ffn units [2, 6) of every expert (a
    range on dim 2), holds exactly that part of what the whole weight is initialised with,
    drawn in chunks smaller than one expert; the whole source keeps its own name's values."""
    monkeypatch.setattr(mat, "CHUNK_ELEMENTS", 7)
    with parameters_on_meta():
        model = nn.Module()
        model.experts = Experts()
    rules = init_rules(model)
    source_names = mat.parameter_names(model)
    source = model.experts.w_in
    model.placed, model.sliced, model.copied = nn.Module(), nn.Module(), nn.Module()
    mat.set_derived_parameter(model.placed, "w_in", source, rows=[3, 1])
    mat.set_derived_parameter(model.sliced, "w_in", source, dim=2, start=2, stop=6)
    mat.set_derived_parameter(model.copied, "w_in", source)
    del model.experts  # the layer the program replaced
    materialize(model, model, torch.device("cpu"), rules, source_names=source_names)
    whole = _whole(rules["experts.w_in"], "experts.w_in", (5, 3, 8))
    assert torch.equal(model.placed.w_in, whole[[3, 1]])
    assert torch.equal(model.sliced.w_in, whole[:, :, 2:6])
    assert torch.equal(model.copied.w_in, whole)
    assert mat.derived_parameters(model)["placed.w_in"].source_name == "experts.w_in"
    # On real tensors the part is copied at once; the record keeps the source's shape, not its values.
    real = torch.arange(24.0).reshape(4, 6)
    holder = nn.Module()
    assert torch.equal(mat.set_derived_parameter(holder, "w", real, rows=[2], dim=1, start=1, stop=3), real[[2], 1:3])
    record = mat.derived_parameters(holder)["w"]
    assert record.source.device.type == "meta" and record.source.shape == real.shape and record.rows == (2,)
    assert mat.name_derived_sources(holder, {"table": real}) == 1
    assert mat.derived_parameters(holder)["w"].source_name == "table"
