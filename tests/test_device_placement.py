"""Tensors the compiled programs make live on the device they are used on.

The gloo tests run everything on the CPU, where a tensor made without ``device=`` lands on
the right device by accident. On GPUs the same line makes a CPU tensor that NCCL refuses
("Tensors must be CUDA") or that cannot index a GPU tensor, and the program fails at its
first step. So every tensor factory call in ``codegen/`` names its device: the device of
the data it meets, or ``"cpu"`` for values that stay on the host.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from codegen.runtime.moe import count_choices
from codegen.runtime.moe_exchange import _block_transpose

CODEGEN = Path(__file__).resolve().parent.parent / "codegen"
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
             "linspace", "eye"}


def factory_calls_without_device(source: str) -> list[tuple[int, str]]:
    """(line, function) of every ``torch.<factory>(...)`` call in ``source`` without ``device=``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(keyword.arg == "device" for keyword in node.keywords)):
            found.append((node.lineno, f"torch.{node.func.attr}"))
    return found


def test_the_lint_finds_a_factory_call_without_a_device():
    source = "import torch\ncounts = torch.tensor([1, 2])\nok = torch.zeros(3, device=x.device)\n"
    assert factory_calls_without_device(source) == [(2, "torch.tensor")]


def test_every_tensor_the_programs_make_names_its_device():
    missing = [f"{path.relative_to(CODEGEN.parent)}:{line}: {call}"
               for path in sorted(CODEGEN.rglob("*.py"))
               for line, call in factory_calls_without_device(path.read_text())]
    assert not missing, "tensor factory calls without device= (wrong device on GPUs):\n" + "\n".join(missing)


class _Layer:
    """The two routing statistics an MoE layer keeps, made on the host as the layers make them."""

    def __init__(self, experts: int) -> None:
        self.routed_counts = torch.zeros(experts, dtype=torch.float64, device="cpu")
        self.coselected = torch.zeros(experts, experts, dtype=torch.float64, device="cpu")


def test_routing_statistics_follow_the_tokens_device():
    # "meta" stands in for a GPU: adding a meta table into CPU tensors fails as a GPU one does.
    layer = _Layer(4)
    count_choices(layer, torch.zeros(6, 4, dtype=torch.float64, device="meta"))
    assert layer.routed_counts.device.type == "meta" and layer.coselected.device.type == "meta"


def test_routing_statistics_count_choices_and_pairs():
    layer = _Layer(3)
    # Token 0 chose experts 0 and 1, token 1 chose 1 and 2, token 2 chose 0 and 1.
    count_choices(layer, torch.tensor([[1, 1, 0], [0, 1, 1], [1, 1, 0]], dtype=torch.float64))
    assert layer.routed_counts.tolist() == [2.0, 3.0, 1.0]
    assert layer.coselected.tolist() == [[0.0, 2.0, 0.0], [2.0, 0.0, 1.0], [0.0, 1.0, 0.0]]


def test_the_two_step_exchange_reorders_rows_on_their_device():
    # Blocks (a, b) of sizes [[1, 2], [3, 0]]: rows 0 | 1 2 | 3 4 5 | -, read b-major.
    assert _block_transpose([[1, 2], [3, 0]], torch.device("cpu")).tolist() == [0, 3, 4, 5, 1, 2]
    assert _block_transpose([[1, 2], [3, 0]], torch.device("meta")).device.type == "meta"
