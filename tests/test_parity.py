"""Distributed parity: every compiled program trains exactly like one device.

For each example model (MLP, GPT, CNN, a tiny HuggingFace GPT-2) and each data-parallel
flavour (DDP, ZeRO-1, ZeRO-2, FSDP) at world sizes 2 and 4, the compiled program's sharded
step (outputs, loss, every gradient, every updated parameter) must equal the same step on one
device (``codegen.runtime.parity.check_parity``, the comparison behind ``launch.py --check``).
ZeRO-1's step goes through the program's ``make_optimizer`` hook (a ShardedStatesOptimizer).
GPT with DDP and GPT-2 with FSDP also run with every block recomputed in backward
(``codegen.runtime.recompute``), and GPT-2 with ZeRO-2 in bf16 mixed precision.

Starting gloo processes costs seconds on 2 cores, so each world size compiles its programs
first and checks them all in ONE launch of ``tests/dist_check_many.py``, shared with other
modules' programs of that world size (``tests/launch_groups.py``); the
parametrized tests then read that launch's ``RESULT`` line of their own program, so a failure
names the model, flavour and world size. Negative controls (a DDP program whose gradients are
never averaged; a ZeRO-1 program whose ranks step their own share of the parameters and never
share the result) prove the check can fail and that it steps through the program's optimizer
hook, and the CLI path is run exactly as a user types it:
``planner plan``, ``planner compile``, ``torchrun out/launch.py --check --steps 2``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

import planner
from planner.model_spec import ModelSpec
from launch_groups import register_group  # this folder is on sys.path under pytest
from rank_processes import launch_ranks

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
DIST_CHECK_MANY = Path(__file__).resolve().with_name("dist_check_many.py")

WORLD_SIZES = (2, 4)
FLAVOURS = ("ddp", "zero1", "zero2", "fsdp")
# Every global batch divides by 4 so each world size gets whole, equal per-rank slices.
HF_GPT2_TINY = {
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 4,
    "vocab_size": 128,
    "n_positions": 64,
    "batch_size": 4,
    "seq_len": 16,
}
MODELS = {
    "mlp": ("examples/mlp.py", {"batch_size": 8}),
    "gpt": ("examples/gpt.py", {"batch_size": 8}),
    "cnn": ("examples/cnn.py", {"batch_size": 8}),
    "gpt2": ("hf:gpt2", HF_GPT2_TINY),
}
# "+recompute": the flavour's plan with every repeated block recomputed in backward.
# "+bf16": bf16 mixed precision (forward under autocast).
CASES = [(model, flavour) for model in MODELS for flavour in FLAVOURS] + [
    ("gpt", "ddp+recompute"), ("gpt2", "fsdp+recompute"), ("gpt2", "zero2+bf16"),
]

# Seconds. One launch here takes ~7-25 s (2 cores); the limits only stop a hung collective.
LAUNCH_TIMEOUT = 300
CLI_TIMEOUT = 120

# Appended to a compiled DDP program: the later definition wins, so each rank trains the bare
# model on its slice of the batch and its gradients are never averaged over "dp".
WITHOUT_DDP = '''

def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """Negative control: the bare model, no DistributedDataParallel around it."""
    return model
'''
# Appended to a compiled ZeRO-1 program: each rank keeps the states of its slice of every
# weight and updates that slice only, but never all-gathers the updated slices (what
# ShardedStatesOptimizer.step ends with), so the replicas drift apart after the step. Only a
# check that builds its optimizer through the program's make_optimizer can see it.
WITHOUT_GATHER = '''

def make_optimizer(module, mesh, optimizer_class, **kwargs):
    """Negative control: states sharded over "dp", updated slices never all-gathered."""
    optimizer = ShardedStatesOptimizer(module.parameters(), mesh, "dp", optimizer_class, **kwargs)
    for piece in optimizer.pieces:
        piece.gather = lambda group, ranks: None
    return optimizer
'''
FAILED_ON_A_TENSOR = re.compile(r"parity FAILED: worst tensor (grad of|updated) net\.\d+\.(weight|bias)")


# --------------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class Launch:
    """A finished command: its exit status and output."""

    command: list[str]
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        """The command and its output, for an assertion message: the whole of stdout, the
        lines of stderr that say why a process died (a crash's C++ backtrace buries them
        thousands of characters above the end), then the end of stderr."""
        causes = "\n".join(crash_causes(self.stderr))
        return (
            f"$ {' '.join(self.command)}\nexit status {self.returncode}\n"
            f"--- stdout ---\n{self.stdout}\n--- why (stderr lines naming an error) ---\n{causes}\n"
            f"--- stderr (end) ---\n{self.stderr[-6000:]}"
        )


CAUSE = re.compile(r"terminate called|what\(\)|Error|error:|Exception|Killed|signal", re.IGNORECASE)


def crash_causes(stderr: str, limit: int = 30) -> list[str]:
    """The distinct lines of ``stderr`` that name an error (``terminate called ...``,
    ``what(): ...``, ``...Error: ...``), backtrace frames left out, at most ``limit``."""
    lines = []
    for line in stderr.splitlines():
        line = line.strip()
        if CAUSE.search(line) and not line.startswith("frame #") and line not in lines:
            lines.append(line[:400])
    return lines[:limit]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(command: list[str], cwd: Path, timeout: float) -> Launch:
    """Run ``command`` in its own process group; on timeout kill the whole group (torchrun's
    workers too, which would otherwise wait forever in a collective) and fail with its output."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # what torchrun would pick, without its warning
    # torchrun reads its --master-port from PET_MASTER_PORT: a free port instead of 29500, so
    # concurrent test runs do not collide, while the command stays as a user types it.
    env["PET_MASTER_PORT"] = str(_free_port())
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        launch = Launch(command, process.returncode, stdout, stderr)
        pytest.fail(f"timed out after {timeout} s:\n{launch.describe()}")
    return Launch(command, process.returncode, stdout, stderr)


def check_many(world: int, programs: list[Path], cwd: Path, in_float64: list[Path] = (),
               timeout: float = LAUNCH_TIMEOUT) -> Launch:
    """Check every compiled program in ``programs`` (and those of ``in_float64`` in float64,
    ``--check --fp64``) in ONE launch of ``dist_check_many.py`` on ``world`` gloo processes,
    started as torchrun starts its workers but without its agent (``tests/rank_processes.py``:
    a harness needs no agent, and it costs a second of a 2-core machine per launch); the
    launch itself must succeed. (``tests/launch_groups.py`` shares one such launch between
    test modules.)"""
    launch = _check_launch(world, programs, in_float64, cwd, timeout)
    if launch.returncode != 0:
        launch = _relaunch_unreported(world, programs, in_float64, cwd, timeout, launch)
    assert launch.returncode == 0, f"dist_check_many.py failed at world size {world}:\n{launch.describe()}"
    return launch


def _check_launch(world: int, programs: list[Path], in_float64: list[Path], cwd: Path, timeout: float) -> Launch:
    float64 = [argument for folder in in_float64 for argument in ("--fp64", str(folder))]
    return run_ranks(world, DIST_CHECK_MANY, [*map(str, programs), *float64], cwd, timeout)


def _relaunch_unreported(world: int, programs: list[Path], in_float64: list[Path], cwd: Path, timeout: float,
                         crashed: Launch) -> Launch:
    """After a launch that died part-way (a rank crashed: once in CI, gloo aborted while
    making a later program's process group, after 17 programs had printed ``ok``), check every
    program that did not print ``ok`` again in ONE fresh launch, and return a launch whose
    stdout holds one RESULT line per program: the first launch's ``ok`` lines and the fresh
    launch's. A crash's ``FAILED`` lines are not kept (a rank whose peer died reports the lost
    connection as its program's error). The crash is not hidden: it is raised as a warning,
    with the lines naming its cause, that pytest prints in its summary. A program that fails
    (or crashes its launch) every time fails the fresh launch the same way, which then carries
    both outputs."""
    passed = [line for line in crashed.stdout.splitlines() if line.startswith("RESULT ") and " ok " in line]

    def not_passed(folders: list[Path]) -> list[Path]:
        return [folder for folder in folders if not any(line.startswith(f"RESULT {folder} ok ") for line in passed)]

    left, left_float64 = not_passed(list(programs)), not_passed(list(in_float64))
    warnings.warn(
        f"dist_check_many.py crashed at world size {world} (exit status {crashed.returncode}) with "
        f"{len(left) + len(left_float64)} of {len(programs) + len(in_float64)} programs not passed; "
        f"they are checked again in a fresh launch. Why it crashed: {' | '.join(crash_causes(crashed.stderr, 8))}",
        stacklevel=2,
    )
    again = _check_launch(world, left, left_float64, cwd, timeout)
    stderr = f"{crashed.stderr}\n--- the fresh launch of the programs not passed ---\n{again.stderr}"
    return Launch(again.command, again.returncode, "".join(f"{line}\n" for line in passed) + again.stdout, stderr)


def run_ranks(world: int, script: Path, arguments: list[str], cwd: Path, timeout: float,
              environment: dict[str, str] | None = None) -> Launch:
    """A test harness ``script`` (not launch.py, which tests run as a user does, under
    torchrun) on ``world`` ranks started as torchrun's workers, without its agent
    (``tests/rank_processes.py``); fails the test on timeout."""
    status, stdout, stderr = launch_ranks(world, script, list(arguments), cwd, timeout, environment)
    launch = Launch([f"<{world} ranks>", sys.executable, str(script), *arguments], status, stdout, stderr)
    if status is None:
        pytest.fail(f"timed out after {timeout} s:\n{launch.describe()}")
    return launch


def result_of(launch: Launch, folder: Path) -> str:
    """The RESULT line of ``folder`` in ``launch`` without its prefix: ``ok ...`` or ``FAILED ...``."""
    prefix = f"RESULT {folder} "
    lines = [line[len(prefix) :] for line in launch.stdout.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"expected one RESULT line for {folder}, got {len(lines)}:\n{launch.describe()}"
    return lines[0]


def _torchrun(nproc: int) -> list[str]:
    """``torchrun --nproc_per_node N``: the console script next to this Python if installed."""
    script = Path(sys.executable).with_name("torchrun")
    launcher = [str(script)] if script.is_file() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--nproc_per_node", str(nproc)]


def _compile(source: str, overrides: dict, world: int, flavour: str, folder: Path) -> Path:
    spec = ModelSpec(source if source.startswith("hf:") else str(REPO / source), overrides)
    base, _, variant = flavour.partition("+")
    plan = planner.plan(spec, f"cpu:1x{world}", dp_flavour=base, precision="bf16" if variant == "bf16" else "fp32")
    if variant == "recompute":
        plan = dataclasses.replace(plan, recompute="full")
    planner.compile(plan, folder)
    return folder


def _remove_update_gather(folder: Path) -> Path:
    source = folder / "model_spmd.py"
    text = source.read_text()
    assert "ShardedStatesOptimizer(" in text and "def make_optimizer(" in text, f"{source} is not a ZeRO-1 program:\n{text}"
    source.write_text(text + WITHOUT_GATHER)
    return folder


def _remove_gradient_averaging(folder: Path) -> Path:
    source = folder / "model_spmd.py"
    text = source.read_text()
    assert "DistributedDataParallel(" in text, f"{source} is not a DDP program:\n{text}"
    source.write_text(text + WITHOUT_DDP)
    return folder


# ------------------------------------------------------- every model x flavour x world size


@dataclass(frozen=True)
class WorldRun:
    """One torchrun launch of dist_check_many.py over every program of one world size."""

    world: int
    folders: dict[tuple[str, str], Path]  # (model, flavour) -> compiled program
    broken: Path  # the negative control: DDP without gradient averaging
    ungathered: Path  # the negative control: ZeRO-1 without the all-gather of updated slices
    launch: Launch

    def result(self, folder: Path) -> str:
        """The RESULT line of ``folder`` without its prefix: ``ok ...`` or ``FAILED ...``."""
        return result_of(self.launch, folder)


def _world_programs(root: Path, world: int) -> tuple:
    folders = {
        (model, flavour): _compile(*MODELS[model], world, flavour, root / f"{model}_{flavour}")
        for model, flavour in CASES
    }
    broken = _remove_gradient_averaging(_compile(*MODELS["mlp"], world, "ddp", root / "mlp_ddp_unaveraged"))
    ungathered = _remove_update_gather(_compile(*MODELS["mlp"], world, "zero1", root / "mlp_zero1_ungathered"))
    return (folders, broken, ungathered), [*folders.values(), broken, ungathered]


# Checked in the session's launch of each world size, with other modules' programs
# (tests/launch_groups.py).
WORLD_GROUPS = {world: register_group(world, _world_programs) for world in WORLD_SIZES}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda world: f"world{world}")
def world_run(request, parity_launches) -> WorldRun:
    world = request.param
    (folders, broken, ungathered), launch = parity_launches.result(WORLD_GROUPS[world])
    return WorldRun(world, folders, broken, ungathered, launch)


@pytest.mark.parametrize(("model", "flavour"), CASES, ids=[f"{model}-{flavour}" for model, flavour in CASES])
def test_sharded_step_equals_single_device(world_run: WorldRun, model: str, flavour: str) -> None:
    result = world_run.result(world_run.folders[model, flavour])
    assert result.startswith("ok parity ok: "), f"{model} {flavour} at world size {world_run.world}: {result}"


def test_every_program_reports_a_result(world_run: WorldRun) -> None:
    # The launch is shared with other modules' programs: each of ours has exactly one line.
    for folder in [*world_run.folders.values(), world_run.broken, world_run.ungathered]:
        assert world_run.result(folder).startswith(("ok ", "FAILED ")), world_run.result(folder)


def test_unaveraged_gradients_are_reported(world_run: WorldRun) -> None:
    result = world_run.result(world_run.broken)
    assert result.startswith("FAILED ") and FAILED_ON_A_TENSOR.search(result), result


def test_zero1_step_goes_through_the_program_optimizer(world_run: WorldRun) -> None:
    # Gradients are right (DDP averages them); only the slices of the updated parameters a
    # rank does not step are stale, and only the program's own make_optimizer could have
    # made them so.
    result = world_run.result(world_run.ungathered)
    assert result.startswith("FAILED ") and re.search(r"worst tensor updated net\.\d+\.(weight|bias)", result), result


def test_compiled_data_parallel_flavours(world_run: WorldRun) -> None:
    """What each flavour compiles to: ZeRO-1 is DDP plus a ShardedStatesOptimizer over "dp";
    ZeRO-2 is FSDP2 units that keep their gathered weights from forward to backward."""
    source = {flavour: (world_run.folders["gpt", flavour] / "model_spmd.py").read_text() for flavour in FLAVOURS}
    assert "DistributedDataParallel(" in source["zero1"] and "def make_optimizer(" in source["zero1"]
    assert 'ShardedStatesOptimizer(module.parameters(), mesh, "dp", optimizer_class, **kwargs)' in source["zero1"]
    assert "def make_optimizer(" not in source["ddp"] + source["zero2"] + source["fsdp"]
    units = ("fully_shard(model.get_submodule('blocks.0'), mesh=dp_mesh, reshard_after_forward=False)",  # repr()'d paths
             "fully_shard(model.get_submodule('blocks.1'), mesh=dp_mesh, reshard_after_forward=False)",
             "fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)")
    assert all(line in source["zero2"] for line in units), source["zero2"]
    assert "reshard_after_forward" not in source["fsdp"]
    bf16 = (world_run.folders["gpt2", "zero2+bf16"] / "model_spmd.py").read_text()
    assert "run_in_autocast(model, dp_mesh.device_type, torch.bfloat16)" in bf16
    assert "run_in_autocast" not in source["zero2"]


# ------------------------------------------------------------------ launch.py, as a user runs it


def test_check_fails_when_gradients_are_not_averaged(tmp_path: Path) -> None:
    _remove_gradient_averaging(_compile(*MODELS["mlp"], 2, "ddp", tmp_path / "out"))
    launch = _run([*_torchrun(2), "out/launch.py", "--check"], cwd=tmp_path, timeout=CLI_TIMEOUT)
    assert launch.returncode == 1, launch.describe()
    assert FAILED_ON_A_TENSOR.search(launch.stdout), launch.describe()


@pytest.fixture(scope="module")
def gpt_cli_program(tmp_path_factory) -> Path:
    """``planner plan examples/gpt.py --cluster cpu:1x2 -o p.json`` then ``planner compile p.json -o out``,
    typed in the repository (plan) and in a fresh folder (compile); returns that folder."""
    work = tmp_path_factory.mktemp("cli_gpt")
    plan = _run(
        [sys.executable, "-m", "planner", "plan", "examples/gpt.py", "--cluster", "cpu:1x2", "-o", str(work / "p.json")],
        cwd=REPO,
        timeout=CLI_TIMEOUT,
    )
    assert plan.returncode == 0 and re.search(r"mesh +dp=2 ", plan.stdout), plan.describe()
    compiled = _run([sys.executable, "-m", "planner", "compile", "p.json", "-o", "out"], cwd=work, timeout=CLI_TIMEOUT)
    assert compiled.returncode == 0, compiled.describe()
    assert {"launch.py", "model_spmd.py", "plan.json"} <= {path.name for path in (work / "out").iterdir()}
    return work


def test_cli_check_and_steps(gpt_cli_program: Path) -> None:
    launch = _run([*_torchrun(2), "out/launch.py", "--check", "--steps", "2"], cwd=gpt_cli_program, timeout=CLI_TIMEOUT)
    assert launch.returncode == 0, launch.describe()
    assert "parity ok: max_abs_err=" in launch.stdout, launch.describe()
    for step in (1, 2):
        assert re.search(rf"^step {step}/2: \d+\.\d+ ms  loss \d", launch.stdout, re.MULTILINE), launch.describe()
    assert "mean step time: " in launch.stdout, launch.describe()


def test_cli_wrong_world_size_is_one_line_error(gpt_cli_program: Path) -> None:
    launch = _run([*_torchrun(4), "out/launch.py", "--check"], cwd=gpt_cli_program, timeout=CLI_TIMEOUT)
    assert launch.returncode != 0, launch.describe()
    errors = [line for line in launch.stderr.splitlines() if line.startswith("error: ")]
    assert errors, launch.describe()
    assert all("compiled for 2 ranks" in line and "--nproc_per_node 2" in line for line in errors), launch.describe()
    assert "raise LaunchError" not in launch.stderr, launch.describe()  # no traceback of ours


def test_cli_hf_gpt2_check(tmp_path: Path) -> None:
    settings = [argument for key, value in HF_GPT2_TINY.items() for argument in ("--set", f"{key}={value}")]
    plan = _run(
        [sys.executable, "-m", "planner", "plan", "hf:gpt2", "--cluster", "cpu:1x2", *settings, "-o", "p.json"],
        cwd=tmp_path,
        timeout=CLI_TIMEOUT,
    )
    assert plan.returncode == 0, plan.describe()
    compiled = _run([sys.executable, "-m", "planner", "compile", "p.json", "-o", "out"], cwd=tmp_path, timeout=CLI_TIMEOUT)
    assert compiled.returncode == 0, compiled.describe()
    launch = _run([*_torchrun(2), "out/launch.py", "--check"], cwd=tmp_path, timeout=CLI_TIMEOUT)
    assert launch.returncode == 0 and "parity ok: max_abs_err=" in launch.stdout, launch.describe()
    # GPT-2's dropout modules, switched off for the check, and said so before the verdict.
    assert re.search(r"^--check: switched off randomness: \d+ nn\.Dropout modules$", launch.stdout, re.MULTILINE), launch.describe()
