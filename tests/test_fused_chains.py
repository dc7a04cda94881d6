"""``cost_model.fused_chains`` (``Plan.fused_chains``): a norm module's eager kernels and a
rotary embedding's priced as one fused kernel each, by hand; a plan with the setting prices
and recomputes the fused kernels."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from cost_model.fused_chains import FusedKernel, chain_kernels, fused_kernel_times
from cost_model.simulator import Simulator, simulated
from planner.api import prepare_model
from planner.cluster import Cluster
from planner.graph import OpGraph, OpNode, TensorMeta
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan
from tests.simulation_only_fields import check_choice_field

H100 = Cluster.preset("dgx-h100").device_of(0)
LLAMA = str(Path(__file__).resolve().parents[1] / "examples" / "llama.py")
# An H100's fused-norm stream: 3.35e12 B/s x 0.525 (memory_kernels.FUSED_NORM_EFFICIENCY);
# its contiguous pointwise stream: 3.35e12 x 0.913 (STREAMING_EFFICIENCY); 5 us a launch.
NORM_STREAM = 3.35e12 * 0.525  # 1.75875e12 B/s
POINTWISE_STREAM = 3.35e12 * 0.913
LAUNCH = 5e-6


def norm_graph() -> OpGraph:
    """Block 0's input_layernorm as transformers traces it (shortened to three ops: the upcast,
    the row mean and the weight product), then a q projection outside it."""
    x = TensorMeta((4, 2048, 4096), torch.bfloat16)
    x32 = TensorMeta(x.shape, torch.float32)
    weight = TensorMeta((4096,), torch.bfloat16)
    norm, kind = "model.layers.0.input_layernorm", "Qwen3MoeRMSNorm"
    block = ("model.layers", 0)
    nodes = [
        OpNode(name="to", op="aten._to_copy.default", inputs=("x",), input_meta=(x,), output_meta=(x32,),
               module=norm, module_type=kind, block=block, bytes_moved=x.nbytes + x32.nbytes),
        OpNode(name="mean", op="aten.mean.dim", inputs=("to",), input_meta=(x32,),
               output_meta=(TensorMeta((4, 2048, 1), torch.float32),), module=norm, module_type=kind, block=block,
               bytes_moved=x32.nbytes),
        OpNode(name="mul_weight", op="aten.mul.Tensor", inputs=("w", "to"), input_meta=(weight, x),
               output_meta=(x,), params=(f"{norm}.weight",), param_inputs=("w",), module=norm, module_type=kind,
               block=block, bytes_moved=weight.nbytes + 2 * x.nbytes),
        OpNode(name="q_proj", op="aten.linear.default", inputs=("mul_weight",), input_meta=(x,), output_meta=(x,),
               module="model.layers.0.self_attn.q_proj", module_type="Linear", block=block,
               bytes_moved=2 * x.nbytes),
    ]
    return OpGraph(nodes=nodes, inputs=[], parameters={f"{norm}.weight": weight}, buffers={}, batch_size=4)


def test_a_norm_module_is_one_kernel_moving_input_output_and_weight_once():
    graph = norm_graph()
    kernels = chain_kernels(graph, "norms")
    # The chain's last op carries one rms_norm of its input, (4, 2048, 4096) bf16 = 2^25
    # elements, and the 4,096-element bf16 weight; the upcast and the mean cost nothing; the
    # projection is no norm's.
    assert kernels == {"to": None, "mean": None,
                       "mul_weight": FusedKernel("norm", "aten.rms_norm.default",
                                                 TensorMeta((4, 2048, 4096), torch.bfloat16), 4096 * 2)}
    # Bytes moved once: x read and y written, 2 x 2^25 x 2 B, and the weight 8,192 B =
    # 134,225,920 B; at 1.75875e12 B/s 76.32 us, + one launch = 81.32 us. Backward at twice
    # the bytes (defaults.BACKWARD_TO_FORWARD; a norm's gradient reads its input again): 157.64 us.
    forward, backward = fused_kernel_times(kernels["mul_weight"], 1.0, H100, "bf16")
    assert forward == pytest.approx(134_225_920 / NORM_STREAM + LAUNCH)
    assert forward == pytest.approx(81.32e-6, rel=1e-3)
    assert backward == pytest.approx(2 * 134_225_920 / NORM_STREAM + LAUNCH)
    # A quarter of the work (a rank's share): a quarter of the bytes, still one launch.
    assert fused_kernel_times(kernels["mul_weight"], 0.25, H100, "bf16")[0] == pytest.approx(
        134_225_920 / 4 / NORM_STREAM + LAUNCH)
    # Unset, nothing is fused.
    assert chain_kernels(graph, "") == {}


def test_a_norm_traced_as_one_fused_op_is_left_as_it_is():
    # nn.LayerNorm traces as one aten.layer_norm, already priced as the fused kernel it is.
    x = TensorMeta((4, 1024, 2048), torch.bfloat16)
    graph = OpGraph(nodes=[OpNode(name="ln", op="aten.layer_norm.default", inputs=("x",), input_meta=(x,),
                                  output_meta=(x,), module="blocks.0.ln_1", module_type="LayerNorm",
                                  block=("blocks", 0), bytes_moved=2 * x.nbytes)],
                    inputs=[], parameters={}, buffers={}, batch_size=4)
    assert chain_kernels(graph, "norms_rope") == {}


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


def test_the_rotary_embeddings_of_q_and_k_are_one_kernel_each():
    graph = rope_graph()
    kernels = chain_kernels(graph, "norms_rope")
    # q's and k's five kernels each (the slices are views and cost nothing anyway): each add
    # carries one kernel of its (4, 32, 2048, 128) bf16 tensor, the other four nothing; the
    # projections and the cos/sin tables are not in them.
    rotated = TensorMeta((4, 32, 2048, 128), torch.bfloat16)
    assert kernels == {
        **{f"{t}_{name}": None for t in ("q", "k") for name in ("mul_cos", "neg", "cat", "mul_sin")},
        "q_add": FusedKernel("rope", "te.fused_rope", rotated), "k_add": FusedKernel("rope", "te.fused_rope", rotated),
    }
    # One pass each way reading and writing 2^25 bf16 elements: 134,217,728 B at 0.913 of
    # 3.35e12 B/s = 43.88 us, + one launch = 48.88 us, forward and backward alike.
    forward, backward = fused_kernel_times(kernels["q_add"], 1.0, H100, "bf16")
    assert forward == backward == pytest.approx(134_217_728 / POINTWISE_STREAM + LAUNCH)
    assert forward == pytest.approx(48.88e-6, rel=1e-3)
    # "norms" fuses the norms alone: the rotary chains stay as traced.
    assert chain_kernels(graph, "norms") == {}


def test_an_eager_attentions_masked_scores_are_no_rotary_embedding():
    # eager_attention_forward: scores = q @ k^T * scale, then + mask, in the attention module
    # on 4-D tensors: mul and add, but no rotate_half (neg, cat), so nothing is fused.
    scores = TensorMeta((4, 32, 2048, 2048), torch.bfloat16)
    mask = TensorMeta((4, 1, 2048, 2048), torch.bfloat16)
    attn, block = "model.layers.0.self_attn", ("model.layers", 0)
    nodes = [
        OpNode(name="qk", op="aten.matmul.default", inputs=(), input_meta=(scores,), output_meta=(scores,),
               module=attn, block=block),
        OpNode(name="scale", op="aten.mul.Tensor", inputs=("qk",), input_meta=(scores,), output_meta=(scores,),
               module=attn, block=block),
        OpNode(name="masked", op="aten.add.Tensor", inputs=("scale", "mask"), input_meta=(scores, mask),
               output_meta=(scores,), module=attn, block=block),
    ]
    graph = OpGraph(nodes=nodes, inputs=[], parameters={}, buffers={}, batch_size=4)
    assert chain_kernels(graph, "norms_rope") == {}


@functools.cache
def _llama_plan():
    """examples/llama.py, 2 blocks of width 2,048 (sequence 2,048, 8 sequences) on one H100,
    with 16-bit weights as the runs this setting describes (no autocast): large enough that
    each block's time is its kernels', not the host's issuing them."""
    graph, spec, name, cluster = prepare_model(
        ModelSpec(LLAMA, {"size": "tiny", "batch_size": 8, "seq_len": 2048, "dim": 2048, "n_heads": 16,
                          "n_kv_heads": 4, "ffn_dim": 8192}), "dgx-h100:1x1")
    plan = dataclasses.replace(megatron_plan(graph, cluster, spec, name, precision="bf16"), half_precision_weights=True)
    return plan, graph


def test_a_plan_with_fused_norms_prices_and_recomputes_the_fused_kernels():
    plan, graph = _llama_plan()
    eager, fused = (Simulator(dataclasses.replace(plan, fused_chains=setting), graph) for setting in ("", "norms"))
    eager_block = next(segment for segment in eager.segments() if segment.block)
    fused_block = next(segment for segment in fused.segments() if segment.block)
    kernels = chain_kernels(graph, "norms")
    norm_ops = [name for name in eager_block.nodes if name in kernels]
    # Each block's two RMSNorms (x * rsqrt(x.pow(2).mean(-1) + eps) * w): six kernels each.
    assert len(norm_ops) == 12 and sum(kernels[name] is not None for name in norm_ops) == 2
    # One fused kernel: x of 8 x 2,048 x 2,048 priced at bf16, read and written: 134,217,728 B,
    # and the weight (2,048 fp32 traced, 4,096 B at bf16): 134,221,824 B at 1.75875e12 B/s =
    # 76.32 us + one launch = 81.32 us.
    one_norm = 134_221_824 / NORM_STREAM + LAUNCH
    assert one_norm == pytest.approx(81.32e-6, rel=1e-3)
    eager_norms = sum(eager.costs[name].forward_s for name in norm_ops)
    assert fused_block.forward_s == pytest.approx(eager_block.forward_s - eager_norms + 2 * one_norm, rel=1e-12)
    # Full recomputation runs each block's forward again in backward: the fused kernels, on
    # one device with nothing to overlap, 2 blocks x the fused block's forward more a step.
    steps = {(setting, recompute): simulated(dataclasses.replace(plan, fused_chains=setting, recompute=recompute),
                                             graph).estimate.step_time_s
             for setting in ("", "norms") for recompute in ("none", "full")}
    assert steps["norms", "full"] - steps["norms", "none"] == pytest.approx(2 * fused_block.forward_s, rel=1e-9)
    assert steps["", "full"] - steps["", "none"] == pytest.approx(2 * eager_block.forward_s, rel=1e-9)
    assert steps["norms", "none"] < steps["", "none"]


def test_the_field_is_validated_saved_and_refused_by_compile(tmp_path):
    plan, _ = _llama_plan()
    # The planner's own weights, so that compile refuses this field and not the 16-bit weights.
    check_choice_field(dataclasses.replace(plan, half_precision_weights=False), "fused_chains", "norms_rope", tmp_path)
