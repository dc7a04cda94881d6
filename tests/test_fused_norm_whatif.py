"""``benchmarks/fused_norm_whatif.py``: a row's norms as the eager trace prices them against
one fused kernel each, by hand (no row is simulated here: each check is arithmetic; the fused
pricing itself is tested in tests/test_fused_chains.py)."""

from __future__ import annotations

import pytest

from benchmarks.fused_norm_whatif import forwards_per_pass, step_seconds
from planner.strategy import KEEP_A2A, NORMS_MOE_ACT


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
