"""Checkpoints of MoE programs, whose experts are per-rank parts of the model's weights.

- ``DerivedPart`` describes a rank's experts (dim-0 rows) or slices (a range of one dim) as
  chunks of the whole tensor, and reads its part of a whole tensor (no processes).
- In real gloo processes (``examples/moe.py``, 4 experts, world 2): train 4 steps expert
  parallel under DDP with expert 0 copied on both ranks, save; resume on the expert-sliced
  mode under FSDP2 and on one device without MoE layers for 4 more; resume the one-device
  checkpoint expert parallel under FSDP2 for 2 more: every loss equals an uninterrupted
  single-device run (1e-5). Expert 0 is written once though two ranks hold it. A model with
  other expert shapes is refused with one line. Tiny HF
  Mixtral's stacked experts, placed under FSDP2, resume data parallel under DDP likewise.
- Experts sharded over their copies (FSDP2 over each copy group, world 4): saved after 2
  steps, resumed on one device; one device's checkpoint resumed sharded over the copies;
  exported and started from with ``--init-from``: every loss the single device's.
- Across MoE layouts and world sizes: sharded copies under ZeRO-2 (world 4) -> every expert
  sliced under ZeRO-1 (world 2) -> sharded copies again, exported whole after the last step;
  tiny HF Mixtral's experts sharded over copies -> copied whole under ZeRO-1.
- ``export-checkpoint`` of an MoE checkpoint loads (strict, ``weights_only=True``) into the
  model built from the spec, with the single device's weights; ``launch.py --init-from``
  starts an expert-parallel program from it with the single device's loss.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from moe_plans import EXPERTS, MOE_EXAMPLE, hf_moe_plan, moe_plan
from test_checkpoint import _losses, _ok, _single_device_losses, _torchrun
from test_checkpoint_identity import _launch
from torch.distributed.checkpoint import FileSystemReader

import planner
from codegen.runtime.checkpoint import export_checkpoint
from codegen.runtime.derived_checkpoint import DerivedPart
from codegen.runtime.launcher import random_like
from codegen.runtime.program import load_program
from planner.api import prepare_model
from planner.model_loss import extract_loss
from planner.model_spec import ModelSpec
from search.data_parallel import data_parallel_plan

EXPERT_WEIGHT = "blocks.0.moe.experts.w_in"  # (experts, width, ffn) in examples/moe.py


def test_a_part_is_the_chunks_of_the_whole_tensor_it_holds() -> None:
    whole = torch.arange(4 * 3 * 6, dtype=torch.float32).reshape(4, 3, 6)
    experts = DerivedPart(torch.zeros(2, 3, 6), "w", (4, 3, 6), rows=(3, 1))
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in experts.__create_chunk_list__()] == [
        ((3, 0, 0), (1, 3, 6)), ((1, 0, 0), (1, 3, 6)),
    ]
    experts.copy_from_whole(whole)
    assert torch.equal(experts.local, whole[[3, 1]])
    written = experts.__create_write_items__("model.w", experts)
    assert [tuple(item.index.offset) for item in written] == [(3, 0, 0), (1, 0, 0)]
    assert all(tuple(item.tensor_data.size) == (4, 3, 6) for item in written)
    assert torch.equal(experts.chunk(written[1].index), whole[1:2])  # a view of the rank's tensor

    sliced = DerivedPart(torch.zeros(4, 3, 2), "w", (4, 3, 6), dim=2, start=2, stop=4)
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in sliced.__create_chunk_list__()] == [((0, 0, 2), (4, 3, 2))]
    sliced.copy_from_whole(whole)
    assert torch.equal(sliced.local, whole[:, :, 2:4])
    with pytest.raises(ValueError, match="not the part of shape"):
        DerivedPart(torch.zeros(3, 3, 6), "w", (4, 3, 6), rows=(0, 1))


@pytest.fixture(scope="module")
def moe_programs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_programs")
    spec = ModelSpec(str(MOE_EXAMPLE), {"n_expert": EXPERTS, "capacity_factor": 1.25, "ffn": 128})
    graph, spec, name, cluster = prepare_model(spec, "cpu:1x1")
    plans = {
        "ep_ddp": moe_plan(2, "expert_parallel", "skewed"),  # expert 0 on both ranks
        "ep_fsdp": moe_plan(2, "expert_parallel", "skewed", flavour="fsdp"),
        "sliced_fsdp": moe_plan(2, "expert_sliced", flavour="fsdp"),
        "one": data_parallel_plan(graph, cluster, spec, name, "ddp", precision="fp32"),  # no MoE layers
    }
    spec = ModelSpec(str(MOE_EXAMPLE), {"n_expert": 2 * EXPERTS, "capacity_factor": 1.25, "ffn": 128})
    graph, spec, name, cluster = prepare_model(spec, "cpu:1x1")
    plans["more_experts"] = data_parallel_plan(graph, cluster, spec, name, "ddp", precision="fp32")
    return {key: planner.compile(plan, root / key) for key, plan in plans.items()}


def _single_device_weights(folder: Path, steps: int) -> dict[str, torch.Tensor]:
    """The weights after ``steps`` steps of launch.py's loop on one device."""
    program = load_program(folder)
    model, args, kwargs = program.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        torch.manual_seed(1000 + step)
        extract_loss(model(*random_like(args), **random_like(kwargs))).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: value.detach() for name, value in model.state_dict().items()}


@pytest.mark.distributed
def test_moe_checkpoints_resume_on_other_plans_export_and_init_from(moe_programs, tmp_path, monkeypatch, capsys) -> None:
    reference = _single_device_losses(moe_programs["one"], 10)
    saved, other = tmp_path / "ckpt", tmp_path / "ckpt_one"

    def run(world: int, program: str, *flags: str) -> dict[int, float]:
        return _losses(_ok(_torchrun(world, str(moe_programs[program] / "launch.py"), *flags, cwd=tmp_path)))

    first = run(2, "ep_ddp", "--steps", "4", "--checkpoint-dir", str(saved))
    shutil.copytree(saved, other)
    sliced = run(2, "sliced_fsdp", "--steps", "8", "--checkpoint-dir", str(saved), "--resume")
    single = run(1, "one", "--steps", "8", "--checkpoint-dir", str(other), "--resume")
    placed = run(2, "ep_fsdp", "--steps", "10", "--checkpoint-dir", str(other), "--resume")
    assert sorted(first) == [1, 2, 3, 4] and sorted(sliced) == sorted(single) == [5, 6, 7, 8]
    assert sorted(placed) == [9, 10]
    for losses in (first, sliced, single, placed):
        for step, loss in losses.items():
            assert loss == pytest.approx(reference[step - 1], abs=1e-5), step

    # Another model (twice the experts) is refused with one line, not a traceback. The refusal
    # comes before the process group starts: launch.py's main runs in this process.
    status, said = _launch(moe_programs["more_experts"], 1, ["--steps", "10", "--checkpoint-dir", str(saved), "--resume"],
                           monkeypatch, capsys)
    assert status == 2 and len(said) == 1, said
    assert said[0].startswith("error:") and "is of another model" in said[0] and "this program trains MoEGPT" in said[0], said

    # The expert-parallel checkpoint: each expert one chunk, expert 0 (on both ranks) written once.
    metadata = FileSystemReader(str(saved / "step-00000004")).read_metadata().state_dict_metadata
    chunks = sorted(tuple(chunk.offsets) for chunk in metadata[f"model.{EXPERT_WEIGHT}"].chunks)
    assert chunks == [(expert, 0, 0) for expert in range(EXPERTS)]

    # Exported, each checkpoint is the single device's weights under the model's names.
    # AdamW moves a weight whose gradient is near eps by ~lr whatever the gradient's last
    # bits (see codegen/runtime/parity.py), so the weights agree to lr / 10, not to 1e-5.
    model, args, kwargs = load_program(moe_programs["one"]).build_model()
    for folder, steps in ((saved / "step-00000004", 4), (saved / "step-00000008", 8), (other / "step-00000010", 10)):
        exported = tmp_path / f"{folder.parent.name}-{steps}.pt"
        assert export_checkpoint(folder, exported)[0] == steps
        weights = torch.load(exported, weights_only=True)
        model.load_state_dict(weights)  # strict: every name of the model built from the spec
        for name, value in _single_device_weights(moe_programs["one"], steps).items():
            torch.testing.assert_close(weights[name], value, atol=1e-4, rtol=0, msg=f"{name} after {steps} steps")

    # A new expert-parallel run from the weights after step 8: its first loss is the single device's.
    started = run(2, "ep_ddp", "--steps", "1", "--init-from", str(tmp_path / "ckpt-8.pt"))
    model.load_state_dict(torch.load(tmp_path / "ckpt-8.pt", weights_only=True))
    torch.manual_seed(1000)
    with torch.no_grad():
        expected = extract_loss(model(*random_like(args), **random_like(kwargs))).item()
    assert started[1] == pytest.approx(expected, abs=1e-5)


@pytest.mark.distributed
def test_hf_mixtral_experts_resume_in_another_mode(tmp_path) -> None:
    """transformers' own MoE block: its stacked experts placed (expert 0 copied) under FSDP2,
    saved after 3 steps, resumed data parallel under DDP (every expert on every rank)."""
    placed = planner.compile(hf_moe_plan(2, "mixtral", "expert_parallel", "skewed", flavour="fsdp"), tmp_path / "ep")
    replicated = planner.compile(hf_moe_plan(2, "mixtral", "data_parallel"), tmp_path / "dp")
    saved = tmp_path / "ckpt"
    first = _losses(_ok(_torchrun(2, str(placed / "launch.py"), "--steps", "3", "--checkpoint-dir", str(saved),
                                  cwd=tmp_path)))
    resumed = _losses(_ok(_torchrun(2, str(replicated / "launch.py"), "--steps", "6", "--checkpoint-dir", str(saved),
                                    "--resume", cwd=tmp_path)))
    assert sorted(first) == [1, 2, 3] and sorted(resumed) == [4, 5, 6]
    reference = _single_device_losses(replicated, 6)
    for step, loss in {**first, **resumed}.items():
        assert loss == pytest.approx(reference[step - 1], abs=1e-5), step
    exported = tmp_path / "model.pt"
    export_checkpoint(saved / "step-00000003", exported)
    model = load_program(replicated).build_model()[0]
    model.load_state_dict(torch.load(exported, weights_only=True))  # strict


@pytest.mark.distributed
def test_experts_sharded_over_their_copies_checkpoint_both_ways(moe_programs, tmp_path) -> None:
    """Each rank's FSDP2 shard of its group's experts is saved as its part of the model's
    stacked expert weights (and its AdamW states likewise), so one device resumes from it,
    and it resumes from one device's checkpoint, with the uninterrupted single device's losses."""
    sharded = planner.compile(moe_plan(4, "expert_parallel", "grid", sharded_copies=True), tmp_path / "sharded")
    assert any(layout.sharded_copies for layout in load_program(sharded).plan.expert_layouts)
    reference = _single_device_losses(moe_programs["one"], 4)
    there, back = tmp_path / "from_sharded", tmp_path / "from_one"

    def run(world: int, program: Path, *flags: str) -> dict[int, float]:
        return _losses(_ok(_torchrun(world, str(program / "launch.py"), *flags, cwd=tmp_path)))

    first = run(4, sharded, "--steps", "2", "--checkpoint-dir", str(there))
    single = run(1, moe_programs["one"], "--steps", "4", "--checkpoint-dir", str(there), "--resume")
    run(1, moe_programs["one"], "--steps", "2", "--checkpoint-dir", str(back))
    resumed = run(4, sharded, "--steps", "4", "--checkpoint-dir", str(back), "--resume")
    assert sorted(first) == [1, 2] and sorted(single) == sorted(resumed) == [3, 4]
    for losses in (first, single, resumed):
        for step, loss in losses.items():
            assert loss == pytest.approx(reference[step - 1], abs=1e-5), step

    # Exported from the sharded run's checkpoint: a new sharded run from it starts at the single device's loss.
    exported = tmp_path / "sharded.pt"
    assert export_checkpoint(back / "step-00000004", exported)[0] == 4
    started = run(4, sharded, "--steps", "1", "--init-from", str(exported))
    model, args, kwargs = load_program(moe_programs["one"]).build_model()
    model.load_state_dict(torch.load(exported, weights_only=True))
    torch.manual_seed(1000)
    with torch.no_grad():
        expected = extract_loss(model(*random_like(args), **random_like(kwargs))).item()
    assert started[1] == pytest.approx(expected, abs=1e-5)


@pytest.mark.distributed
def test_sharded_copies_under_zero1_checkpoint_both_ways(moe_programs, tmp_path) -> None:
    """ZeRO-1 with each expert sharded over its 2 copies (world 4): each rank's AdamW states of
    its expert shard are saved as that shard's part of the stacked weights' states, so the
    run resumes on itself and on one device with the uninterrupted single device's losses."""
    zero1 = planner.compile(moe_plan(4, "expert_parallel", "grid", flavour="zero1", sharded_copies=True),
                            tmp_path / "zero1")
    reference = _single_device_losses(moe_programs["one"], 4)
    saved, copied = tmp_path / "ckpt", tmp_path / "ckpt_copy"

    def run(world: int, program: Path, folder: Path, steps: int, *flags: str) -> dict[int, float]:
        return _losses(_ok(_torchrun(world, str(program / "launch.py"), "--steps", str(steps), "--checkpoint-dir",
                                     str(folder), *flags, cwd=tmp_path)))

    first = run(4, zero1, saved, 2)
    shutil.copytree(saved, copied)
    again = run(4, zero1, saved, 4, "--resume")
    single = run(1, moe_programs["one"], copied, 4, "--resume")
    assert sorted(first) == [1, 2] and sorted(again) == sorted(single) == [3, 4]
    for losses in (first, again, single):
        for step, loss in losses.items():
            assert loss == pytest.approx(reference[step - 1], abs=1e-5), step


@pytest.mark.distributed
def test_sharded_copies_and_zero1_resume_onto_each_other_and_export_whole(moe_programs, tmp_path) -> None:
    """Experts sharded over their copies under ZeRO-2 (world 4) resume as every expert sliced
    under ZeRO-1 (world 2: dense optimizer states saved as ZeRO-1's pieces), which resume as
    sharded copies again: every loss, and the weights exported after the last step, are the
    uninterrupted single device's."""
    sharded = planner.compile(moe_plan(4, "expert_parallel", "grid", flavour="zero2", sharded_copies=True),
                              tmp_path / "sharded")
    sliced = planner.compile(moe_plan(2, "expert_sliced", flavour="zero1"), tmp_path / "sliced")
    reference = _single_device_losses(moe_programs["one"], 6)
    saved = tmp_path / "ckpt"

    def run(world: int, program: Path, steps: int, *flags: str) -> dict[int, float]:
        return _losses(_ok(_torchrun(world, str(program / "launch.py"), "--steps", str(steps), "--checkpoint-dir",
                                     str(saved), *flags, cwd=tmp_path)))

    losses = [run(4, sharded, 2), run(2, sliced, 4, "--resume"), run(4, sharded, 6, "--resume")]
    assert [sorted(part) for part in losses] == [[1, 2], [3, 4], [5, 6]]
    for part in losses:
        for step, loss in part.items():
            assert loss == pytest.approx(reference[step - 1], abs=1e-5), step
    exported = tmp_path / "model.pt"
    assert export_checkpoint(saved / "step-00000006", exported)[0] == 6
    weights = torch.load(exported, weights_only=True)
    load_program(moe_programs["one"]).build_model()[0].load_state_dict(weights)  # strict: every name, whole
    # AdamW moves a weight whose gradient is near eps by ~lr whatever its last bits: lr / 10 (as above).
    for name, value in _single_device_weights(moe_programs["one"], 6).items():
        torch.testing.assert_close(weights[name], value, atol=1e-4, rtol=0, msg=name)


@pytest.mark.distributed
def test_hf_mixtral_experts_sharded_over_copies_resume_under_zero1(tmp_path) -> None:
    """transformers' stacked experts sharded over their copies (FSDP2, world 4), saved after
    2 steps, resumed expert parallel with expert 0 copied whole under ZeRO-1 (world 2)."""
    sharded = planner.compile(hf_moe_plan(4, "mixtral", "expert_parallel", "grid", flavour="fsdp", sharded_copies=True),
                              tmp_path / "sharded")
    copied = planner.compile(hf_moe_plan(2, "mixtral", "expert_parallel", "skewed", flavour="zero1"), tmp_path / "zero1")
    saved = tmp_path / "ckpt"
    first = _losses(_ok(_torchrun(4, str(sharded / "launch.py"), "--steps", "2", "--checkpoint-dir", str(saved),
                                  cwd=tmp_path)))
    resumed = _losses(_ok(_torchrun(2, str(copied / "launch.py"), "--steps", "4", "--checkpoint-dir", str(saved),
                                    "--resume", cwd=tmp_path)))
    assert sorted(first) == [1, 2] and sorted(resumed) == [3, 4]
    reference = _single_device_losses(copied, 4)
    for step, loss in {**first, **resumed}.items():
        assert loss == pytest.approx(reference[step - 1], abs=1e-5), step
