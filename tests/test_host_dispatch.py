"""The host's time per op bounds a GPU step from below (``cost_model.host_dispatch``).

Worked by hand: a tensor-parallel program of a tiny MLP on H100s has kernels of a few
microseconds, shorter than what the host spends issuing each DTensor op, so each segment
takes its op count times the host's time per op; the same program at a large width is
bound by its kernels and keeps the device's time; on CPUs the host's time adds instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_model import defaults
from cost_model.host_dispatch import DTENSOR_BACKWARD_DISPATCH_S, DTENSOR_FORWARD_DISPATCH_S, host_wait
from cost_model.simulator import Simulator
from planner import baselines
from planner.model_spec import ModelSpec

MLP_FILE = str(Path(__file__).resolve().parent.parent / "examples" / "mlp.py")


def _megatron(cluster: str, width: int):
    spec = ModelSpec(MLP_FILE, {"batch_size": 16, "in_features": width, "hidden": 2 * width, "out_features": 8, "layers": 2})
    plan = baselines.megatron(spec, cluster, tp=2, precision="bf16" if "h100" in cluster else "fp32")
    return Simulator(plan, plan.graph)


def _has_backward(simulator: Simulator, name: str) -> bool:
    return any(meta.dtype.is_floating_point for meta in simulator.context.nodes[name].output_meta)


def test_host_wait_is_the_host_time_beyond_the_device_time():
    assert host_wait(3e-6, 10e-6) == pytest.approx(7e-6)
    assert host_wait(10e-6, 3e-6) == 0.0


def test_a_tiny_graph_program_on_gpus_waits_for_the_host():
    simulator = _megatron("dgx-h100:1x2", width=32)
    forward_per_op = defaults.KERNEL_OVERHEAD_S + DTENSOR_FORWARD_DISPATCH_S  # 13.7 us
    backward_per_op = defaults.KERNEL_OVERHEAD_S + DTENSOR_BACKWARD_DISPATCH_S  # 17.5 us
    for segment in simulator.segments():
        device_forward = sum(simulator.costs[name].forward_s for name in segment.nodes)
        graded = sum(1 for name in segment.nodes if _has_backward(simulator, name))
        # bf16 autocast casts each Linear's fp32 weight and bias (DTensors) before the matmul,
        # and its backward casts their gradients back: one more op each way per tensor.
        casts = sum(len(simulator.context.nodes[name].params) for name in segment.nodes
                    if simulator.context.nodes[name].op == "aten.linear.default")
        # Every op issues in 13.7 us; no kernel of 16 x 32 values takes that long.
        ops = len(segment.nodes) + casts
        assert device_forward + segment.forward_comm_s < ops * forward_per_op
        assert segment.forward_s + segment.forward_comm_s == pytest.approx(ops * forward_per_op)
        assert segment.backward_s + segment.backward_comm_s == pytest.approx((graded + casts) * backward_per_op)


def test_a_wide_graph_program_on_gpus_is_bound_by_its_kernels():
    simulator = _megatron("dgx-h100:1x2", width=8192)
    for segment in simulator.segments():
        if len(segment.nodes) < 3:
            continue
        device_forward = sum(simulator.costs[name].forward_s for name in segment.nodes)
        assert segment.host_forward_s < device_forward
        assert segment.forward_s == pytest.approx(device_forward)


def test_on_cpus_the_host_is_the_device():
    simulator = _megatron("cpu:1x2", width=32)
    assert simulator.context.host is None
    for segment in simulator.segments():
        assert segment.host_forward_s == 0.0
        assert segment.forward_s == pytest.approx(sum(simulator.costs[name].forward_s for name in segment.nodes))


def test_a_host_bound_plan_says_so_and_keeps_the_figure_in_its_file(tmp_path):
    import planner
    from planner.plans import load_plan

    spec = ModelSpec(MLP_FILE, {"batch_size": 16, "in_features": 32, "hidden": 64, "out_features": 8, "layers": 2})
    # fp32: in bf16 this tiny step is mostly the FSDP2 units' gathers and fp32 reductions
    # (cost_model.mixed_precision), and the host's share falls just under the warning's 10%.
    plan = planner.plan(spec, "dgx-h100:1x2", precision="fp32", progress=False)
    simulator = Simulator(plan, plan.graph)
    waits = sum(segment.host_wait_s for segment in simulator.segments()) * simulator.context.micro_batches
    assert plan.estimate.host_wait_s == pytest.approx(waits) and waits > 0.1 * plan.estimate.step_time_s
    assert any("wait for the host" in warning for warning in plan.warnings)
    assert "waiting for the host to issue ops" in plan.report()
    plan.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").estimate.host_wait_s == pytest.approx(plan.estimate.host_wait_s)


def _pipeline_on_cpus(device_overrides: dict):
    """A pp=2 pipeline (1F1B, 2 micro-batches) of the GPT example (2 blocks, batch 8) on two
    CPU devices of the cpu preset, their fields replaced by ``device_overrides``."""
    import dataclasses

    from planner.cluster import Cluster

    base = Cluster.preset("cpu", devices_per_node=2)
    node = dataclasses.replace(base.nodes[0], device=dataclasses.replace(base.nodes[0].device, **device_overrides))
    cluster = dataclasses.replace(base, nodes=(node,))
    spec = ModelSpec(str(Path(MLP_FILE).with_name("gpt.py")), {})
    plan = baselines.megatron(spec, cluster, pp=2, micro_batch=4, precision="fp32")  # 8 / 4: 2 micro-batches
    return Simulator(plan, plan.graph)


def test_a_pipeline_on_uncalibrated_cpus_pays_dtensor_dispatch_on_every_op_of_every_micro_batch():
    # A pipeline's stages are graph programs: every op runs on DTensors, so on a CPU device
    # without a calibrated dtensor_op_overhead_s each op costs the measured default on top of
    # its kernel, 8.7 us forward and 12.5 us backward (benchmarks/host_dispatch.py), as on
    # GPUs; a device calibrated at 0 pays none. Node costs are per micro-batch, so the two
    # micro-batches each pay it again.
    uncalibrated = _pipeline_on_cpus({"dtensor_op_overhead_s": None})
    free = _pipeline_on_cpus({"dtensor_op_overhead_s": 0.0})
    assert uncalibrated.context.host is None and uncalibrated.context.micro_batches == 2
    for name, cost in uncalibrated.costs.items():
        assert cost.forward_s == pytest.approx(free.costs[name].forward_s + 8.7e-6)
        expected_backward = free.costs[name].backward_s + (12.5e-6 if _has_backward(uncalibrated, name) else 0.0)
        assert cost.backward_s == pytest.approx(expected_backward)
    # Per stage and micro-batch: 8.7 us per op forward, 12.5 us per op with a backward; each
    # stage holds 29 ops, 28 with a backward: 29 x 8.7 + 28 x 12.5 = 602.3 us. 1F1B with
    # pp = 2 and m = 2 runs m + pp - 1 = 3 stage passes (forward and backward) one after the
    # other on its critical path: the step grows by 3 x 602.3 us = 1.807 ms.
    per_stage = [0.0, 0.0]
    for segment in uncalibrated.segments():
        graded = sum(1 for name in segment.nodes if _has_backward(uncalibrated, name))
        per_stage[segment.stage] += len(segment.nodes) * 8.7e-6 + graded * 12.5e-6
    extra = uncalibrated.run().step_time_s - free.run().step_time_s
    assert per_stage == pytest.approx([602.3e-6, 602.3e-6])
    assert extra == pytest.approx(3 * 602.3e-6)


def test_a_plain_data_parallel_module_on_cpus_pays_no_dtensor_dispatch():
    from planner.cluster import Cluster

    spec = ModelSpec(MLP_FILE, {"batch_size": 8, "in_features": 16, "hidden": 32, "out_features": 8, "layers": 2})
    plan = baselines.ddp(spec, Cluster.preset("cpu", devices_per_node=2))
    simulator = Simulator(plan, plan.graph)
    assert simulator.context.dtensor_dispatch.forward_s == simulator.context.dtensor_dispatch.backward_s == 0.0


def test_megatron_cores_own_program_pays_the_launch_not_dtensors_dispatch():
    # A plan pricing Megatron-Core's distributed optimizer is Megatron-Core's program (plain
    # tensors; compile refuses the field): its host issues each op in KERNEL_OVERHEAD_S (5 us),
    # where the same layout as this project's graph program also pays DTensor's dispatch
    # (5 + 8.7 = 13.7 us forward, 5 + 12.5 = 17.5 us backward).
    import dataclasses

    spec = ModelSpec(MLP_FILE, {"batch_size": 16, "in_features": 32, "hidden": 64, "out_features": 8, "layers": 2})
    plan = baselines.megatron(spec, "dgx-h100:1x4", tp=2, precision="bf16")
    assert Simulator(plan, plan.graph).context.host.forward_s == pytest.approx(13.7e-6)
    megatron = dataclasses.replace(plan, dp_flavour="zero1", megatron_distributed_optimizer=True)
    host = Simulator(megatron, megatron.graph).context.host
    assert (host.forward_s, host.backward_s) == (defaults.KERNEL_OVERHEAD_S, defaults.KERNEL_OVERHEAD_S)
