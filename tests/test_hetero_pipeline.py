"""Pipelines over device groups of different types (``planner.families.hetero_pipeline``,
Metis): the exact split of the blocks, each stage priced on its own device, the search's
choice of order and split on ``examples/clusters/mixed.toml`` (two cpu-fast, two cpu-slow
devices), the fast devices alone with the slow ones left out, the plan section, and the
compiled program against one device in real gloo processes (one launch).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys
from pathlib import Path

import pytest

import planner
from cost_model.compute import op_times
from cost_model.simulator import Simulator, simulated
from planner.api import prepare_model
from planner.errors import PlanFileError
from planner.families.hetero_pipeline.balance import balanced_stages, stage_seconds
from planner.constraints import SearchConstraints
from planner.families.hetero_pipeline.candidates import (
    hetero_pipeline_candidates,
    ordered_cluster,
    staged_estimates,
    staged_plan,
    width_estimates,
    width_plan,
)
from planner.families.hetero_pipeline.costs import stage_device
from planner.families.hetero_pipeline.section import HeteroStagesSection
from planner.families.hetero_pipeline.widths import WidthLayout
from planner.device_groups import device_groups
from planner.model_spec import ModelSpec
from search.budget import SearchBudget
from search.context import SearchContext

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_parity import check_many, result_of  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MIXED = str(REPO / "examples/clusters/mixed.toml")
GPT4 = ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8, "n_layer": 4})
TIED_LLAMA = ModelSpec("hf:llama", {"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128,
                                    "tie_word_embeddings": True, "seq_len": 16, "batch_size": 4})


def every_split(block_s, head_s, tail_s, fits):
    """The least slowest stage over every split of the blocks (each stage one or more)."""
    stages, blocks = len(block_s), len(block_s[0])
    best = None
    for cuts in itertools.combinations(range(1, blocks), stages - 1):
        bounds = (0, *cuts, blocks)
        counts = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        if all(fits(s, bounds[s], bounds[s + 1]) for s in range(stages)):
            slowest = max(stage_seconds(block_s, head_s, tail_s, counts))
            best = slowest if best is None else min(best, slowest)
    return best


def test_a_stage_twice_as_fast_takes_three_blocks_of_four() -> None:
    # 4 blocks of 2 ms on the slow device, 1 ms on the fast one (twice the speed). Fast
    # first: 3 blocks there (3 ms) and 1 on the slow (2 ms) -> slowest 3 ms; the even split
    # 2/2 gives max(2, 4) = 4 ms and 4/0 is not a pipeline.
    fast, slow = [1e-3] * 4, [2e-3] * 4
    assert balanced_stages([fast, slow], 0.0, 0.0) == ((3, 1), pytest.approx(3e-3))
    # Slow first: 1 block there (2 ms), 3 on the fast (3 ms).
    assert balanced_stages([slow, fast], 0.0, 0.0) == ((1, 3), pytest.approx(3e-3))
    # A head of 1.5 ms on the first (fast) stage moves a block: 2 + 1.5 = 3.5 vs 2 x 2 = 4 ms.
    assert balanced_stages([fast, slow], 1.5e-3, 0.0) == ((2, 2), pytest.approx(4e-3))
    # The fast stage's memory holds 2 blocks at most: 2/2 again.
    assert balanced_stages([fast, slow], 0.0, 0.0, lambda s, i, j: s != 0 or j - i <= 2)[0] == (2, 2)
    assert balanced_stages([fast, slow], 0.0, 0.0, lambda s, i, j: False) is None
    assert balanced_stages([fast[:1], slow[:1]], 0.0, 0.0) is None  # fewer blocks than stages


def random_split_case(generator: random.Random):
    """A random split problem: (block_s, head_s, tail_s, fits) of 2-4 stages over up to 7
    blocks, each stage holding at most a random number of blocks."""
    stages = generator.randint(2, 4)
    blocks = generator.randint(stages, 7)
    block_s = [[generator.uniform(0.1, 3.0) for _ in range(blocks)] for _ in range(stages)]
    head, tail = generator.uniform(0, 2), generator.uniform(0, 2)
    limit = [generator.randint(1, blocks) for _ in range(stages)]

    def fits(s, i, j):
        return j - i <= limit[s]

    return block_s, head, tail, fits


def test_the_split_is_the_best_of_every_split() -> None:
    generator = random.Random(27)
    for _ in range(300):
        block_s, head, tail, fits = random_split_case(generator)
        found = balanced_stages(block_s, head, tail, fits)
        best = every_split(block_s, head, tail, fits)
        if best is None:
            assert found is None
            continue
        counts, slowest = found
        assert slowest == pytest.approx(best) and sum(counts) == len(block_s[0]) and min(counts) >= 1
        assert max(stage_seconds(block_s, head, tail, counts)) == pytest.approx(best)


@pytest.fixture(scope="module")
def traced():
    graph, spec, name, cluster = prepare_model(GPT4, MIXED)
    return graph, spec, name, cluster


def test_the_search_gives_the_fast_stage_more_blocks_and_prices_each_stage_on_its_device() -> None:
    # Batch 16: DTensor's dispatch is host time charged alike on both devices
    # (cost_model.host_dispatch), so at batch 8 the fixed per-op cost of each micro-batch
    # outweighs the FLOPs and two blocks each balance best; at 16 the FLOPs tell.
    wide_batch = ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 16, "n_layer": 4})
    graph, spec, name, cluster = prepare_model(wide_batch, MIXED)
    estimates, grids = staged_estimates(graph, cluster, "fp32", ("ddp",), SearchBudget())
    fast, slow = (group.device for group in device_groups(cluster))
    assert fast.name == "cpu-fast" and slow.name == "cpu-slow"
    # Both orders were priced, as one stage per group (pp=2, dp=2) and as each group cut into
    # two stages of one rank (pp=4); every two-stage estimate gives the fast stage at least
    # as many blocks as the slow, the best of each order more (four stages over four blocks
    # hold one each).
    assert {e.order for e in estimates} == {(0, 1), (1, 0), (0, 0, 1, 1), (1, 1, 0, 0)}
    for estimate in estimates:
        if len(estimate.order) == 2:
            assert estimate.blocks[estimate.order.index(0)] >= estimate.blocks[estimate.order.index(1)], estimate
        else:
            assert estimate.blocks == (1, 1, 1, 1) and estimate.config.dp == 1
    for order in ((0, 1), (1, 0)):
        estimate = min((e for e in estimates if e.order == order), key=lambda e: e.step_s)
        assert estimate.blocks[order.index(0)] > estimate.blocks[order.index(1)], estimate
    best = estimates[0]
    plan = staged_plan(best, graph, cluster, grids, spec, name, ())
    section = plan.sections["hetero-pp"]
    assert section.stage_devices == tuple(("cpu-fast", "cpu-slow")[g] for g in best.order)
    assert section.blocks == best.blocks and len(section.busy_s) == 2
    # Each op priced on its stage's device: the simulator's cost of every op of a fast stage
    # is its cost on the slowest device less (slow - fast) roofline seconds at its work share;
    # the slow stage's ops are unchanged.
    plain = dataclasses.replace(plan, sections={})
    priced, slowest = Simulator(plan, graph).costs, Simulator(plain, graph).costs
    strategies = {s.node: s for s in plan.strategies}
    work = 1.0 / (2 * best.config.micro_batches)  # dp=2 splits every op's batch rows
    checked = 0
    for node in graph.nodes:
        if node.is_view or not node.op.startswith("aten.mm") and "linear" not in node.op:
            continue
        device = stage_device(plan, strategies[node.name].stage)
        forward_fast, _ = op_times(node, work, fast, "fp32")
        forward_slow, _ = op_times(node, work, slow, "fp32")
        expected = slowest[node.name].forward_s - (forward_slow - forward_fast if device == fast else 0.0)
        assert priced[node.name].forward_s == pytest.approx(expected)
        checked += 1
    assert checked >= 4 * 4  # four linears in each of the four blocks
    # cpu-fast has exactly twice cpu-slow's peak FLOP/s and memory bandwidth, so an op's
    # roofline time on it is half, plus half the fixed per-op overhead: fast < slow.
    assert forward_fast < forward_slow
    # Priced on the slowest device throughout, the same plan is predicted slower.
    assert plan.estimate.step_time_s < simulated(plain, graph).estimate.step_time_s


def test_the_section_round_trips_and_bad_values_are_one_line(traced) -> None:
    section = HeteroStagesSection(("cpu-fast", "cpu-slow"), (3, 1), (0.1, 0.2), (10, 20))
    assert HeteroStagesSection.from_json(section.to_json(), "p.json") == section
    for bad in ({"stage_devices": "x"}, {"stage_devices": ["a"]}, {"stage_devices": ["a", "b"], "blocks": [1]},
                {"stage_devices": ["a", "b"], "busy_s": [-1, 0]}, {"stage_devices": ["a", "b"], "extra": 1}, [1]):
        with pytest.raises(PlanFileError) as error:
            HeteroStagesSection.from_json(bad, "p.json")
        assert "\n" not in str(error.value) and "hetero-pp" in str(error.value)
    graph, spec, name, cluster = traced
    estimates, grids = staged_estimates(graph, cluster, "fp32", ("ddp",), SearchBudget())
    plan = staged_plan(estimates[0], graph, cluster, grids, spec, name, ())
    with pytest.raises(ValueError, match="order the cluster's nodes"):
        swapped = tuple(reversed(plan.sections["hetero-pp"].stage_devices))
        dataclasses.replace(plan, sections={"hetero-pp": HeteroStagesSection(swapped)})


@pytest.fixture(scope="module")
def candidates(traced):
    """The family's candidates on the mixed cluster, as the search asks for them."""
    graph, spec, name, cluster = traced
    context = SearchContext(graph=graph, cluster=cluster, spec=spec, model_name=name, search="auto",
                            budget=SearchBudget(), seed=0, warnings=(), precision="fp32",
                            constraints=SearchConstraints(), routing=None, tp_layouts="auto", meshes=[])
    return hetero_pipeline_candidates(context)


def test_the_other_stage_order_lists_the_slow_nodes_first(candidates) -> None:
    chosen = next(plan for plan in candidates if "hetero-pp" in plan.sections)
    section = chosen.sections["hetero-pp"]
    swapped = dataclasses.replace(
        chosen, cluster=ordered_cluster(chosen.cluster, device_groups(chosen.cluster), (1, 0)),
        sections={"hetero-pp": HeteroStagesSection(tuple(reversed(section.stage_devices)), section.blocks)},
    )
    assert [swapped.cluster.device_of(rank).name for rank in range(4)] == [
        section.stage_devices[1]] * 2 + [section.stage_devices[0]] * 2


def test_the_fast_devices_alone_are_tried_and_say_what_they_leave_out(candidates) -> None:
    staged = [plan for plan in candidates if "hetero-pp" in plan.sections]
    alone = [plan for plan in candidates if "hetero-pp" not in plan.sections]
    assert staged and alone
    for plan in alone:
        assert plan.cluster.world_size == 2 and {plan.cluster.device_of(r).name for r in range(2)} == {"cpu-fast"}
        best_all = min(plan.estimate.step_time_s for plan in staged)
        why = (f"alone is predicted at {plan.estimate.step_time_s * 1e3:.4g} ms per step, against "
               f"{best_all * 1e3:.4g} ms for the best pipeline on every device")
        assert any("devices left out: 2 cpu-slow" in warning and "slower than cpu-fast" in warning
                   and why in warning for warning in plan.warnings), plan.warnings


@pytest.mark.distributed
def test_stages_on_fast_and_slow_devices_match_one_device(candidates, traced, tmp_path) -> None:
    """The family's fastest simulated plan (what the search keeps of it: the fast stage holds
    more blocks), its fastest with each group cut into two stages, the best layout of stages of
    different widths at micro-batches of 2 samples (priced, not kept by the search: on this
    cluster a layout of one width is faster), and a tiny Llama with tied embeddings on stages of
    widths 2, 1, 1 (the slow pair first; the tied weight's gradient summed over stages 0 and 2 of
    different widths), compiled and checked against one device in one launch at world 4. (Its
    stages in the other order, the slow devices' nodes first, compile to the same program
    with ranks 0-1 on the slow stage; left out of the launch to keep the suite's time.)"""
    staged = [plan for plan in candidates if "hetero-pp" in plan.sections]
    chosen = min(staged, key=lambda plan: plan.estimate.step_time_s)
    section = chosen.sections["hetero-pp"]
    fast_stage = section.stage_devices.index("cpu-fast")
    assert section.blocks[fast_stage] > section.blocks[1 - fast_stage]
    # Each group cut into two stages of one rank (pp=4, dp=1): the runtime's even pp x dp mesh
    # runs it as it is, stage s on rank s, the cluster's fast nodes first or last.
    graph, spec, name, cluster = traced
    estimates, grids = staged_estimates(graph, cluster, "fp32", ("ddp",), SearchBudget())
    split = staged_plan(next(e for e in estimates if len(e.order) == 4), graph, cluster, grids, spec, name, ())
    assert split.mesh.axis_size("pp") == 4 and len(set(split.sections["hetero-pp"].stage_devices[:2])) == 1
    # The best layout of different widths here (the fast pair as two stages, the slow pair as one).
    uneven = width_plan(next(e for e in width_estimates(graph, cluster, "fp32", SearchBudget(), (2,))
                             if e.step.layout.uneven), graph, cluster, spec, name, "fp32", SearchBudget())
    llama_graph, llama_spec, llama_name, llama_cluster = prepare_model(TIED_LLAMA, MIXED)
    slow_first = next(e for e in width_estimates(llama_graph, llama_cluster, "fp32", SearchBudget(), (2,))
                      if e.step.layout == WidthLayout((1, 0, 0), (2, 1, 1)))
    llama = width_plan(slow_first, llama_graph, llama_cluster, llama_spec, llama_name, "fp32", SearchBudget())
    assert llama.sections["hetero-pp"].stage_devices == ("cpu-slow", "cpu-fast", "cpu-fast")
    folders = [planner.compile(plan, tmp_path / label) for plan, label in
               ((chosen, "chosen"), (split, "split"), (uneven, "uneven"), (llama, "llama"))]
    assert "SHARED_PARAMETERS = {(0, 2): ('model.embed_tokens.weight',)}" in (folders[3] / "model_spmd.py").read_text()
    launch = check_many(4, folders, tmp_path)
    for folder in folders:
        assert result_of(launch, folder).startswith("ok"), launch.describe()


def test_the_example_mixes_load_with_their_cited_figures() -> None:
    from planner.cluster import Cluster

    spot = Cluster.load(REPO / "examples/clusters/l4-a10g-spot.toml")
    assert [group.device.name for group in device_groups(spot)] == ["L4-24GB", "A10G-24GB"]
    assert spot.inter_link.bandwidth == 40e9 / 8 / 4  # 40 Gbps per 4-GPU instance
    lab = Cluster.load(REPO / "examples/clusters/v100-a100.toml")
    assert [len(group.ranks) for group in device_groups(lab)] == [16, 16]
    assert lab.inter_link.bandwidth == 4 * 100e9 / 8 / 8  # DGX-1: 4 x EDR 100 Gb/s per 8 GPUs


def test_the_report_lists_each_stage_its_device_and_blocks(candidates) -> None:
    from rich.console import Console

    from planner.families.hetero_pipeline.report import hetero_pipeline_section

    plan = next(plan for plan in candidates if "hetero-pp" in plan.sections)
    section = plan.sections["hetero-pp"]
    console = Console(width=160, record=True)
    parts = hetero_pipeline_section(plan)
    console.print(parts[0])
    text = console.export_text()
    rows = [[cell.strip() for cell in line.split("│")[1:5]] for line in text.splitlines() if "│" in line]
    for stage, (name, blocks) in enumerate(zip(section.stage_devices, section.blocks)):
        assert [str(stage), f"{2 * stage}-{2 * stage + 1}", name, str(blocks)] in rows, rows
    # The links crossed: each stage's pair of ranks shares a node (one node per device kind in
    # mixed.toml); the hop from stage 0 to stage 1 crosses [inter_node], 2e9 B/s.
    links = [[cell.strip() for cell in line.split("│")[7:9]] for line in text.splitlines()
             if "│" in line and line.split("│")[1].strip() in ("0", "1")]
    assert links == [["within a node", "2 GB/s/device"], ["within a node", "-"]], links
    slowest = max(range(2), key=lambda stage: section.busy_s[stage])
    assert f"the step waits for stage {slowest} ({section.stage_devices[slowest]})" in parts[1].text
