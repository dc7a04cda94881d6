"""Another system's loss side (``Plan.loss_implementation``, ``Plan.metric_cross_entropies``):
FlashAttention's fused cross entropy and a trainer's metric cross entropies, priced by hand
(``cost_model.loss_kernels``), and the plan fields validated, saved, refused by ``compile``
and used by the simulated step.

H100 SXM5 preset: 3.35e12 B/s of HBM at the default memory efficiency 0.8 = 2.68e12 B/s;
A100 80GB: 2.039e12 x 0.8 = 1.6312e12 B/s; every kernel pays the default 5 us launch overhead.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest

import planner
from cost_model import defaults
from cost_model.compute import op_times
from cost_model.loss_kernels import loss_bytes_per_logit, loss_kernels
from cost_model.simulator import simulated
from planner.api import prepare_model
from planner.cluster import Cluster
from planner.errors import PlanFileError
from planner.model_spec import ModelSpec
from planner.plans import load_plan
from search.data_parallel import fsdp_units
from search.megatron import megatron_plan
from tests.simulation_only_fields import check_choice_field
from tests.test_loss_kernels import cross_entropy_node

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
H100_DEVICE = Cluster.preset("dgx-h100").device_of(0)
H100_STREAM = 3.35e12 * defaults.MEMORY_EFFICIENCY  # 2.68e12 B/s
A100_STREAM = 2.039e12 * defaults.MEMORY_EFFICIENCY  # 1.6312e12 B/s
OVERHEAD = defaults.KERNEL_OVERHEAD_S


def test_fused_xentropy_reads_16_bit_logits_twice_and_once_more_for_the_gradient():
    # cunn_SoftMaxXEntropyForward: one pass for the maximum and plain sum, one for the sum of
    # exponentials, 2 bytes each = 4; cunn_SoftMaxXEntropyBackward: read 2, write 2 = 4. One
    # kernel each way. Eager autocast cross entropy over MPT's 50,368 classes: 22 and 26.
    assert loss_bytes_per_logit(50368, 2, "fused_xentropy") == (4, 4)
    assert loss_kernels(2, "fused_xentropy") == (1, 1)
    assert loss_bytes_per_logit(50368, 2) == (22, 26)


def test_metric_cross_entropies_add_eager_forwards_only():
    # Composer's two train metrics: each an eager cross entropy's forward under autocast
    # (cast 2 + 4, log_softmax's three reads and one write of 4 bytes = 22; 3 kernels).
    # With the fused loss: forward 4 + 2 x 22 = 48 bytes and 1 + 2 x 3 = 7 kernels; the
    # backward is the loss's alone (4 bytes, 1 kernel).
    assert loss_bytes_per_logit(50368, 2, "fused_xentropy", 2) == (48, 4)
    assert loss_kernels(2, "fused_xentropy", 2) == (7, 1)
    # With eager PyTorch's loss: 22 + 44 = 66 forward, 26 backward.
    assert loss_bytes_per_logit(50368, 2, "", 2) == (66, 26)


def test_an_unknown_implementation_is_refused():
    with pytest.raises(ValueError, match="loss implementation must be one of"):
        loss_bytes_per_logit(50368, 2, "apex")


def test_mpt_7b_micro_batch_loss_by_hand():
    # MPT-7B@8xH100: 6 sequences of 2,048 tokens = 12,288 rows x 50,368 classes =
    # 618,921,984 bf16 logits per micro-batch.
    logits = 12288 * 50368
    node = cross_entropy_node(12288, 50368)
    eager_forward, eager_backward = op_times(node, 1.0, H100_DEVICE, "bf16")
    forward, backward = op_times(node, 1.0, H100_DEVICE, "bf16", "fused_xentropy", 2)
    # Fused loss and two metrics: 48 B x 618.9e6 / 2.68e12 B/s = 11.085 ms + 7 launches;
    # backward 4 B x 618.9e6 / 2.68e12 = 0.9238 ms + 1 launch.
    assert forward == pytest.approx(48 * logits / H100_STREAM + 7 * OVERHEAD)
    assert forward == pytest.approx(11.120e-3, rel=1e-3)
    assert backward == pytest.approx(4 * logits / H100_STREAM + OVERHEAD)
    assert backward == pytest.approx(0.9288e-3, rel=1e-3)
    # Against eager autocast cross entropy (22 + 26 = 48 bytes, 7 launches both ways): the
    # same bytes and launches in all, 17.2 ms either way; the fused loss's saving is what the
    # metrics spend.
    assert eager_forward + eager_backward == pytest.approx(48 * logits / H100_STREAM + 7 * OVERHEAD)
    assert forward + backward == pytest.approx(52 * logits / H100_STREAM + 8 * OVERHEAD)


@functools.cache
def _fsdp_plan():
    """examples/gpt.py (width 256, 2 layers, sequence 1,024, vocabulary 32,768) as FSDP units
    over the 8 GPUs of one DGX-A100: a vocabulary large enough that the step's last segment
    is bound by its kernels, not by the host issuing them (``cost_model.host_dispatch``)."""
    graph, spec, name, cluster = prepare_model(ModelSpec(GPT, {"batch_size": 8, "n_layer": 2, "n_embd": 256,
                                                               "n_head": 4, "seq_len": 1024, "vocab_size": 32768}),
                                               "dgx-a100-80g:1")
    plan = megatron_plan(graph, cluster, spec, name, precision="bf16", dp_flavour="fsdp")
    return simulated(dataclasses.replace(plan, fsdp_units=fsdp_units(graph)), graph), graph


def test_the_simulated_step_prices_the_plans_loss():
    own, graph = _fsdp_plan()
    fused = simulated(dataclasses.replace(own, loss_implementation="fused_xentropy"), graph)
    composer = simulated(dataclasses.replace(own, loss_implementation="fused_xentropy", metric_cross_entropies=2),
                         graph)
    # Each rank's loss: 1 sequence of 1,024 tokens x 32,768 classes = 33,554,432 bf16 logits.
    # Eager: under 40,960 classes the forward keeps a row in registers (cast 6 + read 4 +
    # write 4 = 14 bytes); over 12,288 the backward reads the gradient twice (zero fill 4 +
    # 4 x 4 + cast gradient 6 = 26); 3 + 4 launches. Fused: 4 + 4 bytes, 1 + 1 launches:
    # (40 - 8) x 33.55e6 / 1.6312e12 B/s + 5 x 5 us = 0.68325 ms less.
    logits = 1024 * 32768
    saved = (40 - 8) * logits / A100_STREAM + 5 * OVERHEAD
    assert saved == pytest.approx(0.68325e-3, rel=1e-4)
    # Composer's two metrics: 2 x 14 bytes and 2 x 3 launches more: 0.60597 ms.
    metrics = 2 * 14 * logits / A100_STREAM + 6 * OVERHEAD
    assert metrics == pytest.approx(0.60597e-3, rel=1e-4)
    # The loss runs on the compute stream with nothing to hide it: the step moves by exactly
    # the loss's difference.
    step = own.estimate.step_time_s
    assert fused.estimate.step_time_s == pytest.approx(step - saved, rel=1e-9)
    assert composer.estimate.step_time_s == pytest.approx(step - saved + metrics, rel=1e-9)


def test_the_fields_are_validated_saved_and_refused_by_compile(tmp_path):
    own, _ = _fsdp_plan()
    check_choice_field(own, "loss_implementation", "fused_xentropy", tmp_path)
    for wrong in (-1, 1.5, True):
        with pytest.raises(ValueError, match="field 'metric_cross_entropies' must be a whole number"):
            dataclasses.replace(own, metric_cross_entropies=wrong)
    plan = dataclasses.replace(own, metric_cross_entropies=2)
    plan.save(tmp_path / "metrics.json")
    assert load_plan(tmp_path / "metrics.json").metric_cross_entropies == 2
    with pytest.raises(PlanFileError, match="'metric_cross_entropies' 2"):
        planner.compile(plan, tmp_path / "out2")
    # A plan without it computes no train metrics, and the field is not written.
    assert "metric_cross_entropies" not in json.loads((tmp_path / "own.json").read_text())
    assert load_plan(tmp_path / "own.json").metric_cross_entropies == 0
