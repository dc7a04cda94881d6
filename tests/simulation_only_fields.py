"""Checks shared by the plan fields that describe other systems' runs (the switches
``fused_splits_local``, ``tp_comm_overlap``; the choices ``optimizer_implementation``,
``loss_implementation``, ``gradient_clipping``): set on a plan, they survive its file,
``compile`` refuses them in one line, and a plan file written without the field reads as off."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import planner
from planner.errors import PlanFileError
from planner.plans import load_plan


def check_field_is_validated(plan, field: str, conflicting: dict, message: str) -> None:
    """``plan`` with ``conflicting`` changes is refused in one line matching ``message``, and
    ``field`` must be a boolean."""
    with pytest.raises(ValueError, match=message) as error:
        dataclasses.replace(plan, **conflicting)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=f"field '{field}' must be true or false"):
        dataclasses.replace(plan, **{field: "yes"})


def check_simulation_only_field(plan, field: str, folder: Path) -> None:
    """``plan`` has ``field`` true: it round-trips, is refused by ``compile``, and is off when absent."""
    plan.save(folder / "plan.json")
    loaded = load_plan(folder / "plan.json")
    assert getattr(loaded, field) and loaded.estimate == plan.estimate
    with pytest.raises(PlanFileError, match=f"plan field '{field}' is true") as refused:
        planner.compile(plan, folder / "out")
    assert "\n" not in str(refused.value)
    data = json.loads((folder / "plan.json").read_text())
    del data[field]
    (folder / "old.json").write_text(json.dumps(data))
    assert not getattr(load_plan(folder / "old.json"), field)


def check_choice_field(plan, field: str, chosen: str, folder: Path) -> None:
    """``field`` of ``plan`` (unset, "") refuses an unknown value in one line; set to ``chosen``
    it round-trips and ``compile`` refuses it in one line; unset it is not written and reads
    back as ""."""
    with pytest.raises(ValueError, match=f"field '{field}' must be one of") as error:
        dataclasses.replace(plan, **{field: "apex"})
    assert "\n" not in str(error.value)
    chosen_plan = dataclasses.replace(plan, **{field: chosen})
    chosen_plan.save(folder / "chosen.json")
    assert getattr(load_plan(folder / "chosen.json"), field) == chosen
    with pytest.raises(PlanFileError, match=f"plan field '{field}' is '{chosen}'") as refused:
        planner.compile(chosen_plan, folder / "out")
    assert "\n" not in str(refused.value)
    plan.save(folder / "own.json")
    assert field not in json.loads((folder / "own.json").read_text())
    assert getattr(load_plan(folder / "own.json"), field) == ""
