"""FSDP2 with gradients reduced in fp32 (``Plan.fsdp_fp32_reduce``: torchtitan's
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``), checked
against bytes worked by hand."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest

from cost_model.simulator import simulated
from planner.api import prepare_model
from planner.model_spec import ModelSpec
from search.data_parallel import fsdp_units
from search.megatron import megatron_plan
from tests.simulation_only_fields import check_field_is_validated, check_simulation_only_field

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")


@functools.cache
def _model():
    """examples/gpt.py (width 256, 2 layers), traced once, for the 8 GPUs of one DGX-H100."""
    return prepare_model(ModelSpec(GPT, {"batch_size": 8, "n_layer": 2, "n_embd": 256, "n_head": 4, "seq_len": 128,
                                         "vocab_size": 512}), "dgx-h100:1")


@functools.cache
def _fsdp(fp32_reduce: bool):
    """The model as FSDP2 units (one per block and the root) over dp = 8."""
    graph, spec, name, cluster = _model()
    plan = megatron_plan(graph, cluster, spec, name, precision="bf16", dp_flavour="fsdp")
    plan = dataclasses.replace(plan, fsdp_units=fsdp_units(graph), fsdp_fp32_reduce=fp32_reduce)
    return simulated(plan, graph)


def test_fp32_reduce_scatters_move_twice_the_gradient_bytes_and_gathers_stay_bf16() -> None:
    """P parameters, dp = 8, one micro-batch. bf16: every gradient reduce-scattered once in
    bf16 (2P), each weight gathered in bf16 for forward and, but the root's, again for
    backward. fp32 reduce: the reduce-scatter moves 4P, the gathers the same: the difference
    is 2P bytes, of which each rank sends 7/8."""
    bf16, fp32 = _fsdp(False), _fsdp(True)
    parameters = bf16.summary.parameters
    difference = fp32.estimate.bytes_per_axis["dp"] - bf16.estimate.bytes_per_axis["dp"]
    assert difference == pytest.approx(2 * parameters * 7 / 8)
    assert fp32.estimate.step_time_s > bf16.estimate.step_time_s

    def durations(plan, prefix):
        return sorted(e.duration_s for e in plan.estimate.timeline if e.device == "stage 0" and e.name.startswith(prefix))

    assert durations(fp32, "all-gather") == durations(bf16, "all-gather")
    assert all(slow > fast for slow, fast in zip(durations(fp32, "reduce-scatter"), durations(bf16, "reduce-scatter")))


def test_the_field_needs_fsdp2_units_and_is_refused_by_compile(tmp_path) -> None:
    plan = _fsdp(True)
    check_field_is_validated(plan, "fsdp_fp32_reduce", {"dp_flavour": "ddp"},
                             "'fsdp_fp32_reduce' is true but the plan is ddp in bf16")
    check_simulation_only_field(plan, "fsdp_fp32_reduce", tmp_path)
