"""``planner colocate`` (planner/colocation.py, cost_model/colocation.py): two jobs sharing a
cluster, simulated one after the other, split, and co-located in crossover order.

The scheduling is checked on hand-built timelines whose schedules are worked out below; the
command on real saved plans (examples/gpt.py and examples/cnn.py on cpu:1x2).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

import planner
from cost_model.colocation import CROSSOVER, ONE_AFTER_THE_OTHER, colocate_timelines
from planner.cli import main
from planner.cluster_edits import with_memory
from planner.colocation import COLOCATED, SEQUENTIAL, SPLIT
from planner.strategy import TimelineEvent
from planner.units import format_bytes
from user_errors import assert_user_error

ROOT = Path(__file__).resolve().parents[1]

# Job A: compute 0-4 s, then its gradient all-reduce 4-6 s (6 s alone).
JOB_A = (TimelineEvent("stage 0", "compute", "fwd+bwd", 0.0, 4.0),
         TimelineEvent("stage 0", "collective", "all-reduce", 4.0, 2.0))
# Job B: compute 0-2 s, then its all-reduce 2-3 s (3 s alone).
JOB_B = (TimelineEvent("stage 0", "compute", "fwd+bwd", 0.0, 2.0),
         TimelineEvent("stage 0", "collective", "all-reduce", 2.0, 1.0))


def test_crossover_round_worked_by_hand():
    # First round, A listed first: A computes 0-4; B's compute waits for the shared compute
    # stream, 4-6, under A's all-reduce 4-6; B's all-reduce 6-7. Makespan 7 (alone in turn: 9).
    # Second round: A's compute waits for its all-reduce (6): 6-10; B's for its own (7) and the
    # stream: 10-12; A's all-reduce 10-12; B's 12-13. Third: A 12-16 (after its all-reduce,
    # the stream is free at 12), B 16-18, A's all-reduce 16-18, B's 18-19.
    # Steady round = 19 - 13 = 6 = 4 + 2: the compute stream is never idle.
    shared = colocate_timelines([JOB_A, JOB_B], ["A", "B"], overlap_slowdown=0.0)
    assert shared.first_round_s == pytest.approx(7.0)
    assert shared.round_s == pytest.approx(6.0)
    assert shared.job_finish_s == pytest.approx((6.0, 7.0))
    placed = {(event.name, event.stream): (event.start_s, event.duration_s) for event in shared.timeline}
    assert placed == {
        ("A: fwd+bwd", "compute"): (0.0, 4.0), ("A: all-reduce", "collective"): (4.0, 2.0),
        ("B: fwd+bwd", "compute"): (4.0, 2.0), ("B: all-reduce", "collective"): (6.0, 1.0),
    }
    assert {event.device for event in shared.timeline} == {"device 0"}


def test_the_job_listed_first_computes_first():
    # B first: B computes 0-2, its all-reduce 2-3; A computes 2-6 (under B's all-reduce 2-3),
    # its all-reduce 6-8. The first round ends at 8, one later than A first: the long
    # all-reduce (A's) is exposed at the end.
    shared = colocate_timelines([JOB_B, JOB_A], ["B", "A"], overlap_slowdown=0.0)
    assert shared.first_round_s == pytest.approx(8.0)
    assert shared.job_finish_s == pytest.approx((3.0, 8.0))


def test_compute_beside_the_other_jobs_communication_is_slowed():
    # Slowdown 0.5 of the time beside the other job's collectives, read on the schedule
    # without it (one pass, as the simulator does):
    #   round 1: B's compute 4-6 beside A's all-reduce 4-6: +1 -> 4-7; B's all-reduce 7-8.
    #   round 2: A's compute 6-10 beside B's all-reduce 6-7: +0.5 -> 6-10.5; A's all-reduce
    #            10.5-12.5; B's compute 10-12 beside A's all-reduce 10-12: +1 -> 10.5-13.5;
    #            B's all-reduce 13.5-14.5. Two rounds end at 14.5.
    #   round 3: A's compute 12-16 beside B's all-reduce 12-13: +0.5 -> 13.5-18; B's 16-18
    #            beside A's all-reduce 16-18: +1 -> 18-21; B's all-reduce 21-22.
    # Steady round = 22 - 14.5 = 7.5. A job's compute beside its own collective is not
    # charged again (its timeline's durations already hold it).
    shared = colocate_timelines([JOB_A, JOB_B], ["A", "B"], overlap_slowdown=0.5)
    assert shared.first_round_s == pytest.approx(8.0)
    assert shared.round_s == pytest.approx(7.5)
    alone = colocate_timelines([JOB_A], ["A"], overlap_slowdown=0.5)
    assert alone.round_s == pytest.approx(6.0)


def _ddp_step(all_reduce_s: float) -> tuple[TimelineEvent, ...]:
    """A data-parallel step alone: forward 0-1 s, backward 1-3, its gradient all-reduce from
    3 for ``all_reduce_s``, then the optimizer, 0.5 s, once the all-reduce ends."""
    return (TimelineEvent("stage 0", "compute", "forward", 0.0, 1.0),
            TimelineEvent("stage 0", "compute", "backward", 1.0, 2.0),
            TimelineEvent("stage 0", "collective", "all-reduce", 3.0, all_reduce_s),
            TimelineEvent("stage 0", "compute", "optimizer", 3.0 + all_reduce_s, 0.5))


def test_a_faster_network_never_gives_a_slower_round():
    # Two copies of the step, A listed first. Each round needs 2 x (1 + 2 + 0.5) = 7 s of
    # compute on the one compute stream: no order does better.
    # The crossover order alone, all-reduce 1.5 s (three rounds): A 0-3, A's all-reduce 3-4.5,
    # B's forward 3-4; at 4 B's backward (ready) goes before A's optimizer (ready at 4.5):
    # 4-6, A's optimizer 6-6.5, B's all-reduce 6-7.5; A's forward 6.5-7.5, backward 7.5-9.5
    # (B's optimizer, ready at 7.5, ties and yields to A), B's optimizer 9.5-10, forward 10-11,
    # A's all-reduce 9.5-11. At 11 A's optimizer and B's backward tie, A goes; at 11.5 A's
    # next forward and B's backward tie, A goes again: A laps B, whose backward waits for
    # 14.5-16.5, its all-reduce 16.5-18, and B's third step runs alone, ending at 23.5. Two
    # rounds end at 15.5: a round of 8 s. With a 2 s all-reduce (a slower network) the
    # ready times fall so that A never laps B: 7 s, the compute bound. Faster network,
    # slower round: issue 29's anomaly (two ResNet-50 jobs on 16 V100s).
    fast, slow = _ddp_step(1.5), _ddp_step(2.0)
    crossover = [colocate_timelines([job, job], ["A", "B"], 0.0, orders=(CROSSOVER,)).round_s for job in (fast, slow)]
    assert crossover == pytest.approx([8.0, 7.0])
    # In the order by phase (A computes, B finishes, B computes, A finishes, ...) B's
    # backward goes before A's optimizer at 11 and each job's optimizer before the other's
    # next compute: the compute stream is never idle after 0, 7 s a round on either network.
    shared = [colocate_timelines([job, job], ["A", "B"], 0.0) for job in (fast, slow)]
    assert [entry.round_s for entry in shared] == pytest.approx([7.0, 7.0])
    # One after the other, each step whole in turn: 5 s + 5 s alone (1.5 s all-reduce), the
    # bound no kept order exceeds.
    turn = colocate_timelines([fast, fast], ["A", "B"], 0.0, orders=(ONE_AFTER_THE_OTHER,))
    assert (turn.round_s, turn.first_round_s) == pytest.approx((10.0, 10.0))


def test_colocate_timelines_rejects_an_unknown_order():
    with pytest.raises(ValueError, match="orders must be some of"):
        colocate_timelines([JOB_A, JOB_B], ["A", "B"], 0.0, orders=("fastest",))


# ----------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> tuple[Path, Path]:
    """examples/gpt.py and examples/cnn.py planned on cpu:1x2 and saved by the CLI."""
    folder = tmp_path_factory.mktemp("jobs")
    gpt, cnn = folder / "gpt.json", folder / "cnn.json"
    assert main(["plan", str(ROOT / "examples" / "gpt.py"), "--cluster", "cpu:1x2", "-o", str(gpt)]) == 0
    assert main(["plan", str(ROOT / "examples" / "cnn.py"), "--cluster", "cpu:1x2", "-o", str(cnn)]) == 0
    return gpt, cnn


def test_colocate_prints_three_arrangements_and_writes_both_jobs_trace(capsys, plans, tmp_path):
    gpt, cnn = plans
    trace = tmp_path / "shared.json"
    capsys.readouterr()
    assert main(["colocate", str(gpt), str(cnn), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    for heading in (SEQUENTIAL, SPLIT, COLOCATED):
        assert f"{heading}:" in out
    assert out.count("slowdown against alone: A ") == 3
    assert "each job re-planned on 1 of 2 devices" in out
    assert "winner: " in out
    events = [event for event in json.loads(trace.read_text())["traceEvents"] if event["ph"] == "X"]
    assert any(event["name"].startswith("A: ") for event in events)
    assert any(event["name"].startswith("B: ") for event in events)


def test_colocate_figures(plans):
    gpt, cnn = plans
    result = planner.colocate([gpt, cnn], split=False)
    alone = [planner.simulate(path) for path in (gpt, cnn)]
    by_name = {arrangement.name: arrangement for arrangement in result.arrangements}
    assert set(by_name) == {SEQUENTIAL, COLOCATED}
    # One after the other: a round is A's step plus B's.
    assert by_name[SEQUENTIAL].round_s == pytest.approx(alone[0].step_time_s + alone[1].step_time_s)
    # Co-located: both jobs' compute shares one stream, so a round holds at least both
    # compute streams' busy time; it can only hide communication, never add to the sum.
    compute = sum(e.duration_s for r in alone for e in r.timeline if e.stream == "compute")
    assert compute - 1e-12 <= by_name[COLOCATED].round_s <= by_name[SEQUENTIAL].round_s
    assert result.memory_bytes == (alone[0].memory.total, alone[1].memory.total)
    assert by_name[COLOCATED].steps_per_s == pytest.approx(2 / by_name[COLOCATED].round_s)
    assert result.winner is by_name[COLOCATED]


def test_colocated_jobs_that_do_not_fit_together_lose(plans):
    gpt, cnn = plans
    loaded = [planner.load_plan(path) for path in (gpt, cnn)]
    alone_memory = [planner.simulate(plan).memory.total for plan in loaded]
    # Room for the larger job alone, not for both.
    capacity = max(alone_memory) + min(alone_memory) // 2
    small = [dataclasses.replace(plan, cluster=with_memory(plan.cluster, capacity)) for plan in loaded]
    result = planner.colocate(small, split=False)
    colocated = next(a for a in result.arrangements if a.name == COLOCATED)
    assert not colocated.fits and "swapping states out within an interleaved round is not modelled" in colocated.note
    assert result.winner.name == SEQUENTIAL
    assert any("does not fit" in line for line in result.report())


def test_colocate_refuses_clusters_of_different_sizes(capsys, plans, tmp_path):
    gpt, _ = plans
    four = tmp_path / "cnn4.json"
    assert main(["plan", str(ROOT / "examples" / "cnn.py"), "--cluster", "cpu:1x4", "-o", str(four)]) == 0
    assert_user_error(capsys, ["colocate", str(gpt), str(four), "--no-split"], "different sizes", ": 2", ": 4")


def test_colocate_names_a_missing_plan(capsys, plans, tmp_path):
    gpt, _ = plans
    missing = tmp_path / "nope.json"
    assert_user_error(capsys, ["colocate", str(gpt), str(missing), "--no-split"], "nope.json")


def test_colocate_needs_two_plans(capsys, plans):
    assert_user_error(capsys, ["colocate", str(plans[0])], "two or more plans")


def test_three_jobs_on_two_devices_cannot_split(plans):
    # Two devices do not make three equal shares: the split arrangement says so and
    # the winner is chosen among the other two.
    gpt, cnn = plans
    result = planner.colocate([gpt, cnn, gpt])
    split = next(a for a in result.arrangements if a.name == SPLIT)
    assert not split.fits and split.note == "2 devices do not split into 3 equal shares of whole nodes or devices"
    assert result.labels == ("A", "B", "C")
    assert {event.name.split(":")[0] for event in result.timeline} == {"A", "B", "C"}
    assert result.winner.name in (SEQUENTIAL, COLOCATED)


def test_share_of_cluster():
    from planner.cluster import Cluster
    from planner.colocation import share_of_cluster

    assert share_of_cluster(Cluster.preset("cpu", 1, 4), 2).world_size == 2
    two_nodes = Cluster.preset("dgx-a100-80g", 2)
    half = share_of_cluster(two_nodes, 2)
    assert (half.num_nodes, half.world_size) == (1, 8)  # whole nodes, not half of each
    assert share_of_cluster(Cluster.preset("cpu", 1, 3), 2) is None


def test_trace_never_overwrites_a_plan(capsys, plans):
    gpt, cnn = plans
    before = gpt.read_text()
    assert_user_error(capsys, ["colocate", str(gpt), str(cnn), "--no-split", "--trace", str(gpt)], "not a Chrome trace")
    assert gpt.read_text() == before


def test_a_job_on_one_simulated_device_fills_every_slot():
    # A two-stage job P (stage 1 starts when stage 0 ends) beside JOB_B, simulated on one
    # device that stands for every rank: B runs on both slots.
    #   slot 0: P's stage 0 0-1 (ties to the job listed first), B's compute 1-3, B's all-reduce 3-4;
    #   slot 1: P's stage 1 waits for stage 0 (ready at 1), so B's compute, ready at 0,
    #           starts first: 0-2, filling P's bubble; P's stage 1 2-3; B's all-reduce 2-3.
    # The first round ends at 4 (slot 0).
    pipeline = (TimelineEvent("stage 0", "compute", "F stage 0", 0.0, 1.0),
                TimelineEvent("stage 1", "compute", "F stage 1", 1.0, 1.0))
    # (The crossover order on its own; its steady round is 4: P, ready first, runs all its
    # steps ahead of B's, which queue up behind. The order by phase runs each slot's P step
    # then B step, 1 + 2 = 3 s of compute a round, the stream never idle once started: that is kept.)
    shared = colocate_timelines([pipeline, JOB_B], ["P", "B"], overlap_slowdown=0.0, orders=(CROSSOVER,))
    placed = sorted((event.device, event.name, event.start_s) for event in shared.timeline)
    assert placed == [
        ("device 0", "B: all-reduce", 3.0), ("device 0", "B: fwd+bwd", 1.0), ("device 0", "P: F stage 0", 0.0),
        ("device 1", "B: all-reduce", 2.0), ("device 1", "B: fwd+bwd", 0.0), ("device 1", "P: F stage 1", 2.0),
    ]
    assert shared.first_round_s == pytest.approx(4.0)
    assert shared.job_finish_s == pytest.approx((3.0, 4.0))
    assert shared.round_s == pytest.approx(4.0)
    best = colocate_timelines([pipeline, JOB_B], ["P", "B"], overlap_slowdown=0.0)
    assert best.round_s == pytest.approx(3.0)
    assert {event.device for event in best.timeline if event.name.startswith("B:")} == {"device 0", "device 1"}


def test_a_pipeline_job_keeps_its_stages_order(plans):
    # A pipeline's stage waits for the stage before it as it did alone, so co-located it
    # is never faster than alone; its bubbles are where the other job's compute fits.
    from planner import baselines

    _, cnn = plans
    pipeline = baselines.megatron(str(ROOT / "examples" / "gpt.py"), planner.Cluster.preset("cpu", 1, 2),
                                  pp=2, micro_batch=2, precision="fp32")
    result = planner.colocate([pipeline, cnn], split=False)
    by_name = {arrangement.name: arrangement for arrangement in result.arrangements}
    assert max(result.alone_s) <= by_name[COLOCATED].round_s <= by_name[SEQUENTIAL].round_s
    assert {event.device for event in result.timeline} == {"device 0", "device 1"}
    # Memory device by device: rank r holds the pipeline's stage r beside the whole
    # data-parallel job (the same bytes on both ranks), against its own device.
    stages = planner.simulate(pipeline).stage_memory
    cnn_bytes = planner.simulate(cnn).memory.total
    assert [device.job_bytes for device in result.devices] == [(stages[0].total, cnn_bytes), (stages[1].total, cnn_bytes)]
    assert stages[0].total != stages[1].total
    report = result.report()
    assert f"  rank 0 ({result.devices[0].device}): A {format_bytes(stages[0].total)} + B {format_bytes(cnn_bytes)} = " \
           f"{format_bytes(stages[0].total + cnn_bytes)} of {format_bytes(result.devices[0].capacity_bytes)} (fits)" in report


def test_colocate_api_refuses_one_round(plans):
    from planner.errors import ArgumentError
    from user_errors import assert_api_error

    assert_api_error(lambda: planner.colocate(list(plans), split=False, rounds=1), ArgumentError, "at least 2", "got 1")


def test_a_share_too_small_for_a_job_is_said():
    # 2 MiB devices: examples/gpt.py fits two of them (a two-stage pipeline, about 1.6 MiB
    # each) but not one (its smallest plan on one device needs 3.5 MiB), so the split
    # cannot run; both jobs resident (about 1.6 + 1.0 MiB) do not fit either, and running
    # them in turn wins.
    from planner.cluster import Cluster

    small = with_memory(Cluster.preset("cpu", 1, 2), 2 * 2**20)
    jobs = [planner.plan(str(ROOT / "examples" / name), small, progress=False) for name in ("gpt.py", "cnn.py")]
    assert all(job.estimate.fits for job in jobs)
    result = planner.colocate(jobs)
    by_name = {arrangement.name: arrangement for arrangement in result.arrangements}
    assert not by_name[SPLIT].fits
    assert f"{jobs[0].name} cannot be planned on 1 device: the model does not fit" in by_name[SPLIT].note
    assert sum(result.memory_bytes) > 2 * 2**20 and not by_name[COLOCATED].fits
    assert result.winner.name == SEQUENTIAL


# ----------------------------------------------------------------- planning beside a co-runner


def test_plan_beside_a_co_runner_says_its_round(capsys, plans, tmp_path):
    gpt, cnn = plans
    beside = tmp_path / "cnn_beside.json"
    capsys.readouterr()
    assert main(["plan", str(ROOT / "examples" / "cnn.py"), "--cluster", "cpu:1x2", "--co-runner", str(gpt),
                 "-o", str(beside)]) == 0
    summary = planner.load_plan(beside).search_summary
    found = re.search(r"planned beside (\S+): co-located round ([\d.]+) ms against ([\d.]+) ms for the plan fastest "
                      r"alone", summary)
    assert found and found.group(1) == str(gpt)
    # The figures are colocate's: the chosen plan's round beside gpt, against the round of
    # the plan chosen alone (the fixture's cnn.json), which can only be longer or equal.
    report = planner.colocate([gpt, beside], split=False).to_dict()
    alone = planner.colocate([gpt, cnn], split=False).to_dict()
    chosen_round = next(a["round_s"] for a in report["arrangements"] if a["name"] == COLOCATED)
    alone_round = next(a["round_s"] for a in alone["arrangements"] if a["name"] == COLOCATED)
    assert float(found.group(2)) == pytest.approx(chosen_round * 1e3, abs=1e-3)
    assert float(found.group(3)) == pytest.approx(alone_round * 1e3, abs=1e-3)
    assert chosen_round <= alone_round


def test_colocate_json_is_the_whole_report(capsys, plans):
    gpt, cnn = plans
    capsys.readouterr()
    assert main(["colocate", str(gpt), str(cnn), "--no-split", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [job["label"] for job in data["jobs"]] == ["A", "B"] and data["jobs"][0]["name"] == str(gpt)
    assert [device["rank"] for device in data["devices"]] == [0, 1]
    for device in data["devices"]:
        assert device["total_bytes"] == sum(device["job_bytes"]) and device["fits"]
    by_name = {arrangement["name"]: arrangement for arrangement in data["arrangements"]}
    assert set(by_name) == {SEQUENTIAL, COLOCATED}
    sequential = by_name[SEQUENTIAL]
    assert sequential["round_s"] == pytest.approx(sum(job["alone_s"] for job in data["jobs"]))
    assert sequential["slowdown"] == pytest.approx([sequential["round_s"] / job["alone_s"] for job in data["jobs"]])
    assert data["winner"] == COLOCATED
    assert data["gain_over_sequential"] == pytest.approx(sequential["round_s"] / by_name[COLOCATED]["round_s"])
    assert data["trace"] is None


def test_colocate_refuses_plans_for_different_clusters_and_bad_files(capsys, plans, tmp_path):
    gpt, cnn = plans
    other = tmp_path / "cnn_small.json"
    loaded = planner.load_plan(cnn)
    dataclasses.replace(loaded, cluster=with_memory(loaded.cluster, 2**30)).save(other)
    assert_user_error(capsys, ["colocate", str(gpt), str(other), "--no-split"], f"{gpt} is planned for",
                      f"but {other} for", "plan both jobs for the same cluster")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json {")
    assert_user_error(capsys, ["colocate", str(gpt), str(garbage), "--no-split"], "garbage.json", "not valid JSON")


def test_plan_refuses_a_bad_co_runner_before_tracing(capsys, plans, tmp_path):
    gpt, _ = plans
    cnn_py = str(ROOT / "examples" / "cnn.py")
    assert_user_error(capsys, ["plan", cnn_py, "--cluster", "cpu:1x4", "--co-runner", str(gpt)],
                      "different sizes", f"{gpt}: 2", "--cluster cpu:1x4: 4")
    assert_user_error(capsys, ["plan", cnn_py, "--co-runner", str(tmp_path / "absent.json")], "absent.json",
                      "does not exist")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("[1, 2")
    assert_user_error(capsys, ["plan", cnn_py, "--co-runner", str(garbage)], "garbage.json", "not valid JSON")
    assert_user_error(capsys, ["plan", cnn_py, "--co-runner", str(gpt), "-o", str(gpt)], "-o")


def test_a_data_parallel_plan_beside_a_co_runner(plans):
    # search="dp" re-ranks the data-parallel flavours that fit the same way, and says so.
    gpt, _ = plans
    chosen = planner.plan(str(ROOT / "examples" / "cnn.py"), "cpu:1x2", search="dp", co_runner=gpt, progress=False)
    found = re.search(r"planned beside (\S+): co-located round ([\d.]+) ms against ([\d.]+) ms for the plan fastest "
                      r"alone; (\d+) kept plans", chosen.search_summary)
    assert found and found.group(1) == str(gpt) and int(found.group(4)) == 4  # ddp, zero1, zero2, fsdp
    assert float(found.group(2)) <= float(found.group(3))
