"""The training loop of ``launch.py``: the user's data, a learning-rate schedule and gradient
clipping give the same losses as the same loop on one device (one torchrun launch), and the
pieces the loop is built from (schedule, data checks) on their own."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

import planner
from codegen.runtime.profiling import collective_kind, profile_split
from codegen.runtime.program import load_program
from codegen.runtime.training_loop import as_inputs, clip_gradients, learning_rate_factor, load_data
from cost_model.calibration import load_measured
from planner.cli import main as cli_main
from planner.errors import LaunchError
from planner.model_spec import ModelSpec
from tests.test_parity import _run, _torchrun

REPO = Path(__file__).resolve().parent.parent
GPT = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64, "seq_len": 16, "batch_size": 4}
STEPS, WARMUP, LR, MIN_RATIO, CLIP = 6, 2, 3e-3, 0.1, 0.3

DATA = f'''
import torch

def batches(batch_size):
    """Next-token pairs from a fixed random text: the same on every rank."""
    text = torch.randint(0, {GPT["vocab_size"]}, (4096,), generator=torch.Generator().manual_seed(7))
    for step in range({STEPS}):
        starts = torch.arange(batch_size) * 97 + step * 13
        window = torch.stack([text[start:start + {GPT["seq_len"]} + 1] for start in starts.tolist()])
        yield window[:, :-1], window[:, 1:]
'''


def test_learning_rate_factor_by_hand() -> None:
    # warm-up 2 of 6 steps: 1/2, 2/2; cosine over steps 2..5 (3 intervals) down to 0.1.
    factors = [learning_rate_factor(step, "cosine", 2, 6, 0.1) for step in range(6)]
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 3)) for k in range(4)]
    assert factors == pytest.approx([0.5, 1.0, *cosine])
    assert [learning_rate_factor(step, "linear", 0, 5, 0.0) for step in range(5)] == pytest.approx([1, 0.75, 0.5, 0.25, 0])
    assert learning_rate_factor(10, "cosine", 0, 0, 0.0) == 1.0  # until the data ends: no known total, no decay


def test_a_gradient_several_ranks_hold_counts_once_in_the_clipped_norm() -> None:
    """A pipeline stage w ranks wide (or a weight tied over stages) leaves the same whole
    gradient on each of its ranks; clip_gradients adds its squared norm / holders, so the
    sum over the ranks is one device's. By hand, on one rank with holders 4 for the first
    parameter (grad (3, 4): squared norm 25 -> 6.25) and 1 for the second (grad (12,): 144):
    norm sqrt(150.25); with max_norm 1 every gradient is scaled by 1 / (norm + 1e-6)."""
    first, second = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    first.grad, second.grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
    norm = clip_gradients([first, second], 1.0, holders=lambda param: 4 if param is first else 1)
    assert norm == pytest.approx(math.sqrt(6.25 + 144.0), rel=1e-12)
    assert second.grad.item() == pytest.approx(12.0 / (norm + 1e-6), rel=1e-6)


def test_profile_split_and_collective_names() -> None:
    # 12 steps: a third (4) profiled, 1 warm-up, 7 clean (6 once the first is left out).
    assert profile_split(12) == (7, 1, 4)
    assert profile_split(5) == (3, 1, 1)
    assert profile_split(30) == (24, 1, 5)  # at most 5 profiled
    assert [collective_kind(name) for name in ("gloo:all_reduce", "nccl:_allgather_base", "gloo:send", "aten::mm")] == [
        "all_reduce", "all_gather", "send_recv", None]


def test_data_errors_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "data.py").write_text("def batches(batch_size):\n    return 3\n")
    with pytest.raises(LaunchError, match="define batches\\(batch_size\\)"):
        load_data(f"{tmp_path / 'data.py'}:batches", 4)
    with pytest.raises(LaunchError, match="defines no function nothing"):
        load_data(f"{tmp_path / 'data.py'}:nothing", 4)
    with pytest.raises(LaunchError, match="no file"):
        load_data(f"{tmp_path / 'missing.py'}:batches", 4)
    example = (torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long))
    with pytest.raises(LaunchError, match=r"input 0 is \(4, 8\) torch.int64, but the plan was made for \(4, 16\)"):
        as_inputs((torch.zeros(4, 8, dtype=torch.long), example[1]), example, {})
    with pytest.raises(LaunchError, match="1 positional input"):
        as_inputs(example[0], example, {})


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "3", "--profile", "m.json"], "--profile needs --steps 5 or more"),
        (["--data", "data.py:batches", "--lr-schedule", "cosine"], "--lr-schedule cosine decays over --steps N"),
        (["--steps", "2", "--metrics", "missing/metrics.jsonl"], "--metrics: cannot write missing/metrics.jsonl: folder"),
        (["--steps", "2", "--clip-grad-norm", "-1"], "--clip-grad-norm"),
    ],
)
def test_bad_training_flags_are_one_line_before_anything_starts(tmp_path: Path, capsys, flags, message) -> None:
    from codegen.runtime.launcher import main

    assert main(tmp_path, flags) == 2  # the folder holds no program: the flags were refused first
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error, error


def _single_device_losses(data_file: Path, program_folder: Path) -> tuple[list[float], list[float], list[float]]:
    """The loop on one device with torch's own schedulers and clipping: losses, grad norms,
    lrs; from the weights every build of the program starts from (initialised by name)."""
    model, _, _ = load_program(program_folder).build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / WARMUP, end_factor=1.0, total_iters=WARMUP - 1)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS - WARMUP - 1, eta_min=MIN_RATIO * LR)
    schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, decay], milestones=[WARMUP])
    losses, norms, lrs = [], [], []
    for idx, targets in load_data(f"{data_file}:batches", GPT["batch_size"]):
        loss = model(idx.contiguous(), targets.contiguous())
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        losses.append(loss.item())
    return losses, norms, lrs


def test_user_data_schedule_and_clipping_match_one_device(tmp_path: Path) -> None:
    """FSDP on 2 gloo ranks (gradients are DTensors sharded over dp, so clipping needs the
    global norm) trains the user's batches with warm-up + cosine and clipping: every step's
    loss, gradient norm and learning rate equal the single-device loop's. The same run's
    ``--profile`` writes a measured.json that ``planner compare`` reads."""
    data_file = tmp_path / "data.py"
    data_file.write_text(DATA)
    plan = planner.plan(ModelSpec(str(REPO / "examples/gpt.py"), GPT), "cpu:1x2", dp_flavour="fsdp")
    planner.compile(plan, tmp_path / "out")
    launch = _run(
        [*_torchrun(2), "out/launch.py", "--data", "data.py:batches", "--steps", str(STEPS), "--lr", str(LR),
         "--optimizer", "adamw", "--lr-schedule", "cosine", "--warmup-steps", str(WARMUP), "--min-lr-ratio",
         str(MIN_RATIO), "--clip-grad-norm", str(CLIP), "--metrics", "metrics.jsonl", "--profile", "measured.json"],
        cwd=tmp_path, timeout=240,
    )
    assert launch.returncode == 0, launch.describe()
    assert "MFU" in launch.stdout and "predicted" in launch.stdout and "peak mem" in launch.stdout, launch.describe()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses, norms, lrs = _single_device_losses(data_file, tmp_path / "out")
    assert len(records) == STEPS == len(losses)
    assert min(norms) > CLIP  # clipping acted on every step, so a wrong norm would change the losses
    assert [record["lr"] for record in records] == pytest.approx(lrs, rel=1e-9)
    assert [record["grad_norm"] for record in records] == pytest.approx(norms, rel=1e-4)
    assert [record["loss"] for record in records] == pytest.approx(losses, rel=1e-4, abs=1e-5)
    assert all(record["tokens_per_s"] > 0 and 0 < record["mfu"] for record in records)
    measured = load_measured(tmp_path / "measured.json")
    wait, _, active = profile_split(STEPS)
    assert len(measured.step_times_s) == wait - 1  # the clean steps, the first left out
    assert measured.ops["aten::mm"]["flops"] > 0 and measured.ops["aten::mm"]["time_s"] > 0
    assert {"all_gather"} <= {item["kind"] for item in measured.collectives if item["bytes"] > 0}  # FSDP's gathers
    assert cli_main(["compare", str(tmp_path / "out" / "plan.json"), str(tmp_path / "measured.json")]) == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
