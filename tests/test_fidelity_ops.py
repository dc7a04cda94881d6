"""``benchmarks/fidelity_ops.py``: a fidelity row's kernel time by kind of op, from the simulator's
own node costs."""

from __future__ import annotations

import pytest

from benchmarks.fidelity import simulate
from benchmarks.fidelity_runs import runs
from benchmarks.fidelity_ops import kernel_time_by_kind, main, op_kind


def test_matmuls_group_together_and_other_ops_by_name():
    assert op_kind("aten.linear.default") == op_kind("aten.bmm.default") == "matmul"
    assert op_kind("aten.layer_norm.default") == "aten.layer_norm"


def test_mpt_7b_on_h100_matmul_time_is_its_flops_at_the_sustained_ceiling(capsys):
    (run,) = [run for run in runs() if run.name == "MPT-7B@8xH100"]
    plan, _ = simulate(run)
    kinds = {kind.kind: kind for kind in kernel_time_by_kind(plan, plan.graph)}
    # By hand: each of 8 ranks runs 6 samples x 2048 = 12,288 tokens (one micro-batch). Forward
    # GEMM FLOPs: 32 blocks x 2 x 12,288 x 12 x 4096^2 = 158.33e12 (q|k|v, out, 4x MLP), plus the
    # head 2 x 12,288 x 4096 x 50,368 = 5.07e12: 163.40e12. Every shape reaches the MAMF ceiling
    # at the H100's sustained clock, 989.4e12 x 0.801 x 1575/1830 = 682.08e12 FLOP/s: 239.56 ms,
    # plus 129 launches of 5 us = 0.65 ms; backward two GEMMs of the same size each: twice that,
    # and each block's four bias gradients (cost_model.gradient_copies), reductions reading the
    # output gradients: 2 bytes x 12,288 x (12,288 + 4096 + 16,384 + 4096) + 2 x 36,864 written
    # = 906.04e6 bytes / (3.35e12 x 0.8) = 0.33808 ms + 4 x 5 us, x 32 blocks = 11.459 ms (the
    # output layer, MPT's tied embedding, has no bias).
    matmul = kinds["matmul"]
    assert matmul.count == 129
    assert matmul.forward_s == pytest.approx(0.2402, rel=2e-3)
    bias_gradients = 32 * (2 * (12288 * 36864 + 36864) / (3.35e12 * 0.8) + 4 * 5e-6)
    assert bias_gradients == pytest.approx(11.459e-3, rel=1e-3)
    assert matmul.backward_s == pytest.approx(2 * matmul.forward_s + bias_gradients, rel=1e-3)
    assert "aten.scaled_dot_product_attention" in kinds and kinds["aten.layer_norm"].count == 65
    main(["--runs", "MPT-7B@8xH100", "--top", "3"])
    printed = capsys.readouterr().out
    # Third: the fused LayerNorm (at memory_kernels.FUSED_NORM_EFFICIENCY, 0.525 of HBM
    # bandwidth: 7.8 + 15.2 ms) ahead of the contiguous gelu (0.913: 8.6 + 12.8 ms), which the
    # top 3 leave out.
    assert "matmul" in printed and "all kernels" in printed and "aten.layer_norm" in printed
    assert "aten.gelu" not in printed
