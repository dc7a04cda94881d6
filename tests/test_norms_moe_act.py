"""Megatron-Core's ``--recompute-modules layernorm moe_act`` as the plan mode ``norms_moe_act``
(``planner.strategy.NORMS_MOE_ACT``, ``cost_model.recompute``), and the activations a traced
transformers decoder keeps (``cost_model.node_costs``), worked by hand on the tiny
``hf:qwen3_moe`` of ``tests/moe_plans.py``: width 32, 4 heads of 8, 4 experts of width 40,
top-2, SwiGLU; 8 sequences of 8 tokens over 2 CPU ranks (expert parallel over dp), fp32. A
rank's micro-batch is 32 tokens: a (tokens, 32) activation is 32 x 32 x 4 = 4,096 bytes, a
per-token scalar 32 x 4 = 128 bytes."""

from __future__ import annotations

import pytest

from cost_model.memory_kernels import STREAMING_EFFICIENCY
from cost_model.recompute import activation_bytes, backward_time
from cost_model.simulator import Simulator
from moe_plans import HF_MOE, hf_moe_plan
from planner.api import compile_blocker, prepare_model
from planner.model_spec import ModelSpec
from planner.strategy import NORMS_MOE_ACT, RECOMPUTE_MODES


@pytest.fixture(scope="module")
def simulated():
    graph, _, _, _ = prepare_model(ModelSpec("hf:qwen3_moe", HF_MOE["qwen3_moe"]), "cpu:1x2")
    plan = hf_moe_plan(2, "qwen3_moe", "expert_parallel")
    simulator = Simulator(plan, graph)
    block = next(segment for segment in simulator.segments() if segment.block)
    return graph, plan, simulator, block


def _kept(graph, simulator, module: str) -> dict[str, float]:
    """Saved bytes by op (``op#k`` for the k-th of that op) of the ops of ``module`` exactly."""
    kept, seen = {}, {}
    for node in graph.nodes:
        if node.module == module:
            short = node.op.split(".")[1]
            seen[short] = seen.get(short, 0) + 1
            kept[f"{short}#{seen[short]}"] = simulator.costs[node.name].saved_bytes
    return kept


def test_an_rmsnorm_keeps_what_autograd_keeps(simulated) -> None:
    """transformers' RMSNorm: x.to(fp32) (4,096: pow and x * rsqrt read it), mean + eps (128,
    rsqrt reads it), rsqrt (128), (x * rsqrt).to(dtype) (4,096: the weight's product keeps it),
    weight * that (4,096: the projections read it) = 12,544. The product x * rsqrt is read only
    by the conversion back (ToCopyBackward0 keeps no input) and by export's
    _assert_tensor_metadata (no autograd node): not kept (it was: 16,640)."""
    graph, _, simulator, _ = simulated
    kept = _kept(graph, simulator, "model.layers.0.input_layernorm")
    assert sum(kept.values()) == 4_096 + 128 + 128 + 4_096 + 4_096 == 12_544
    assert kept["mul#1"] == 0 and kept["mul#2"] == 4_096


def test_rotary_tables_from_a_buffer_need_no_gradient(simulated) -> None:
    """The rotary ``inv_freq`` is a buffer, not a parameter: cos and sin need no gradient, so
    q * cos and rotate_half(q) * sin keep the tables, not q nor rotate_half's cat (4,096 each,
    kept before), and the q norm's output (read only by those products) is not kept either."""
    graph, _, simulator, _ = simulated
    attention = [node for node in graph.nodes if node.module == "model.layers.0.self_attn"]
    assert [simulator.costs[node.name].saved_bytes for node in attention if node.op == "aten.cat.default"] == [0, 0]
    q_norm = _kept(graph, simulator, "model.layers.0.self_attn.q_norm")
    assert q_norm["mul#2"] == 0  # weight * normalised q


def test_norms_moe_act_drops_the_block_norms_and_the_expert_activation(simulated) -> None:
    """Per block and micro-batch: the two block norms keep 2 x 12,544 = 25,088 bytes; their
    inputs (the block's input and the attention's residual sum, 4,096 each) are kept by no op,
    so their checkpoints hold 8,192. The experts' SwiGLU keeps silu(gate) and silu(gate) * up,
    2 x 40 x 4 = 320 bytes a routed row, of the 32 + 4 x 40 = 192 x 4 = 768 the experts keep
    a row. Recomputing adds the norms' forward and the SwiGLU read (gate, up) and written
    once: 3 x 40 x 4 = 480 bytes a row at the CPU's bandwidth x 0.913."""
    graph, plan, simulator, block = simulated
    layer = next(iter(simulator.context.moe_layers.values()))
    rows = layer.cost.busiest_copies
    assert block.norm_bytes == 25_088 and block.norm_input_bytes == 8_192
    assert layer.activation_function_bytes == pytest.approx(rows * 320)
    assert layer.activation_bytes == pytest.approx(rows * 768)
    bandwidth = plan.cluster.device_of(0).memory_bandwidth
    assert layer.activation_function_s == pytest.approx(rows * 480 / (bandwidth * STREAMING_EFFICIENCY))
    kept, transient = activation_bytes(block, NORMS_MOE_ACT)
    assert kept == pytest.approx(block.saved_bytes - 25_088 + 8_192 - rows * 320)
    assert transient == pytest.approx(25_088 + rows * 320)
    assert backward_time(block, NORMS_MOE_ACT) == pytest.approx(
        block.backward_s + block.norm_forward_s + layer.activation_function_s)
    assert block.norm_forward_s > 0
    # Between none and selective in what a block keeps here (no attention scores of s x s
    # beyond 8 x 8 to drop): the mode is listed with the others, priced for every segment.
    assert NORMS_MOE_ACT in RECOMPUTE_MODES
    profile = next(p for p in simulator.segment_profiles() if p.block)
    assert profile.kept_bytes[NORMS_MOE_ACT] == pytest.approx(kept)
    assert profile.kept_bytes[NORMS_MOE_ACT] < profile.kept_bytes["none"]


def test_a_plan_with_norms_moe_act_is_priced_and_refused_by_compile(simulated) -> None:
    graph, plan, _, _ = simulated
    import dataclasses

    from cost_model.simulator import simulated as simulate_plan

    none = simulate_plan(plan, graph).estimate
    recomputed = simulate_plan(dataclasses.replace(plan, recompute=NORMS_MOE_ACT), graph).estimate
    assert recomputed.memory.activations < none.memory.activations
    assert recomputed.step_time_s > none.step_time_s
    reason = compile_blocker(dataclasses.replace(plan, recompute=NORMS_MOE_ACT))
    assert reason is not None and NORMS_MOE_ACT in reason and "\n" not in reason
    from planner.verdict import strategy_words

    assert "norms and the experts' activation function recomputed" in strategy_words(
        dataclasses.replace(plan, recompute=NORMS_MOE_ACT))
