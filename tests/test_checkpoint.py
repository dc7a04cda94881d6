"""Per-shard initialisation and checkpoints of compiled programs, in real gloo processes.

- Every rank holds only its shards, with the values the whole model built on one device has
  (``torch.equal``): FSDP, tensor-parallel and pipeline programs on 2 ranks, dp x tp and a
  2-D SUMMA program (every linear's weight in 2 x 2 blocks) on 4, and MoE programs under FSDP2
  on 2 (experts placed with a copied expert, experts sliced, tiny HF Mixtral's experts placed):
  each rank materialises only its experts or slices.
- A wide MLP whose fp32 weights are about 3x a per-rank cap builds under the cap on each of
  4 FSDP ranks, and trains with the losses of one device. A deeper MLP, 1.25x a cap, builds
  AND trains with AdamW under the cap on each of 8 FSDP ranks (each layer its own FSDP unit,
  so a rank gathers two layers at a time, never the model), with the losses of one device.
- Train 4 steps on FSDP (world 2), save; resume on a pipeline plan (world 2) and on one
  device (world 1) for 4 more: the losses equal an uninterrupted single-device run of 8.
- ``planner export-checkpoint`` writes a state_dict that loads (``weights_only=True``, strict)
  into the model built from the spec; ``launch.py --init-from`` starts a tensor-parallel
  program from it with the loss the single device computes from those weights.
- A tensor-parallel run loses a rank to SIGKILL mid-run; restarted with ``--resume``, its
  losses continue those of an uninterrupted run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_parity import REPO, Launch, _free_port, run_ranks

import planner
from codegen.runtime.checkpoint import export_checkpoint
from codegen.runtime.launcher import random_like
from codegen.runtime.program import load_program
from planner.api import prepare_model
from planner.model_loss import extract_loss
from planner.model_spec import ModelSpec
from search.megatron import megatron_plan
from moe_plans import hf_moe_plan, moe_plan
from summa_plans import summa_plan

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).resolve().with_name("init_ckpt_worker.py")
GPT = ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8})
# About 201 MB of fp32 weights (three 4096 x 4096 layers): ~50 MB per rank on 4 FSDP ranks.
WIDE_MLP = ModelSpec(str(REPO / "examples/mlp.py"), {"batch_size": 8, "hidden": 4096, "layers": 5})
WIDE_MLP_BYTES = 4 * (32 * 4096 + 4096 + 3 * (4096 * 4096 + 4096) + 4096 * 8 + 8)
MEMORY_CAP = int(0.35 * WIDE_MLP_BYTES)  # per rank: the whole model is ~2.9x this
# About 420 MB of fp32 weights in 25 layers of 2048 x 2048. On 8 FSDP ranks with AdamW a rank
# holds 4/8 of the model (weights, gradients, two moments) plus two gathered layers (~8% of
# it): training needs about 0.6x the model, under a cap the whole model exceeds by 1.25x.
DEEP_MLP = ModelSpec(str(REPO / "examples/mlp.py"), {"batch_size": 8, "hidden": 2048, "layers": 25})
DEEP_MLP_BYTES = 4 * (32 * 2048 + 2048 + 23 * (2048 * 2048 + 2048) + 2048 * 8 + 8)
TRAIN_CAP = int(0.8 * DEEP_MLP_BYTES)
KILL_STEPS = 40  # long enough that the kill lands mid-run (it comes at about step 6)
STEP_LINE = re.compile(r"^step (\d+)/\d+: [\d.]+ ms  loss ([-\d.]+) ", re.M)
TIMEOUT = 300


def _torchrun(world: int, *arguments: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
               "--master_port", str(_free_port()), *arguments]
    # A fixed mmap threshold: glibc then returns every freed large block at once, so a
    # rank's peak resident memory measures what the build holds (not reused freed heap).
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False)


def _worker(world: int, *arguments: str, cwd: Path) -> Launch:
    """``init_ckpt_worker.py`` on ``world`` ranks, a test harness, started without torchrun's
    agent (``test_parity.run_ranks``), in ``_torchrun``'s environment."""
    environment = {"PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "131072"}
    return run_ranks(world, WORKER, list(arguments), cwd, TIMEOUT, environment)


def _losses(text: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(text)}


def _ok(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("programs")
    folders = {}

    def write(name: str, plan: planner.Plan) -> None:
        folders[name] = planner.compile(plan, root / name)

    write("one", planner.plan(GPT, "cpu:1x1", dp_flavour="ddp", precision="fp32"))
    write("fsdp", planner.plan(GPT, "cpu:1x2", dp_flavour="fsdp", precision="fp32"))
    write("zero1", planner.plan(GPT, "cpu:1x2", dp_flavour="zero1", precision="fp32"))
    graph, spec, name, cluster = prepare_model(GPT, "cpu:1x2")
    write("tp", megatron_plan(graph, cluster, spec, name, tp=2, precision="fp32"))
    write("pp", megatron_plan(graph, cluster, spec, name, pp=2, schedule="1f1b", micro_batch=2, precision="fp32"))
    graph, spec, name, cluster = prepare_model(GPT, "cpu:1x4")
    write("dp_tp", megatron_plan(graph, cluster, spec, name, tp=2, sequence_parallel=True, precision="fp32"))
    write("dp_tp_zero1", megatron_plan(graph, cluster, spec, name, tp=2, dp_flavour="zero1", precision="fp32"))
    write("wide_fsdp", planner.plan(WIDE_MLP, "cpu:1x4", dp_flavour="fsdp", precision="fp32"))
    write("summa_2d", summa_plan(GPT, "2d"))
    write("moe_ep_fsdp", moe_plan(2, "expert_parallel", "skewed", flavour="fsdp"))
    write("moe_sliced_fsdp", moe_plan(2, "expert_sliced", flavour="fsdp"))
    write("mixtral_ep_fsdp", hf_moe_plan(2, "mixtral", "expert_parallel", "round-robin", flavour="fsdp"))
    write("deep_fsdp8", planner.plan(DEEP_MLP, "cpu:1x8", dp_flavour="fsdp", precision="fp32"))
    return folders


@pytest.fixture(scope="module")
def reference_losses(programs, tmp_path_factory) -> dict[int, float]:
    """One device, uninterrupted, through the same launch.py loop."""
    run = _torchrun(1, str(programs["one"] / "launch.py"), "--steps", str(KILL_STEPS), cwd=tmp_path_factory.mktemp("one"))
    losses = _losses(_ok(run))
    assert sorted(losses) == list(range(1, KILL_STEPS + 1))
    return losses


@pytest.fixture(scope="module")
def one_device_at_step_2(programs, tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """One device's first 2 steps, checkpointed at step 2 (the start of both ZeRO-1 resume
    tests, launched once), and their losses. A test resumes from a copy (``_copy_of``)."""
    saved = tmp_path_factory.mktemp("one_step2") / "ckpt"
    run = _torchrun(1, str(programs["one"] / "launch.py"), "--steps", "2", "--checkpoint-dir", str(saved),
                    "--save-every", "2", cwd=saved.parent)
    losses = _losses(_ok(run))
    assert sorted(losses) == [1, 2] and sorted(p.name for p in saved.iterdir()) == ["step-00000002"]
    return saved, losses


def _copy_of(checkpoints: Path, into: Path) -> Path:
    shutil.copytree(checkpoints, into)
    return into


def _results(text: str) -> dict[tuple[str, int], dict[str, int]]:
    found = {}
    for folder, rank, fields in re.findall(r"^RESULT (\S+) rank=(\d+) (.*)$", text, re.MULTILINE):
        found[(Path(folder).name, int(rank))] = {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", fields)}
    return found


def test_each_rank_builds_only_its_shards_with_the_single_device_values(programs, tmp_path) -> None:
    exact_at_two = ("fsdp", "tp", "pp", "moe_ep_fsdp", "moe_sliced_fsdp", "mixtral_ep_fsdp")
    two = _results(_ok(_worker(2, *(f"exact:{programs[n]}" for n in exact_at_two), cwd=tmp_path)))
    four = _worker(4, f"exact:{programs['dp_tp']}", f"exact:{programs['summa_2d']}",
                     f"steps=3:{programs['wide_fsdp']}", cwd=tmp_path)
    four_results = _results(_ok(four))
    whole = sum(p.numel() * 4 for p in load_program(programs["one"]).build_model()[0].parameters())
    for (name, rank), result in {**two, **four_results}.items():
        if name == "wide_fsdp":
            continue
        assert result["compared"] > 0 and result["mismatched"] == 0, (name, rank, result)
        if name in ("fsdp", "pp"):  # FSDP keeps 1/2 of every weight; a pipeline stage its own layers
            assert result["held_bytes"] < 0.75 * whole, (name, rank, result)
        if name == "summa_2d":  # a quarter of each linear's weight, half of the embeddings and norms
            assert result["held_bytes"] < 0.5 * whole, (name, rank, result)
    assert sum(two[("fsdp", rank)]["held_bytes"] for rank in (0, 1)) == whole
    assert {name for name, _ in two} >= set(exact_at_two)

    # The wide MLP: each rank's build stays under the cap, a third of the whole model.
    for rank in range(4):
        result = four_results[("wide_fsdp", rank)]
        assert result["held_bytes"] == pytest.approx(WIDE_MLP_BYTES / 4, rel=0.01)
        assert 0.9 * result["held_bytes"] < result["peak_build_bytes"] < MEMORY_CAP, (rank, result, MEMORY_CAP)
    # ... and trains as one device does (same init, same batches, AdamW at launch.py's lr).
    program = load_program(programs["wide_fsdp"])
    model, args, kwargs = program.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = _losses(four.stdout)
    assert sorted(losses) == [1, 2, 3]
    for step in range(3):
        torch.manual_seed(1000 + step)
        loss = extract_loss(model(*random_like(args), **random_like(kwargs)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert losses[step + 1] == pytest.approx(loss.item(), abs=2e-5)


def _single_device_losses(folder: Path, steps: int) -> list[float]:
    """The losses launch.py's loop gives on one device: same init, batches, AdamW and lr."""
    program = load_program(folder)
    model, args, kwargs = program.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        torch.manual_seed(1000 + step)
        loss = extract_loss(model(*random_like(args), **random_like(kwargs)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_model_over_the_cap_trains_under_it_on_8_fsdp_ranks(programs, tmp_path) -> None:
    plan = load_program(programs["deep_fsdp8"]).plan
    assert len(plan.fsdp_units) == 25  # a model without repeated blocks: one unit per layer
    run = _worker(8, f"steps=2:{programs['deep_fsdp8']}", cwd=tmp_path)
    text = _ok(run)
    # The marker is found anywhere, not only at a line's start: a line of another rank's
    # output may run into it without a line break.
    trained = {int(rank): int(peak) for rank, peak in re.findall(r"TRAINED \S+ rank=(\d+) peak_train_bytes=(\d+)", text)}
    built = _results(text)
    assert sorted(trained) == list(range(8)), text[-2000:]
    for rank in range(8):
        assert built[("deep_fsdp8", rank)]["peak_build_bytes"] < TRAIN_CAP < DEEP_MLP_BYTES
        # Build and two AdamW steps (gathers, gradients, moments) all stay under the cap.
        assert trained[rank] < TRAIN_CAP, (rank, trained[rank], TRAIN_CAP)
    losses = _losses(text)
    assert sorted(losses) == [1, 2]
    for step, expected in enumerate(_single_device_losses(programs["deep_fsdp8"], 2), start=1):
        assert losses[step] == pytest.approx(expected, abs=2e-5)


def test_resume_on_other_plans_export_and_init_from(programs, reference_losses, tmp_path) -> None:
    saved = tmp_path / "fsdp_ckpt"
    first = _losses(_ok(_torchrun(
        2, str(programs["fsdp"] / "launch.py"), "--steps", "4", "--checkpoint-dir", str(saved), "--save-every", "2",
        cwd=tmp_path,
    )))
    assert sorted(first) == [1, 2, 3, 4]
    assert sorted(p.name for p in saved.iterdir()) == ["step-00000002", "step-00000004"]
    one_device = tmp_path / "one_ckpt"
    shutil.copytree(saved, one_device)

    # Onto a pipeline (another flavour, a pipeline split) and onto one device (another world size).
    pipeline = _ok(_torchrun(
        2, str(programs["pp"] / "launch.py"), "--steps", "8", "--checkpoint-dir", str(saved), "--resume", cwd=tmp_path,
    ))
    single = _ok(_torchrun(
        1, str(programs["one"] / "launch.py"), "--steps", "8", "--checkpoint-dir", str(one_device), "--resume",
        cwd=tmp_path,
    ))
    assert "resumed from" in pipeline and "at step 4" in pipeline
    for resumed in (_losses(pipeline), _losses(single)):
        assert sorted(resumed) == [5, 6, 7, 8]
        for step, loss in {**first, **resumed}.items():
            assert loss == pytest.approx(reference_losses[step], abs=1e-5), step

    # One plain state_dict of the weights after step 8, from the pipeline's checkpoint.
    exported = tmp_path / "model.pt"
    cli = subprocess.run(
        [sys.executable, "-m", "planner", "export-checkpoint", str(saved), "-o", str(exported)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=TIMEOUT, check=False,
    )
    assert cli.returncode == 0 and "after step 8" in cli.stdout, cli.stdout + cli.stderr
    model, args, kwargs = load_program(programs["tp"]).build_model()  # the example batch launch.py draws from
    model.load_state_dict(torch.load(exported, weights_only=True))  # strict: every name, tied ones too
    from_single = tmp_path / "single.pt"
    assert export_checkpoint(one_device / "step-00000008", from_single)[0] == 8
    other = torch.load(from_single, weights_only=True)
    # AdamW moves a weight whose gradient is near eps by ~lr whatever the gradient's last
    # bits (see codegen/runtime/parity.py), so the weights agree to lr / 10, not to 1e-5.
    for name, value in torch.load(exported, weights_only=True).items():
        torch.testing.assert_close(value, other[name], atol=1e-4, rtol=0)

    # A new tensor-parallel run from those weights: its first loss is the single device's.
    started = _losses(_ok(_torchrun(
        2, str(programs["tp"] / "launch.py"), "--steps", "1", "--init-from", str(exported), cwd=tmp_path,
    )))
    torch.manual_seed(1000)
    with torch.no_grad():
        expected = extract_loss(model(*random_like(args), **random_like(kwargs))).item()
    assert started[1] == pytest.approx(expected, abs=1e-5)


def test_zero1_of_a_graph_program_trains_and_checkpoints_its_pieces(programs, reference_losses, one_device_at_step_2,
                                                                      tmp_path) -> None:
    """ZeRO-1 beside tensor parallelism (dp 2 x tp 2) keeps each rank's piece of every
    weight's AdamW states. One device trains 2 steps and saves; the dp x tp program resumes
    from it (the states loaded into each rank's pieces), trains steps 3-4 and saves (each
    piece written as its box of the whole weight); one device resumes for 5-8. Every loss
    is the uninterrupted single device's: states lost or misplaced would change them."""
    saved = _copy_of(one_device_at_step_2[0], tmp_path / "ckpt")
    common = ["--checkpoint-dir", str(saved), "--save-every", "2"]
    first = one_device_at_step_2[1]
    middle = _ok(_torchrun(4, str(programs["dp_tp_zero1"] / "launch.py"), "--steps", "4", *common, "--resume", cwd=tmp_path))
    last = _losses(_ok(_torchrun(1, str(programs["one"] / "launch.py"), "--steps", "8", *common, "--resume", cwd=tmp_path)))
    assert "at step 2" in middle and sorted(_losses(middle)) == [3, 4] and sorted(last) == [5, 6, 7, 8]
    for step, loss in {**first, **_losses(middle), **last}.items():
        assert loss == pytest.approx(reference_losses[step], abs=1e-5), step


def test_zero1_of_the_data_parallel_program_resumes_onto_another_plan(programs, reference_losses, one_device_at_step_2,
                                                                       tmp_path) -> None:
    """The data-parallel ZeRO-1 program (DDP and ShardedStatesOptimizer on dp=2) resumes one
    device's checkpoint of step 2 into each rank's pieces, trains steps 3-4 and saves (each
    piece's states as its box of the whole weight); the FSDP program resumes from that for
    steps 5-8. Every loss is the uninterrupted single device's."""
    saved = _copy_of(one_device_at_step_2[0], tmp_path / "ckpt")
    common = ["--checkpoint-dir", str(saved), "--save-every", "2"]
    first = one_device_at_step_2[1]
    middle = _ok(_torchrun(2, str(programs["zero1"] / "launch.py"), "--steps", "4", *common, "--resume", cwd=tmp_path))
    last = _ok(_torchrun(2, str(programs["fsdp"] / "launch.py"), "--steps", "8", *common, "--resume", cwd=tmp_path))
    assert "at step 2" in middle and "at step 4" in last
    assert sorted(_losses(middle)) == [3, 4] and sorted(_losses(last)) == [5, 6, 7, 8]
    for step, loss in {**first, **_losses(middle), **_losses(last)}.items():
        assert loss == pytest.approx(reference_losses[step], abs=1e-5), step


def test_a_non_finite_loss_stops_the_run_before_it_is_checkpointed(programs, tmp_path) -> None:
    """A learning rate of 1e30 makes step 2's loss NaN: the run stops there with one line
    naming the step and the checkpoint to resume from (step 1's), and writes no checkpoint
    of the NaN weights."""
    saved = tmp_path / "ckpt"
    run = _torchrun(1, str(programs["one"] / "launch.py"), "--steps", "6", "--lr", "1e30", "--checkpoint-dir", str(saved),
                    "--save-every", "1", cwd=tmp_path)
    assert run.returncode != 0
    assert sorted(_losses(run.stdout)) == [1]
    assert re.search(r"^error: the loss is nan at step 2: stopped before saving it; resume from \S*step-00000001 ",
                     run.stderr, re.MULTILINE), run.stderr[-2000:]
    assert sorted(p.name for p in saved.iterdir()) == ["step-00000001"]


def _rank_process(parent: int, rank: int) -> int | None:
    """The pid of the torchrun worker of ``rank`` under launcher process ``parent``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        parent_pid = int(stat.rsplit(")", 1)[1].split()[1])
        if parent_pid == parent and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def test_a_killed_rank_restarts_from_the_last_checkpoint(programs, reference_losses, tmp_path) -> None:
    saved = tmp_path / "ckpt"
    arguments = [str(programs["tp"] / "launch.py"), "--steps", str(KILL_STEPS), "--checkpoint-dir", str(saved), "--keep", "2"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(
        [*command, *arguments, "--save-every", "2"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True,
    )
    printed, killed = [], False
    deadline = time.monotonic() + TIMEOUT
    for line in run.stdout:
        printed.append(line)
        if "checkpoint complete" in line and "step-00000004" in line and not killed:
            victim = _rank_process(run.pid, 1)
            assert victim is not None, "no rank-1 worker found under torchrun"
            os.kill(victim, signal.SIGKILL)
            killed = True
        assert time.monotonic() < deadline
    assert run.wait(timeout=TIMEOUT) != 0 and killed, "".join(printed)[-2000:]
    before = _losses("".join(printed))
    assert 4 <= max(before) < KILL_STEPS, "".join(printed)[-2000:]  # it died mid-run

    restarted = _ok(_torchrun(2, *arguments, "--resume", cwd=tmp_path))
    resumed_at = int(re.search(r"at step (\d+)", restarted).group(1))
    assert 4 <= resumed_at <= max(before)
    after = _losses(restarted)
    assert sorted(after) == list(range(resumed_at + 1, KILL_STEPS + 1))
    for step, loss in {**before, **after}.items():
        assert loss == pytest.approx(reference_losses[step], abs=1e-5), step
    # --keep 2: the checkpoint it resumed from and the final one remain.
    complete = sorted(folder.name for folder in saved.iterdir() if (folder / "soap-checkpoint.json").is_file())
    assert complete == [f"step-{resumed_at:08d}", f"step-{KILL_STEPS:08d}"], complete


def test_sigterm_stops_after_the_step_with_a_checkpoint_of_it(programs, reference_losses, tmp_path) -> None:
    """A scheduler preempting the job sends SIGTERM to torchrun, which forwards it to every
    rank: the run finishes the step in progress, saves a checkpoint of it (none was due) and
    says so; resumed, it continues with the losses of an uninterrupted run."""
    saved = tmp_path / "ckpt"
    arguments = [str(programs["tp"] / "launch.py"), "--steps", str(KILL_STEPS), "--checkpoint-dir", str(saved)]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen([*command, *arguments], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    printed, signalled = [], False
    deadline = time.monotonic() + TIMEOUT
    for line in run.stdout:
        printed.append(line)
        if line.startswith("step 3/") and not signalled:
            run.send_signal(signal.SIGTERM)
            signalled = True
        assert time.monotonic() < deadline
    assert run.wait(timeout=TIMEOUT) != 0 and signalled, "".join(printed)[-2000:]
    text = "".join(printed)
    stopped = re.search(r"^stopped by SIGTERM after step (\d+): its checkpoint is in \S+; continue with --resume$", text,
                        re.MULTILINE)
    assert stopped, text[-2000:]
    step = int(stopped.group(1))
    assert 3 <= step < KILL_STEPS and sorted(_losses(text)) == list(range(1, step + 1))
    assert [folder.name for folder in saved.iterdir()] == [f"step-{step:08d}"]
    assert (saved / f"step-{step:08d}" / "soap-checkpoint.json").is_file()

    resumed = _ok(_torchrun(2, *arguments[:2], str(step + 2), *arguments[3:], "--resume", cwd=tmp_path))
    after = _losses(resumed)
    assert sorted(after) == [step + 1, step + 2]
    for number, loss in {**_losses(text), **after}.items():
        assert loss == pytest.approx(reference_losses[number], abs=1e-5), number


# ------------------------------------------------------------------ mistakes, one line each


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "2", "--save-every", "2"], "--save-every, --keep and --resume need --checkpoint-dir"),
        (["--check", "--checkpoint-dir", "ck"], "add --steps N"),
        (["--steps", "2", "--checkpoint-dir", "ck", "--resume", "--init-from", "m.pt"], "pick one (or --resume auto"),
        (["--steps", "2", "--init-from", "missing.pt"], "no file 'missing.pt'"),
    ],
)
def test_checkpoint_flag_mistakes_are_one_line(tmp_path, monkeypatch, flags, message) -> None:
    from codegen.runtime.launcher import build_parser, check_checkpoint_options
    from planner.errors import LaunchError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LaunchError, match=re.escape(message)):
        check_checkpoint_options(build_parser().parse_args(flags))


def test_export_checkpoint_mistakes_are_one_line(tmp_path, capsys) -> None:
    from planner.cli import main

    (tmp_path / "not_a_checkpoint").mkdir()
    assert main(["export-checkpoint", str(tmp_path / "nowhere"), "-o", str(tmp_path / "m.pt")]) == 2
    assert main(["export-checkpoint", str(tmp_path / "not_a_checkpoint"), "-o", str(tmp_path / "m.pt")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and "no folder" in errors[0] and "is not a complete soap-planner checkpoint" in errors[1], errors
