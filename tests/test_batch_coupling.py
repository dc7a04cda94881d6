"""Which models mix the samples of their batch (``search.batch_coupling``), so that a step on
slices of the batch (DP wrappers, accumulation, pipeline micro-batches) would differ."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import planner
from planner.api import prepare_model
from planner.errors import PlanningError
from planner.model_spec import ModelSpec
from search.batch_coupling import batch_coupled_ops, coupling_warning

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class Head(nn.Module):
    """A linear classifier whose loss is shaped by ``loss``; dim 0 of ``x`` is the batch."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.loss = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.fc(x)
        if self.loss == "centred":  # each sample minus the batch mean: samples mix
            logits = logits - logits.mean(dim=0, keepdim=True)
        if self.loss == "running":  # a running count over the batch (as MoE routing keeps)
            logits = logits.cumsum(dim=0)
        ce = F.cross_entropy(logits, y)
        if self.loss == "product":  # two batch means multiplied: not a mean of per-sample terms
            return ce * logits.mean()
        if self.loss == "inverse":  # 1 / mean is not the mean of 1 / x
            return 1.0 / ce
        if self.loss == "regularised":  # a mean plus a term every rank computes alike: exact
            return ce + 0.01 * (self.fc.weight ** 2).sum() * 2.0
        return ce


def coupled(loss: str) -> list[str]:
    graph, *_ = prepare_model(Head(loss), "cpu:1x2", (torch.randn(8, 8), torch.randint(0, 4, (8,))))
    return [op.op for op in batch_coupled_ops(graph)]


@pytest.mark.parametrize("loss", ["plain", "regularised"])
def test_independent_samples_are_not_flagged(loss):
    assert coupled(loss) == []


@pytest.mark.parametrize(
    ("loss", "where"),
    [("centred", "aten.sub.Tensor"), ("running", "aten.cumsum.default"), ("product", "aten.mul.Tensor"),
     ("inverse", "aten.reciprocal.default")],
)
def test_mixing_samples_is_flagged_where_it_happens(loss, where):
    found = coupled(loss)
    assert found and found[0].startswith(where.rsplit(".", 1)[0]), found


def test_moe_routing_is_flagged_in_its_moe_modules_and_dense_models_are_not():
    moe, *_ = prepare_model(ModelSpec(str(EXAMPLES / "moe.py"), {"moe_every": 2, "n_layer": 4}), "cpu:1x2")
    modules = {op.module.split(".moe")[0] + ".moe" for op in batch_coupled_ops(moe)}
    assert modules == {"blocks.1.moe", "blocks.3.moe"}  # every other block is MoE
    assert "blocks.1.moe, blocks.3.moe" in coupling_warning(batch_coupled_ops(moe))
    for example in ("gpt.py", "llama.py"):
        graph, *_ = prepare_model(ModelSpec(str(EXAMPLES / example), {}), "cpu:1x2")
        assert batch_coupled_ops(graph) == [], example


def test_data_parallelism_is_refused_in_one_line_for_such_a_model():
    with pytest.raises(PlanningError) as info:
        planner.plan(ModelSpec(str(EXAMPLES / "moe.py"), {}), "cpu:1x4", dp_flavour="ddp", progress=False)
    message = str(info.value)
    assert "\n" not in message and "mixes the samples of its batch in blocks.0.moe, blocks.1.moe" in message
    assert "plan it without --dp" in message
