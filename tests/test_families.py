"""The registry of parallelism families (``planner.families``) and what a family relies on it
for: being listed, competing in the search through its candidates part, its section saved
under its own key of the plan file and read back, and its plans compiled by its emitter.

HSDP is the family added through the registry alone, so it is the example throughout; its
own program and parity are in ``tests/test_hsdp_program.py``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import planner
from planner.cli import main
from planner.errors import PlanFileError
from planner.families import Family, emitting_family, families_of, family, family_names, registered
from planner.families.hsdp.section import HsdpSection
from planner.plans import Plan

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")


@pytest.fixture(scope="module")
def fsdp_plan() -> Plan:
    return planner.plan(GPT, "cpu:2x2", dp_flavour="fsdp", precision="fp32")


@pytest.fixture(scope="module")
def hsdp_plan() -> Plan:
    """What ``planner plan examples/gpt.py --cluster cpu:2x2 --family hsdp`` chooses."""
    return planner.plan(GPT, "cpu:2x2", constraints={"families": ["hsdp"]})


def test_planner_families_lists_every_registered_family_once(capsys):
    assert main(["families"]) == 0
    out = capsys.readouterr().out
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert names == list(family_names())
    assert {"ddp", "zero1", "zero2", "fsdp", "hsdp", "tp", "summa", "pipeline", "moe"} <= set(names)
    assert len(set(names)) == len(names)


def test_every_family_folder_declares_what_it_is():
    for declared in registered():
        # A name is what --family takes: identifier characters, words joined by "-" (top-k).
        assert declared.summary and declared.name.replace("-", "_").isidentifier(), declared
        assert (declared.emitter == "") == (declared.claims is None), f"{declared.name}: an emitter needs claims"
        if declared.section is not None:
            for method in ("check", "to_json", "from_json", "describe"):
                assert callable(getattr(declared.section, method, None)), (declared.name, method)


def test_only_hsdp_is_searched_when_it_is_the_only_family_allowed(hsdp_plan):
    assert families_of(hsdp_plan) == {"hsdp"}
    assert hsdp_plan.sections == {"hsdp": HsdpSection(2)}
    assert hsdp_plan.name == "fsdp (dp=4; hsdp 2 x 2)"
    assert all("hsdp" in alt.name for alt in hsdp_plan.runners_up), [alt.name for alt in hsdp_plan.runners_up]
    assert hsdp_plan.search_summary.startswith("constrained by --family hsdp")


def test_a_section_is_saved_under_its_familys_key_and_read_back(hsdp_plan, tmp_path):
    path = tmp_path / "p.json"
    hsdp_plan.save(path)
    data = json.loads(path.read_text())
    assert data["hsdp"] == {"shard": 2}
    loaded = planner.load_plan(path)
    assert loaded.sections == hsdp_plan.sections and loaded.name == hsdp_plan.name


def test_a_plan_of_the_previous_version_loads_without_sections(fsdp_plan):
    data = fsdp_plan.to_dict()
    data["version"] = 8
    loaded = Plan.from_dict(data)
    assert loaded.sections == {} and loaded.strategies == fsdp_plan.strategies and loaded.name == fsdp_plan.name


def test_a_key_no_field_and_no_family_has_is_one_line(fsdp_plan):
    data = fsdp_plan.to_dict()
    data["hybrid_sharding"] = {"shard": 2}
    with pytest.raises(PlanFileError, match=r"field 'hybrid_sharding' is not a plan field or the section of a "
                                            r"parallelism family this soap-planner knows \([^)]*hsdp[^)]*\)"):
        Plan.from_dict(data)


def test_a_section_that_does_not_fit_its_plan_is_refused_when_the_plan_is_made(fsdp_plan):
    with pytest.raises(ValueError, match="hsdp.shard"):
        dataclasses.replace(fsdp_plan, sections={"hsdp": HsdpSection(4)})
    with pytest.raises(ValueError, match="belongs to no parallelism family"):
        dataclasses.replace(fsdp_plan, sections={"zero4": HsdpSection(2)})


def test_each_plan_is_compiled_by_the_family_that_claims_it(fsdp_plan, hsdp_plan):
    assert emitting_family(hsdp_plan).name == "hsdp"
    assert emitting_family(fsdp_plan).name in {"ddp", "zero1", "zero2", "fsdp"}  # one emitter for the flavours
    searched = planner.plan(GPT, "cpu:1x2", constraints={"mesh": {"tp": 2}})
    assert emitting_family(searched).name == "tp"


# A family added from outside the package: its candidates part, found through the registry,
# is asked by the search and its plan competes like any other.
ASKED: list[str] = []


def renamed_fsdp_candidates(context) -> list[Plan]:
    ASKED.append(context.model_name)
    fsdp = [plan for plan in context.found if plan.name.startswith("fsdp (") and not plan.sections]
    return [dataclasses.replace(plan, label="toy") for plan in fsdp[:1]]


def test_a_family_registered_beside_the_others_is_searched(monkeypatch):
    toy = Family("toy", "a test family", lambda plan: plan.label == "toy", data_parallel=True,
                 candidates=f"{__name__}:renamed_fsdp_candidates", search_order=99)
    real = registered()
    monkeypatch.setattr("planner.families.registered", lambda: (*real, toy))
    ASKED.clear()
    plan = planner.plan(GPT, "cpu:1x2", constraints={"families": ["toy", "fsdp"]})
    assert ASKED == [plan.summary.name]
    assert {alt.name for alt in plan.runners_up} | {plan.name} >= {"toy (dp=2; fsdp)", "fsdp (dp=2)"}
    assert family("toy") is toy
