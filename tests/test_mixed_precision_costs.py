"""What a bf16 plan's program moves and casts, priced as it runs (``cost_model.mixed_precision``),
checked against bytes and seconds worked by hand.

The compiled bf16 program keeps fp32 weights and gradients under autocast; its FSDP2 units
gather bf16 and reduce-scatter fp32 (``codegen.runtime.precision.BF16_FSDP_POLICY``, as
torchtitan shards); outside such units autocast casts every matmul's fp32 weight each
micro-batch. ``Plan.half_precision_weights`` prices another system's 16-bit weights and
gradients instead (Megatron-LM, DeepSpeed, Composer's FSDP)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest

from cost_model.compute import roofline_time
from cost_model.simulator import simulated
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from cost_model.simulator import Simulator
from search.data_parallel import data_parallel_plan
from tests.simulation_only_fields import check_field_is_validated, check_simulation_only_field

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
WIDTH = 1024  # wide enough that a block's kernels, not the host issuing them, set its time


@functools.cache
def _model():
    """examples/gpt.py (width 1024, 2 layers), traced once, for the 8 GPUs of one DGX-H100."""
    return prepare_model(ModelSpec(GPT, {"batch_size": 64, "n_layer": 2, "n_embd": WIDTH, "n_head": 8, "seq_len": 512,
                                         "vocab_size": 512}), "dgx-h100:1")


@functools.cache
def _plan(flavour: str, half_precision_weights: bool):
    """The model over dp = 8 in bf16 as the planner's data-parallel program runs it (FSDP2
    units, one per block and the root, for fsdp and zero2), or with another system's 16-bit
    weights."""
    graph, spec, name, cluster = _model()
    plan = data_parallel_plan(graph, cluster, spec, name, flavour, precision="bf16")
    return simulated(dataclasses.replace(plan, half_precision_weights=half_precision_weights), graph)


def _durations(plan, prefix: str) -> list[float]:
    return sorted(e.duration_s for e in plan.estimate.timeline if e.device == "stage 0" and e.name.startswith(prefix))


def _autocast_activations(plan, nodes=None) -> tuple[float, float]:
    """(forward, backward) seconds autocast's fp32 activations add to one micro-batch of
    ``nodes`` (default: every op) of the planner's own bf16 program
    (``cost_model.autocast_activations``, checked by hand in tests/test_autocast_activations.py):
    its layer norms return fp32, which the next matmul casts back."""
    from cost_model.autocast_activations import add_autocast_activation_bytes
    from cost_model.node_costs import NodeCost
    graph = _model()[0]
    context = Simulator(plan, graph).node_costs.context
    strategies = {strategy.node: strategy for strategy in plan.strategies}
    total = NodeCost()
    for node in graph.nodes if nodes is None else nodes:
        add_autocast_activation_bytes(context, node, strategies[node.name], total)
    return total.forward_s, total.backward_s


def test_fsdp2_reduce_scatters_move_fp32_and_gathers_stay_bf16() -> None:
    """P parameters, dp = 8, one micro-batch. 16-bit weights: every gradient reduce-scattered
    once in bf16 (2P). The planner's FSDP2 policy: in fp32 (4P); the gathers are bf16 in both.
    The difference is 2P bytes, of which each rank sends 7/8."""
    half, own = _plan("fsdp", True), _plan("fsdp", False)
    parameters = half.summary.parameters
    difference = own.estimate.bytes_per_axis["dp"] - half.estimate.bytes_per_axis["dp"]
    assert difference == pytest.approx(2 * parameters * 7 / 8)
    assert own.estimate.step_time_s > half.estimate.step_time_s
    # (equal up to rounding: a timeline's durations are finish - start, and the copy-in before
    # each gather, which reads the fp32 shard of one and the 16-bit shard of the other, moves
    # their starts)
    assert _durations(own, "all-gather") == pytest.approx(_durations(half, "all-gather"), rel=1e-12)
    assert all(slow > fast for slow, fast in zip(_durations(own, "reduce-scatter"), _durations(half, "reduce-scatter")))
    # Inside the units the weights are bf16 already: no weight is cast; the forward differs by
    # the fp32 activations autocast leaves (16-bit runs keep theirs 16-bit), up to the
    # nanosecond the timeline's finish - start rounding leaves.
    forward = sum(_durations(own, "F0 ")) - sum(_durations(half, "F0 "))
    assert forward > 0 and forward == pytest.approx(_autocast_activations(own)[0], abs=1e-8)


def test_ddp_all_reduces_fp32_gradients_and_autocast_casts_every_matmul_weight() -> None:
    """DDP, P parameters, dp = 8: the ring all-reduce sends 2 x 7/8 of the gradient, 4P bytes
    in fp32 against 2P for 16-bit gradients. Each block's four Linear layers (c_attn 3h x h,
    attention c_proj h x h, c_fc 4h x h, mlp c_proj h x 4h, each with its bias: 12h^2 + 9h
    elements in 8 tensors) are cast by autocast once per forward, 4 bytes read and 2 written
    per element, a memory-bound kernel per tensor; the embeddings and norms are not (their
    ops are not on autocast's bf16 list)."""
    half, own = _plan("ddp", True), _plan("ddp", False)
    parameters = half.summary.parameters
    assert own.estimate.bytes_per_axis["dp"] == pytest.approx(2 * 7 / 8 * 4 * parameters)
    assert half.estimate.bytes_per_axis["dp"] == pytest.approx(2 * 7 / 8 * 2 * parameters)
    h = WIDTH
    tensors = [3 * h * h, 3 * h, h * h, h, 4 * h * h, 4 * h, 4 * h * h, h]
    assert sum(tensors) == 12 * h * h + 9 * h
    device = own.cluster.device_of(0)
    casts = sum(roofline_time(0.0, 6 * n, device, "bfloat16") for n in tensors)
    graph = _model()[0]
    block = [node for node in graph.nodes if node.module.startswith("blocks.0")]
    own_costs, half_costs = (Simulator(plan, graph).node_costs for plan in (own, half))
    strategies = {strategy.node: strategy for strategy in own.strategies}
    forward, backward = 0.0, 0.0
    for node in block:
        mine, theirs = (costs.compute(node, strategies[node.name], edges=[]) for costs in (own_costs, half_costs))
        forward += mine.forward_s - theirs.forward_s
        backward += mine.backward_s - theirs.backward_s
    # Beside the weight casts, autocast's fp32 activations (its layer norms' outputs, cast
    # again by the matmuls that read them).
    activations = _autocast_activations(own, block)
    assert forward == pytest.approx(casts + activations[0], rel=1e-9)
    assert backward == pytest.approx(casts + activations[1], rel=1e-9)  # the gradients cast back to fp32
    assert own.estimate.step_time_s > half.estimate.step_time_s


def test_zero2_units_take_the_policy_and_ddp_does_not() -> None:
    """ZeRO-2's FSDP2 units: bf16 gathers (2 bytes), fp32 reduce-scatters (4 bytes) and no
    weight casts, per rank 7/8 of (2P + 4P) bytes."""
    own, half = _plan("zero2", False), _plan("zero2", True)
    parameters = own.summary.parameters
    assert own.estimate.bytes_per_axis["dp"] == pytest.approx(7 / 8 * (2 + 4) * parameters)
    forward = sum(_durations(own, "F0 ")) - sum(_durations(half, "F0 "))
    assert forward == pytest.approx(_autocast_activations(own)[0], abs=1e-8)


def test_the_field_needs_a_16_bit_precision_and_is_refused_by_compile(tmp_path) -> None:
    plan = _plan("fsdp", True)
    check_field_is_validated(plan, "half_precision_weights", {"precision": "fp32"},
                             "'half_precision_weights' is true but the plan is in fp32")
    check_simulation_only_field(plan, "half_precision_weights", tmp_path)


def test_a_plan_file_naming_the_retired_fsdp_fp32_reduce_still_loads(tmp_path) -> None:
    """``fsdp_fp32_reduce`` priced torchtitan's policy for simulated plans; every bf16 FSDP2
    program runs it now, so a plan file naming it loads as the planner's own program."""
    import json

    from planner.plans import load_plan

    plan = _plan("fsdp", False)
    plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    data["fsdp_fp32_reduce"] = True
    (tmp_path / "old.json").write_text(json.dumps(data))
    loaded = load_plan(tmp_path / "old.json")
    assert not loaded.half_precision_weights and loaded.estimate == plan.estimate
