"""The compile-time dry run (codegen/dry_run.py) and what graph codegen writes from it.

The dry run runs a generated program once as rank 0 of a fake process group on meta
tensors. Besides ops DTensor cannot run, it must catch ops DTensor runs *wrongly*: a
convolution whose weight is split over ``tp`` comes out of DTensor's convolution handler as a
slice of the channels that DTensor calls whole. The program then runs that op on whole
inputs, and says why. (``tests/test_zoo.py`` runs this program and checks it against one
device.) Also here: tensor constants written into the program through ``repr`` only.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import planner
from codegen.spmd_literals import MAX_CONSTANT_ELEMENTS, tensor_literal
from planner.api import prepare_model
from planner.errors import PlanningError
from planner.model_spec import ModelSpec
from planner.strategy import Mesh
from search.node_candidates import node_strategies
from search.plan_builder import unsimulated_plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
R = Replicate()


def tp_plan(spec: ModelSpec, world: int = 2, split_convolutions: bool = False) -> planner.Plan:
    """``spec`` on a ``tp`` mesh of ``world`` ranks, every op replicated (a graph program);
    with ``split_convolutions`` the convolutions' weights (and biases) are split on output
    channels: right by arithmetic, wrong on DTensor (the rules no longer offer it; a plan
    file could still say it)."""
    graph, spec, name, cluster = prepare_model(spec, f"cpu:1x{world}")
    mesh = Mesh((("tp", world),))
    options = node_strategies(graph, mesh)
    strategies = []
    for node in graph.nodes:
        strategy = options[node.name][0]  # all-replicate
        if split_convolutions and node.op.startswith("aten.conv"):
            split = (R,), (Shard(0),), (Shard(0),)
            strategy = dataclasses.replace(
                strategy, inputs=split, outputs=((Shard(1),),), params=dict(zip(node.params, split[1:]))
            )
        strategies.append(strategy)
    strategies = tuple(strategies)
    inputs = {i.name: (R,) if i.meta else None for i in graph.inputs}
    return unsimulated_plan(graph, cluster, spec, name, mesh, strategies, inputs)


def conv_weights_split_plan(world: int = 2) -> planner.Plan:
    """examples/cnn.py on ``tp`` with its convolution weights split (see ``tp_plan``)."""
    return tp_plan(ModelSpec(str(EXAMPLES / "cnn.py"), {"batch_size": 8}), world, split_convolutions=True)


def test_a_convolution_dtensor_gets_wrong_runs_on_whole_inputs(tmp_path):
    folder = planner.compile(conv_weights_split_plan(), tmp_path / "cnn_conv_split")
    source = (folder / "model_spmd.py").read_text()
    convolutions = [line for line in source.splitlines() if "aten.conv2d.default" in line and " = " in line]
    assert len(convolutions) == 3
    assert all("self._replicated(aten.conv2d.default," in line for line in convolutions), convolutions
    assert source.count("# DTensor runs conv2d on these placements but gets it wrong:") == 3
    # The first convolution: 16 output channels, split over 2 ranks, labelled whole.
    assert "its result on rank 0 is (8, 8, 16, 16) where (R) of the traced (8, 16, 16, 16) promise (8, 16, 16, 16)" in source
    assert "WARNING" not in source  # the dry run ran to the end


def test_functional_dropout_reads_its_float_attribute_at_run_time(tmp_path):
    """F.dropout(x, self.p, ...) and dropout_p=self.attention_dropout: the program reads the
    attributes live, so --check switching them off holds when backward recomputes a block."""
    spec = ModelSpec(str(Path(__file__).resolve().with_name("zoo_models.py")) + ":functional_dropout", {})
    source = (planner.compile(tp_plan(spec), tmp_path / "dropout") / "model_spmd.py").read_text()
    table = source[source.index("DROPOUT_MODULES = {") : source.index("}", source.index("DROPOUT_MODULES = {"))]
    # Op names end in a digest of what the op computes (planner.node_names): compared by base.
    entries = [(re.sub(r"_[0-9a-f]{6}(_\d+)?$", "", name), value) for name, value in re.findall(r"'(\w+)': (.+),", table)]
    assert sorted(entries) == [
        ("dropout", "'dropout'"),  # the nn.Dropout module
        ("dropout", "('', 'p')"),
        ("scaled_dot_product_attention", "('', 'attention_dropout')"),
    ], table


# ---------------------------------------------------------------- tensor constants


class _Rank:
    device = torch.device("cpu")


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor(0.5),
        torch.tensor([[1, -2], [3, 4]]),
        torch.tensor([1.0, float("inf"), float("-inf"), float("nan")]),
        torch.tensor([True, False]),
        torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
    ],
    ids=["scalar", "int matrix", "non-finite", "bool", "bf16"],
)
def test_tensor_constants_are_written_as_literals(value):
    source = tensor_literal(value, "c_lifted_tensor_0")
    rebuilt = eval(source, {"torch": torch, "float": float}, {"self": _Rank()})  # noqa: S307 - the code under test
    assert rebuilt.dtype == value.dtype and rebuilt.shape == value.shape
    assert torch.equal(rebuilt.nan_to_num(), value.nan_to_num()) and math.isnan(float(rebuilt.flatten()[-1])) == (
        math.isnan(float(value.flatten()[-1]))
    )


CPU_VECTOR_MODEL = """
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return (self.linear(x) * torch.tensor([1.0, -1.0, 2.0, 0.5])).pow(2).mean()


def build(batch_size=8):
    return Scaled(), (torch.randn(batch_size, 4),)
"""


def test_a_constant_made_without_a_device_compiles(tmp_path):
    """torch.tensor([...]) without a device is a CPU tensor that meta inputs cannot meet: the
    tracer and codegen's look at the model's output both have to cope."""
    (tmp_path / "scaled.py").write_text(CPU_VECTOR_MODEL)
    folder = planner.compile(tp_plan(ModelSpec(str(tmp_path / "scaled.py"), {})), tmp_path / "out")
    source = (folder / "model_spmd.py").read_text()
    assert "= torch.tensor([1.0, -1.0, 2.0, 0.5], dtype=torch.float32, device=self.device)" in source


def test_big_or_odd_constants_are_refused_with_one_line():
    with pytest.raises(PlanningError, match="register it as a buffer"):
        tensor_literal(torch.zeros(MAX_CONSTANT_ELEMENTS + 1), "c_big")
    with pytest.raises(PlanningError, match="complex64"):
        tensor_literal(torch.zeros(2, dtype=torch.complex64), "c_complex")
