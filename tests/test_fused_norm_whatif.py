"""``benchmarks/fused_norm_whatif.py``: a row's RMSNorms as the eager trace prices them against
one fused kernel each, by hand (no row is simulated here: each check is arithmetic)."""

from __future__ import annotations

import pytest
import torch

import cost_model.moe_overlap
import cost_model.node_costs
from benchmarks.fused_norm_whatif import (
    forwards_per_pass,
    fused_norm_node,
    fused_replacements,
    norms_fused,
    priced_with,
    rope_chains,
    rope_replacements,
    signature_collisions,
    step_seconds,
)
from cost_model.compute import op_times
from planner.cluster import Cluster
from planner.graph import OpGraph, OpNode, TensorMeta
from planner.strategy import KEEP_A2A, NORMS_MOE_ACT

H100 = Cluster.preset("dgx-h100").device_of(0)


def test_forwards_per_pass_follow_the_recomputation_mode():
    # A block recomputed whole runs every norm in it twice; norms_moe_act (Megatron-Core's
    # --recompute-modules layernorm) only the block's own two; the rest once.
    assert forwards_per_pass("full", block_norm=False) == forwards_per_pass(KEEP_A2A, block_norm=True) == 2
    assert forwards_per_pass(NORMS_MOE_ACT, block_norm=True) == 2
    assert forwards_per_pass(NORMS_MOE_ACT, block_norm=False) == 1  # Qwen3's q_norm / k_norm
    assert forwards_per_pass("selective", block_norm=True) == forwards_per_pass("none", block_norm=True) == 1


def test_step_seconds_by_hand():
    # The FSDP row's input_layernorm as traced: 0.358 ms forward, 0.741 ms backward a micro-batch,
    # recomputed (two forwards), 94 blocks x 4 micro-batches: (2 x 0.358 + 0.741) x 376 = 547.8 ms.
    assert step_seconds(0.358e-3, 0.741e-3, 2, 94, 4) == pytest.approx(0.5478, rel=1e-4)
    # Without recomputation one forward: (0.358 + 0.741) x 376 = 413.2 ms.
    assert step_seconds(0.358e-3, 0.741e-3, 1, 94, 4) == pytest.approx(0.4132, rel=1e-3)


def test_fused_norm_is_one_kernel_moving_input_output_and_weight():
    # The eager chain's first op (x.to(float32)) reads x: (4, 2048, 4096) bf16 = 2^25 elements.
    x = TensorMeta((4, 2048, 4096), torch.bfloat16)
    upcast = OpNode(name="to", op="aten._to_copy.default", inputs=("x",), input_meta=(x,),
                    output_meta=(TensorMeta(x.shape, torch.float32),), module="model.layers.3.input_layernorm")
    fused = fused_norm_node(upcast, TensorMeta((4096,), torch.bfloat16))
    assert fused.op == "aten.rms_norm.default" and fused.output_meta == (x,)
    # Bytes: x read and y written, 2 x 2^25 x 2 B, and the weight 4096 x 2 B = 134,225,920.
    assert fused.bytes_moved == 2 * 2**25 * 2 + 4096 * 2 == 134_225_920
    # Priced as the simulator prices a fused norm on an H100 (3.35e12 B/s x 0.525 = 1.75875e12
    # B/s, cost_model.memory_kernels.FUSED_NORM_EFFICIENCY; 5 us a launch): forward 76.32 us +
    # 5 us = 81.32 us; backward twice the bytes (defaults.BACKWARD_TO_FORWARD): 157.64 us.
    forward, backward = op_times(fused, 1.0, H100, "bf16")
    assert forward == pytest.approx(134_225_920 / 1.75875e12 + 5e-6)
    assert forward == pytest.approx(81.32e-6, rel=1e-3)
    assert backward == pytest.approx(2 * 134_225_920 / 1.75875e12 + 5e-6)


def norm_graph() -> OpGraph:
    """Block 0's input_layernorm as transformers traces it (shortened to three ops: the upcast,
    the row mean and the weight product), then a q projection outside it."""
    x = TensorMeta((4, 2048, 4096), torch.bfloat16)
    x32 = TensorMeta(x.shape, torch.float32)
    weight = TensorMeta((4096,), torch.bfloat16)
    norm = "model.layers.0.input_layernorm"
    block = ("model.layers", 0)
    nodes = [
        OpNode(name="to", op="aten._to_copy.default", inputs=("x",), input_meta=(x,), output_meta=(x32,),
               module=norm, block=block, bytes_moved=x.nbytes + x32.nbytes),
        OpNode(name="mean", op="aten.mean.dim", inputs=("to",), input_meta=(x32,),
               output_meta=(TensorMeta((4, 2048, 1), torch.float32),), module=norm, block=block,
               bytes_moved=x32.nbytes),
        OpNode(name="mul_weight", op="aten.mul.Tensor", inputs=("w", "to"), input_meta=(weight, x),
               output_meta=(x,), params=(f"{norm}.weight",), param_inputs=("w",), module=norm, block=block,
               bytes_moved=weight.nbytes + 2 * x.nbytes),
        OpNode(name="q_proj", op="aten.linear.default", inputs=("mul_weight",), input_meta=(x,), output_meta=(x,),
               module="model.layers.0.self_attn.q_proj", block=block, bytes_moved=2 * x.nbytes),
    ]
    return OpGraph(nodes=nodes, inputs=[], parameters={f"{norm}.weight": weight}, buffers={}, batch_size=4)


def test_fused_replacements_give_the_module_one_kernel():
    graph = norm_graph()
    replacements = fused_replacements(graph)
    # The op reading the weight carries the fused kernel of the chain's input (x and y of 2^25
    # bf16 elements, the weight of 4096: 134,225,920 bytes), the others nothing; the projection
    # is no norm's, and shares no norm op's signature.
    assert replacements["mul_weight"].op == "aten.rms_norm.default"
    assert replacements["mul_weight"].input_meta[0] == TensorMeta((4, 2048, 4096), torch.bfloat16)
    assert replacements["mul_weight"].bytes_moved == 134_225_920
    assert replacements["to"] is None and replacements["mean"] is None
    assert "q_proj" not in replacements
    assert signature_collisions(graph, replacements) == []


def test_priced_with_prices_the_replacements_and_leaves_the_rest():
    graph = norm_graph()
    times = priced_with(fused_replacements(graph))
    by_name = {node.name: node for node in graph.nodes}
    # The weight's op: the fused kernel's 81.32 us forward (test above); the rest of the norm
    # free; the projection as before.
    assert times(by_name["mul_weight"], 1.0, H100, "bf16")[0] == pytest.approx(134_225_920 / 1.75875e12 + 5e-6)
    assert times(by_name["to"], 1.0, H100, "bf16") == times(by_name["mean"], 1.0, H100, "bf16") == (0.0, 0.0)
    assert times(by_name["q_proj"], 1.0, H100, "bf16") == op_times(by_name["q_proj"], 1.0, H100, "bf16")


def test_norms_fused_restores_the_simulators_pricing():
    with norms_fused(norm_graph()):
        assert cost_model.node_costs.op_times is not op_times
        assert cost_model.moe_overlap.op_times is cost_model.node_costs.op_times
    assert cost_model.node_costs.op_times is op_times and cost_model.moe_overlap.op_times is op_times


def rope_graph() -> OpGraph:
    """Block 0's attention applying transformers' eager rotary embedding to q and to k of the
    same shape (as in a model without grouped keys): q * cos + cat(-q2, q1) * sin each."""
    x = TensorMeta((4, 32, 2048, 128), torch.bfloat16)
    half = TensorMeta((4, 32, 2048, 64), torch.bfloat16)
    table = TensorMeta((1, 1, 2048, 128), torch.bfloat16)
    attn, block = "model.layers.0.self_attn", ("model.layers", 0)
    nodes = [OpNode(name=name, op="aten.linear.default", inputs=(), input_meta=(x,), output_meta=(x,),
                    module=f"{attn}.{name}", block=block) for name in ("q_proj", "k_proj")]
    nodes += [OpNode(name=name, op="aten.cos.default", inputs=(), input_meta=(table,), output_meta=(table,),
                     module="model.rotary_emb") for name in ("cos", "sin")]
    for t in ("q", "k"):
        def op(name, kind, inputs, metas, out=x):
            return OpNode(name=f"{t}_{name}", op=kind, inputs=inputs, input_meta=metas, output_meta=(out,),
                          module=attn, block=block)
        nodes += [
            op("mul_cos", "aten.mul.Tensor", (f"{t}_proj", "cos"), (x, table)),
            op("first_half", "aten.slice.Tensor", (f"{t}_proj",), (x,), half),
            op("second_half", "aten.slice.Tensor", (f"{t}_proj",), (x,), half),
            op("neg", "aten.neg.default", (f"{t}_second_half",), (half,), half),
            op("cat", "aten.cat.default", (f"{t}_neg", f"{t}_first_half"), (half, half)),
            op("mul_sin", "aten.mul.Tensor", (f"{t}_cat", "sin"), (x, table)),
            op("add", "aten.add.Tensor", (f"{t}_mul_cos", f"{t}_mul_sin"), (x, x)),
        ]
    return OpGraph(nodes=nodes, inputs=[], parameters={}, buffers={}, batch_size=4)


def test_rope_chains_one_per_rotated_tensor():
    graph = rope_graph()
    chains = rope_chains(graph)
    # Two chains of five kernels (the slices are views), q's and k's, even with equal shapes;
    # the projections and the cos/sin tables are not in them.
    assert [[op.name for op in chain] for chain in chains] == [
        [f"{t}_{name}" for name in ("mul_cos", "neg", "cat", "mul_sin", "add")] for t in ("q", "k")]
    replacements = rope_replacements(graph)
    # The add carries one contiguous kernel reading and writing (4, 32, 2048, 128) bf16:
    # 2 x 2^25 x 2 B = 134,217,728 bytes, on an H100 at 0.913 of 3.35e12 B/s (the streaming
    # kind): 43.88 us + 5 us; the chain's other ops nothing.
    fused = replacements["q_add"]
    assert fused.bytes_moved == 134_217_728
    assert op_times(fused, 1.0, H100, "bf16")[0] == pytest.approx(134_217_728 / (3.35e12 * 0.913) + 5e-6)
    assert op_times(fused, 1.0, H100, "bf16")[0] == pytest.approx(48.88e-6, rel=1e-3)
    assert replacements["q_mul_cos"] is None and replacements["k_cat"] is None
    assert "q_proj" not in replacements and "cos" not in replacements
    assert signature_collisions(graph, replacements) == []
