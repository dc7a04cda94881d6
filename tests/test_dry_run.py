"""What graph codegen writes besides ops: tensor constants, through ``repr`` only."""

from __future__ import annotations

import math

import pytest
import torch

from codegen.spmd_emit import MAX_CONSTANT_ELEMENTS, tensor_literal
from planner.errors import PlanningError

# ---------------------------------------------------------------- tensor constants


class _Rank:
    device = torch.device("cpu")


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor(0.5),
        torch.tensor([[1, -2], [3, 4]]),
        torch.tensor([1.0, float("inf"), float("-inf"), float("nan")]),
        torch.tensor([True, False]),
        torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
    ],
    ids=["scalar", "int matrix", "non-finite", "bool", "bf16"],
)
def test_tensor_constants_are_written_as_literals(value):
    source = tensor_literal(value, "c_lifted_tensor_0")
    rebuilt = eval(source, {"torch": torch, "float": float}, {"self": _Rank()})  # noqa: S307 - the code under test
    assert rebuilt.dtype == value.dtype and rebuilt.shape == value.shape
    assert torch.equal(rebuilt.nan_to_num(), value.nan_to_num()) and math.isnan(float(rebuilt.flatten()[-1])) == (
        math.isnan(float(value.flatten()[-1]))
    )


def test_big_or_odd_constants_are_refused_with_one_line():
    with pytest.raises(PlanningError, match="register it as a buffer"):
        tensor_literal(torch.zeros(MAX_CONSTANT_ELEMENTS + 1), "c_big")
    with pytest.raises(PlanningError, match="complex64"):
        tensor_literal(torch.zeros(2, dtype=torch.complex64), "c_complex")
