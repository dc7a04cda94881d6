"""``planner compile --colocate A.json B.json`` (codegen/colocate.py, codegen/runtime/colocate*.py):
two data-parallel jobs trained in one program, one job's gradient all-reduces in flight while
the other computes.

- The folder: each job's own program (exactly what compiling it alone writes) and a
  launch.py that imports the co-located runtime; plans that cannot share a program are
  refused with one line naming the job and the fix.
- In real gloo processes (examples/gpt.py with dropout under DDP as job A, examples/cnn.py
  under ZeRO-1 as job B), one torchrun launch each at world 2 and 4: ``--check`` trains both co-located,
  then each alone with the single-job loop from the same seeds, and every updated parameter
  is equal; at world 2 each job also checkpoints into its own folder.
- As the one rank of a world-1 group in the test process (no launch): a run one after the
  other passes ``--check``; both jobs resume from its step-2 checkpoints in crossover order
  (step 3's losses as in the first run) with job B's learning rate raised until its loss is
  not finite, and that one failure stops both jobs with one line naming job B.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

import planner
from planner.errors import PlanningError
from planner.model_spec import ModelSpec
from tests.torchrun_run import torchrun
from user_errors import assert_api_error, assert_user_error

REPO = Path(__file__).resolve().parents[1]
# With dropout: each job's random draws must be its own, whatever the other job does between them.
GPT = ModelSpec(str(REPO / "examples" / "gpt.py"), {"batch_size": 8, "dropout": 0.1})
CNN = str(REPO / "examples" / "cnn.py")
# The in-process run's jobs: the same models, smaller (each step of the one rank costs little).
SMALL_GPT = ModelSpec(str(REPO / "examples" / "gpt.py"),
                      {"n_layer": 1, "n_embd": 32, "n_head": 4, "vocab_size": 64, "seq_len": 16, "batch_size": 4})
SMALL_CNN = ModelSpec(CNN, {"batch_size": 4, "width": 8})
# A round line's finished steps: "A step 3 loss 5.750250".
STEP_LOSS = re.compile(r"\b([AB]) step (\d+) loss ([-\d.naif]+)")


def jobs(world: int) -> tuple[planner.Plan, planner.Plan]:
    """Job A (GPT, DDP) and job B (CNN, ZeRO-1) planned for ``world`` CPU devices."""
    cluster = f"cpu:1x{world}"
    return (planner.plan(GPT, cluster, dp_flavour="ddp", precision="fp32"),
            planner.plan(CNN, cluster, dp_flavour="zero1", precision="fp32"))


@pytest.fixture(scope="module")
def world_two() -> tuple[planner.Plan, planner.Plan]:
    return jobs(2)


def parameter_count(spec: ModelSpec | str) -> int:
    """How many parameters the model has (what --check compares)."""
    spec = spec if isinstance(spec, ModelSpec) else ModelSpec(spec)
    return len(list(spec.build(torch.device("meta"))[0].parameters()))


def equal_lines(steps: int, specs=(GPT, CNN)) -> list[str]:
    """--check's verdict for both jobs (of ``specs``), every parameter equal."""
    return [f"job {label}: all {parameter_count(spec)} parameters equal after {steps} steps, co-located and alone"
            for label, spec in zip("AB", specs)]


def losses(output: str) -> dict[tuple[str, int], str]:
    """(job, step) -> the printed loss, from a co-located run's round lines."""
    return {(job, int(step)): loss for job, step, loss in STEP_LOSS.findall(output)}


def test_each_job_folder_is_the_jobs_own_program(world_two, tmp_path):
    out = planner.compile_colocated(world_two, tmp_path / "out")
    for name, plan in zip(("job_a", "job_b"), world_two):
        alone = planner.compile(plan, tmp_path / f"{name}_alone")
        for file in ("model_spmd.py", "plan.json", "launch.py"):
            assert (out / name / file).read_text() == (alone / file).read_text(), (name, file)
    launch = (out / "launch.py").read_text()
    assert "from codegen.runtime.colocate import main" in launch
    assert "torchrun --nproc_per_node 2 launch.py --steps 5 --check" in launch


def test_plans_that_cannot_share_a_program_are_refused(world_two, tmp_path, capsys):
    gpt, cnn = world_two
    fsdp = planner.plan(CNN, "cpu:1x2", dp_flavour="fsdp", precision="fp32")
    assert_api_error(lambda: planner.compile_colocated([gpt, fsdp], tmp_path / "a"), PlanningError,
                     "job B", "shards its weights with fsdp", "--dp ddp")
    four = planner.plan(CNN, "cpu:1x4", dp_flavour="ddp", precision="fp32")
    assert_api_error(lambda: planner.compile_colocated([gpt, four], tmp_path / "b"), PlanningError,
                     "job A is planned for 2 devices and job B for 4")
    assert_api_error(lambda: planner.compile_colocated([gpt], tmp_path / "c"), PlanningError, "got 1 plans")
    assert not any((tmp_path / name).exists() for name in "abc")
    gpt.save(tmp_path / "gpt.json")
    cnn.save(tmp_path / "cnn.json")
    assert_user_error(capsys, ["compile", str(tmp_path / "gpt.json"), "--colocate", str(tmp_path / "gpt.json"),
                               str(tmp_path / "cnn.json"), "-o", str(tmp_path / "d")], "or two with --colocate", "got both")


@pytest.mark.distributed
def test_co_located_jobs_train_as_alone_and_checkpoint_each_job_world_two(world_two, tmp_path):
    out = planner.compile_colocated(world_two, tmp_path / "out")
    checkpoints = tmp_path / "ck"
    run = torchrun(2, str(out / "launch.py"), "--steps", "3", "--check", "--checkpoint-dir", str(checkpoints),
                   "--save-every", "2")
    assert all(line in run for line in equal_lines(3)), run
    assert set(losses(run)) == {(job, step) for job in "AB" for step in range(1, 4)}
    for job in ("job_a", "job_b"):
        assert sorted(path.name for path in (checkpoints / job).glob("step-*")) == ["step-00000002", "step-00000003"]


def run_in_process(folder: Path, argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """The co-located launch.py of ``folder`` as the only rank of a gloo group in this
    process (no torchrun: a world-1 program); its exit status and what it printed."""
    import torch.distributed as dist

    from codegen.runtime.colocate import main

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    assert not dist.is_initialized(), "a process group is already up in this test process"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    capsys.readouterr()
    try:
        status = main(folder, argv)  # destroys the group when it ends
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out, err = capsys.readouterr()
    return status, out + err


def test_resumed_jobs_continue_and_one_failing_job_stops_both(tmp_path, monkeypatch, capsys):
    one_device = [planner.plan(spec, "cpu:1x1", dp_flavour="ddp", precision="fp32") for spec in (SMALL_GPT, SMALL_CNN)]
    out = planner.compile_colocated(one_device, tmp_path / "out")
    checkpoints = tmp_path / "ck"
    # The first run takes each job's step whole (the benchmark's baseline), and its --check
    # compares both jobs with themselves alone.
    status, first = run_in_process(out, ["--steps", "3", "--one-after-the-other", "--check", "--checkpoint-dir",
                                         str(checkpoints), "--save-every", "2"], monkeypatch, capsys)
    assert status == 0, first
    assert all(line in first for line in equal_lines(3, (SMALL_GPT, SMALL_CNN))), first
    trained = losses(first)
    for job in ("job_a", "job_b"):
        shutil.rmtree(checkpoints / job / "step-00000003")  # resume from step 2
    # Job B's learning rate is raised so that its weights blow up in step 3's update: its
    # step-4 loss is not finite, and that stops both jobs.
    status, second = run_in_process(out, ["--steps", "5", "--checkpoint-dir", str(checkpoints), "--resume",
                                          "--lr-b", "1e30"], monkeypatch, capsys)
    assert status == 2, second
    for job in ("job_a", "job_b"):
        assert f"resumed from {checkpoints / job / 'step-00000002'} at step 2" in second
    resumed = losses(second)
    # Both jobs continue where the checkpoint left them: step 3 as in the first run (the
    # crossover order changes nothing in either job's arithmetic).
    assert (resumed[("A", 3)], resumed[("B", 3)]) == (trained[("A", 3)], trained[("B", 3)])
    failure = [line for line in second.splitlines() if "stops both jobs" in line]
    assert len(failure) == 1 and failure[0].startswith("error: job B (ddp (dp=1) of cnn.py) failed at step 4"), second
    assert re.search(r"the loss is (nan|inf) at step 4", failure[0])
    assert ("A", 5) not in resumed  # job A stopped with it


@pytest.mark.distributed
def test_co_located_jobs_train_as_alone_world_four(tmp_path):
    out = planner.compile_colocated(jobs(4), tmp_path / "out")
    run = torchrun(4, str(out / "launch.py"), "--steps", "3", "--check")
    assert all(line in run for line in equal_lines(3)), run
    assert "crossover: mean round" in run
