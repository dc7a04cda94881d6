"""Op names in plans depend on what each op computes, not on the order it was traced in
(planner/node_names.py).

Plans name ops by node name and ``compile`` re-traces the model in another process. A forward
that builds its masks while iterating a ``set`` of strings is traced in the order of Python's
string hashing, which changes with ``PYTHONHASHSEED`` in every process: the same model must
get the same names, each for the same op, whatever the order (the compile across hash seeds
and its parity are in tests/test_stable_programs.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from planner.model_spec import ModelSpec
from planner.trace import trace

REPO = Path(__file__).resolve().parents[1]
OUTSIDE_MODELS = REPO / "tests" / "models" / "outside_models.py"


def _graph(order: str):
    model, args, kwargs = ModelSpec(f"{OUTSIDE_MODELS}:set_order_masks", {"order": order}).build("meta")
    return trace(model, args, kwargs)


def _identities(graph) -> dict[str, tuple]:
    """name -> (op, the names it reads, its module): what a plan's strategy is matched with."""
    return {node.name: (node.op, node.inputs, node.module) for node in graph.nodes}


def test_the_same_ops_traced_in_another_order_keep_their_names():
    listed, reversed_ = _graph("listed"), _graph("reversed")
    assert [node.op for node in listed.nodes] != [node.op for node in reversed_.nodes], "the two orders differ"
    assert _identities(listed) == _identities(reversed_)


def test_names_are_unique_identifiers_and_tell_identical_ops_apart():
    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return h.sum() * 2 + h.sum() * 3  # the same sum twice, then different scalings

    graph = trace(Twice(), (torch.randn(8, 4),))
    names = [node.name for node in graph.nodes]
    assert len(set(names)) == len(names) and all(name.isidentifier() for name in names)
    sums = sorted(node.name for node in graph.nodes if node.op == "aten.sum.default")
    assert len(sums) == 2 and sums[1] == f"{sums[0]}_2", sums
    products = [node.name for node in graph.nodes if node.op == "aten.mul.Tensor"]
    assert len(products) == 2 and products[0].rsplit("_", 1)[0] == products[1].rsplit("_", 1)[0] == "mul"
    assert products[0] != products[1]
    # The fx graph the program is written from carries the same names.
    assert set(names) <= {node.name for node in graph.graph_module.graph.nodes}


_TRACE_IN_A_PROCESS = """
import json, sys
from planner.model_spec import ModelSpec
from planner.trace import trace
model, args, kwargs = ModelSpec(sys.argv[1], {}).build("meta")
graph = trace(model, args, kwargs)
print(json.dumps([[node.name, node.op, list(node.inputs)] for node in graph.nodes]))
"""


def test_processes_with_other_hash_seeds_give_the_same_names():
    traced = {}
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-c", _TRACE_IN_A_PROCESS, f"{OUTSIDE_MODELS}:set_order_masks"],
                              capture_output=True, text=True, env=env, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        traced[seed] = json.loads(done.stdout.strip().splitlines()[-1])
    assert [op for _, op, _ in traced["1"]] != [op for _, op, _ in traced["2"]], "the hash seeds trace different orders"
    assert {name: (op, inputs) for name, op, inputs in traced["1"]} == {name: (op, inputs) for name, op, inputs in traced["2"]}
