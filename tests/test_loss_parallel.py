"""A cross entropy on logits split over the classes: what Megatron's layout plans for it
(``search.rules.conventions``, followed by ``search.rules.choice.follow``) and what the simulator charges (``cost_model.loss_parallel``).

The program runs it with PyTorch's ``loss_parallel`` (``codegen.runtime.loss_parallel``);
its parity is checked by ``tests/test_spmd_parity.py`` (GPT and llama under Megatron's layout,
fp32 and bf16, on ``tp=2`` and ``dp=2 x tp=2``) and its bytes by ``tests/test_comm_audit.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from cost_model.collectives import collective_time
from cost_model.simulator import Simulator
from planner.api import prepare_model
from planner.graph import OpNode, TensorMeta
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan
from search.rules.choice import follow

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
# examples/gpt.py: vocabulary 256, 32 positions; a global batch of 8 gives 256 rows of logits.
ROWS, VOCABULARY = 8 * 32, 256


def _loss_node(attrs: tuple = (None, None), inputs: int = 2) -> OpNode:
    shapes = [(ROWS, VOCABULARY), (ROWS,), (VOCABULARY,)][:inputs]
    dtypes = [torch.float32, torch.int64, torch.float32][:inputs]
    return OpNode(
        name="cross_entropy_loss", op="aten.cross_entropy_loss.default", inputs=tuple(f"in{i}" for i in range(inputs)),
        input_meta=tuple(TensorMeta(s, d) for s, d in zip(shapes, dtypes)), output_meta=(TensorMeta((), torch.float32),),
        attrs=attrs,
    )


def test_class_split_logits_stay_split_and_give_the_whole_loss() -> None:
    wanted, outputs = follow(_loss_node(), (Shard(1), Replicate()), 2, conventions=True)
    assert wanted == (Shard(1), Replicate()) and outputs == (Replicate(),)


@pytest.mark.parametrize(
    "node",
    [_loss_node((None, None, None, 1, -100, 0.1)), _loss_node((None, None, None), inputs=3)],
    ids=["label smoothing", "class weights"],
)
def test_losses_loss_parallel_cannot_run_gather_the_logits(node: OpNode) -> None:
    """``loss_parallel`` takes neither label smoothing nor class weights: the plan gathers
    the logits (an all-gather the simulator prices as an edge)."""
    wanted, outputs = follow(node, (Shard(1),) + (Replicate(),) * (len(node.inputs) - 1), 2, conventions=True)
    assert all(p == Replicate() for p in wanted) and outputs == (Replicate(),)


@pytest.mark.parametrize("dp", [1, 2])
def test_vocabulary_parallel_loss_all_reduces_three_values_per_row(dp: int) -> None:
    """Worked by hand: GPT under Megatron's layout on tp=2 (dp=1 or 2), fp32. The logits
    (256 rows, 256 classes) are split over tp by classes and over dp by rows, so a rank
    holds 256/dp rows; forward all-reduces each row's max, sum of exponentials and target
    log-probability over tp: 3 all-reduces of 256/dp x 4 B, each sending 2(2-1)/2 = 1x its
    size. Backward sends nothing."""
    graph, spec, name, cluster = prepare_model(ModelSpec(GPT, {"batch_size": 8}), f"cpu:1x{2 * dp}")
    plan = megatron_plan(graph, cluster, spec, name, tp=2, precision="fp32")
    simulator = Simulator(plan, graph)
    loss = next(node for node in graph.nodes if node.op == "aten.cross_entropy_loss.default")
    strategy = simulator.context.strategies[loss.name]
    tp = plan.mesh.names.index("tp")
    assert strategy.inputs[0][tp] == Shard(1) and strategy.outputs[0][tp] == Replicate()
    cost = simulator.costs[loss.name]
    size_bytes = ROWS // dp * 4
    assert cost.axis_bytes == {"tp": pytest.approx(3 * size_bytes)}
    ranks, concurrent, _ = simulator.context.groups["tp"]
    one = collective_time("all_reduce", size_bytes, simulator.context.cluster, ranks, concurrent) + simulator.context.redistribute_overhead_s
    assert cost.forward_comm_s == pytest.approx(3 * one)
    assert cost.backward_comm_s == 0.0


def test_only_losses_loss_parallel_takes_are_priced_as_such() -> None:
    """A plan that splits the classes of a label-smoothed or weighted loss anyway (by hand)
    runs it through DTensor's rule: no ``loss_parallel`` all-reduces are charged for it."""
    from cost_model.loss_parallel import class_axis
    from planner.strategy import NodeStrategy

    def strategy(inputs: int) -> NodeStrategy:
        placements = ((Shard(1),), (Replicate(),), (Replicate(),))[:inputs]
        return NodeStrategy("cross_entropy_loss", "aten.cross_entropy_loss.default", "", placements, ((Replicate(),),))

    assert class_axis(_loss_node(), strategy(2)) == 0
    assert class_axis(_loss_node((None, None, None, 1, -100, 0.1)), strategy(2)) is None
    assert class_axis(_loss_node((None, None, None), inputs=3), strategy(3)) is None
