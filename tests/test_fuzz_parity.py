"""Property-based parity: random models with random valid strategies train like one device.

A fixed sample of the cases of ``benchmarks/fuzz_parity.py`` (which runs any number): each
case is a random small model (``tests/fuzz/random_model.py``, from the ops the sharding rules
cover) on a mesh of 2 ranks (``dp=2``, ``tp=2``) or 4 (``dp=4``, ``tp=4``, ``dp=2 x tp=2``),
with one of the rule registry's candidates drawn at random for every op
(``tests/fuzz/cases.py``), compiled and checked against one device: outputs, loss, every
gradient and every updated parameter (``launch.py --check``'s comparison). Each world size
checks its programs in ONE torchrun launch.

The generation is plain seeded ``random``, not hypothesis: each case must be rebuilt from a
number inside every torchrun rank (the model spec carries the seed), and the expensive part
(a torchrun launch) must check many cases at once, whereas hypothesis runs, and shrinks, one
example at a time. A failing case number is the reproduction:
``python benchmarks/fuzz_parity.py --case N`` prints its plan and its result.

A negative control (one sample program with its first all-reduce removed) proves the launch
reports a wrong program, and the sample is checked to cover every op family of the rules.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fuzz"))
from cases import Compiled, case, compile_case  # noqa: E402
from parity_launch import check_programs  # noqa: E402
from random_model import recipe  # noqa: E402

# Cases 380..411: 16 per world size, and (test_the_sample_covers_every_op_family) every op
# family the generator draws, tied weights and every mesh; the first window of 32 cases
# that covers them all.
SAMPLE = range(380, 412)
# Distinct ATen ops of the traced sample that stand for each family the rules cover.
FAMILIES = {
    "linear": {"aten.linear.default"},
    "matmul": {"aten.matmul.default"},
    "bmm": {"aten.bmm.default"},
    "layer norm": {"aten.layer_norm.default"},
    "RMS norm": {"aten.rms_norm.default"},
    "softmax": {"aten.softmax.int", "aten._softmax.default"},
    "attention": {"aten.scaled_dot_product_attention.default"},
    "elementwise": {"aten.gelu.default", "aten.silu.default", "aten.relu.default", "aten.tanh.default", "aten.add.Tensor"},
    "reductions": {"aten.sum.dim_IntList", "aten.mean.dim", "aten.amax.default"},
    "views": {"aten.view.default", "aten.reshape.default", "aten.transpose.int", "aten.permute.default",
              "aten.split_with_sizes.default", "aten.cat.default"},
    "embedding": {"aten.embedding.default"},
    "convolution": {"aten.conv1d.default", "aten.conv2d.default"},
    "loss": {"aten.cross_entropy_loss.default", "aten.mse_loss.default"},
}
STALL_S = 240  # seconds without a new result before a launch is stopped (a hang)


@dataclass(frozen=True)
class WorldRun:
    world: int
    compiled: dict[int, Compiled]  # case number -> compiled (or refused) program
    broken: Path  # the negative control
    results: dict[Path, str]


def _skip_first_all_reduce(folder: Path) -> Path | None:
    """A copy of ``folder`` whose program keeps its partial sums where it should sum them,
    or ``None`` when its program has no all-reduce."""
    from test_spmd_parity import skip_first_all_reduce

    broken = folder.with_name(folder.name + "_broken")
    shutil.copytree(folder, broken)
    try:
        return skip_first_all_reduce(broken)
    except AssertionError:  # no "# all-reduce over tp" line before a redistribution
        shutil.rmtree(broken)
        return None


def _world_run(world: int, root: Path) -> WorldRun:
    compiled = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ops without a rule: named in the plan already
        for number in SAMPLE:
            if case(number).world == world:
                compiled[number] = compile_case(case(number), root / f"case{number}")
    folders = [c.folder for c in compiled.values() if c.folder is not None]
    broken = next((b for b in map(_skip_first_all_reduce, folders) if b is not None), None)
    assert broken is not None, f"no program of the world-{world} sample has an all-reduce over tp to remove"
    return WorldRun(world, compiled, broken, check_programs(world, [*folders, broken], root, STALL_S))


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> WorldRun:
    return _world_run(2, tmp_path_factory.mktemp("fuzz_world2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> WorldRun:
    return _world_run(4, tmp_path_factory.mktemp("fuzz_world4"))


def _run_of(request, number: int) -> WorldRun:
    return request.getfixturevalue(f"world{case(number).world}")


@pytest.mark.distributed
@pytest.mark.parametrize("number", SAMPLE, ids=lambda number: f"case{number}")
def test_random_plan_trains_like_one_device(request, number: int) -> None:
    run = _run_of(request, number)
    compiled = run.compiled[number]
    if compiled.refusal is not None:  # a one-line PlannerError: allowed, and counted below
        assert "\n" not in compiled.refusal and compiled.refusal, compiled.describe()
        return
    result = run.results[compiled.folder]
    assert result.startswith("ok parity ok: "), (
        f"{compiled.describe()}\n{result}\nrerun: python benchmarks/fuzz_parity.py --case {number}"
    )


@pytest.mark.distributed
@pytest.mark.parametrize("world", (2, 4))
def test_refusals_are_rare_and_the_broken_program_is_reported(request, world: int) -> None:
    run = request.getfixturevalue(f"world{world}")
    refused = [c.describe() + ": " + c.refusal for c in run.compiled.values() if c.refusal]
    assert len(refused) <= len(run.compiled) // 6, "\n".join(refused)
    assert run.results[run.broken].startswith("FAILED parity FAILED: "), run.results[run.broken]


def test_the_sample_covers_every_op_family() -> None:
    from planner.api import prepare_model

    seen: set[str] = set()
    for number in SAMPLE:
        graph, _, _, _ = prepare_model(case(number).spec, f"cpu:1x{case(number).world}")
        seen |= {node.op for node in graph.nodes}
    missing = {family: sorted(ops) for family, ops in FAMILIES.items() if not ops & seen}
    assert not missing, f"the sample {SAMPLE} traces no op of {missing}"
    assert any(recipe(number).head.settings.get("tied") for number in SAMPLE), "no model of the sample ties weights"
    meshes = {str(case(number).mesh) for number in SAMPLE}
    assert meshes == {"dp=2", "tp=2", "dp=4", "tp=4", "dp=2 x tp=2"}, meshes


def test_a_case_is_rebuilt_from_its_number() -> None:
    """Every torchrun rank rebuilds the same model and batch from the spec's seed, whatever
    else it drew from Python's generator before."""
    import random

    import torch

    from random_model import build

    built = []
    for noise in (1, 2):
        random.seed(noise)
        torch.manual_seed(0)
        model, batch = build(seed=SAMPLE[0])
        built.append((model.state_dict(), batch))
    (first, first_batch), (second, second_batch) = built
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert all(torch.equal(a, b) for a, b in zip(first_batch, second_batch))
    assert len({recipe(number).structure for number in SAMPLE}) == len(SAMPLE)  # no two alike
    assert all(recipe(number).batch % 4 == 0 for number in SAMPLE)  # whole slices on 2 and 4 ranks


# ------------------------------------------------------------- the launcher's bookkeeping


def _canned(monkeypatch, launches: list[tuple[int | None, list[str]]]) -> list[list[str]]:
    """Replace torchrun by canned launches: each gives (exit status, RESULT lines by folder
    name: "ok" or "FAILED"); returns the folder names each launch was asked to check."""
    import parity_launch

    asked: list[list[str]] = []

    def launch(world, folders, cwd, stall_s):
        asked.append([folder.name for folder in folders])
        status, verdicts = launches[len(asked) - 1]
        lines = [f"RESULT {folder} {verdict} parity {verdict}" for folder, verdict in zip(folders, verdicts)]
        return status, "\n".join(lines), "terminate called\n  what():  collective mismatch"

    monkeypatch.setattr(parity_launch, "_launch", launch)
    return asked


def test_a_program_that_stops_the_launch_is_named_and_the_rest_checked_again(monkeypatch, tmp_path) -> None:
    folders = [tmp_path / name for name in ("a", "b", "c", "d")]
    # Launch 1: a ok, b fails, c fails after b (b may have left a collective half-done), d
    # gives no line: c and d go again. Launch 2: c ok, d gives no line with nothing failed
    # before it, so d stopped the launch.
    asked = _canned(monkeypatch, [(1, ["ok", "FAILED", "FAILED"]), (1, ["ok"])])
    results = check_programs(2, folders, tmp_path)
    assert asked == [["a", "b", "c", "d"], ["c", "d"]]
    assert results[folders[0]].startswith("ok") and results[folders[1]].startswith("FAILED parity")
    assert results[folders[2]].startswith("ok")
    assert results[folders[3]] == "FAILED launch stopped in this program: exit status 1: what():  collective mismatch"


def test_a_hang_is_blamed_on_the_first_program_without_a_result(monkeypatch, tmp_path) -> None:
    folders = [tmp_path / name for name in ("a", "b", "c")]
    asked = _canned(monkeypatch, [(None, ["ok"]), (0, ["ok"])])
    results = check_programs(2, folders, tmp_path, stall_s=5)
    assert asked == [["a", "b", "c"], ["c"]]
    assert results[folders[1]] == "FAILED launch stopped in this program: no result for 5 s (hung)"
    assert results[folders[2]].startswith("ok")
