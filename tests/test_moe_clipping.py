"""``--clip-grad-norm`` of MoE programs (codegen/runtime/held_parts_norm.py).

The global norm over dense and expert gradients, each expert's gradient counted once
whatever its copies, is the norm ``torch.nn.utils.clip_grad_norm_`` takes on one device.

- Unit (one process): the boxes a rank's parameters hold, for a plain tensor, a rank's
  own experts and a slice of every expert, as a checkpoint names them; how many ranks hold
  each, partly overlapping parts refused; on one gloo rank, the norm worked out by hand and
  a parameter the model does not record refused in one line.
- In real gloo processes, one launch per layout of ``examples/moe.py`` (4 experts): expert
  parallel with expert 0 copied whole on two ranks under DDP (world 2), experts sharded over
  their copies under FSDP2 (world 4), every expert sliced under ZeRO-1 (world 2), every
  expert on every rank under ZeRO-2 (world 2); and tiny HF Mixtral's stacked experts with
  expert 0 copied whole (world 2). Each trains 3 steps with a limit below every step's norm:
  every step's gradient norm and loss equal the single-device loop's with torch's clipping.
  Counting a copied expert twice, or a replicated weight once per rank, changes the norm
  (and then the losses).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from moe_plans import hf_moe_plan, moe_plan
from test_checkpoint import _ok, _torchrun
from torch import nn

import planner
from codegen.runtime.held_parts_norm import HeldPartsNorm, box_holders, held_boxes
from codegen.runtime.launcher import random_like
from codegen.runtime.materialize import Derivation
from codegen.runtime.program import load_program
from planner.errors import LaunchError
from planner.model_loss import extract_loss

STEPS = 3
# Below every step's norm on one device (checked in the test), so clipping acts each step.
CLIP = 0.05


def test_the_boxes_a_rank_holds_are_the_chunks_a_checkpoint_names():
    whole = torch.zeros(4, 3, 6)
    dense = held_boxes(torch.full((5, 2), 2.0), "dense", None)
    assert dense.boxes == [("dense", (0, 0), (5, 2))]
    assert dense.squares().tolist() == pytest.approx([10 * 2.0**2], rel=1e-12)  # 10 elements of 2
    rows = Derivation(source=whole, rows=(3, 1), source_name="experts")
    mine = held_boxes(torch.stack([torch.full((3, 6), 1.0), torch.full((3, 6), 3.0)]), "experts", rows)
    assert mine.boxes == [("experts", (3, 0, 0), (1, 3, 6)), ("experts", (1, 0, 0), (1, 3, 6))]
    assert mine.squares().tolist() == pytest.approx([18 * 1.0, 18 * 3.0**2], rel=1e-12)  # each expert's 18 elements on its own
    sliced = Derivation(source=whole, dim=2, start=2, stop=4, source_name="experts")
    assert held_boxes(torch.ones(4, 3, 2), "experts", sliced).boxes == [("experts", (0, 0, 2), (4, 3, 2))]


def test_each_box_is_counted_by_its_holders_and_partial_overlaps_are_refused():
    # rank 0: expert 0 (copied) and expert 1, the dense weight; rank 1: expert 0's copy, expert 2, the dense weight
    rank0 = [("w", (0, 0), (1, 4)), ("w", (1, 0), (1, 4)), ("dense", (0,), (6,))]
    rank1 = [("w", (0, 0), (1, 4)), ("w", (2, 0), (1, 4)), ("dense", (0,), (6,))]
    assert box_holders([rank0, rank1]) == {
        ("w", (0, 0), (1, 4)): 2, ("w", (1, 0), (1, 4)): 1, ("dense", (0,), (6,)): 2, ("w", (2, 0), (1, 4)): 1,
    }
    # rows 0..1 on one rank and row 1 alone on another share row 1 without being one box
    with pytest.raises(LaunchError, match=r"^w: two ranks hold parts of it that partly overlap") as refused:
        box_holders([[("w", (0, 0), (2, 4))], [("w", (1, 0), (1, 4))]])
    assert "\n" not in str(refused.value)
    # a box beside another (columns 0..1 and 2..3 of the same rows) is disjoint, not refused
    assert len(box_holders([[("w", (0, 0), (2, 2))], [("w", (0, 2), (2, 2))]])) == 2
    # slices of every row (dim 1) with one slice a column too wide, found among 2,048 ranks' slices
    slices = [[("w", (0, 2 * rank), (8, 2))] for rank in range(2048)]
    assert len(box_holders(slices)) == 2048
    with pytest.raises(LaunchError, match=re.escape("partly overlap (((0, 4094), (8, 2)) and ((0, 4095), (8, 2)))")):
        box_holders([*slices, [("w", (0, 4095), (8, 2))]])


@pytest.fixture
def one_rank():
    assert not dist.is_initialized(), "a process group is already up in this test process"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_ranks_norm_is_the_models_and_an_unrecorded_parameter_is_one_line(one_rank):
    model = nn.Sequential(nn.Linear(2, 3, bias=False), nn.Linear(3, 1))
    grads = {"0.weight": torch.full((3, 2), 1.0), "1.weight": torch.full((1, 3), 2.0), "1.bias": torch.full((1,), 4.0)}
    for name, param in model.named_parameters():
        param.grad = grads[name].clone()
    clipper = HeldPartsNorm(model, model)
    # 6 x 1^2 + 3 x 2^2 + 4^2 = 34; clipped to 1, every gradient scaled by 1 / sqrt(34)
    assert clipper.clip(1.0) == pytest.approx(34**0.5, rel=1e-12)
    assert clipper.norm() == pytest.approx(1.0, rel=1e-5)
    assert model[1].bias.grad.item() == pytest.approx(4.0 / 34**0.5, rel=1e-5)

    stray = nn.Sequential(model, nn.Linear(1, 1))  # a parameter the model does not hold
    with pytest.raises(LaunchError, match=r"^this program holds a parameter of shape \(1, 1\) .* leave --clip-grad-norm out") as refused:
        HeldPartsNorm(model, stray)
    assert "\n" not in str(refused.value)


def _single_device(folder: Path) -> tuple[list[float], list[float]]:
    """Losses and gradient norms (before clipping) of launch.py's loop on one device with
    torch's own clipping: same init, batches (seeded 1000 + step), AdamW at lr 1e-3."""
    model, args, kwargs = load_program(folder).build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, norms = [], []
    for step in range(STEPS):
        torch.manual_seed(1000 + step)
        loss = extract_loss(model(*random_like(args), **random_like(kwargs)))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


LAYOUTS = {
    "copied_whole_ddp": (2, lambda: moe_plan(2, "expert_parallel", "skewed")),
    "sharded_copies_fsdp": (4, lambda: moe_plan(4, "expert_parallel", "grid", flavour="fsdp", sharded_copies=True)),
    "sliced_zero1": (2, lambda: moe_plan(2, "expert_sliced", flavour="zero1")),
    "every_expert_on_every_rank_zero2": (2, lambda: moe_plan(2, "data_parallel", flavour="zero2")),
    "hf_mixtral_copied_whole_ddp": (2, lambda: hf_moe_plan(2, "mixtral", "expert_parallel", "skewed")),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_moe_programs_clip_by_the_single_devices_norm(name, tmp_path):
    world, make_plan = LAYOUTS[name]
    plan = make_plan()
    folder = planner.compile(plan, tmp_path / "out")
    losses, norms = _single_device(folder)
    assert min(norms) > CLIP  # clipping acted on every step: a wrong norm changes the losses too
    _ok(_torchrun(world, str(folder / "launch.py"), "--steps", str(STEPS), "--clip-grad-norm", str(CLIP),
                  "--metrics", "metrics.jsonl", cwd=tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["grad_norm"] for record in records] == pytest.approx(norms, rel=1e-5)
    assert [record["loss"] for record in records] == pytest.approx(losses, rel=1e-5, abs=1e-6)
