"""Uneven data parallelism's compiled programs in real gloo processes, world 4 on
``examples/clusters/mixed.toml`` (two fast, two slow devices).

- One launch of ``tests/dist_check_many.py`` checks, against one device: the GPT example's
  plan as ``python -m planner plan`` chooses it (uneven shares), the CNN (batch norm: its
  statistics are taken over the ranks, whose uneven counts it sums), a tiny HuggingFace
  Llama, the GPT's FSDP, ZeRO-1 and ZeRO-2 programs with uneven shares, and its DDP and FSDP
  programs accumulating gradients over each rank's own micro-batches of uneven shares, and its
  ZeRO-1 program with optimizer-state shares by memory (1/1/3/3 of the flat parameters:
  reduce-scatter-v and all-gather-v, ``planner.families.uneven_dp.state_runtime``).
  Outputs, loss, gradients and updated parameters must equal one device's.
- Checkpoints: 2 steps of the uneven DDP program, resumed for 2 on the even DDP program of
  the same model, then for 2 more on the uneven one again (DDP weights are whole on every
  rank, so the checkpoint does not depend on the shares). All 6 losses are one device's.
- Without processes: the program slices the batch by its shares (a comment names each rank's
  rows) and the loss weight is ``b_r * dp / B``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import planner
from planner.families.uneven_dp.runtime import share_rows, uneven_shard_batch
from planner.families.uneven_dp.section import UnevenSection
from planner.model_spec import ModelSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hsdp_program import _losses, _one_device_losses  # noqa: E402
from torchrun_run import torchrun  # noqa: E402
from test_parity import check_many, result_of  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MIXED = str(REPO / "examples/clusters/mixed.toml")
GPT = ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 8})
CNN = ModelSpec(str(REPO / "examples/cnn.py"), {"batch_size": 8})
LLAMA = ModelSpec("hf:llama", {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                               "batch_size": 8, "seq_len": 16})
GPT16 = ModelSpec(str(REPO / "examples/gpt.py"), {"batch_size": 16})
SHARES = UnevenSection((3, 3, 1, 1))
ACCUMULATING = UnevenSection((5, 5, 3, 3))
STATE_SHARES = UnevenSection((3, 3, 1, 1), state_shares=(1, 1, 3, 3))


def with_shares(spec: ModelSpec, flavour: str, shares: UnevenSection = SHARES, steps: int = 1) -> planner.Plan:
    """The ``flavour`` plan of ``spec`` on the mixed cluster with ``shares`` (3/3/1/1), each
    rank's in ``steps`` micro-batches."""
    plan = planner.plan(spec, MIXED, dp_flavour=flavour, precision="fp32", progress=False)
    return dataclasses.replace(plan, accumulation_steps=steps, sections={"uneven": shares})


def test_share_rows_and_the_slices_a_rank_takes() -> None:
    import torch

    assert [share_rows((3, 3, 1, 1), rank) for rank in range(4)] == [(0, 3), (3, 6), (6, 7), (7, 8)]
    batch = torch.arange(8).reshape(8, 1)
    (local, mask), kwargs = uneven_shard_batch((batch, batch), {"targets": batch}, 2, (3, 3, 1, 1),
                                               ("x", "targets"), ("x", "mask"))
    assert local.flatten().tolist() == [6] and mask.shape[0] == 8 and kwargs["targets"].flatten().tolist() == [6]


def test_the_program_slices_by_shares(tmp_path) -> None:
    folder = planner.compile(with_shares(GPT, "ddp"), tmp_path / "gpt")
    source = (folder / "model_spmd.py").read_text()
    assert "BATCH_SHARES = (3, 3, 1, 1)" in source and "#   rank 2: 1 of 8 rows" in source
    assert "DistributedDataParallel(" in source
    assert "def forward_backward" not in source  # no accumulation: the runtime's equal cuts


@pytest.mark.distributed
def test_uneven_programs_match_one_device(tmp_path) -> None:
    chosen = tmp_path / "p.json"
    planned = subprocess.run([sys.executable, "-m", "planner", "plan", str(REPO / "examples/gpt.py"), "--cluster",
                              MIXED, "-o", str(chosen)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert '"uneven"' in chosen.read_text()
    folders = [planner.compile(planner.load_plan(chosen), tmp_path / "gpt-chosen")]
    folders += [planner.compile(with_shares(spec, flavour), tmp_path / name) for name, spec, flavour in (
        ("cnn-ddp", CNN, "ddp"), ("llama-ddp", LLAMA, "ddp"), ("gpt-fsdp", GPT, "fsdp"), ("gpt-zero1", GPT, "zero1"),
        ("gpt-zero2", GPT, "zero2"),
    )]
    # Accumulating: shares 5/5/3/3 of 16 in 2 micro-batches (3+2 and 2+1 rows) under DDP, and
    # in 3 (2+2+1 and 1+1+1) under FSDP, which reduce-scatters every micro-batch's gradients.
    folders += [planner.compile(with_shares(GPT16, flavour, ACCUMULATING, steps), tmp_path / name)
                for name, flavour, steps in (("gpt-ddp-accumulating", "ddp", 2), ("gpt-fsdp-accumulating", "fsdp", 3))]
    source = (folders[-1] / "model_spmd.py").read_text()  # each rank's micro-batches, named
    assert "ACCUMULATION_STEPS = 3" in source and "#   rank 0: [2, 2, 1]" in source and "#   rank 3: [1, 1, 1]" in source
    assert "def forward_backward" in source
    # States by memory: 1/1/3/3 of the flat parameters on ranks taking 3/3/1/1 of the batch.
    zero1 = planner.load_plan(tmp_path / "gpt-zero1" / "plan.json")  # planned above: not again
    states = dataclasses.replace(zero1, sections={"uneven": STATE_SHARES})
    folders.append(planner.compile(states, tmp_path / "gpt-zero1-state-shares"))
    assert "STATE_SHARES = (1, 1, 3, 3)" in (folders[-1] / "model_spmd.py").read_text()
    launch = check_many(4, folders, tmp_path)
    for folder in folders:
        assert result_of(launch, folder).startswith("ok parity ok"), (folder.name, result_of(launch, folder))


@pytest.mark.distributed
def test_uneven_checkpoints_resume_on_the_even_plan_and_back(tmp_path) -> None:
    uneven_plan = with_shares(GPT, "ddp")
    uneven = planner.compile(uneven_plan, tmp_path / "uneven")
    even = planner.compile(dataclasses.replace(uneven_plan, sections={}), tmp_path / "even")
    resume_there_and_back(uneven, even, tmp_path, 2)


def resume_there_and_back(uneven: Path, even: Path, tmp_path: Path, steps: int) -> None:
    """Run ``steps`` steps of ``uneven`` saving a checkpoint, resume for ``steps`` more on
    ``even``, then ``steps`` more on ``uneven`` again; every loss must be one device's."""
    saved = tmp_path / "ckpt"
    first = torchrun(4, str(uneven / "launch.py"), "--steps", str(steps), "--checkpoint-dir", str(saved),
                     "--save-every", str(steps), cwd=tmp_path)
    second = torchrun(4, str(even / "launch.py"), "--steps", str(2 * steps), "--checkpoint-dir", str(saved),
                      "--resume", "--save-every", str(steps), cwd=tmp_path)
    third = torchrun(4, str(uneven / "launch.py"), "--steps", str(3 * steps), "--checkpoint-dir", str(saved),
                     "--resume", cwd=tmp_path)
    assert f"at step {steps}" in second and f"at step {2 * steps}" in third, (second[-2000:], third[-2000:])
    losses = {**_losses(first), **_losses(second), **_losses(third)}
    assert sorted(losses) == list(range(1, 3 * steps + 1))
    for step, expected in _one_device_losses(even, 3 * steps).items():
        assert losses[step] == pytest.approx(expected, abs=1e-5), step


class _Op:
    """A stand-in for an ATen op as a dispatch mode sees it: a namespace and a call."""

    def __init__(self, namespace: str, run) -> None:
        self.namespace, self._run = namespace, run

    def __call__(self, *args, **kwargs):
        return self._run(*args)


def test_the_slowdown_follows_the_cluster_and_stretches_each_op_not_the_waits() -> None:
    import time

    import torch

    from codegen.runtime.slowdown import Pacer, paced, slowdown_factor

    plan = with_shares(GPT, "ddp")
    # mixed.toml: ranks 0-1 at 100 GFLOP/s, ranks 2-3 at 50: the slow ones 2x, times the base.
    assert [slowdown_factor(plan, rank) for rank in range(4)] == [1.0, 1.0, 2.0, 2.0]
    assert [slowdown_factor(plan, rank, 4.0) for rank in range(4)] == [4.0, 4.0, 8.0, 8.0]

    # The arithmetic, on clocks of our own: an op of 10 ms CPU that took 12 ms of wall at
    # K = 3 owes 3 x 10 - 12 = 18 ms, slept at once (over FLUSH_S = 1 ms); sleeping 20 ms
    # leaves a 2 ms credit, which a collective (c10d) drops after sleeping nothing.
    clock = {"cpu": 0.0, "wall": 0.0}
    slept = []

    def op_of(cpu_s: float, wall_s: float):
        def run(*_args):
            clock["cpu"] += cpu_s
            clock["wall"] += wall_s
        return _Op("aten", run)

    def sleep(seconds: float) -> None:
        slept.append(round(seconds, 9))
        clock["wall"] += seconds + 0.002

    pacer = Pacer(3.0, lambda: clock["cpu"], lambda: clock["wall"], sleep)
    pacer.__torch_dispatch__(op_of(0.010, 0.012), ())
    assert slept == [0.018] and pacer.owed_s == pytest.approx(-0.002)
    pacer.__torch_dispatch__(_Op("c10d", lambda *_: None), ())
    assert slept == [0.018] and pacer.owed_s == 0.0

    # Real ops on one thread: every op stretched to 3 x its CPU seconds (at least: a busy host
    # may stretch it more, which the pacer counts), a 50 ms wait between ops not stretched.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thread_time counts this thread's CPU only
    try:
        weight = torch.randn(256, 256, requires_grad=True)
        x = torch.randn(256, 256)

        def work() -> torch.Tensor:
            out = x
            for _ in range(6):
                out = torch.tanh(out @ weight)
            return out.sum()

        work().backward()  # warm-up
        with paced(3.0) as pacer:
            cpu, wall = time.thread_time(), time.perf_counter()
            work().backward()
            time.sleep(0.05)
            pacer.settle()
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    finally:
        torch.set_num_threads(threads)
    # cpu counts the Python between ops too (not stretched): the ops' share is most of it.
    assert wall >= 3 * 0.8 * cpu + 0.05, (cpu, wall)
    assert pacer.slept_s <= 2 * cpu + 0.01, (cpu, pacer.slept_s)  # never the 50 ms wait
