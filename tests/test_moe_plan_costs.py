"""A plan's MoE layers in the simulator (``cost_model.moe_layers``) against values worked out
by hand.

The cluster is made for arithmetic (as in tests/test_moe_costs.py): one node of 4 devices
at 1 TFLOP/s, memory traffic free, no kernel overhead; links of 1 GB/s with next to no
latency. The model: ``examples/moe.py`` with 2 MoE blocks, batch 8 x 32 tokens = 256 tokens
per layer, width 64, 4 GELU experts of FFN 128 (2 matmuls: 2 x 64 x 128 = 16,384 weights
each, 65,536 per layer), top-2, capacity factor 1.25: each expert takes at most
1.25 x 512 / 4 = 160 of the 512 routed copies, and its buffer is padded to 160.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_model.simulator import Simulator, simulated
from planner.api import prepare_model
from planner.cluster import Cluster, DeviceSpec, LinkSpec, NodeSpec
from planner.model_spec import ModelSpec
from planner.strategy import ExpertLayout, ExpertPlacement
from search.moe_search import moe_base_plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DEVICE = DeviceSpec(
    name="arith", peak_flops={"float32": 1e12}, memory_bytes=10**12, memory_bandwidth=1e30,
    matmul_efficiency=1.0, memory_efficiency=1.0, kernel_overhead_s=0.0,
)
LINK = LinkSpec(bandwidth=1e9, latency=1e-15)
CLUSTER = Cluster(name="arith", nodes=(NodeSpec(DEVICE, 4, LINK),), inter_link=LINK, backend="gloo")
EXPERT_WEIGHTS = 65_536  # per layer: 4 experts x 2 x 64 x 128
COPY_FLOPS = 2 * 2 * 64 * 128  # forward FLOPs of one routed copy through its expert


@pytest.fixture(scope="module")
def model():
    graph, spec, name, _ = prepare_model(ModelSpec(str(EXAMPLES / "moe.py"), {"ffn": 128}), CLUSTER)
    return graph, moe_base_plan(graph, CLUSTER, spec, name)


def layouts(mode: str, placement: ExpertPlacement | None = None, loads=()) -> tuple[ExpertLayout, ...]:
    return tuple(
        ExpertLayout(f"blocks.{i}.moe", mode, 4, 2, 1.25, placement=placement, expert_loads=loads) for i in range(2)
    )


def plan_with(model, mode, placement=None, loads=()):
    graph, base = model
    import dataclasses

    return dataclasses.replace(base, expert_layouts=layouts(mode, placement, loads))


def test_the_graph_knows_its_moe_layers_and_their_ops(model):
    graph, _ = model
    assert [block.module for block in graph.moe_blocks] == ["blocks.0.moe", "blocks.1.moe"]
    ops = graph.moe_nodes("blocks.0.moe")
    assert {node.module for node in ops} == {"blocks.0.moe", "blocks.0.moe.router", "blocks.0.moe.experts"}
    assert not any(node.module.startswith("blocks.1") for node in ops)


def test_expert_parallel_experts_are_priced_on_the_busiest_device(model):
    graph, _ = model
    simulator = Simulator(plan_with(model, "expert_parallel", ExpertPlacement.round_robin(4, 4)), graph)
    layer = simulator.context.moe_layers["blocks.0.moe"]
    anchor = simulator.costs[layer.anchor]
    # Uniform routing: every device holds one expert padded to 160 copies.
    assert anchor.forward_s == pytest.approx(160 * COPY_FLOPS / 1e12)
    assert anchor.backward_s == pytest.approx(2 * 160 * COPY_FLOPS / 1e12)
    # Each device sends its 128 copies (512 / 4) of 64 x 4 B and receives its expert's 128:
    # 32,768 B; an all-to-all costs 3/4 x 32,768 / 1e9, dispatch and combine in each pass.
    one = 0.75 * 32_768 / 1e9
    # Forward also all-gathers each rank's counts of choices: 4 ranks x top-2 x 4 experts x 8 B.
    counts = 0.75 * 4 * 2 * 4 * 8 / 1e9
    assert anchor.forward_comm_s == pytest.approx(2 * one + counts) and anchor.backward_comm_s == pytest.approx(2 * one)
    # Bytes sent: the four all-to-alls and the counts' all-gather, 3/4 of 4 x 2 x 4 x 8 B
    # (tests/test_comm_audit.py counts the program's).
    assert anchor.axis_bytes["dp"] == pytest.approx(4 * 0.75 * 32_768 + 0.75 * 4 * 2 * 4 * 8)
    # The other expert ops carry nothing; no routing op pays a resharding.
    for name in layer.expert_nodes - {layer.anchor}:
        assert simulator.costs[name].forward_s == 0 and simulator.costs[name].backward_s == 0
    assert all(simulator.costs[name].forward_comm_s == 0 for name in layer.nodes - {layer.anchor})
    # The router runs on each device's 64 tokens: 2 x 64 x 64 x 4 FLOPs.
    router = next(n for n in graph.moe_nodes("blocks.0.moe") if "blocks.0.moe.router.weight" in n.params)
    assert simulator.costs[router.name].forward_s == pytest.approx(2 * 64 * 64 * 4 / 1e12)


def test_expert_states_follow_the_mode(model):
    graph, _ = model
    replicated = simulated(plan_with(model, "data_parallel"), graph).estimate
    parallel = simulated(plan_with(model, "expert_parallel", ExpertPlacement.round_robin(4, 4)), graph).estimate
    sliced = simulated(plan_with(model, "expert_sliced"), graph).estimate
    # A device holds all 4 experts replicated, 1 of 4 expert parallel, 1/4 of each sliced:
    # 3/4 of 65,536 weights fewer per layer, 2 layers; fp32 Adam: 4 B weights, 4 B
    # gradients, 8 B optimizer states.
    fewer = 2 * 0.75 * EXPERT_WEIGHTS
    for smaller in (parallel, sliced):
        assert replicated.memory.weights - smaller.memory.weights == pytest.approx(fewer * 4, abs=2)
        assert replicated.memory.gradients - smaller.memory.gradients == pytest.approx(fewer * 4, abs=2)
        assert replicated.memory.optimizer_states - smaller.memory.optimizer_states == pytest.approx(fewer * 8, abs=2)
    # Expert parallel keeps a send buffer of its own 256 / 4 x 2 = 128 copies and a receive
    # buffer of the busiest device's 160 (padded to the capacity), rows of 64 x 4 B; sliced
    # keeps the gathered copies (4 x 160 of them). DDP's bucket (the whole gradient of a
    # model this small) shrinks with the gradients a device holds.
    bucket_shrinks = fewer * 4
    assert parallel.memory.communication_buffers - replicated.memory.communication_buffers == pytest.approx(
        (128 + 160) * 64 * 4 - bucket_shrinks, abs=2
    )
    assert sliced.memory.communication_buffers - replicated.memory.communication_buffers == pytest.approx(
        4 * 160 * 64 * 4 - bucket_shrinks, abs=2
    )


def test_expert_gradients_are_all_reduced_only_in_data_parallel_mode(model):
    graph, _ = model
    replicated = simulated(plan_with(model, "data_parallel"), graph).estimate.bytes_per_axis["dp"]
    parallel = simulated(plan_with(model, "expert_parallel", ExpertPlacement.round_robin(4, 4)), graph)
    # DDP's all-reduce sends 2 x 3/4 of the gradients; expert parallel drops the experts'
    # (65,536 x 4 B per layer) and sends its four all-to-alls (3/4 x 32,768 B each) instead.
    expected = replicated - 2 * (2 * 0.75 * EXPERT_WEIGHTS * 4) + 2 * (4 * 0.75 * 32_768)
    assert parallel.estimate.bytes_per_axis["dp"] == pytest.approx(expected)
    # The plan's layouts carry their cost for the report.
    cost = parallel.expert_layouts[0].cost
    assert cost.compute_s == pytest.approx(3 * 160 * COPY_FLOPS / 1e12)
    assert cost.communication_s == pytest.approx(4 * 0.75 * 32_768 / 1e9 + 0.75 * 4 * 2 * 4 * 8 / 1e9)


def test_copies_of_an_expert_sum_their_gradients_and_split_its_tokens(model):
    graph, _ = model
    # Expert 0 on devices 0 and 1 (half its tokens each), the others one device each.
    placement = ExpertPlacement(4, (((0, 0.5), (1, 0.5)), ((1, 1.0),), ((2, 1.0),), ((3, 1.0),)))
    simulator = Simulator(plan_with(model, "expert_parallel", placement), graph)
    layer = simulator.context.moe_layers["blocks.0.moe"]
    # Device 1 computes half of expert 0's 160 padded copies and all 160 of expert 1's.
    assert layer.cost.busiest_copies == pytest.approx(240)
    # The copied expert's gradients (2 x 64 x 128 x 4 B) summed as the program does it: a
    # ring all-reduce over the whole group of 4, 2 x 3/4 x 65,536 / 1e9.
    summed = 2 * 0.75 * 65_536 / 1e9
    assert layer.replica_sync_s == pytest.approx(summed, rel=1e-6)
    assert simulator.costs[layer.anchor].backward_comm_s == pytest.approx(layer.cost.backward_comm_s + summed, rel=1e-6)
    # Device 1 holds two experts: half the layer's expert weights.
    assert layer.param_fraction == 0.5


def test_a_layout_for_a_layer_the_model_lacks_is_named(model):
    graph, base = model
    import dataclasses

    wrong = dataclasses.replace(base, expert_layouts=(ExpertLayout("blocks.7.moe", "data_parallel", 4, 2, 1.25),))
    with pytest.raises(ValueError, match="'blocks.7.moe', which is not an MoE layer"):
        Simulator(wrong, graph)


def test_experts_a_rank_holds_alone_are_not_sharded_by_fsdp(model):
    import dataclasses

    graph, _ = model
    # Device 1 holds experts 0 (a copy) and 1: half of each layer's 65,536 expert weights,
    # its own, which FSDP does not shard; replicated experts are sharded 4 ways like the rest.
    placement = ExpertPlacement(4, (((0, 0.5), (1, 0.5)), ((1, 1.0),), ((2, 1.0),), ((3, 1.0),)))
    fsdp = {"dp_flavour": "fsdp", "fsdp_units": graph.block_paths()}
    parallel = simulated(dataclasses.replace(plan_with(model, "expert_parallel", placement), **fsdp), graph).estimate
    replicated = simulated(dataclasses.replace(plan_with(model, "data_parallel"), **fsdp), graph).estimate
    more = 2 * (0.5 * EXPERT_WEIGHTS - EXPERT_WEIGHTS / 4)
    assert parallel.memory.weights - replicated.memory.weights == pytest.approx(more * 4, abs=2)
    assert parallel.memory.gradients - replicated.memory.gradients == pytest.approx(more * 4, abs=2)
    assert parallel.memory.optimizer_states - replicated.memory.optimizer_states == pytest.approx(more * 8, abs=2)


def test_sharded_copies_hold_a_share_of_their_experts_and_gather_and_reduce_scatter_them(model):
    import dataclasses

    graph, base = model
    # 2 experts per device, each on 2 devices: experts 0-1 on devices 0-1, experts 2-3 on 2-3.
    grid = ExpertPlacement.copied_grid(4, 4, 2)
    assert grid.replicas == (((0, 0.5), (1, 0.5)),) * 2 + (((2, 0.5), (3, 0.5)),) * 2
    assert grid.copy_groups == ((0, 1), (2, 3))

    def plan(sharded: bool):
        return dataclasses.replace(base, expert_layouts=tuple(
            ExpertLayout(f"blocks.{i}.moe", "expert_parallel", 4, 2, 1.25, placement=grid, sharded_copies=sharded)
            for i in range(2)
        ))

    whole, sharded = Simulator(plan(False), graph), Simulator(plan(True), graph)
    whole_layer, layer = whole.context.moe_layers["blocks.0.moe"], sharded.context.moe_layers["blocks.0.moe"]
    # Whole copies: a device holds 2 of 4 experts; every expert is copied, so all 4 experts'
    # gradients (4 x 16,384 x 4 B) are all-reduced over the group of 4: 2 x 3/4 x 262,144 / 1e9.
    assert whole_layer.param_fraction == 0.5
    assert whole_layer.replica_sync_s == pytest.approx(2 * 0.75 * 262_144 / 1e9, rel=1e-6)
    # Sharded: half of each of its 2 experts. Its 2 experts' weights (2 x 16,384 x 4 B =
    # 131,072 B) are all-gathered over its copy pair (a ring of 2 sends half: 65,536 B at
    # 1 GB/s) in each pass, and their gradients reduce-scattered alike; nothing all-reduced.
    assert layer.param_fraction == 0.25 and layer.replica_sync_s == 0
    assert layer.copy_gather_s == pytest.approx(65_536 / 1e9, rel=1e-6)
    assert layer.copy_reduce_s == pytest.approx(65_536 / 1e9, rel=1e-6)
    anchor = sharded.costs[layer.anchor]
    assert anchor.weight_gather_s == layer.copy_gather_s and anchor.copy_reduce_s == layer.copy_reduce_s
    assert anchor.backward_comm_s == pytest.approx(layer.cost.backward_comm_s)  # the reduce-scatter is off the critical path

    whole_estimate, estimate = simulated(plan(False), graph).estimate, simulated(plan(True), graph).estimate
    # A quarter of each layer's 65,536 expert weights fewer: 4 B weights, 4 B gradients, 8 B states.
    fewer = 2 * 0.25 * EXPERT_WEIGHTS
    assert whole_estimate.memory.weights - estimate.memory.weights == pytest.approx(fewer * 4, abs=2)
    assert whole_estimate.memory.gradients - estimate.memory.gradients == pytest.approx(fewer * 4, abs=2)
    assert whole_estimate.memory.optimizer_states - estimate.memory.optimizer_states == pytest.approx(fewer * 8, abs=2)
    # The gathered weights of the layer running and of the one prefetched (2 x 131,072 B),
    # less the shrinking DDP bucket (the whole gradient of a model this small).
    assert estimate.memory.communication_buffers - whole_estimate.memory.communication_buffers == pytest.approx(
        2 * 131_072 - fewer * 4, abs=2)
    # Per layer a device sends half of 131,072 B three times (two gathers, one reduce-scatter),
    # over its copy pair (counted apart from dp, whose bytes do not change).
    assert estimate.bytes_per_axis["expert-copies"] == pytest.approx(2 * 3 * 65_536)
    assert estimate.bytes_per_axis["dp"] == pytest.approx(whole_estimate.bytes_per_axis["dp"])
    # Each layer's experts are gathered once per pass (FSDP2 units), and reduce-scattered in
    # backward. On gloo FSDP2's collectives block the thread that runs the model
    # (step_contributor.fsdp2_stream): the second layer's gather runs on the compute stream
    # after the segment before it and before its own layer (the segments in forward order are: before blocks,
    # blocks.0, after blocks, blocks.1), not beside it.
    gathers = [e for e in estimate.timeline if "all-gather experts" in e.name]
    assert len(gathers) == 4 and all(e.stream == "compute" for e in gathers)
    assert all(e.duration_s == pytest.approx(65_536 / 1e9, rel=1e-6) for e in gathers)
    by_name = {e.name: e for e in estimate.timeline}
    second, before = by_name["F0 all-gather experts blocks.1"], by_name["F0 after blocks"]
    assert second.start_s >= before.start_s + before.duration_s
    assert by_name["F0 blocks.1"].start_s == pytest.approx(second.start_s + second.duration_s)
    assert sum(1 for e in estimate.timeline if e.name.endswith("reduce-scatter expert grads")) == 2
    # The report's cost of a layer: the two gathers and the reduce-scatter are communication.
    cost, whole_cost = simulated(plan(True), graph).expert_layouts[0].cost, simulated(plan(False), graph).expert_layouts[0].cost
    assert cost.communication_s - whole_cost.communication_s == pytest.approx(3 * 65_536 / 1e9 - 2 * 0.75 * 262_144 / 1e9)
    # In bf16 the program shards the copies under BF16_FSDP_POLICY (bf16 gathers, fp32
    # reductions; planner.program_shape.shards_expert_copies_in_bf16), and so does the price:
    # the gather moves half of 2 x 16,384 x 2 B = 65,536 B (32.768 us at 1 GB/s), the
    # reduce-scatter half of the fp32 131,072 B (65.536 us); per layer a device sends
    # (2 x 65,536 + 131,072) / 2 = 131,072 B over its copy pair.
    bf16 = Simulator(dataclasses.replace(plan(True), precision="bf16"), graph)
    bf16_layer = bf16.context.moe_layers["blocks.0.moe"]
    assert bf16_layer.copy_gather_s == pytest.approx(32_768 / 1e9, rel=1e-6)
    assert bf16_layer.copy_reduce_s == pytest.approx(65_536 / 1e9, rel=1e-6)
    assert bf16_layer.copy_sent_bytes == pytest.approx(131_072)


def test_accumulation_routes_and_prices_each_micro_batch(model):
    import dataclasses

    graph, _ = model
    # 2 micro-batches of 4 x 32 = 128 tokens: each routed on its own (as the compiled
    # program routes them), so each expert's capacity is the micro-batch's,
    # 1.25 x 256 / 4 = 80 of its 256 routed copies, not 160.
    plan = dataclasses.replace(plan_with(model, "expert_parallel", ExpertPlacement.round_robin(4, 4)),
                               accumulation_steps=2)
    simulator = Simulator(plan, graph)
    layer = simulator.context.moe_layers["blocks.0.moe"]
    anchor = simulator.costs[layer.anchor]
    assert layer.cost.busiest_copies == 80
    assert anchor.forward_s == pytest.approx(80 * COPY_FLOPS / 1e12)
    # Each device sends 64 copies (256 / 4) of 64 x 4 B = 16,384 B per all-to-all, and the
    # counts' all-gather (3/4 x 4 x 2 x 4 x 8 B) runs for every micro-batch.
    one = 0.75 * 16_384 / 1e9
    counts = 0.75 * 4 * 2 * 4 * 8 / 1e9
    assert anchor.forward_comm_s == pytest.approx(2 * one + counts) and anchor.backward_comm_s == pytest.approx(2 * one)
    # Memory of one micro-batch in flight (``dispatch_buffer_bytes``): the send buffer of the
    # device's own 128 / 4 x 2 = 64 copies and the receive buffer of the busiest device's 80
    # padded copies, rows of 64 x 4 B; and half the experts' kept activations.
    assert layer.buffer_bytes == (64 + 80) * 64 * 4
    whole = Simulator(plan_with(model, "expert_parallel", ExpertPlacement.round_robin(4, 4)), graph)
    assert layer.activation_bytes == pytest.approx(whole.context.moe_layers["blocks.0.moe"].activation_bytes / 2)
    # The step: both micro-batches' compute (3 passes x 80 copies each, 160 in all, as at
    # once) and both micro-batches' collectives.
    cost = simulated(plan, graph).expert_layouts[0].cost
    assert cost.compute_s == pytest.approx(2 * 3 * 80 * COPY_FLOPS / 1e12)
    assert cost.communication_s == pytest.approx(2 * (4 * one + counts))


def test_identical_layers_share_one_pricing_and_other_loads_do_not(model):
    """Both MoE layers have one shape: with equal layouts they are priced once (the same
    cost object, each with its own ops); a layer with other loads is priced on its own."""
    import dataclasses

    from cost_model.simulation_cache import graph_facts

    graph, base = model
    prices = graph_facts(graph).moe_layer_prices
    placement = ExpertPlacement.round_robin(4, 4)
    before = len(prices)
    layers = Simulator(plan_with(model, "expert_parallel", placement, (0.4, 0.3, 0.2, 0.1)), graph).context.moe_layers
    assert len(prices) == before + 1
    first, second = layers["blocks.0.moe"], layers["blocks.1.moe"]
    assert first.cost is second.cost and first.anchor != second.anchor and not first.nodes & second.nodes
    skewed = (layouts("expert_parallel", placement, (0.4, 0.3, 0.2, 0.1))[0],
              layouts("expert_parallel", placement, (0.1, 0.2, 0.3, 0.4))[1])
    layers = Simulator(dataclasses.replace(base, expert_layouts=skewed), graph).context.moe_layers
    assert len(prices) == before + 2 and layers["blocks.0.moe"].cost is first.cost
    assert layers["blocks.1.moe"].cost is not first.cost


def test_recomputation_keeping_exchanges_repeats_no_all_to_all_and_keeps_their_outputs(model):
    """``full_keep_a2a`` (``cost_model.recompute``): a block's backward recomputes its
    forward compute but not its MoE layer's exchanges, and keeps their outputs per
    micro-batch, worked by hand on the arithmetic cluster (expert parallel, round robin:
    one expert per device)."""
    import dataclasses

    from planner.strategy import KEEP_A2A

    graph, _ = model
    plan = plan_with(model, "expert_parallel", ExpertPlacement.round_robin(4, 4))
    simulator = Simulator(plan, graph)
    one = 0.75 * 32_768 / 1e9  # one all-to-all (test above): 3/4 of 32,768 B at 1 GB/s
    counts = 0.75 * 4 * 2 * 4 * 8 / 1e9  # the routing counts' all-gather
    # What forward exchanges and the recomputation keeps: the combine's rows back on this
    # device (its 128 copies x 64 x 4 B = 32,768 B) and the dispatch's rows at its expert
    # (the busiest device's buffer, padded to 160 copies: 160 x 64 x 4 B = 40,960 B).
    kept = 128 * 64 * 4 + 160 * 64 * 4
    blocks = [s for s in simulator.segments() if s.block]
    profiles = [p for p in simulator.segment_profiles() if p.block]
    assert len(blocks) == len(profiles) == 2
    for segment, profile in zip(blocks, profiles):
        assert segment.kept_exchange_s == pytest.approx(2 * one + counts)
        assert segment.kept_exchange_bytes == kept
        # Full recomputation runs the dispatch, the combine and the counts' all-gather again;
        # keeping them, backward recomputes the block's forward compute only.
        assert profile.time_s["full"] - profile.time_s[KEEP_A2A] == pytest.approx(2 * one + counts)
        assert profile.time_s[KEEP_A2A] - profile.time_s["none"] == pytest.approx(segment.forward_s)
        assert profile.kept_bytes[KEEP_A2A] - profile.kept_bytes["full"] == kept
        assert profile.transient_bytes[KEEP_A2A] == profile.transient_bytes["full"]
    # One micro-batch in flight: the step holds both blocks' kept exchanges on top of full's.
    full, keeping = (simulated(dataclasses.replace(plan, recompute=mode), graph).estimate
                     for mode in ("full", KEEP_A2A))
    assert keeping.memory.activations - full.memory.activations == 2 * kept
    assert keeping.step_time_s < full.step_time_s


def test_the_report_says_what_keeping_the_exchanges_means(model):
    """A plan recomputing with ``full_keep_a2a`` says so in its strategy words and its
    recompute line, in words a reader who does not know the mode's name understands."""
    import dataclasses

    from planner.report import report_details
    from planner.strategy import KEEP_A2A
    from planner.verdict import strategy_words

    graph, _ = model
    plan = simulated(dataclasses.replace(plan_with(model, "expert_parallel", ExpertPlacement.round_robin(4, 4)),
                                         recompute=KEEP_A2A), graph)
    assert "every repeated block recomputed in backward but its MoE layers' all-to-alls (outputs kept)" in strategy_words(plan)
    line = dict(report_details(plan))["recompute"]
    assert line.startswith("full_keep_a2a (full_keep_a2a: blocks recomputed in backward except their MoE layers' "
                           "all-to-alls, whose dispatch and combine outputs are kept from forward)")
