"""What ``launch.py --check`` prints when parity fails (``codegen.runtime.parity.ParityResult``)."""

from __future__ import annotations

from codegen.runtime.parity_compare import ParityResult, TensorDiff

FAILED = TensorDiff("grad of conv_stem.weight", 3e-3, 35.0)


def test_an_fp32_failure_names_the_float64_check_and_stays_one_line():
    message = ParityResult(10, 3e-3, FAILED, float64_possible=True).message(1e-5, 1e-4)
    assert message.startswith("parity FAILED: worst tensor grad of conv_stem.weight: max_abs_err=3.000e-03 (35.0x")
    assert message.endswith("--check --fp64 tells rounding from a bug") and "\n" not in message


def test_no_float64_hint_where_it_cannot_help():
    # Already in float64, a plan --fp64 cannot check (bf16, pipelines), or a pass.
    for result in (ParityResult(10, 3e-3, FAILED, in_float64=True, float64_possible=True),
                   ParityResult(10, 3e-3, FAILED),
                   ParityResult(10, 1e-7, TensorDiff("loss", 1e-7, 0.01), float64_possible=True)):
        assert "--fp64" not in result.message(1e-5, 1e-4)
