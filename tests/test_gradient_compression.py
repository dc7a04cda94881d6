"""Gradient compression as plan families (``planner/families/gradient_compression/``):
PowerSGD and top-k sections, their costs worked out by hand, and where the search keeps them.

- Sections: round trip through the plan JSON; every malformed value one line naming the
  field; ZeRO/FSDP plans, accumulation and two compressions at once refused in one line.
- Costs by hand: ``powersgd_work``/``top_k_work`` on a segment of known shapes; a simulated
  MLP step's bytes over ``dp`` and its compressed collectives' times against
  ``collective_time`` for the sizes worked out on paper.
- Where it pays: on four single-V100 machines on 10 Gb/s Ethernet a wide MLP's PowerSGD plan
  is chosen and the search summary gives the gain; on one NVSwitch node none is kept and the
  summary says why.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

import planner
from cost_model.collectives import collective_time
from cost_model.segments import Segment
from cost_model.simulator import simulated
from planner.errors import PlanFileError
from planner.families.gradient_compression.costs import half_reduce_work, powersgd_work, top_k_work
from planner.families.gradient_compression.section import HalfReduceSection, PowerSgdSection, TopKSection
from planner.model_spec import ModelSpec
from planner.plans import Plan

REPO = Path(__file__).resolve().parents[1]
# MLP 32 -> 1024 -> 1024 -> 8: weights (1024, 32), (1024, 1024), (8, 1024), biases 1024, 1024, 8.
MLP = ModelSpec(str(REPO / "examples/mlp.py"), {"hidden": 1024, "layers": 3, "batch_size": 16})
SOURCE = "plan file 'p.json'"


@pytest.fixture(scope="module")
def ddp_plan() -> Plan:
    """The MLP as DDP over 4 single-V100 machines on 10 Gb/s Ethernet (p3.2xlarge), fp32."""
    return planner.plan(MLP, "p3.2xlarge:4", dp_flavour="ddp", precision="fp32", search="dp")


def with_section(plan: Plan, key: str, section) -> Plan:
    return simulated(dataclasses.replace(plan, sections={key: section}), plan.graph)


def test_sections_round_trip_and_name_themselves(ddp_plan) -> None:
    for key, section, words in (("powersgd", PowerSgdSection(2, warm_start=False), "powersgd rank 2, no warm start"),
                                ("top-k", TopKSection(0.01), "top-k 1%")):
        plan = dataclasses.replace(ddp_plan, sections={key: section})
        assert words in plan.name
        again = Plan.from_dict(plan.to_dict())
        assert again.sections == {key: section}


@pytest.mark.parametrize("key, data, field", [
    ("powersgd", {"rank": 0}, "powersgd.rank"),
    ("powersgd", {"rank": True}, "powersgd.rank"),
    ("powersgd", {"rank": 2, "warm_start": "yes"}, "powersgd.warm_start"),
    ("powersgd", {}, "powersgd.rank"),
    ("powersgd", [2], "powersgd"),
    ("powersgd", {"rank": 2, "rnak": 2}, "powersgd"),
    ("top-k", {"fraction": 0}, "top-k.fraction"),
    ("top-k", {"fraction": 0.9}, "top-k.fraction"),
    ("top-k", {"fraction": "1%"}, "top-k.fraction"),
    ("top-k", {"fraction": 0.01, "error_feedback": 1}, "top-k.error_feedback"),
    ("half-reduce", {"dtype": "fp8"}, "half-reduce.dtype"),
    ("half-reduce", {"dtype": "fp16", "to": 1}, "half-reduce"),
])
def test_a_malformed_section_is_one_line_naming_the_field(key, data, field) -> None:
    section_class = {"powersgd": PowerSgdSection, "top-k": TopKSection, "half-reduce": HalfReduceSection}[key]
    with pytest.raises(PlanFileError) as error:
        section_class.from_json(data, SOURCE)
    message = str(error.value)
    assert "\n" not in message and message.startswith(SOURCE) and f"'{field}" in message


def test_zero_fsdp_accumulation_and_two_compressions_are_refused_in_one_line(ddp_plan) -> None:
    fsdp = planner.plan(MLP, "p3.2xlarge:4", dp_flavour="fsdp", precision="fp32", search="dp")
    with pytest.raises(ValueError, match=r"^field 'top-k' compresses DDP's gradient all-reduce, but the plan is fsdp.*--dp ddp"):
        dataclasses.replace(fsdp, sections={"top-k": TopKSection(0.01)})
    with pytest.raises(ValueError, match=r"accumulates 2 micro-batches"):
        dataclasses.replace(ddp_plan, accumulation_steps=2, sections={"powersgd": PowerSgdSection(1)})
    with pytest.raises(ValueError, match=r"both compress the gradients; keep one"):
        dataclasses.replace(ddp_plan, sections={"powersgd": PowerSgdSection(1), "top-k": TopKSection(0.01)})


def test_half_reduce_refuses_bf16_plans_and_bf16_on_gloo(ddp_plan) -> None:
    bf16 = planner.plan(MLP, "dgx-a100-80g", dp_flavour="ddp", precision="bf16", search="dp")
    with pytest.raises(ValueError, match=r"^field 'half-reduce' halves an fp32 reduction, but the plan's precision is bf16"):
        dataclasses.replace(bf16, sections={"half-reduce": HalfReduceSection("fp16")})
    gloo = planner.plan(MLP, "cpu:1x2", dp_flavour="ddp", precision="fp32", search="dp")
    with pytest.raises(ValueError, match=r"^field 'half-reduce.dtype' is bf16, whose PyTorch hook needs NCCL.*use fp16"):
        dataclasses.replace(gloo, sections={"half-reduce": HalfReduceSection("bf16")})
    assert "grads reduced in bf16" in dataclasses.replace(ddp_plan, sections={"half-reduce": HalfReduceSection("bf16")}).name


def test_half_reduce_work_by_hand(ddp_plan) -> None:
    segment = Segment("s", 0, params={"w": 1000, "b": 10}, shapes={}, dp_synced={"w", "b"})
    work = half_reduce_work(segment, element_bytes=4)
    assert work.first_bytes == 1010 * 2  # the bucket all-reduced in 16 bits
    assert work.encode_bytes == work.decode_bytes == 1010 * (4 + 2)  # cast down, cast back
    # The MLP on p3.2xlarge:4: its 4,366,368 fp32 gradient bytes all-reduced as 2,183,184.
    plan = with_section(ddp_plan, "half-reduce", HalfReduceSection("fp16"))
    assert plan.estimate.bytes_per_axis["dp"] == pytest.approx(ddp_plan.estimate.bytes_per_axis["dp"] / 2)


def test_powersgd_work_by_hand() -> None:
    # One 4096 x 1024 weight and its 4096 bias, rank 4, fp32 gradients (4 bytes).
    segment = Segment("s", 0, params={"w": 4096 * 1024, "b": 4096}, shapes={"w": (4096, 1024), "b": (4096,)},
                      dp_synced={"w", "b"})
    work = powersgd_work(segment, rank=4, error_feedback=True, warm_start=True, element_bytes=4)
    # (n + m) r * 2 = 5120 * 4 * 2 = 40,960 < n m = 4,194,304: compressed. P: 4096 x 4, Q: 1024 x 4.
    assert work.first_bytes == (4096 + 4096 * 4) * 4  # the bias uncompressed, then P
    assert work.second_bytes == 1024 * 4 * 4  # Q
    assert work.encode_flops == 2 * 4096 * 1024 * 4  # P = M Q
    assert work.middle_flops == 2 * 4096 * 4 * 4 + 2 * 4096 * 1024 * 4  # orthogonalise P, Q = M^T P
    assert work.decode_flops == 2 * 4096 * 1024 * 4  # M = P Q^T
    # Error feedback: M += E (3 passes), a copy (2), P = M Q (1); plus P and Q written.
    assert work.encode_bytes == 4096 * 1024 * 4 * 6 + (4096 * 4 + 1024 * 4) * 4
    # Kept between steps: the error (one fp32 M) and, with warm start, P and Q.
    assert work.kept_bytes == 4096 * 1024 * 4 + (4096 * 4 + 1024 * 4) * 4
    # A 16 x 16 weight at rank 8 is sent whole: (16 + 16) 8 * 2 = 512 >= 256.
    small = Segment("t", 0, params={"w": 256}, shapes={"w": (16, 16)}, dp_synced={"w"})
    assert powersgd_work(small, 8, True, True, 4).first_bytes == 256 * 4
    assert powersgd_work(small, 8, True, True, 4).second_bytes == 0


def test_top_k_work_by_hand() -> None:
    segment = Segment("s", 0, params={"w": 4096 * 1024, "b": 4096}, shapes={}, dp_synced={"w", "b"})
    work = top_k_work(segment, fraction=0.01, error_feedback=False, element_bytes=2, dp=8)
    k = math.ceil(0.01 * (4096 * 1024 + 4096))  # 41,984 entries
    assert k == 41984
    assert work.collective == "all_gather"
    assert work.first_bytes == 8 * k * (2 + 4)  # every rank's bf16 values and int32 indices gathered
    assert work.encode_bytes == (4096 * 1024 + 4096) * 2 * 4 + k * 6  # 4 radix passes, no error feedback
    assert work.kept_bytes == 0


def test_a_simulated_step_sends_the_factors_and_prices_them_as_collectives(ddp_plan) -> None:
    plan = with_section(ddp_plan, "powersgd", PowerSgdSection(1))
    # Rank 1: (1024, 32) -> P 1024, Q 32; (1024, 1024) -> P 1024, Q 1024; (8, 1024) -> P 8, Q 1024
    # (each (n + m) * 2 < n m); biases 1024 + 1024 + 8 all-reduced whole. fp32: 4 bytes.
    first, second = (2056 + 1024 + 1024 + 8) * 4, (32 + 1024 + 1024) * 4
    # A ring all-reduce sends 2 (dp - 1) / dp of its size: 2 * 3 / 4.
    assert plan.estimate.bytes_per_axis["dp"] == pytest.approx((first + second) * 1.5)
    uncompressed = ddp_plan.estimate.bytes_per_axis["dp"]
    assert uncompressed == pytest.approx((32 * 1024 + 1024 * 1024 + 8 * 1024 + 2056) * 4 * 1.5)
    # The collectives: the MLP's 4,366,368 bytes of gradients fill DDP's first 1 MiB bucket and
    # one more of the rest (3,317,792 bytes); each bucket's all-reduce carries its share of the
    # compressed bytes: first P and the vectors, then Q.
    whole = (32 * 1024 + 1024 * 1024 + 8 * 1024 + 2056) * 4
    assert whole == 4_366_368
    ranks = list(range(4))
    events = {event.name: event.duration_s for event in plan.estimate.timeline}
    for name, sent in (("all-reduce compressed grads (before blocks, 2 bucket(s))", first),
                       ("all-reduce compressed grads (Q, before blocks, 2 bucket(s))", second)):
        expected = sum(collective_time("all_reduce", bucket * sent / whole, plan.cluster, ranks)
                       for bucket in (2**20, whole - 2**20))
        assert events[name] == pytest.approx(expected, rel=1e-9)
    # The uncompressed plan all-reduces the two buckets whole.
    plain = {event.name: event.duration_s for event in ddp_plan.estimate.timeline}
    assert plain["all-reduce grads (before blocks, 2 buckets)"] == pytest.approx(
        sum(collective_time("all_reduce", bucket, plan.cluster, ranks) for bucket in (2**20, whole - 2**20)))
    # On 0.75 GB/s per machine the factors' 25 KB beat 4.3 MB all-reduced whole.
    assert plan.estimate.step_time_s < ddp_plan.estimate.step_time_s


@pytest.fixture(scope="module")
def slow_ethernet_plan() -> Plan:
    """A wide MLP planned on eight 10 Gb/s machines (p3.2xlarge), every family allowed."""
    wide = ModelSpec(str(REPO / "examples/mlp.py"), {"hidden": 4096, "layers": 8, "batch_size": 64})
    return planner.plan(wide, "p3.2xlarge:8", precision="fp32")


def test_the_search_chooses_compression_on_slow_ethernet_and_says_the_gain(slow_ethernet_plan) -> None:
    plan = slow_ethernet_plan
    assert set(plan.sections) & {"powersgd", "top-k"}, plan.name
    assert "gradient compression pays: best compressed" in plan.search_summary
    assert "Gradient compression:" in plan.report() and "lossy" in plan.report()


def test_the_search_keeps_no_compression_on_nvswitch_and_says_why() -> None:
    plan = planner.plan(MLP, "dgx-a100-80g", precision="bf16")
    assert not set(plan.sections) & {"powersgd", "top-k"}, plan.name
    assert "gradient compression not chosen" in plan.search_summary


def test_planner_families_lists_them_and_family_searches_one_alone() -> None:
    from planner.families import family_names

    assert {"powersgd", "top-k", "half-reduce"} <= set(family_names())
    plan = planner.plan(MLP, "cpu:1x2", precision="fp32", constraints={"families": ["top-k"]})
    assert set(plan.sections) == {"top-k"}, plan.name
    assert "gradient compression (asked by --family)" in plan.search_summary


def test_the_report_says_the_whole_gain_and_warns_of_a_method_outside_the_tolerance(slow_ethernet_plan,
                                                                                   monkeypatch) -> None:
    from planner.families.gradient_compression import convergence
    from planner.families.gradient_compression.report import summary_parts

    # The summary's notes split at "; " outside parentheses: a plan's name holds one.
    assert summary_parts("a (dp=8; powersgd rank 1) b; c") == ["a (dp=8; powersgd rank 1) b", "c"]
    plan = slow_ethernet_plan
    section = plan.sections["powersgd"] if "powersgd" in plan.sections else plan.sections["top-k"]
    method = convergence.benchmark_method(section)
    assert method in convergence.MEASURED, plan.name
    # Measured 2x the uncompressed loss on one model: the report warns, with the figures.
    monkeypatch.setitem(convergence.MEASURED, method, {"gpt": 2.0, "cnn": 1.05})
    words = " ".join(plan.report().split())
    why = next(line for line in words.split("Why: ")[1:] if line.startswith("gradient compression pays"))
    assert why.startswith(f"gradient compression pays: best compressed {plan.name} ")  # the name whole
    assert "Convergence risk:" in words and "x2.00 (GPT), x1.05 (CNN)" in words
    # Within the 10% on both: no warning.
    monkeypatch.setitem(convergence.MEASURED, method, {"gpt": 1.08, "cnn": 0.9})
    assert "Convergence risk" not in plan.report()
    # A setting the benchmark does not run (top-k 0.5%) is said to be unmeasured.
    assert "is not among the settings" in convergence.convergence_risk(TopKSection(0.005), "top-k 0.5%")
