"""No silently wrong program from models nobody here wrote, and plans that fit in any process.

The models (tests/models/outside_models.py) are stand-ins for what outside code does; each
once gave a program that trained another model, failed, or did not compile:

- a batch-norm subclass with an activation in its forward (timm's ``BatchNormAct2d``) under
  DDP: the program keeps the activation and takes the statistics over both ranks;
- an LSTM and a GRU, under DDP (``launch.py --check --steps 2``, as a user runs it) and FSDP:
  their weights materialise and the step matches one device;
- masks built in the order of a ``set`` of strings: planned with ``planner plan`` under one
  ``PYTHONHASHSEED``, compiled under another and checked under a third (three processes,
  three trace orders), the program fits and matches one device;
- a forward that calls ``self.head.to(x.device)``: it plans, compiles and matches one device.

The parity checks of world 2 run in ONE torchrun launch (``check_many``), plus the one
``launch.py`` run.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import planner
from planner.model_spec import ModelSpec
from test_parity import CLI_TIMEOUT, Launch, _run, _torchrun, check_many, result_of

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
OUTSIDE_MODELS = REPO / "tests" / "models" / "outside_models.py"
WORLD = 2
# Hash seeds of the three processes: planning, compiling, running (each traces the model).
PLAN_SEED, COMPILE_SEED, RUN_SEED = "1", "2", "3"


def _spec(factory: str) -> ModelSpec:
    return ModelSpec(f"{OUTSIDE_MODELS}:{factory}", {})


def _cli(arguments: list[str], cwd: Path, seed: str) -> Launch:
    """``python -m planner ...`` in a process with ``PYTHONHASHSEED=seed``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONHASHSEED", seed)  # _run passes this process's environment on
        return _run([sys.executable, "-m", "planner", *arguments], cwd=cwd, timeout=CLI_TIMEOUT)


@dataclass(frozen=True)
class StableRun:
    folders: dict[str, Path]
    launch: Launch  # dist_check_many over every folder
    plans: dict[str, dict]  # the set-order model's plan files by hash seed

    def result(self, name: str) -> str:
        return result_of(self.launch, self.folders[name])


@pytest.fixture(scope="module")
def stable_run(tmp_path_factory) -> StableRun:
    root = tmp_path_factory.mktemp("stable")
    folders = {}
    for name, factory, flavour in (("batch_norm_act_ddp", "batch_norm_act", "ddp"),
                                   ("recurrent_fsdp", "recurrent", "fsdp"),
                                   ("moves_its_head", "moves_its_head", None)):
        plan = planner.plan(_spec(factory), f"cpu:1x{WORLD}", dp_flavour=flavour, effort=0.25, progress=False)
        folders[name] = planner.compile(plan, root / name)
    # The set-order model: planned under two hash seeds (two trace orders), compiled under a third,
    # on a tensor-parallel mesh so that the plan is a graph program whose op names matter (left
    # free, the search runs it as DDP: on CPUs DTensor's per-op dispatch costs more than its split saves).
    plans = {}
    for seed in (PLAN_SEED, COMPILE_SEED):
        planned = _cli(["plan", f"{OUTSIDE_MODELS}:set_order_masks", "--cluster", f"cpu:1x{WORLD}", "--effort", "0.25",
                        "--mesh", f"tp={WORLD}", "-o", f"set_order_{seed}.json"], root, seed)
        assert planned.returncode == 0, planned.describe()
        plans[seed] = json.loads((root / f"set_order_{seed}.json").read_text())
    compiled = _cli(["compile", f"set_order_{PLAN_SEED}.json", "-o", "set_order"], root, COMPILE_SEED)
    assert compiled.returncode == 0, compiled.describe()
    folders["set_order"] = root / "set_order"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONHASHSEED", RUN_SEED)
        launch = check_many(WORLD, list(folders.values()), root)
    return StableRun(folders, launch, plans)


@pytest.mark.parametrize("name", ["batch_norm_act_ddp", "recurrent_fsdp", "moves_its_head", "set_order"])
def test_program_matches_one_device(stable_run: StableRun, name: str) -> None:
    result = stable_run.result(name)
    assert result.startswith("ok parity ok: "), f"{name}: {result}"


def test_batch_norm_subclass_is_synchronised_with_its_activation(stable_run: StableRun) -> None:
    source = (stable_run.folders["batch_norm_act_ddp"] / "model_spmd.py").read_text()
    assert "DistributedDataParallel(" in source and "synchronise_batch_norm(model" in source, source


def test_plans_name_the_same_ops_under_any_hash_seed(stable_run: StableRun) -> None:
    """The two planning processes traced the masks in different orders (the test is not
    vacuous), yet name every op alike; the program compiled from one plan in a third process
    is a graph program (the names mattered) and matched one device above."""
    first, second = (stable_run.plans[seed]["strategies"] for seed in (PLAN_SEED, COMPILE_SEED))
    assert [s["op"] for s in first] != [s["op"] for s in second], "both hash seeds traced the same order"
    assert {s["node"]: s["op"] for s in first} == {s["node"]: s["op"] for s in second}
    assert ["tp", WORLD] in stable_run.plans[PLAN_SEED]["mesh"], "a data-parallel plan names no op"


def test_recurrent_program_checks_and_trains_as_a_user_runs_it(tmp_path: Path) -> None:
    plan = planner.plan(_spec("recurrent"), f"cpu:1x{WORLD}", dp_flavour="ddp", progress=False)
    planner.compile(plan, tmp_path / "out")
    launch = _run([*_torchrun(WORLD), "out/launch.py", "--check", "--steps", "2"], cwd=tmp_path, timeout=CLI_TIMEOUT)
    assert launch.returncode == 0, launch.describe()
    assert "parity ok: max_abs_err=" in launch.stdout, launch.describe()
    for step in (1, 2):
        assert re.search(rf"^step {step}/2: .* loss \d", launch.stdout, re.MULTILINE), launch.describe()
