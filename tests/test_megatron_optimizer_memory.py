"""Memory of Megatron-Core's distributed optimizer (``Plan.megatron_distributed_optimizer``)
as ``cost_model.step_memory`` counts it, worked by hand: bf16 weights (2 bytes), the fp32
gradient buffer unsharded (4 bytes), fp32 master weights and Adam's two moments (12 bytes)
divided by dp for every weight, whatever its shape (Megatron-LM's
docs/source/api-guide/dist_optimizer.md: "bf16 param, fp32 grads", 6 + 12/d bytes per
parameter); no bucket buffer beside the gradient buffer. And a published layout that fits
only as the framework holds it: Megatron-Core's 7.1B weak-scaling row fits, the same layout
with twice the samples per pass does not."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cost_model.simulator import simulated
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
GIB = 2**30


def _zero1_on_eight(megatron: bool):
    """examples/gpt.py at width 100, 4 heads, 2 layers, 128 positions, vocabulary 500, on one
    DGX-H100 as dp = 8 ZeRO-1 in bf16: the fused q|k|v weight (300 x 100), the attention
    projection (100 x 100), the embeddings and head (500 x 100) and the width-100 vectors have
    no dimension 8 divides."""
    graph, spec, name, cluster = prepare_model(ModelSpec(GPT, {
        "batch_size": 32, "n_layer": 2, "n_embd": 100, "n_head": 4, "seq_len": 128, "vocab_size": 500}),
        "dgx-h100:1")
    plan = megatron_plan(graph, cluster, spec, name, precision="bf16", dp_flavour="zero1")
    return simulated(dataclasses.replace(plan, megatron_distributed_optimizer=megatron), graph)


def test_distributed_optimizer_holds_6_plus_12_over_dp_bytes_per_parameter() -> None:
    """P = 355,600 parameters: token embedding 500 x 100 = 50,000, positions 128 x 100 =
    12,800, two blocks of 121,300 (norms 2 x 200, q|k|v 30,000 + 300, projection 10,000 + 100,
    MLP 40,000 + 400 and 40,000 + 100), final norm 200, untied head 50,000. Megatron: weights
    2P = 711,200 bytes, gradients 4P = 1,422,400, states 12P / 8 = 533,400 (every weight cut,
    300 x 100 included), no communication buffer: 6P + 12P/8 = 2,667,000 bytes besides the
    activations. The planner's own ZeRO-1 steps the weights 8 divides no dimension of whole, so
    its states are over 12P / 8 (and it holds a 2-byte gradient and a bucket)."""
    plan = _zero1_on_eight(megatron=True)
    memory = plan.estimate.memory
    parameters = plan.summary.parameters
    assert parameters == 355_600
    assert memory.weights == 711_200
    assert memory.gradients == 1_422_400
    assert memory.optimizer_states == 533_400
    assert memory.communication_buffers == 0
    planner_zero1 = _zero1_on_eight(megatron=False).estimate.memory
    assert planner_zero1.optimizer_states > 12 * parameters / 8
    assert planner_zero1.activations == memory.activations


def _megatron_row(batch: int):
    """Megatron-Core's weak-scaling 7.1B row (benchmarks/fidelity_runs.py) with ``batch``
    sequences per step (the row states 192: 4 per dp rank, in one pass)."""
    from benchmarks.fidelity import simulate
    from benchmarks.fidelity_runs import runs

    run = next(run for run in runs() if run.name == "MCore-GPT-7.1B@96xH100")
    run = dataclasses.replace(run, overrides={**run.overrides, "batch_size": batch})
    plan, _ = simulate(run)
    return plan


def test_megatron_7b_row_fits_and_twice_its_samples_do_not() -> None:
    """tp 2 x dp 48 on 96 H100s (84.48e9 B = 78.7 GiB usable: planner.gpu_presets), 30 layers, width h = 4096, sequence
    s = 4096, vocabulary 131,072 untied, learned positions. Per tp rank P ~ 7.13e9 / 2:
    weights 2P = 7.13e9 B (6.6 GiB), fp32 gradients 4P (13.3 GiB), states 12P / 48 (0.8 GiB):
    20.8 GiB. Activations: Korthikanti et al. 2023 (section 4.2.2, sequence parallelism with
    tensor parallelism; attention that keeps no s x s, as cuDNN's fused kernel: the 5as/h term
    gone) keep at least 34 s b h / t bytes per layer per pass: b = 4 samples, t = 2:
    34 x 4096 x 4 x 4096 / 2 x 30 = 34.2e9 B = 31.9 GiB; 20.8 + 31.9 = 52.7 GiB, under 78.7
    with room for the logits. With b = 8: 63.8 GiB of layers alone, 84.6 GiB with the states:
    over the device, whatever the logits."""
    parameters_per_rank = 3.56e9
    states = (2 + 4 + 12 / 48) * parameters_per_rank
    fits = _megatron_row(192).estimate
    assert fits.memory.weights + fits.memory.gradients + fits.memory.optimizer_states == pytest.approx(states, rel=0.01)
    layers_b4 = 34 * 4096 * 4 * 4096 / 2 * 30
    assert layers_b4 <= fits.memory.activations <= layers_b4 + 6 * GIB
    assert fits.fits
    doubled = _megatron_row(384).estimate
    assert doubled.memory.activations >= 2 * layers_b4
    assert not doubled.fits
