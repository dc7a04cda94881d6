"""Which activations a step keeps for backward (``cost_model.node_costs.NodeCosts.
kept_for_backward``), as autograd keeps them, worked by hand on examples/llama.py: a product by
a tensor that needs no gradient keeps only that tensor (MulBackward0's ``_saved_self`` is None
when ``other`` requires no grad), stack keeps nothing of its inputs (StackBackward0 saves only
``dim``), and ops no gradient flows through (the rotary tables built from ``arange``) record
nothing. A rotary embedding's input projections are then not held: what the autograd of the
real program holds, not more."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cost_model.simulator import Simulator
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan

LLAMA = str(Path(__file__).resolve().parents[1] / "examples" / "llama.py")


def _one_layer_llama():
    """One Llama layer (width 64, 4 heads of 16, 2 KV heads, SwiGLU 128, vocabulary 100) on one
    DGX-H100, fp32, DDP over 8 ranks: one 16-token sequence per rank, so a (16, 64) activation
    is 16 x 64 x 4 = 4,096 bytes."""
    graph, spec, name, cluster = prepare_model(ModelSpec(LLAMA, {
        "batch_size": 8, "seq_len": 16, "dim": 64, "n_layer": 1, "n_heads": 4, "n_kv_heads": 2,
        "vocab_size": 100, "ffn_dim": 128}), "dgx-h100:1")
    plan = megatron_plan(graph, cluster, spec, name, precision="fp32", dp_flavour="ddp")
    return graph, Simulator(plan, graph).costs


def test_autograd_keeps_the_product_by_a_constant_table_only() -> None:
    """The facts the rule stands on, in this torch: x * c with c needing no gradient saves c
    and not x; stack saves only its dimension."""
    x, table = torch.randn(4, requires_grad=True), torch.randn(4)
    product = x * table
    assert product.grad_fn._saved_self is None and product.grad_fn._saved_other is not None
    stacked = torch.stack((x * 2, x * 3), dim=-1)
    assert [name for name in dir(stacked.grad_fn) if name.startswith("_saved")] == ["_saved_dim"]


def test_one_llama_layer_keeps_what_autograd_keeps() -> None:
    """Bytes the layer keeps, one 16-token sequence in fp32:
    attention norm: mean + eps (16 x 4 = 64), rsqrt (64), x * rsqrt (4,096), times the weight
    (4,096): 8,320; attention: v (16 x 32 x 4 = 2,048), rotated q (stack, 4,096), rotated k
    (2,048), attention's output (4,096): 12,288; the residual sum (4,096); FFN norm 8,320;
    SwiGLU: w1's output, silu's, w3's, their product (16 x 128 x 4 = 8,192 each): 32,768; the
    second residual sum, which the final norm reads (4,096). Total 69,888. Before, also q and k
    as projected (4,096 + 2,048) and the rotary halves (4 x 1,024 for q, 4 x 512 for k):
    82,176."""
    graph, costs = _one_layer_llama()
    layer = [node for node in graph.nodes if (node.module or "").startswith("layers.0")]
    assert sum(costs[node.name].saved_bytes for node in layer) == 69_888
    projections = {node.module: costs[node.name].saved_bytes for node in layer if node.op == "aten.linear.default"}
    assert projections["layers.0.attention.wq"] == 0  # read only by the rotary products
    assert projections["layers.0.attention.wk"] == 0
    assert projections["layers.0.attention.wv"] == 2_048  # attention reads it
    rotary = [costs[node.name].saved_bytes for node in layer if node.op in ("aten.sub.Tensor", "aten.add.Tensor")
              and node.module == "layers.0.attention"]
    assert rotary and not any(rotary)


def test_tables_no_gradient_flows_through_keep_only_what_a_product_saves() -> None:
    """The rotary tables: arange, the frequencies and their outer product are read only by
    ops no gradient flows through (nothing kept); cos and sin (16 x 8 x 4 = 512 bytes each)
    are the ``other`` operands the rotary products save."""
    graph, costs = _one_layer_llama()
    tables = {node.op.split(".")[1]: costs[node.name].saved_bytes for node in graph.nodes if not node.module
              and node.op.startswith(("aten.arange", "aten.div", "aten.pow", "aten.outer", "aten.cos", "aten.sin"))}
    assert tables == {"arange": 0, "div": 0, "pow": 0, "outer": 0, "cos": 512, "sin": 512}


def test_projections_of_the_same_shape_keep_their_own_autocast_casts() -> None:
    """Under the planner's bf16 autocast (fp32 weights, FSDP) the q projection reads the
    norm's fp32 output and casts it, the output projection reads attention's bf16 output and
    casts nothing; both are 64 x 64 with 4 KV heads of 4, neither output kept for backward, so
    the node-cost cache must tell them apart by their inputs' run-time widths: wq's forward is
    wo's plus its cast (``autocast_activation_times``), wo's has no cast."""
    from cost_model.autocast_activations import autocast_activation_times
    from cost_model.op_share import work_split

    graph, spec, name, cluster = prepare_model(ModelSpec(LLAMA, {
        "batch_size": 8, "seq_len": 16, "dim": 64, "n_layer": 1, "n_heads": 4, "n_kv_heads": 4,
        "vocab_size": 100, "ffn_dim": 128}), "dgx-h100:1")
    plan = megatron_plan(graph, cluster, spec, name, precision="bf16", dp_flavour="fsdp")
    simulator = Simulator(plan, graph)
    context = simulator.context
    by_module = {node.module: node for node in graph.nodes if node.op == "aten.linear.default"}
    query, output = by_module["layers.0.attention.wq"], by_module["layers.0.attention.wo"]
    costs = simulator.costs
    assert costs[query.name].saved_bytes == costs[output.name].saved_bytes == 0

    def cast_s(node):
        share = 1.0 / (work_split(context.mesh, context.strategies[node.name]) * context.micro_batches)
        return autocast_activation_times(context, node, share, context.device)[0]

    assert cast_s(output) == 0.0 and cast_s(query) > 0.0
    assert costs[query.name].forward_s - costs[output.name].forward_s == pytest.approx(cast_s(query))


def _torchtitan_13b_row(batch: int):
    """torchtitan's Llama2-13B row on 64 A100s (benchmarks/fidelity_runs.py: FSDP2, no
    recomputation, local batch 2 of 4,096 tokens) with ``batch`` sequences per step."""
    import dataclasses

    from benchmarks.fidelity import simulate
    from benchmarks.fidelity_runs import runs

    run = next(run for run in runs() if run.name == "Llama2-13B@64xA100")
    plan, _ = simulate(dataclasses.replace(run, overrides={**run.overrides, "batch_size": batch}))
    return plan.estimate


def test_torchtitan_13b_row_fits_and_twice_its_local_batch_does_not() -> None:
    """Local batch 2 x 4,096 tokens, width 5,120: a (2, 4096, 5120) bf16 activation is
    41,943,040 x 2 = 83.89 MB. One layer keeps: each norm's input, x * rsqrt and its product by
    the weight (3 x 83.89, twice: 503.3 MB), v, rotated q and k, attention's output (4 x 83.89 =
    335.5 MB), SwiGLU's four (2, 4096, 13824) tensors (4 x 226.49 = 906.0 MB): 1,744.8 MB; 40
    layers 69.8 GB = 65.0 GiB, with the head's logits and the rest under 79.0 GiB (an A100
    80GB's 84.86e9 usable bytes, planner.gpu_presets). At local
    batch 4 the layers alone hold 139.6 GB: over any 80 GB device."""
    layer_bytes = 6 * 83.886e6 + 4 * 83.886e6 + 4 * 226.492e6
    fits = _torchtitan_13b_row(128)
    assert 40 * layer_bytes <= fits.memory.activations <= 40 * layer_bytes + 2 * 2**30
    assert fits.fits
    doubled = _torchtitan_13b_row(256)
    assert doubled.memory.activations >= 2 * 40 * layer_bytes
    assert not doubled.fits
