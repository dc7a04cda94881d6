"""Baseline plans (planner/baselines.py) from 1B to 1T parameters, traced on meta tensors.

The large points are Megatron-LM's published configurations (Narayanan et al., SC'21,
table 1): GPT-3 175B on 1024 A100s with (tp, pp) = (8, 8) and batch 1536, and the 1T model
(128 layers, width 25600, 160 heads) with (8, 64) on 3072 GPUs and batch 3072 (here on H100
nodes). Megatron-LM measured 138 and 163 TFLOP/s per A100 there (44% and 52% of peak,
recomputation included); the simulator must land in a plausible MFU band, fit in 80 GB, and
show the 1F1B bubble (p - 1) / (m + p - 1). Tracing 128 layers on meta takes ~10 s, so each
large model is built once (module-scoped fixtures); the file runs in ~35 s on 2 cores.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

import planner
from cost_model.resharding import backward_collective, forward_collective
from cost_model.simulator import Simulator
from planner import baselines
from planner.api import prepare_model
from planner.cluster import Cluster
from planner.errors import PlanningError
from planner.model_spec import ModelSpec
from planner.plans import load_plan
from search.megatron import megatron_plan

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")


def gpt(n_layer: int, n_embd: int, n_head: int, batch_size: int, **extra) -> ModelSpec:
    return ModelSpec(
        GPT,
        {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "vocab_size": 51200, "seq_len": 2048,
         "batch_size": batch_size, **extra},
    )


def parameters(n_layer: int, width: int, vocab: int = 51200, seq: int = 2048) -> int:
    """GPT parameters, untied head: 12 C^2 + 13 C per block (QKV, proj, MLP weights and biases,
    two LayerNorms), embeddings (V + S) C, final LayerNorm 2 C, head V C."""
    return n_layer * (12 * width**2 + 13 * width) + (vocab + seq) * width + 2 * width + vocab * width


GB = 1e9


# ------------------------------------------------------------------ 1.3B, DDP / FSDP


@pytest.fixture(scope="module")
def gpt_1b():
    # GPT-3 XL shape: 24 layers, width 2048, 16 heads; one sample per GPU on 16 A100s.
    return {flavour: build(gpt(24, 2048, 16, 16), "dgx-a100-80g:2") for flavour, build in
            (("ddp", baselines.ddp), ("fsdp", baselines.fsdp))}


def test_gpt_1b_data_parallel(gpt_1b):
    ddp, fsdp = gpt_1b["ddp"], gpt_1b["fsdp"]
    params = parameters(24, 2048)
    assert ddp.summary.parameters == params  # 1.42 B untied
    assert 1.3e9 < params < 1.5e9
    for plan in (ddp, fsdp):
        result = plan.estimate
        assert plan.world_size == 16 and plan.precision == "fp32"
        assert result.step_time_s > 0 and result.fits
        assert 0.1 < result.mfu < 0.7  # of the fp32 peak (19.5 TFLOP/s)
        assert result.samples_per_s == pytest.approx(16 / result.step_time_s)
        assert result.tokens_per_s == pytest.approx(16 * 2048 / result.step_time_s)
    # DDP: 16 B/param unsharded = 22.8 GB; FSDP divides it by 16.
    assert ddp.estimate.memory.weights + ddp.estimate.memory.gradients + ddp.estimate.memory.optimizer_states \
        == pytest.approx(16 * params, abs=3)
    assert fsdp.estimate.memory.weights == pytest.approx(4 * params / 16, abs=1)
    assert fsdp.estimate.memory.total < ddp.estimate.memory.total
    # FSDP sends 3 (n-1)/n of a block's weight bytes (all-gathered for forward and again for
    # backward, gradients reduce-scattered) but 2 (n-1)/n of the root unit's (embeddings, final
    # norm, head): FSDP2 keeps its root gathered from forward to backward
    # (tests/test_comm_audit.py counts it); DDP sends 2 (n-1)/n of every gradient byte.
    units = tuple(unit + "." for unit in fsdp.fsdp_units)
    root = sum(p.numel() for name, p in fsdp.model.build("meta")[0].named_parameters() if not name.startswith(units))
    assert units and 0 < root < params
    assert ddp.estimate.bytes_per_axis["dp"] == pytest.approx(2 * 15 / 16 * 4 * params)
    assert fsdp.estimate.bytes_per_axis["dp"] == pytest.approx(15 / 16 * 4 * (3 * params - root))
    # Both use 2 nodes, so the 5.7 GB all-reduce crosses InfiniBand (25 GB/s per GPU): DDP's
    # gradient all-reduce overlaps the backward but its last buckets wait for the last
    # segment; FSDP2 sends more, but prefetches each block's gather beside the block before
    # it on its own stream, and reduce-scatters beside the gathers: less of it is exposed.
    assert fsdp.estimate.communication_s < ddp.estimate.communication_s


def test_an_fsdp_graph_program_gathers_again_only_its_recomputed_blocks():
    """A graph program gathers each weight where an op reads it, and autograd keeps the
    gathered weight for backward; a fully recomputed block replays its forward in backward,
    gathering its weights again. So with full recomputation the dp bytes grow by one more
    (n-1)/n gather of the blocks' weights, and nothing else (4 layers, 2 ranks, fp32)."""
    spec = gpt(4, 256, 4, 64)
    kept, replayed = (baselines.megatron(spec, "cpu:1x2", tp=1, dp_flavour="fsdp", recompute=mode, precision="fp32")
                      for mode in ("none", "full"))
    blocks = sum(p.numel() for name, p in kept.model.build("meta")[0].named_parameters() if name.startswith("blocks."))
    assert 0 < blocks < kept.summary.parameters
    added = replayed.estimate.bytes_per_axis["dp"] - kept.estimate.bytes_per_axis["dp"]
    assert added == pytest.approx(1 / 2 * 4 * blocks)


# --------------------------------------------------------------- 175B, Megatron 8 x 8


@pytest.fixture(scope="module")
def gpt_175b():
    return baselines.megatron(gpt(96, 12288, 96, 1536), "dgx-a100-80g:128", tp=8, pp=8, micro_batch=1,
                              schedule="1f1b", recompute="full")


def test_gpt_175b_megatron(gpt_175b):
    plan, result = gpt_175b, gpt_175b.estimate
    assert plan.summary.parameters == parameters(96, 12288)
    assert plan.summary.parameters == pytest.approx(175e9, rel=0.01)
    assert plan.world_size == 1024
    assert plan.mesh.axes == (("pp", 8), ("dp", 16), ("tp", 8))
    assert plan.precision == "bf16" and plan.recompute == "full"
    # m = 1536 / (dp 16 x micro-batch 1) = 96 micro-batches.
    m = plan.pipeline.micro_batches
    assert m == 96
    assert result.step_time_s > 0
    assert 0.1 < result.mfu < 0.7  # Megatron-LM: 138 of 312 TFLOP/s, recomputation counted
    assert result.fits and result.memory.total < 80 * GB
    # 1F1B bubble (p - 1) / (m + p - 1) = 7 / 103 = 0.068; a little lower in the simulator
    # because the first and last stages also hold the embedding and the head, and the step's
    # optimizer (torch's foreach AdamW, cost_model.compute) counts as busy compute.
    assert result.bubble_fraction == pytest.approx(7 / (m + 7), rel=0.06)
    # Weights per GPU: 175 B / (tp 8 x pp 8) = 2.74 B params, ~5.5 GB in bf16 (the stage with
    # the embedding holds a little more).
    assert result.memory.weights == pytest.approx(2 * 175e9 / 64, rel=0.05)
    assert set(result.bytes_per_axis) == {"pp", "dp", "tp"}
    assert all(sent > 0 for sent in result.bytes_per_axis.values())


# ------------------------------------------------------------------ 1T, Megatron 8 x 64


@pytest.fixture(scope="module")
def gpt_1t():
    # 128 layers traced on meta take ~10 s here, the simulation ~8 s (64 stages x 512
    # micro-batches).
    return baselines.megatron(gpt(128, 25600, 160, 3072), "dgx-h100:384", tp=8, pp=64, micro_batch=1,
                              schedule="1f1b", recompute="full")


def test_gpt_1t_megatron(gpt_1t):
    plan, result = gpt_1t, gpt_1t.estimate
    assert plan.summary.parameters == parameters(128, 25600)
    assert plan.summary.parameters == pytest.approx(1.008e12, rel=0.01)
    assert plan.world_size == 3072
    assert plan.mesh.axes == (("pp", 64), ("dp", 6), ("tp", 8))
    m = plan.pipeline.micro_batches
    assert m == 3072 // 6 == 512
    assert result.step_time_s > 0
    assert 0.1 < result.mfu < 0.7
    assert result.fits and result.memory.total < 80 * GB
    # 63 / 575 = 0.110. With 2 layers per stage the head (a 25600 x 51200 matmul, 1/6 of a
    # block's FLOPs) makes the last stage ~8% busier than the others, so the busiest stage
    # idles less than the balanced formula says.
    assert result.bubble_fraction == pytest.approx(63 / (m + 63), rel=0.1)
    assert result.bubble_fraction < 63 / (m + 63)


# ----------------------------------------------------------- HF models: block recognition


HF_GPT2 = ModelSpec("hf:gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128, "n_positions": 64,
                               "seq_len": 16, "batch_size": 4})
HF_LLAMA = ModelSpec("hf:llama", {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128,
                                  "seq_len": 16, "batch_size": 4})
# GPT-2's Conv1D stores weights (in, out): column parallel splits dim 1, row parallel dim 0.
# nn.Linear stores (out, in): column parallel splits dim 0, row parallel dim 1.
HF_CASES = {
    "gpt2": (HF_GPT2, {"attn.c_attn": 1, "attn.c_proj": 0, "mlp.c_fc": 1, "mlp.c_proj": 0}),
    "llama": (HF_LLAMA, {"self_attn.q_proj": 0, "self_attn.k_proj": 0, "self_attn.v_proj": 0, "self_attn.o_proj": 1,
                         "mlp.gate_proj": 0, "mlp.up_proj": 0, "mlp.down_proj": 1}),
}


@pytest.fixture(scope="module")
def hf_graphs():
    pytest.importorskip("transformers")
    return {key: prepare_model(spec, "dgx-a100-80g:1x2") for key, (spec, _) in HF_CASES.items()}


@pytest.mark.parametrize("model", list(HF_CASES))
def test_megatron_recognises_hf_blocks(hf_graphs, model):
    graph, spec, name, cluster = hf_graphs[model]
    _, split_dims = HF_CASES[model]
    plan = megatron_plan(graph, cluster, spec, name, tp=2)
    tp = plan.mesh.names.index("tp")
    placements = {}
    for strategy in plan.strategies:
        for param, where in strategy.params.items():
            placements[param] = where[tp]
    for layer in range(2):
        for module, dim in split_dims.items():
            block = f"transformer.h.{layer}" if model == "gpt2" else f"model.layers.{layer}"
            assert str(placements[f"{block}.{module}.weight"]) == f"S({dim})", module
    # The word embedding is vocabulary parallel.
    embedding = "transformer.wte.weight" if model == "gpt2" else "model.embed_tokens.weight"
    assert str(placements[embedding]) == "S(0)"
    assert plan.estimate.bytes_per_axis["tp"] > 0


def _block_tp_collectives(plan, graph):
    """Forward and backward collective kinds on the tp axis at the block edges, counted once per
    (tensor, placement read), as the simulator charges them."""
    tp = plan.mesh.names.index("tp")
    strategies = {s.node: s for s in plan.strategies}
    seen, forward, backward = set(), Counter(), Counter()
    for node in graph.nodes:
        if node.block is None:
            continue
        for position, source in enumerate(node.inputs):
            producer = strategies.get(source)
            wanted = strategies[node.name].inputs[position]
            if producer is None or not producer.outputs or (source, wanted) in seen:
                continue
            seen.add((source, wanted))
            forward[forward_collective(producer.outputs[0][tp], wanted[tp])] += 1
            if node.input_meta[position].dtype.is_floating_point:
                backward[backward_collective(producer.outputs[0][tp], wanted[tp])] += 1
    forward.pop(None, None)
    backward.pop(None, None)
    return forward, backward


@pytest.mark.parametrize("model", list(HF_CASES))
def test_sequence_parallel_replaces_all_reduces(hf_graphs, model):
    graph, spec, name, cluster = hf_graphs[model]
    plain = megatron_plan(graph, cluster, spec, name, tp=2)
    split = megatron_plan(graph, cluster, spec, name, tp=2, sequence_parallel=True)
    # Megatron (2 blocks): one all-reduce after each row-parallel matmul (g), 2 per block;
    # the backward all-reduces of the column-parallel inputs (f) are not edges. LLaMA's
    # vocabulary-parallel embedding goes straight into block 0, whose first norm reads it
    # all-reduced (GPT-2 reduces it at the position embedding's add, before the blocks).
    embedding = 1 if model == "llama" else 0
    assert _block_tp_collectives(plain, graph) == (Counter(all_reduce=4 + embedding), Counter())
    # Sequence parallel (Korthikanti et al. 2022): g becomes a reduce-scatter (backward:
    # all-gather) and f an all-gather (backward: reduce-scatter). No all-reduce is left.
    assert _block_tp_collectives(split, graph) == (
        Counter(all_gather=4, reduce_scatter=4), Counter(all_gather=4, reduce_scatter=4)
    )
    # On 2 ranks a ring all-reduce, S/β + 2α, costs exactly a reduce-scatter plus an
    # all-gather, 2 (S/2β + α): the forward tp communication of the blocks is unchanged.
    plain_sim, split_sim = Simulator(plain, graph), Simulator(split, graph)
    in_blocks = [node.name for node in graph.nodes if node.block is not None]
    plain_forward = sum(plain_sim.costs[n].forward_comm_s for n in in_blocks)
    split_forward = sum(split_sim.costs[n].forward_comm_s for n in in_blocks)
    assert plain_forward > 0
    # Every one moves a (4, 16, 64) tensor; LLaMA's embedding all-reduce is in block 0 without
    # sequence parallelism and in the embedding's own reduce-scatter (outside the blocks) with it.
    assert split_forward * (4 + embedding) / 4 == pytest.approx(plain_forward)
    # Norms, dropouts and residuals hold half the sequence: less activation memory.
    assert split.estimate.memory.activations < plain.estimate.memory.activations


@pytest.mark.parametrize("model", list(HF_CASES))
def test_sequence_parallel_keeps_tp_bytes(hf_graphs, model):
    # Korthikanti et al. 2022: an all-reduce = reduce-scatter + all-gather, same volume, so
    # the activations' bytes sent on tp per step do not change.
    graph, spec, name, cluster = hf_graphs[model]
    plain_bytes = megatron_plan(graph, cluster, spec, name, tp=2).estimate.bytes_per_axis["tp"]
    split_bytes = megatron_plan(graph, cluster, spec, name, tp=2, sequence_parallel=True).estimate.bytes_per_axis["tp"]
    # GPT-2's learned position embedding (seq x hidden, bf16 as Megatron runs by default) is
    # added to the sequence-split stream, so the gradient of its slice is all-gathered in
    # backward: (n-1)/n of it = 1/2 * 16 * 64 * 2 bytes = 1,024.
    seq, hidden = (16, 64) if model == "gpt2" else (0, 0)
    position_gradient = (2 - 1) / 2 * seq * hidden * 2
    # The norms now see a sequence slice each: their weights' (and GPT-2's biases') gradients
    # are partial over tp and all-reduced once per step, 2 (n-1)/n of them, in fp32 (the
    # compiled bf16 program keeps fp32 weights and gradients under autocast:
    # cost_model.mixed_precision). GPT-2: ln_1, ln_2 per block and ln_f, weight and bias;
    # LLaMA: two RMSNorms per block and the final one, weight only.
    norm_elements = (2 * 2 + 1) * 2 * 64 if model == "gpt2" else (2 * 2 + 1) * 64
    norm_gradients = 2 * (2 - 1) / 2 * norm_elements * 4
    assert split_bytes == pytest.approx(plain_bytes + position_gradient + norm_gradients)


# ------------------------------------------------------------------- invalid configs


@pytest.fixture(scope="module")
def gpt_tiny():
    # 4 blocks of width 64, global batch 8.
    graph, spec, name, _ = prepare_model(ModelSpec(GPT, {"n_layer": 4}), "cpu:1x1")
    return graph, spec, name


@pytest.mark.parametrize(
    "cluster, options, message",
    [
        ("dgx-a100-80g:1x8", {"tp": 2, "pp": 2, "dp": 3}, r"tp=2 x pp=2 x dp=3 = 12 but the cluster has 8 devices"),
        ("dgx-a100-80g:1x8", {"tp": 3}, r"tp=3 x pp=1 does not divide the 8 devices"),
        ("dgx-a100-80g:1x8", {"tp": 1, "micro_batch": 3}, r"global batch 8 does not split into micro-batches of 3 "
                                                          r"over dp=8; use a batch that is a multiple of 24"),
        ("dgx-a100-80g:1x4", {"pp": 4, "schedule": "interleaved", "virtual_stages": 1},
         r"interleaved schedule needs virtual_stages >= 2"),
        ("dgx-a100-80g:1x4", {"pp": 2, "micro_batch": 1, "dp": 2, "schedule": "interleaved", "virtual_stages": 2},
         None),  # m = 4, pp = 2: valid
        ("dgx-a100-80g:1x8", {"pp": 4, "dp": 2, "micro_batch": 2, "schedule": "interleaved", "virtual_stages": 2},
         r"micro-batches \(2\) divisible by pp=4"),
        ("dgx-a100-80g:1x3", {"pp": 3}, r"4 layers do not split evenly over 3 pipeline stages"),
        ("dgx-a100-80g:1x2", {"tp": 2, "pp": 1, "recompute": "some"}, r"recompute must be None, 'selective' or 'full'"),
        ("dgx-a100-80g:1x2", {"pp": 2, "schedule": "zigzag"}, r"schedule must be one of gpipe, 1f1b, interleaved"),
    ],
)
def test_invalid_megatron_configs(gpt_tiny, cluster, options, message):
    graph, spec, name = gpt_tiny
    cluster = Cluster.parse(cluster)
    if message is None:
        assert megatron_plan(graph, cluster, spec, name, **options).estimate.step_time_s > 0
        return
    with pytest.raises(PlanningError, match=message):
        megatron_plan(graph, cluster, spec, name, **options)


def test_invalid_data_parallel_and_zero_configs(gpt_tiny):
    with pytest.raises(PlanningError, match=r"global batch of 8 is not divisible by the data-parallel degree 3"):
        baselines.ddp(ModelSpec(GPT, {}), "dgx-a100-80g:1x3")
    with pytest.raises(PlanningError, match=r"ZeRO stage must be 1 or 2"):
        baselines.zero(ModelSpec(GPT, {}), "dgx-a100-80g:1x2", stage=3)


# ------------------------------------------------------------- plans loaded from JSON


def test_simulate_loaded_plan_equals_in_memory_estimate(tmp_path):
    plan = baselines.megatron(GPT, "dgx-a100-80g:1x8", tp=2, pp=2, micro_batch=1, recompute="selective")
    assert plan.mesh.axes == (("pp", 2), ("dp", 2), ("tp", 2))
    assert planner.simulate(plan) == plan.estimate  # same graph, same answer
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = load_plan(path)
    assert loaded.graph is None  # simulate() must re-trace the spec on meta tensors
    again = planner.simulate(loaded)
    assert again.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-12)
    assert again.memory == plan.estimate.memory
    assert again.stage_memory == plan.estimate.stage_memory
    assert dict(again.bytes_per_axis) == pytest.approx(dict(plan.estimate.bytes_per_axis))
    assert again.bubble_fraction == pytest.approx(plan.estimate.bubble_fraction)
    assert again.mfu == pytest.approx(plan.estimate.mfu)
