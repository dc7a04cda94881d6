"""The torchrun command lines suggested for a plan: one node, several nodes, and a model too
big for ``--check``'s one-device reference (``planner.launch_command``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import planner
from codegen.emit import render_launch
from planner.launch_command import check_refusal, first_run_command, reference_bytes

MLP = str(Path(__file__).resolve().parent.parent / "examples" / "mlp.py")


@pytest.fixture(scope="module")
def cpu_plan():
    return planner.plan(MLP, "cpu:1x2", search="dp", progress=False)


@pytest.fixture(scope="module")
def two_node_plan():
    return planner.plan(MLP, "dgx-a100-80g:2", search="dp", progress=False)


def test_one_node_runs_every_rank_from_one_torchrun(cpu_plan):
    assert first_run_command(cpu_plan, "out/launch.py") == "torchrun --nproc_per_node 2 out/launch.py --check"


def test_several_nodes_run_one_torchrun_per_node_with_a_rendezvous(two_node_plan):
    command = first_run_command(two_node_plan, "out/launch.py")
    assert command.startswith("torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d "
                              "--rdzv-endpoint $MASTER_ADDR:29500 out/launch.py --check")
    assert "on each of the 2 nodes" in command
    assert "--nproc_per_node 16" not in render_launch(two_node_plan)
    assert "torchrun --nnodes 2 --nproc_per_node 8" in render_launch(two_node_plan)


def _with_parameters(plan, parameters: int):
    return dataclasses.replace(plan, summary=dataclasses.replace(plan.summary, parameters=parameters))


def test_a_model_too_big_for_one_gpu_is_suggested_a_training_run_not_a_check(two_node_plan):
    # 80 GB A100s: 6e9 parameters need 16 bytes each (fp32 weight, gradient, two AdamW states).
    big = _with_parameters(two_node_plan, 6_000_000_000)
    assert reference_bytes(big) == 96_000_000_000
    assert first_run_command(big, "out/launch.py").split("   #")[0].endswith("out/launch.py --steps 10")
    assert "too big for one" in render_launch(big)
    refusal = check_refusal(big, 80 * 2**30)
    assert refusal is not None and "89.4 GiB for 6,000,000,000 parameters" in refusal and "80.0 GiB" in refusal
    assert "\n" not in refusal
    assert check_refusal(_with_parameters(two_node_plan, 1_000_000_000), 80 * 2**30) is None


def test_cpu_plans_always_suggest_the_check(cpu_plan):
    # A CPU device's memory is a planning budget, not the host's memory.
    assert first_run_command(_with_parameters(cpu_plan, 10**12), "out/launch.py").endswith("--check")
