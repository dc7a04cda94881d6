"""What an uneven tensor-parallel plan holds and moves per rank (``planner/families/uneven_tp/
costs.py``: ``rank_memories``, ``collective_seconds``), worked by hand on the GPT example
(batch 8, 32 tokens, width 64, MLP 256) on the mixed CPU cluster, and checked against the
parameters the compiled program's own ``split_linears`` leaves on each rank.

- Memory: a column split keeps rank r's ``s_r`` of the weight's and bias's output rows, a
  row split its ``s_r`` of the weight's input columns (the bias whole), a batch split all of
  it; weights, gradients and states alike. A row or batch split keeps its slice of the input
  for backward, in place of the whole input where the layer is its only reader. The plan
  reports the rank nearest its own device's capacity.
- Bytes: a batch split's weight-gradient all-reduce moves 4 bytes per element in a bf16 plan
  (the program's weights and gradients stay fp32 under autocast,
  ``cost_model.mixed_precision``), not bf16's 2.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cost_model.collectives import collective_time
from cost_model.simulator import simulated
from planner.api import prepare_model
from planner.cluster import Cluster
from planner.families.uneven_tp.candidates import replicated_plan
from planner.families.uneven_tp.costs import plan_rank_memories
from planner.families.uneven_tp.runtime import split_linears
from planner.families.uneven_tp.section import LayerSplit, UnevenTpSection
from planner.model_spec import ModelSpec

REPO = Path(__file__).resolve().parents[1]
GPT = ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8})
SPLITS = (
    # (8, 32, 64) -> 256 features with a bias: weight 256 x 64, bias 256.
    LayerSplit("blocks.0.mlp.c_fc", "column", (96, 96, 32, 32)),
    # (8, 32, 256) -> 64: weight 64 x 256 (the bias of 64 whole); its input, the gelu's
    # output, 8 x 32 x 256 x 4 = 262144 bytes, has no other reader.
    LayerSplit("blocks.0.mlp.c_proj", "row", (96, 96, 32, 32)),
    # 8 rows of (8, 32, 64): the weight whole; its input (the attention's output, a view of a
    # contiguous copy read by nothing else) 8 x 32 x 64 x 4 = 65536 bytes.
    LayerSplit("blocks.0.attn.c_proj", "batch", (3, 3, 1, 1)),
)


@pytest.fixture(scope="module")
def gpt_on_mixed() -> tuple:
    """The GPT example traced on the mixed cluster: (graph, spec, model name, cluster)."""
    return prepare_model(GPT, Cluster.load(REPO / "examples/clusters/mixed.toml"))


def split_plan(gpt_on_mixed, precision: str = "fp32", cluster: Cluster | None = None, splits=SPLITS):
    """(every op whole on every rank, ``splits`` applied), both simulated."""
    graph, spec, name, mixed = gpt_on_mixed
    base = replicated_plan(graph, cluster or mixed, spec, name, precision)
    return (simulated(base, graph),
            simulated(dataclasses.replace(base, sections={"uneven-tp": UnevenTpSection(splits)}), graph))


def program_parameter_bytes(rank: int, splits=SPLITS) -> int:
    """Bytes of the parameters rank ``rank`` of the compiled program holds: the model with its
    layers replaced as ``model_spmd.parallelize`` replaces them (no collective runs here)."""
    model, _, _ = GPT.build()
    layers = tuple((s.module, s.kind, s.shares) + ((True,) if s.fused else ()) for s in splits)
    split_linears(model, layers, rank, None)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def program_parameter_bytes_whole() -> int:
    """Bytes of the parameters of the model whole (one device)."""
    model, _, _ = GPT.build()
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_each_rank_holds_its_share_worked_by_hand(gpt_on_mixed) -> None:
    whole, plan = split_plan(gpt_on_mixed)
    w, m = whole.estimate.memory, plan.estimate.memory
    # Equal capacities (8 GiB): the fullest rank is a fast one, 96 of each 256.
    # Elements it does not hold: c_fc (256 x 64 + 256) x 160/256 = 10400, c_proj's weight
    # 64 x 256 x 160/256 = 10240; fp32 weights 4, gradients 4, AdamW states 8 bytes each.
    assert plan.estimate.device_memory_bytes == 8 * 2**30
    assert (w.weights - m.weights, w.gradients - m.gradients) == (20640 * 4, 20640 * 4)
    assert w.optimizer_states - m.optimizer_states == 20640 * 8
    # Activations: c_proj keeps 96/256 of the gelu's output instead of all of it
    # (262144 x 160/256 = 163840 fewer), attn.c_proj 3/8 of its input (65536 x 5/8 = 40960).
    assert w.activations - m.activations == 163840 + 40960
    assert m.communication_buffers == w.communication_buffers
    # The compiled program's parameters on rank 0: the whole model's less those 20640 elements.
    assert program_parameter_bytes(0) == program_parameter_bytes_whole() - 20640 * 4


def test_the_rank_nearest_its_own_capacity_is_reported(gpt_on_mixed) -> None:
    mixed = gpt_on_mixed[3]
    fast, slow = mixed.nodes
    # Fast devices of 16 GiB: a slow rank (32 of each 256) is now the nearest its capacity.
    roomy = dataclasses.replace(fast, device=dataclasses.replace(fast.device, memory_bytes=16 * 2**30))
    whole, plan = split_plan(gpt_on_mixed, cluster=dataclasses.replace(mixed, nodes=(roomy, slow)))
    w, m = whole.estimate.memory, plan.estimate.memory
    assert plan.estimate.device_memory_bytes == 8 * 2**30
    # c_fc 65 x 224 = 14560, c_proj 64 x 224 = 14336 elements not held.
    assert w.weights - m.weights == 28896 * 4
    # c_proj keeps 32/256 of the gelu's output (262144 x 224/256 = 229376 fewer), attn.c_proj
    # 1/8 of its input (65536 x 7/8 = 57344 fewer).
    assert w.activations - m.activations == 229376 + 57344
    assert program_parameter_bytes(2) == program_parameter_bytes_whole() - 28896 * 4
    # A plan that does not fit anywhere still says so, against that rank's device.
    tiny = dataclasses.replace(slow, device=dataclasses.replace(slow.device, memory_bytes=m.total - 1))
    _, crowded = split_plan(gpt_on_mixed, cluster=dataclasses.replace(mixed, nodes=(roomy, tiny)))
    assert not crowded.estimate.fits and crowded.estimate.device_memory_bytes == m.total - 1


def test_every_ranks_memory_is_kept_for_the_report(gpt_on_mixed) -> None:
    graph = gpt_on_mixed[0]
    whole, plan = split_plan(gpt_on_mixed)
    w = whole.estimate.memory.total
    fast, _, slow, _ = plan_rank_memories(plan, graph)
    # Fast ranks (96 of 256): the estimate's fullest rank, worked above: 20640 elements x
    # (4 + 4 + 8) bytes and 163840 + 40960 activation bytes fewer than the whole model's.
    assert fast.total == plan.estimate.memory.total == w - 20640 * 16 - (163840 + 40960)
    # Slow ranks (32 of 256): 28896 elements and 229376 + 57344 activation bytes fewer.
    assert slow.total == w - 28896 * 16 - (229376 + 57344)


def test_a_fused_groups_slices_and_a_bf16_batch_splits_fp32_gradients(gpt_on_mixed) -> None:
    graph = gpt_on_mixed[0]
    fused = (LayerSplit("blocks.1.mlp.c_fc", "column", (100, 90, 50, 16), fused=True),
             LayerSplit("blocks.1.mlp.c_proj", "row", (100, 90, 50, 16), fused=True),
             LayerSplit("lm_head", "batch", (1, 1, 5, 1)))
    whole, plan = split_plan(gpt_on_mixed, splits=fused)
    w, m = whole.estimate.memory, plan.estimate.memory
    # Equal capacities: rank 0 (100 of 256) is the fullest. Not held: c_fc 65 x 156 = 10140,
    # c_proj 64 x 156 = 9984 elements; activations: c_fc's output and the gelu's, each
    # 262144 bytes, 156/256 of them (159744 each); lm_head (a batch split, no bias, 1 of 8
    # rows) reads ln_f's output, which nothing else reads: 7/8 of 8 x 32 x 64 x 4 = 57344.
    assert w.weights - m.weights == 20124 * 4
    assert w.activations - m.activations == 2 * 159744 + 57344
    assert program_parameter_bytes(0, fused) == program_parameter_bytes_whole() - 20124 * 4
    # bf16: lm_head's weight-gradient all-reduce (65 x 64 elements, no bias) moves fp32.
    _, bf16 = split_plan(gpt_on_mixed, "bf16", splits=fused)
    cluster, ranks = bf16.cluster, range(4)
    head = next(n for n in graph.nodes if n.module == "lm_head" and n.op == "aten.linear.default")
    vocab, width = graph.parameters["lm_head.weight"].shape
    cost = next(s.cost for s in bf16.strategies if s.node == head.name)
    # Backward: the gather-v of the input's gradient rows (bf16 activations: 4 ranks x the
    # largest share, 5 samples x 32 rows x 64 x 2 bytes), then the all-reduce in fp32.
    gather = collective_time("all_to_all", 4 * 5 * 32 * width * 2, cluster, ranks)
    forward = collective_time("all_to_all", 4 * 5 * 32 * vocab * 2, cluster, ranks)
    reduce = collective_time("all_reduce", vocab * width * 4, cluster, ranks)
    assert cost.communication_s == pytest.approx(forward + gather + reduce, rel=1e-9)
    assert reduce > collective_time("all_reduce", vocab * width * 2, cluster, ranks)
