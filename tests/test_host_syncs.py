"""Host syncs split a segment's host-versus-device bound (``cost_model.host_syncs``).

Worked by hand on timelines of a few ops (microseconds: (device, host) per op, the host
issuing op k once it has spent h_1 + ... + h_k, the device starting it when it is issued and
the op before is done), then on a simulated expert-parallel plan of ``examples/moe.py`` on
H100s: one sync per MoE layer's forward, none in a layer that moves no tokens.
"""

from __future__ import annotations

import dataclasses

import pytest

from cost_model import host_syncs, node_costs
from cost_model.host_dispatch import host_wait
from cost_model.host_syncs import layer_syncs_in_forward, run_ahead_wait, synced_host_wait
from cost_model.simulation_cache import RECENTLY_COSTED
from cost_model.simulator import Simulator
from planner.cluster import Cluster
from planner.expert_kernels import BATCHED_MATMUL, TE_GROUPED_GEMM
from tests.moe_plans import moe_plan

US = 1e-6
# Before the sync: three kernel-bound ops (attention, say) of 100 us, each issued in 10 us.
BEFORE = [(100 * US, 10 * US)] * 3
# After it: the exchange (50 us on the device) then four small ops of 2 us, each issued in 10 us.
AFTER = [(50 * US, 10 * US)] + [(2 * US, 10 * US)] * 4
# The same, but the exchange is short (5 us): the host cannot keep ahead after the sync.
AFTER_SHORT = [(5 * US, 10 * US)] + [(2 * US, 10 * US)] * 4


def _sums(ops):
    return sum(d for d, _ in ops), sum(h for _, h in ops)


def test_after_a_sync_the_device_waits_for_the_first_op_to_be_issued():
    # Host lead 0 at the sync (t = 0): the exchange is issued at 10 and runs 10-60; the small
    # ops are issued at 20, 30, 40, 50, all before 60, so they run 60-68 back to back.
    # 68 - 58 of device work = 10 us waited: the exchange's issue time.
    assert run_ahead_wait(AFTER) == pytest.approx(10 * US)


def test_after_a_sync_a_host_slower_than_the_kernels_is_exposed_op_by_op():
    # Exchange issued at 10, runs 10-15; small ops issued at 20, 30, 40, 50, each run 2 us
    # then: 20-22, 30-32, 40-42, 50-52. Device work 13, done at 52: 39 us waited, more than
    # host - device (50 - 13 = 37) by the last op's 2 us (it cannot start before it is issued).
    assert run_ahead_wait(AFTER_SHORT) == pytest.approx(39 * US)


def test_a_sync_splits_a_segment_that_was_kernel_bound():
    # Without the sync: device 300 + 58 = 358, host 30 + 50 = 80: the host stays ahead, no wait.
    device, host = _sums(BEFORE + AFTER)
    assert host_wait(device, host) == 0.0
    assert synced_host_wait((device, host)) == 0.0
    # With it: the 300 us before it are kernel bound (no wait), and after it the device waits
    # 10 us for the exchange to be issued (timeline above): 368 us for 358 of work.
    assert synced_host_wait(_sums(BEFORE), [AFTER]) == pytest.approx(10 * US)
    # With the short exchange: 300 + 13 = 313 of device work, host 80: no wait unsplit; with
    # the sync, the 39 us of the second timeline.
    device, host = _sums(BEFORE + AFTER_SHORT)
    assert host_wait(device, host) == 0.0
    assert synced_host_wait(_sums(BEFORE), [AFTER_SHORT]) == pytest.approx(39 * US)


def test_a_host_bound_part_before_the_sync_keeps_its_own_wait():
    # Before: 20 us of kernels issued in 30 us -> 10 us waited; after: 10 us (first test).
    assert synced_host_wait((20 * US, 30 * US), [AFTER]) == pytest.approx(20 * US)
    # Two syncs, each followed by the short exchange's ops: 39 us each.
    assert synced_host_wait((20 * US, 30 * US), [AFTER_SHORT, AFTER_SHORT]) == pytest.approx(88 * US)


def test_only_an_expert_parallel_layer_that_moves_tokens_syncs():
    assert layer_syncs_in_forward("expert_parallel", exchanges_tokens=True) == 1
    assert layer_syncs_in_forward("expert_parallel", exchanges_tokens=False) == 0
    assert layer_syncs_in_forward("data_parallel", exchanges_tokens=True) == 0


def _on_h100(plan, expert_implementation: str = TE_GROUPED_GEMM):
    """``plan`` on four H100s, its experts run as ``expert_implementation``
    (``planner.expert_kernels``; by default Transformer Engine's grouped GEMM, as Megatron-Core)."""
    plan = dataclasses.replace(plan, cluster=Cluster.parse("dgx-h100:1x4"), expert_implementation=expert_implementation)
    return Simulator(plan, plan.graph)


def test_each_expert_parallel_layer_syncs_once_in_its_blocks_forward():
    simulator = _on_h100(moe_plan(4, "expert_parallel", "round-robin", precision="bf16"))
    layers = {layer.anchor: layer for layer in simulator.context.moe_layer_of.values()}
    blocks = [segment for segment in simulator.segments() if segment.block]
    assert len(blocks) == len(layers) == 2  # examples/moe.py: two blocks, an MoE layer each
    for segment in blocks:
        assert segment.host_syncs == 1
        anchor = next(name for name in segment.nodes if name in layers)
        # The exchange is issued by the host (one op's dispatch and launch, 5 us on H100s),
        # then the kernels of its one local expert (4 experts on 4 devices), a launch each:
        # forward 2 GEMMs (one per projection) and 3 memory-bound kernels (the activation
        # function and the two permutations), 5 + 5 x 5 = 30 us; backward 4 GEMMs (input and
        # weight gradient of each projection) and the 3, 5 + 7 x 5 = 40 us.
        assert simulator.costs[anchor].host_forward_s == pytest.approx(30 * US)
        assert simulator.costs[anchor].host_backward_s == pytest.approx(40 * US)
        # And so are the routing ops around it, one op each.
        routing = [name for name in segment.nodes if name in simulator.context.moe_layer_of
                   and name not in layers[anchor].expert_nodes]
        assert routing and all(simulator.costs[name].host_forward_s == pytest.approx(5 * US) for name in routing)
    for segment in simulator.segments():
        if not segment.block:
            assert segment.host_syncs == 0


def test_the_host_launches_the_kernels_the_compiled_program_runs():
    # examples/moe.py's layers compiled by the planner run one torch.bmm per projection and a
    # GELU between them (planner.expert_kernels): after the exchange's own op (5 us), forward
    # 2 bmm + 1 GELU = 3 launches, 5 + 3 x 5 = 20 us; backward 4 bmm (input and weight
    # gradient of each projection) + 1 GELU, 5 + 5 x 5 = 30 us.
    simulator = _on_h100(moe_plan(4, "expert_parallel", "round-robin", precision="bf16"), BATCHED_MATMUL)
    anchors = {layer.anchor for layer in simulator.context.moe_layer_of.values()}
    assert len(anchors) == 2
    for anchor in anchors:
        assert simulator.costs[anchor].host_forward_s == pytest.approx(20 * US)
        assert simulator.costs[anchor].host_backward_s == pytest.approx(30 * US)


def test_the_sync_lengthens_a_host_bound_forward_and_leaves_backward_alone(monkeypatch):
    # examples/moe.py at these sizes is host bound on H100s (kernels of a few us, 5 us to
    # issue each op). Unsplit, the forward waits host - device; split at the dispatch, the
    # part after the sync is replayed from no lead, and its last op's kernel can no longer
    # run under the host's issue of later ops: strictly longer. Backward has no sync.
    synced = _on_h100(moe_plan(4, "expert_parallel", "round-robin", precision="bf16"))
    monkeypatch.setattr(host_syncs, "DISPATCH_SYNCS_FORWARD", 0)
    unsynced = _on_h100(moe_plan(4, "expert_parallel", "round-robin", precision="bf16"))
    for with_sync, without in zip(synced.segments(), unsynced.segments()):
        assert without.host_syncs == 0
        assert with_sync.backward_s == pytest.approx(without.backward_s)
        if with_sync.host_syncs:
            assert with_sync.forward_s > without.forward_s
        else:
            assert with_sync.forward_s == pytest.approx(without.forward_s)
    assert synced.run().step_time_s > unsynced.run().step_time_s


def test_the_experts_launches_cost_the_host_after_the_exchange(monkeypatch):
    # The same plan with the host's launches of the experts' kernels costing nothing (the
    # device's launches unchanged): each MoE block's backward is host bound, so it is longer by
    # exactly the 7 launches x 5 us = 35 us the host spends on them; its forward by at most
    # 5 x 5 = 25 us, less what the device's exchange, issued first after the sync, hides
    # (cost_model.segments). The segments around the blocks hold no MoE layer: unchanged.
    launched = _on_h100(moe_plan(4, "expert_parallel", "round-robin", precision="bf16"))
    real = node_costs.efficiencies
    monkeypatch.setattr(node_costs, "efficiencies", lambda device, dtype=None: (*real(device, dtype)[:2], 0.0))
    RECENTLY_COSTED.clear()
    free = _on_h100(moe_plan(4, "expert_parallel", "round-robin", precision="bf16"))
    for with_launches, without in zip(launched.segments(), free.segments()):
        if with_launches.block:
            assert with_launches.backward_s - without.backward_s == pytest.approx(35 * US)
            assert 0 < with_launches.forward_s - without.forward_s <= 25 * US + 1e-12
        else:
            assert with_launches.forward_s == pytest.approx(without.forward_s)
            assert with_launches.backward_s == pytest.approx(without.backward_s)
    RECENTLY_COSTED.clear()
