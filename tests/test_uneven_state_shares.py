"""Optimizer-state shares by memory (Cephalo) in uneven data parallelism: the parts of the
flat parameter vector, the weights chosen by memory (against enumeration), the elements the
program's reduce-scatter-v and all-gather-v move (worked by hand), the plan setting read as
untrusted JSON, and the program that runs them. Its parity with one device is checked in
the uneven programs' launch (``tests/test_uneven_program.py``)."""

from __future__ import annotations

import itertools

import pytest

from planner.errors import PlanFileError
from planner.families.uneven_dp.section import UnevenSection
from planner.families.uneven_dp.state_shares import exchange_elements, memory_state_weights, state_parts


def test_parts_follow_the_weights_and_sum_exactly() -> None:
    # 10 elements by 1:1:3:3 -> exact 1.25, 1.25, 3.75, 3.75: floors 1, 1, 3, 3 (8), the two
    # largest remainders (0.75, ranks 2 and 3) take the 2 left over.
    assert state_parts(10, (1, 1, 3, 3)) == (1, 1, 4, 4)
    # 7 by 1:1:1 -> 2.33 each: floors 2, 2, 2, the one left over to the lowest rank on a tie.
    assert state_parts(7, (1, 1, 1)) == (3, 2, 2)
    assert state_parts(5, (0, 2)) == (0, 5)  # a rank of weight 0 holds nothing
    with pytest.raises(ValueError, match="some positive"):
        state_parts(5, (0, 0))


def test_memory_weights_maximise_the_least_room_left_as_enumeration_does() -> None:
    # Every split of 6 units of 600 bytes over three ranks, against the greedy's.
    for rooms in ((1000.0, 400.0, 400.0), (300.0, 300.0, 900.0), (100.0, 700.0, 250.0), (500.0, 500.0, 500.0)):
        best = max(min(room - 100 * w for room, w in zip(rooms, split))
                   for split in itertools.product(range(7), repeat=3) if sum(split) == 6)
        weights = memory_state_weights(rooms, 600.0, scale=6)
        assert sum(weights) == 6
        assert min(room - 100 * w for room, w in zip(rooms, weights)) == best, (rooms, weights)
    # By hand: rooms 1000/400/400, 600 bytes: level t with (1000 - t) + 2 max(0, 400 - t) = 600
    # -> t = 400: all of it on rank 0.
    assert memory_state_weights((1000.0, 400.0, 400.0), 600.0, scale=6) == (6, 0, 0)


def test_the_busiest_rank_of_an_uneven_exchange_by_hand() -> None:
    # Parts 1/1/4/4 of 10 over 4 ranks: rank 2 sends 10 - 4 = 6 and receives 3 x 4 = 12, so the
    # busiest moves 12 (a ring-v would pass the largest part 3 times: 12 too); rank 0 sends 9,
    # receives 3.
    assert exchange_elements((1, 1, 4, 4)) == 12
    # Even parts 3/3/3/3 of 12: each sends 9 and receives 9 = (n - 1) / n x 12, a ring's figure.
    assert exchange_elements((3, 3, 3, 3)) == 9
    # One part of 10 beside three of 0: each other rank sends rank 3 its 10 elements, so rank 3
    # receives 3 x 10 = 30 (and sends nothing).
    assert exchange_elements((0, 0, 0, 10)) == 30


def test_the_exchange_goes_bucket_by_bucket() -> None:
    from planner.families.uneven_dp.state_shares import bucket_ranges

    # 10 elements fill 3 buckets of 4: three exchanges, each a third (rounded up) of every part.
    # Parts 1/1/4/4 own [0, 1), [1, 2), [2, 6), [6, 10): slices of 1, 1, 2, 2 elements.
    assert bucket_ranges((1, 1, 4, 4), 4) == [
        ((0, 1), (1, 2), (2, 4), (6, 8)),
        ((1, 1), (2, 2), (4, 6), (8, 10)),
        ((1, 1), (2, 2), (6, 6), (10, 10)),
    ]
    assert bucket_ranges((3, 0), 8) == [((0, 3), (3, 3))]  # one bucket: the parts whole


def test_the_setting_is_read_as_untrusted_json_with_one_line_errors() -> None:
    section = UnevenSection.from_json({"shares": [3, 3, 1, 1], "state_shares": [100, 100, 400, 400]}, "p.json")
    assert section.state_shares == (100, 100, 400, 400)
    assert section.to_json()["state_shares"] == [100, 100, 400, 400]
    assert "state_shares" not in UnevenSection((3, 3, 1, 1)).to_json()  # plans without it unchanged
    for bad in ([1, 2], [1, 2, 3, "4"], [0, 0, 0, 0], [1, 2, 3, -1], [1, 2, 3, True], [1, 2, 3, 10**7]):
        with pytest.raises(PlanFileError) as error:
            UnevenSection.from_json({"shares": [3, 3, 1, 1], "state_shares": bad}, "p.json")
        assert "\n" not in str(error.value) and "uneven.state_shares" in str(error.value)
    with pytest.raises(PlanFileError, match="must be a list"):
        UnevenSection.from_json({"shares": [3, 3, 1, 1], "state_shares": "1,1,3,3"}, "p.json")
    # Only ZeRO-1 programs keep whole weights beside split states: another flavour is refused.
    from types import SimpleNamespace

    mesh = SimpleNamespace(names=("dp",), axis_size=lambda axis: 4)
    plan = SimpleNamespace(mesh=mesh, pipeline=None, expert_layouts=(), sections={"uneven": section}, label="",
                           name="fsdp (dp=4)", batch_size=8, accumulation_steps=1, dp_flavour="fsdp")
    with pytest.raises(ValueError, match="needs the zero1 flavour") as error:
        section.check(plan)
    assert "\n" not in str(error.value)
    section.check(SimpleNamespace(**{**vars(plan), "dp_flavour": "zero1"}))


class _Context:
    """What the state-share costs read of a simulated step: a plan of dp alone on one node of
    4 CPU processes (2e9 B/s, 50 us: the ``cpu`` preset), 10,000 parameters."""

    def __init__(self, shares=(3, 3, 1, 1), state_shares=(1, 1, 4, 4), micro_batches=1) -> None:
        from types import SimpleNamespace

        from planner.cluster import Cluster

        self.cluster = Cluster.preset("cpu", 1, 4)
        self.plan = SimpleNamespace(sections={"uneven": UnevenSection(shares, state_shares=state_shares)})
        self.graph = SimpleNamespace(parameter_count=10_000)
        self.dp, self.micro_batches = 4, micro_batches

    def collective(self, kind: str, size_bytes: float, axis: str) -> float:
        from cost_model.collectives import collective_time

        assert axis == "dp"
        return collective_time(kind, size_bytes, self.cluster, [0, 1, 2, 3])


def test_the_uneven_exchange_is_priced_as_the_all_to_all_the_program_runs() -> None:
    from planner.families.uneven_dp.costs import exchange_seconds, parts_of

    context = _Context()
    assert parts_of(context) == (1000, 1000, 4000, 4000)
    # Rank 2 receives 3 x 4000 fp32 elements = 48,000 bytes, the busiest. The pairwise all-to-all
    # of S bytes sent per rank takes 3/4 S / 2e9 + 3 x 50e-6 s; S = 48,000 x 4/3 = 64,000, so
    # 24e-6 + 150e-6 = 174e-6 s.
    assert exchange_seconds(context, parts_of(context)) == pytest.approx(174e-6)
    # Even parts of 2,500: 7,500 x 4 = 30,000 bytes -> 15e-6 + 150e-6 s.
    assert exchange_seconds(context, (2500,) * 4) == pytest.approx(165e-6)


def test_each_rank_holds_its_own_part_of_the_states() -> None:
    from planner.families.uneven_dp.costs import StateSharesStep
    from planner.strategy import MemoryBreakdown

    # The simulator's view of one device: states 8,000 (32,000 split evenly over 4 ranks),
    # activations of the largest share (3 rows) 3,000, buffers 100 besides the largest part's
    # flat fp32 gradient and receive buffer, 4 x (10,000 + 4 x 4,000) = 104,000 bytes.
    context = _Context()
    even = MemoryBreakdown(weights=40_000, gradients=40_000, optimizer_states=8_000, activations=3_000,
                           communication_buffers=104_100)
    ranks = StateSharesStep().rank_memory(context, {}, even)
    # Rank 0: 1,000 of 10,000 elements -> 32,000 x 0.1 = 3,200 bytes of states; 3 rows; the
    # step's buffers 4 x (10,000 + 4 x 1,000) = 56,000 less the 3,000 of activations freed before
    # them: 100 + 53,000. Rank 2: 12,800 bytes, 1 row (1,000), 100 + 104,000 - 1,000.
    assert (ranks[0].optimizer_states, ranks[0].activations, ranks[0].communication_buffers) == (3_200, 3_000, 53_100)
    assert (ranks[2].optimizer_states, ranks[2].activations, ranks[2].communication_buffers) == (12_800, 1_000, 103_100)
    assert ranks[2].weights == ranks[2].gradients == 40_000  # whole on every rank


def test_the_search_places_states_by_memory_where_memory_binds(tmp_path) -> None:
    """Two fast devices with just the even ZeRO-1 plan's memory, two slow ones with twice it:
    balanced shares give the fast ranks more samples, which do not fit beside a quarter of the
    states; with the states on the slow ranks they do, and the step is faster than the even
    plan's."""
    from pathlib import Path

    from planner.api import prepare_model
    from planner.cluster import Cluster
    from planner.device_groups import rank_devices
    from planner.families.uneven_dp.candidates import states_by_memory_plan, uneven_plan
    from planner.model_spec import ModelSpec
    from search.data_parallel import data_parallel_plan

    repo = Path(__file__).resolve().parents[1]
    mixed = (repo / "examples/clusters/mixed.toml").read_text()
    spec = ModelSpec(str(repo / "examples/gpt.py"), {"n_layer": 2, "n_embd": 256, "n_head": 4, "seq_len": 16,
                                                     "vocab_size": 256, "batch_size": 24})

    def cluster(fast: int) -> Cluster:
        before, fast_rest, slow_rest = mixed.split("memory_bytes = 8589934592")
        path = tmp_path / f"memory-{fast}.toml"
        path.write_text(f"{before}memory_bytes = {fast}{fast_rest}memory_bytes = {2 * fast}{slow_rest}")
        return Cluster.load(path)

    graph, spec, name, roomy = prepare_model(spec, cluster(8 << 30))
    needed = data_parallel_plan(graph, roomy, spec, name, "zero1", (), "fp32").estimate.memory.total
    tight = cluster(int(needed * 1.01))
    even = data_parallel_plan(graph, tight, spec, name, "zero1", (), "fp32")
    assert even.estimate.fits
    plain = uneven_plan(even, graph)  # speed-balanced shares with even states
    assert plain is None or not plain.estimate.fits
    chosen = states_by_memory_plan(even, graph)
    section = chosen.sections["uneven"]
    assert chosen.estimate.fits and chosen.accumulation_steps == 1
    assert section.shares[0] > section.shares[2] and section.state_shares[0] < section.state_shares[2]
    assert all(held <= device.memory_bytes for held, device in zip(section.memory_bytes, rank_devices(tight)))
    assert chosen.estimate.step_time_s < even.estimate.step_time_s


def test_the_report_gives_each_rank_its_part_of_the_states() -> None:
    from types import SimpleNamespace

    from rich.console import Console

    from planner.cluster import Cluster
    from planner.families.uneven_dp.report import uneven_section

    plan = SimpleNamespace(sections={"uneven": UnevenSection((3, 3, 1, 1), state_shares=(100, 100, 400, 400))},
                           cluster=Cluster.preset("cpu", 1, 4), batch_size=8, dp_flavour="zero1")
    console = Console(width=160, record=True)
    for part in uneven_section(plan):
        console.print(part)
    text = console.export_text()
    assert "optimizer states" in text and "10.0%" in text and "40.0%" in text  # 100 and 400 of 1000
