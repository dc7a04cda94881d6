"""Models whose backward is their own never get a program that would train them wrong.

``tests/models/ste.py`` quantizes activations with a straight-through estimator (a custom
``torch.autograd.Function`` whose backward passes the gradient through ``round``); its
variants carry module backward hooks, or call ``Tensor.register_hook`` in forward. A graph
program replays the traced ATen ops and would differentiate ``round`` instead (zero
gradients) or drop the hooks. So:

- the tracer records each of them (``OpGraph.opaque_backward``: module path and what);
- ``planner.plan`` keeps such a model to data-parallel plans, with a warning naming the
  module and the Function, whatever search was asked for; those programs run the model's
  own modules and pass ``--check`` parity (one torchrun launch at world size 2);
- ``planner.compile`` refuses a tensor-parallel or pipeline plan of it (a hand-made
  ``baselines.megatron`` plan) with one line naming the module and the Function.

The negative control compiles that tensor-parallel program anyway (the refusal bypassed):
its ``--check`` fails, so the refusal prevents a real wrong program.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import planner
from planner import baselines
from planner.api import prepare_model
from planner.cli import main
from planner.errors import PlanningError
from planner.model_spec import ModelSpec
from launch_groups import register_group
from test_parity import REPO, result_of

STE = str(REPO / "tests" / "models" / "ste.py")
WORLD = 2
# hook setting of ste.py -> what the tracer must name, in module 'blocks.0...'
VARIANTS = {
    "none": ("blocks.0.quant", "custom autograd Function RoundSTE"),
    "backward": ("blocks.0.down", "module backward hook"),
    "tensor": ("blocks.0", "Tensor.register_hook(_halve)"),
}


@pytest.mark.parametrize("hook", list(VARIANTS))
def test_tracer_records_what_the_graph_cannot_replay(hook):
    graph, *_ = prepare_model(ModelSpec(STE, {"hook": hook}), "cpu:1x2")
    module, what = VARIANTS[hook]
    assert graph.opaque_backward[0][0] == module and graph.opaque_backward[0][1].startswith(what), graph.opaque_backward
    assert [m for m, _ in graph.opaque_backward] == [module, module.replace(".0", ".1", 1)]  # once per block


def test_plain_models_have_no_opaque_backward():
    graph, *_ = prepare_model(ModelSpec(str(REPO / "examples" / "gpt.py"), {}), "cpu:1x2")
    assert graph.opaque_backward == []


def test_plan_keeps_the_ste_model_to_data_parallelism_and_says_why():
    plan = planner.plan(STE, "cpu:1x2", search="ilp", progress=False)
    assert plan.mesh.names == ("dp",) and plan.label == ""
    warning = next(w for w in plan.warnings if "RoundSTE" in w)
    assert "module 'blocks.0.quant' runs custom autograd Function RoundSTE (and 1 more place)" in warning
    assert "data parallelism only" in warning
    assert " ".join(warning.split()) in " ".join(plan.report().split())  # the report wraps lines


def test_forced_tensor_parallel_plan_is_refused_at_compile(tmp_path, capsys):
    plan = baselines.megatron(STE, "cpu:1x2", tp=2, precision="fp32")
    with pytest.raises(PlanningError, match=r"module 'blocks\.0\.quant' runs custom autograd Function RoundSTE"):
        planner.compile(plan, tmp_path / "api")
    plan.save(tmp_path / "tp.json")  # loaded from a file (no traced graph): compile traces and refuses too
    assert main(["compile", str(tmp_path / "tp.json"), "-o", str(tmp_path / "cli")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("importing model file /")]
    assert len(lines) == 1 and "RoundSTE" in lines[0] and "--search dp" in lines[0], lines
    assert not (tmp_path / "cli" / "model_spmd.py").exists()


def test_pipeline_plan_of_a_hooked_model_is_refused(tmp_path):
    plan = baselines.megatron(ModelSpec(STE, {"hook": "backward"}), "cpu:2x1", pp=2, micro_batch=2, precision="fp32")
    with pytest.raises(PlanningError, match=r"module 'blocks\.0\.down' runs module backward hook"):
        planner.compile(plan, tmp_path / "pp")


def _programs(root, world):
    """The data-parallel programs of every variant, and the tensor-parallel program of the STE
    model compiled past the refusal, checked in the session's launch (launch_groups.py)."""
    folders = {}
    for hook in VARIANTS:
        plan = planner.plan(ModelSpec(STE, {"hook": hook}), f"cpu:1x{WORLD}", progress=False)
        folders[hook] = planner.compile(plan, root / f"dp-{hook}")
    tp = baselines.megatron(STE, f"cpu:1x{WORLD}", tp=WORLD, precision="fp32")
    tp.graph.opaque_backward = []  # the control: what compile would write if it did not refuse
    folders["tp-control"] = planner.compile(tp, root / "tp-control")
    return folders, list(folders.values())


PROGRAMS = register_group(WORLD, _programs)


@pytest.fixture(scope="module")
def launched(parity_launches):
    return parity_launches.result(PROGRAMS)


@pytest.mark.distributed
@pytest.mark.parametrize("hook", list(VARIANTS))
def test_data_parallel_program_passes_parity(launched, hook):
    folders, launch = launched
    assert result_of(launch, folders[hook]).startswith("ok"), result_of(launch, folders[hook])


@pytest.mark.distributed
def test_control_graph_program_trains_on_wrong_gradients(launched):
    folders, launch = launched
    assert "model_spmd.py" in {p.name for p in Path(folders["tp-control"]).iterdir()}
    result = result_of(launch, folders["tp-control"])
    assert result.startswith("FAILED parity FAILED"), result
    assert "grad of" in result, result  # the gradients differ: the custom backward was lost
