"""``--check`` switches off randomness (codegen/runtime/randomness.py), in one process.

Dropout modules, stochastic-depth modules, functional dropout with a float probability,
ATen dropout ops (what graph programs call) and attention's ``dropout_p`` are all switched
off, and counted; random ops it cannot switch off are named. The distributed side (the
reference and the sharded run switched off alike) is checked by the zoo's parity launches
(tests/test_zoo.py).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointError, checkpoint

from codegen.runtime.randomness import (
    NoDropout,
    RandomnessReport,
    switch_off_dropout_attributes,
    switch_off_dropout_modules,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo_models  # noqa: E402 - the zoo's models live beside the tests


def test_functional_and_aten_dropout_become_the_identity():
    x = torch.randn(16, 16, requires_grad=True)
    report = RandomnessReport()
    with NoDropout(report):
        results = [
            F.dropout(x, 0.5, True),
            F.dropout(x, p=0.3, training=True),
            torch.dropout(x, 0.2, True),
            torch.ops.aten.dropout.default(x, 0.4, True),
            torch.ops.aten.native_dropout.default(x, 0.4, True)[0],
            F.dropout2d(x.view(1, 16, 4, 4), 0.5, True).view(16, 16),
        ]
        F.dropout(x, 0.0, True)  # nothing to switch off: not counted
        F.dropout(x, 0.5, False)  # not training: not counted
    assert all(torch.equal(result, x) for result in results)
    assert report.functional_dropout_calls == len(results)
    results[3].sum().backward()  # still differentiable: the identity's gradient
    assert torch.equal(x.grad, torch.ones_like(x))


def test_attention_dropout_p_becomes_zero():
    q, k, v = (torch.randn(2, 2, 5, 4) for _ in range(3))
    report = RandomnessReport()
    with NoDropout(report):
        functional = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        aten = torch.ops.aten.scaled_dot_product_attention.default(q, k, v, None, 0.5)
        F.scaled_dot_product_attention(q, k, v)  # no dropout: not counted
    expected = F.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(functional, expected) and torch.allclose(aten, expected)
    assert report.attention_dropout_calls == 2


def test_random_ops_that_are_not_dropout_are_named_not_changed():
    report = RandomnessReport()
    with NoDropout(report):
        torch.rand(3)
        torch.randn(2, 2).bernoulli_(0.5)
    with NoDropout(counting=False):
        torch.rand(3)  # the sharded run's calls are not counted again
    assert dict(report.other_random_calls) == {"rand": 1, "randn": 1, "bernoulli_": 1}
    assert "random ops left on" in report.line() and "rand x1" in report.line()


def test_a_model_with_every_kind_of_dropout_runs_deterministically():
    torch.manual_seed(0)
    model, (ids, labels) = zoo_models.functional_dropout()
    model.train()
    report = switch_off_dropout_modules(model)
    assert model.dropout.p == 0.0 and model.p == 0.1  # the float attribute is left; its calls are switched off
    with NoDropout(report):
        first = model(ids, labels)
    with NoDropout(counting=False):
        second = model(ids, labels)
    assert torch.equal(first, second)
    assert torch.equal(first, model.eval()(ids, labels))  # what evaluation mode computes
    assert report.line() == (
        "--check: switched off randomness: 1 nn.Dropout module, 1 functional dropout call, "
        "attention dropout_p in 1 SDPA call"
    )


def test_probability_attributes_are_found_and_switched_off_for_recomputation():
    """The mode is not active when backward recomputes a checkpointed block; the float
    attributes the reference run found are set to 0 so the recomputation draws nothing."""
    torch.manual_seed(0)
    model, (ids, labels) = zoo_models.functional_dropout()
    report = switch_off_dropout_modules(model)
    reference = copy.deepcopy(model)
    no_dropout = NoDropout(report)
    with no_dropout:
        reference(ids, labels).backward()
    assert no_dropout.attributes_in(reference) == [("", "attention_dropout"), ("", "p")]
    switch_off_dropout_attributes(model, no_dropout.attributes_in(reference), report)
    assert model.p == 0.0 and model.attention_dropout == 0.0
    with NoDropout(counting=False):
        checkpoint(model, ids, labels, use_reentrant=False).backward()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, msg=name)
    assert report.line().endswith("attention dropout_p in 1 SDPA call, 2 float dropout attributes set to 0")


def test_without_the_attributes_recomputation_would_draw_new_masks():
    """Why the attributes matter: under the mode alone, backward's recomputation runs dropout
    (here attention takes another path with dropout on, and checkpoint notices)."""
    torch.manual_seed(0)
    model, (ids, labels) = zoo_models.functional_dropout()
    with NoDropout(), pytest.raises(CheckpointError, match="different metadata"):
        checkpoint(model, ids, labels, use_reentrant=False).backward()


class DropPath(nn.Module):
    """timm's stochastic depth: drops whole samples with probability ``drop_prob``."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1 - self.drop_prob
        return x / keep * torch.floor(torch.rand(x.shape[0], 1) + keep)


def test_stochastic_depth_modules_are_switched_off():
    model = nn.Sequential(nn.Linear(4, 4), DropPath(0.5), nn.Dropout(0.0))
    report = switch_off_dropout_modules(model)
    assert model[1].drop_prob == 0.0
    assert (report.dropout_modules, report.drop_path_modules) == (0, 1)  # p=0 already: nothing to switch
    assert report.line() == "--check: switched off randomness: 1 drop-path module"
    assert RandomnessReport().line() == "--check: no dropout found to switch off"


def test_random_ops_only_the_sharded_program_runs_are_named():
    # A graph program replays a drop-path module's traced torch.rand with the traced keep
    # probability, though the module's probability is 0 in both runs (hf:beit, hf:swinv2
    # under tensor parallelism): --check says so rather than fail without a reason.
    report = RandomnessReport()
    with NoDropout(report):
        torch.randn(2)
    program_run = NoDropout(counting=False)
    with program_run:
        torch.randn(2)
        torch.rand(4, 1, 1)
    report.note_program_random_ops(program_run.report)
    assert report.program_only_random_ops == ("rand",)
    assert "random ops only the sharded program ran" in report.line() and report.line().endswith(": rand")
